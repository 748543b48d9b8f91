"""Collectives on a machine: alpha-beta models of NCCL's algorithms, and the machines they run on.

Conventions are nccl-tests' (``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests): ``S`` is the
"size" column, bytes per rank (all-reduce: the tensor; all-gather: the gathered output;
reduce-scatter: the input; all-to-all: this rank's send buffer), ``algbw = S / t`` and
``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all-reduce and ``(n-1)/n`` for
all-gather, reduce-scatter and all-to-all. ``busbw`` is the rate each rank's link carries,
so ``S * factor`` is the number of bytes each rank sends: that is what every formula here
divides by a link bandwidth.

Legend: n ranks in the group, m of them per node, g = n / m nodes spanned. The size ``S``
and the bandwidths ``B``, ``B_i``, ``b_x`` and ``A_nvls`` are the cost model's own symbols
(nccl-tests' and NCCL's notation, also in ``FORMULAS``), not the shape letters of
docs/moe.md: ``S`` the size in bytes (above); ``B_i`` the intra-node bandwidth, the
intra-node link's achievable bandwidth per GPU per direction (line rate x efficiency); the
inter-node link is one NIC, and ``b_x``, the inter-node bandwidth, = NIC rate x efficiency
x NICs per GPU is each GPU's share of its node's NICs (every group of a layout runs at
once, so a node's NICs are shared by all its GPUs); ``B`` the ring bandwidth (below);
``A_nvls`` the NVLS all-reduce's algorithm bandwidth. a_i, a_x: latency per algorithm step
on NVLink/PCIe and on the network; a0 a start-up latency per collective.

    op              algo          time
    all_reduce      ring          a0 + (2(n-1) - 2(g-1)) a_i + 2(g-1) a_x + 2(n-1)/n S / B
    all_reduce      tree          a0 + 2[(m-1) a_i + ceil(log2 g) a_x] + 2 S / B
    all_reduce      nvls          a0 + 2 a_i + S / A_nvls            (one NVSwitch node only)
    all_gather,     ring          a0 + (n-1 - (g-1)) a_i + (g-1) a_x + (n-1)/n S / B
    reduce_scatter
    all_to_all      pairwise      a0 + a + max((m-1)/n S / B_i, (n-m)/n S / b_x)
    all_to_all      hierarchical  a0 + a_i + (m-1)/m S / B_i + a_x + (g-1)/g S / b_x
    p2p             direct        a0 + a_i + S / B_i (same node), a0 + a_x + S / b_x (across)

with B = B_i on one node and min(B_i, m b_x) across nodes: NCCL's rings leave and enter a
node once per ring, one ring per NIC (rails), so the g-node ring's rate is bounded by the
NVLink hops and by the node's NICs that this group's m GPUs own (nccl-tests reach ~8 x
47 GB/s on two DGX H100 nodes; docs/cost.md). A ring crosses nodes 2(g-1) times in an
all-reduce, g-1 times in an all-gather: only those steps pay the network latency (NCCL's
tuning model counts intra- and inter-node steps apart in the same way). The tree is
NCCL's: a chain inside each node and a (double) binary tree across nodes, pipelined, so
each rank sends about 2 S; NVLS is NVLink SHARP (the switch reduces), whose published
all-reduce rate on 8 H100 is a busbw of ~480 GB/s, algbw ~275 GB/s (``A_nvls``). ``auto``,
the default, takes the fastest available all-reduce at each size, as NCCL's tuner does.

All-to-all peers are served in parallel (NCCL's grouped send/recv): one latency, and the
slower of the intra-node share on NVLink and the inter-node share on the GPU's NICs. The
two-level (hierarchical) one first exchanges inside the node so that the inter-node step
sends g-1 messages of S/g instead of n-m messages of S/n: the same inter-node bytes,
fewer and larger messages (Tutel's 2DH, DeepSpeed-MoE's hierarchical all-to-all), paid
for by a second pass over NVLink and a second latency.

Machines (``Hardware``): presets with cited public figures, or calibrated JSON profiles
(``moepar.cost.profiles``, whose ``get_hardware`` takes a preset's name or a profile's path).
A ``Hardware`` prices a collective with its measured curve when it has one for that (op,
group size) on one node (a profile written by ``python -m moepar calibrate``), and with the
two-link model above otherwise: the intra-node link per GPU, and ``nics_per_node`` NICs
shared by the node's GPUs. Each link carries its line rate and the fraction of it NCCL
achieves (``Link.efficiency``), from published nccl-tests bus bandwidths. docs/cost.md lists every figure with its source; the short forms:

- line rates per GPU per direction (NVIDIA quotes NVLink as the bidirectional total):
  NVLink 4 450 GB/s (H100/H200 datasheets, 900 GB/s), H800 NVLink 200 GB/s (400 GB/s),
  NVLink 5 900 GB/s (B200/GB200, 1.8 TB/s), NVLink 3 300 GB/s (A100, 600 GB/s), PCIe Gen5
  x16 64 GB/s (128 GB/s); NICs 400 Gb/s NDR = 50 GB/s, 200 Gb/s HDR = 25 GB/s.
- efficiencies: NVLink 4 370/450 (NVIDIA, nccl-tests issue #212: "~20% protocol overhead,
  effective NVLink bandwidth of 370GB/s"); NDR 47/50 (NVIDIA, nccl-tests issue #290:
  "46-48GB/s per NIC"); HDR 24/25 (NVIDIA, nccl issue #812: 192 GB/s all-reduce busbw on
  DGX A100's 8 x 200 Gb/s); H800 NVLink 160/200 (DeepSeek-V3 report: "NVLink ... 160 GB/s").
- NVLS all-reduce on 8 H100/H200: busbw ~480 GB/s, algbw ~275 GB/s (nccl-tests #212).
- Latencies are NCCL's own tuning model (src/graph/tuning.cc, Ring/Simple protocol):
  3.4 us per step on NVLink, 5.7 us on PCIe, 14 us on the network, 8.4 us base latency
  per collective. They are model constants, not measurements; ``calibrate`` replaces them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Protocol, Sequence

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# "p2p": one tensor from one rank to another (a pipeline stage boundary's send/recv pair),
# priced on a "group" of the two ranks: Placement(2, 2) inside a node, (2, 1) across nodes.
P2P = "p2p"
ALGOS = {"all_reduce": ("auto", "ring", "tree", "nvls"), "all_gather": ("ring",), "reduce_scatter": ("ring",),
         "all_to_all": ("pairwise", "hierarchical"), P2P: ("direct",)}
DEFAULT_ALGO = {"all_reduce": "auto", "all_gather": "ring", "reduce_scatter": "ring",
                "all_to_all": "pairwise", P2P: "direct"}


def check_op(op: str, algo: str | None = None) -> str:
    """Validate ``op`` (and ``algo``); return the algorithm to use."""
    if op not in ALGOS:
        raise ValueError(f"op={op!r} is not a known collective; valid: {', '.join(ALGOS)}")
    algo = DEFAULT_ALGO[op] if algo is None else algo
    if algo not in ALGOS[op]:
        raise ValueError(f"algo={algo!r} is not valid for {op}; valid: {', '.join(ALGOS[op])}")
    return algo


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor: 2(n-1)/n for all-reduce, (n-1)/n otherwise (1 for a
    point-to-point transfer: the sender sends its whole tensor, as nccl-tests' sendrecv)."""
    check_op(op)
    if n < 1:
        raise ValueError(f"group size n={n} must be >= 1")
    if op == P2P:
        return 1.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth S / t, bytes per second."""
    return nbytes / seconds


def busbw(op: str, n: int, nbytes: float, seconds: float) -> float:
    """Bus bandwidth: algbw x factor (the rate each rank's link carries)."""
    return algbw(nbytes, seconds) * bus_factor(op, n)


def bus_bytes(op: str, n: int, nbytes: float) -> float:
    """Bytes each rank sends for one collective of ``nbytes`` (size convention)."""
    return nbytes * bus_factor(op, n)


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link: line rate per rank (or per NIC) per direction (bytes/s), latency
    per algorithm step (s), and the fraction of the line rate NCCL achieves on it
    (``efficiency``: protocol overhead; 1.0 for a measured, calibrated link)."""

    name: str
    bandwidth: float
    latency: float
    source: str = ""
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"link {self.name!r}: bandwidth={self.bandwidth} must be > 0 bytes/s")
        if self.latency < 0:
            raise ValueError(f"link {self.name!r}: latency={self.latency} must be >= 0 s")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"link {self.name!r}: efficiency={self.efficiency} must be in (0, 1]")

    @property
    def achievable(self) -> float:
        """Bytes/s NCCL reaches: line rate x efficiency."""
        return self.bandwidth * self.efficiency


@dataclasses.dataclass(frozen=True)
class Placement:
    """A group of ``size`` ranks with ``per_node`` of them on each node it spans."""

    size: int
    per_node: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.per_node < 1:
            raise ValueError(f"group size={self.size} and per_node={self.per_node} must be >= 1")
        if self.size % self.per_node:
            raise ValueError(f"group size={self.size} is not divisible by its ranks per node "
                             f"per_node={self.per_node}")

    @property
    def nodes(self) -> int:
        return self.size // self.per_node

    @classmethod
    def contiguous(cls, size: int, gpus_per_node: int) -> "Placement":
        """Ranks r..r+size-1 on nodes of ``gpus_per_node`` (e.g. a TP group)."""
        m = min(size, gpus_per_node)
        if size % m:
            raise ValueError(f"group of {size} ranks does not tile nodes of {gpus_per_node} GPUs")
        return cls(size, m)

    @classmethod
    def of_ranks(cls, ranks: Sequence[int], gpus_per_node: int) -> "Placement":
        """Placement of an explicit rank list (node = rank // gpus_per_node)."""
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[r // gpus_per_node] = per_node.get(r // gpus_per_node, 0) + 1
        m = max(per_node.values())
        if any(c != m for c in per_node.values()):
            raise ValueError(f"group {list(ranks)} has unequal ranks per node {per_node}")
        return cls(len(ranks), m)


def _check_link_args(placement: Placement, nbytes: float, nic_share: float) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    if not nic_share > 0:
        raise ValueError(f"nic_share={nic_share} (NICs per GPU) must be > 0")


def _algo_time(op: str, algo: str, placement: Placement, S: float, intra: Link, inter: Link,
               a0: float, nic_share: float, nvls_algbw: float) -> float:
    n, m, g = placement.size, placement.per_node, placement.nodes
    b_i = intra.achievable
    b_x = inter.achievable * nic_share               # this GPU's share of its node's NICs
    # a ring's rate: its NVLink hops, and across nodes the NICs its m GPUs of each node own
    B = b_i if g == 1 else min(b_i, m * b_x)
    a_i, a_x = intra.latency, inter.latency
    if op == "all_reduce" and algo == "ring":
        inter_steps = 2 * (g - 1)
        return a0 + (2 * (n - 1) - inter_steps) * a_i + inter_steps * a_x + 2 * (n - 1) / n * S / B
    if op == "all_reduce" and algo == "tree":    # chain inside the node, binary tree across
        steps = (m - 1) * a_i + (math.ceil(math.log2(g)) * a_x if g > 1 else 0.0)
        return a0 + 2 * steps + 2 * S / B
    if op == "all_reduce":                       # nvls: the NVSwitch reduces and multicasts
        return a0 + 2 * a_i + S / nvls_algbw
    if op == P2P:                                # one message, on NVLink or on this GPU's NICs
        return a0 + (a_x + S / b_x if g > 1 else a_i + S / b_i)
    if op in ("all_gather", "reduce_scatter"):
        return a0 + (n - 1 - (g - 1)) * a_i + (g - 1) * a_x + (n - 1) / n * S / B
    if algo == "pairwise":                       # every peer at once: one latency
        return a0 + (a_x if g > 1 else a_i) + max((m - 1) / n * S / b_i, (n - m) / n * S / b_x)
    # hierarchical: all-to-all among the node's m, then among the g ranks of the same local rank
    t = a0 + a_i + (m - 1) / m * S / b_i
    return t + (a_x + (g - 1) / g * S / b_x if g > 1 else 0.0)


def available_algos(op: str, placement: Placement, nvls_algbw: float = 0.0) -> tuple[str, ...]:
    """The concrete algorithms that can run ``op`` on ``placement`` (``auto`` picks among them)."""
    check_op(op)
    if op != "all_reduce":
        return ALGOS[op]
    return ("ring", "tree") + (("nvls",) if nvls_algbw > 0 and placement.nodes == 1 else ())


def pick_algo(op: str, placement: Placement, nbytes: float, intra: Link, inter: Link,
              algo: str | None = None, base_latency: float = 0.0, nic_share: float = 1.0,
              nvls_algbw: float = 0.0) -> str:
    """The algorithm ``link_time`` prices: ``algo`` itself, or for ``auto`` the fastest one."""
    algo = check_op(op, algo)
    if algo == "nvls" and "nvls" not in available_algos(op, placement, nvls_algbw):
        raise ValueError(f"algo='nvls' needs one node with NVLink SHARP (an nvls_algbw); "
                         f"this group spans {placement.nodes} node(s), nvls_algbw={nvls_algbw}")
    if algo != "auto":
        return algo
    _check_link_args(placement, nbytes, nic_share)
    return min(available_algos(op, placement, nvls_algbw),
               key=lambda a: _algo_time(op, a, placement, float(nbytes), intra, inter, base_latency,
                                        nic_share, nvls_algbw))


def link_time(op: str, placement: Placement, nbytes: float, intra: Link, inter: Link,
              algo: str | None = None, base_latency: float = 0.0, nic_share: float = 1.0,
              nvls_algbw: float = 0.0) -> float:
    """Seconds for one collective of ``nbytes`` (size convention) on the two-link model.

    ``inter`` is one NIC and ``nic_share`` the NICs per GPU (NICs per node / GPUs per
    node); ``nvls_algbw`` > 0 enables the NVLink SHARP all-reduce inside a node."""
    algo = check_op(op, algo)
    if placement.size == 1:
        return 0.0
    _check_link_args(placement, nbytes, nic_share)
    algo = pick_algo(op, placement, nbytes, intra, inter, algo, base_latency, nic_share, nvls_algbw)
    return _algo_time(op, algo, placement, float(nbytes), intra, inter, base_latency, nic_share, nvls_algbw)


def sent_bytes(op: str, placement: Placement, nbytes: float, algo: str | None = None) -> float:
    """Bytes each rank sends (the numerators above); 2 S for the tree all-reduce, S into the
    switch for NVLS. ``auto`` counts as the ring (pass ``pick_algo``'s choice for the rest)."""
    algo = check_op(op, algo)
    n, m, g = placement.size, placement.per_node, placement.nodes
    if n == 1:
        return 0.0
    if op == "all_reduce" and algo == "tree":
        return 2.0 * nbytes
    if op == "all_reduce" and algo == "nvls":
        return float(nbytes)
    if op == "all_to_all" and algo == "hierarchical":
        return (m - 1) / m * nbytes + ((g - 1) / g * nbytes if g > 1 else 0.0)
    return bus_bytes(op, n, nbytes)


FORMULAS = {
    ("all_reduce", "ring"): "2(n-1)/n·S / min(B_i, m·b_x) + intra and inter steps·a",
    ("all_reduce", "tree"): "2·S / min(B_i, m·b_x) + 2[(m-1)·a_i + log2(g)·a_x]",
    ("all_reduce", "nvls"): "S / A_nvls + 2·a_i",
    ("all_gather", "ring"): "(n-1)/n·S / min(B_i, m·b_x) + intra and inter steps·a",
    ("reduce_scatter", "ring"): "(n-1)/n·S / min(B_i, m·b_x) + intra and inter steps·a",
    ("all_to_all", "pairwise"): "max((m-1)/n·S / B_i, (n-m)/n·S / b_x) + a",
    ("all_to_all", "hierarchical"): "(m-1)/m·S / B_i + (g-1)/g·S / b_x + a_i + a_x",
    (P2P, "direct"): "S / B_i + a_i (one node), S / b_x + a_x (across nodes)",
}


# ---- machines -----------------------------------------------------------------------

GB = 1e9

NVLINK_EFF = 370 / 450     # nccl-tests #212: NCCL's effective NVLink 4 rate / line rate
NDR_EFF = 47 / 50          # nccl-tests #290: 46-48 GB/s per 400 Gb/s NIC
HDR_EFF = 24 / 25          # nccl #812: 192 GB/s busbw over 8 x 200 Gb/s (DGX A100)
NVLINK4 = Link("NVLink 4 (NVSwitch)", 450 * GB, 3.4e-6,
               "900 GB/s bidirectional per GPU, NVIDIA H100/H200 datasheets; 370 GB/s achieved, "
               "nccl-tests #212; latency: NCCL tuning.cc", NVLINK_EFF)
NVLINK4_H800 = Link("NVLink 4, H800 (NVSwitch)", 200 * GB, 3.4e-6,
                    "400 GB/s bidirectional per GPU, NVIDIA H800 datasheet; 160 GB/s achieved, "
                    "DeepSeek-V3 technical report sec. 3.2.2; latency: NCCL tuning.cc", 160 / 200)
NVLINK5 = Link("NVLink 5 (NVSwitch)", 900 * GB, 3.4e-6,
               "1.8 TB/s bidirectional per GPU, NVIDIA DGX B200 / GB200 NVL72; efficiency assumed "
               "as NVLink 4's (no published nccl-tests figure found); latency: NCCL tuning.cc", NVLINK_EFF)
NVLINK3 = Link("NVLink 3 (NVSwitch)", 300 * GB, 3.4e-6,
               "600 GB/s bidirectional per GPU, NVIDIA A100 datasheet; efficiency assumed as NVLink 4's; "
               "latency: NCCL tuning.cc", NVLINK_EFF)
PCIE5 = Link("PCIe Gen5 x16", 64 * GB, 5.7e-6,
             "128 GB/s bidirectional, NVIDIA H100 PCIe product brief; efficiency assumed as NVLink 4's; "
             "latency: NCCL tuning.cc", NVLINK_EFF)
IB_NDR = Link("InfiniBand NDR 400 Gb/s NIC", 50 * GB, 14e-6,
              "400 Gb/s ConnectX-7; 46-48 GB/s achieved, nccl-tests #290; latency: NCCL tuning.cc", NDR_EFF)
IB_HDR = Link("InfiniBand HDR 200 Gb/s NIC", 25 * GB, 14e-6,
              "200 Gb/s ConnectX-6 (DGX A100); 192 GB/s over 8, nccl #812; latency: NCCL tuning.cc", HDR_EFF)
NCCL_BASE_LATENCY = 8.4e-6
NVLS_H100_ALGBW = 275 * GB    # nccl-tests #212: NVLS all-reduce on 8 H100, algbw ~275 (busbw ~480) GB/s
MiB = 2 ** 20


class MeasuredCurve(Protocol):
    """What ``Hardware`` needs of a measured curve: its time at a size. The calibrated table,
    ``moepar.cost.profiles.Curve``, is one; profiles imports this module, never the reverse."""

    def predict(self, nbytes: float) -> float: ...


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A machine type: links, GPUs per node, FLOP rate (FLOP/s per GPU), memory (bytes)."""

    name: str
    description: str
    intra: Link
    inter: Link
    gpus_per_node: int
    flops: float
    memory_bytes: float
    base_latency: float = 0.0
    sources: tuple[str, ...] = ()
    curves: Mapping[tuple[str, int], MeasuredCurve] = dataclasses.field(default_factory=dict)
    meta: Mapping[str, object] = dataclasses.field(default_factory=dict)
    nics_per_node: int = 0            # NICs (``inter`` each) per node; 0: one per GPU
    nvls_algbw: float = 0.0           # NVLink SHARP all-reduce algbw inside a node; 0: none
    memory_bandwidth: float = 0.0     # HBM bytes/s per GPU (datasheet); 0: unknown

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name!r}: gpus_per_node={self.gpus_per_node!r} must be an "
                             f"integer >= 1")
        if not isinstance(self.nics_per_node, int) or self.nics_per_node < 0:
            raise ValueError(f"hardware {self.name!r}: nics_per_node={self.nics_per_node!r} must be an "
                             f"integer >= 1 (0: one per GPU)")
        for name in ("flops", "memory_bytes"):
            v = getattr(self, name)
            if not (v > 0 and v < float("inf")):
                raise ValueError(f"hardware {self.name!r}: {name}={v} must be a finite number > 0")
        for name in ("nvls_algbw", "memory_bandwidth", "base_latency"):
            v = getattr(self, name)
            if not (v >= 0 and v < float("inf")):
                raise ValueError(f"hardware {self.name!r}: {name}={v} must be a finite number >= 0")

    @property
    def nics(self) -> int:
        """NICs per node."""
        return self.nics_per_node or self.gpus_per_node

    @property
    def nic_share(self) -> float:
        """NICs per GPU: each GPU's share of its node's NICs."""
        return self.nics / self.gpus_per_node

    def with_gpus_per_node(self, gpus_per_node: int, nics_per_node: int | None = None) -> "Hardware":
        """The same machine with another node size; the NICs per GPU stay (rails: one NIC per
        GPU in DGX/HGX nodes) unless ``nics_per_node`` is given."""
        if nics_per_node is None:
            nics_per_node = max(1, round(self.nic_share * gpus_per_node))
        return self.replace(gpus_per_node=gpus_per_node, nics_per_node=nics_per_node)

    @property
    def calibrated(self) -> bool:
        return bool(self.curves)

    def curve_for(self, op: str, placement: Placement, algo: str | None = None) -> MeasuredCurve | None:
        """The measured curve that prices this call, if any (one node, backend's algorithm)."""
        algo = check_op(op, algo)
        if placement.nodes != 1:
            return None
        if algo != DEFAULT_ALGO[op] and not (op == "all_to_all" and algo == "hierarchical"):
            return None  # a single-node hierarchical all-to-all is the flat one
        return self.curves.get((op, placement.size))

    def collective_time(self, op: str, placement: Placement, nbytes: float,
                        algo: str | None = None) -> float:
        """Predicted seconds for one collective of ``nbytes`` (nccl-tests size, per rank)."""
        if placement.size == 1:
            return 0.0
        curve = self.curve_for(op, placement, algo)
        if curve is not None:
            return curve.predict(nbytes)
        return link_time(op, placement, nbytes, self.intra, self.inter, algo, self.base_latency,
                         self.nic_share, self.nvls_algbw)

    def resolve_algo(self, op: str, placement: Placement, nbytes: float, algo: str | None = None) -> str:
        """The algorithm that prices this call: ``auto`` resolved to the fastest concrete one
        (kept as ``auto`` where a measured curve prices it: the backend chose)."""
        algo = check_op(op, algo)
        if placement.size == 1 or self.curve_for(op, placement, algo) is not None:
            return algo
        return pick_algo(op, placement, nbytes, self.intra, self.inter, algo, self.base_latency,
                         self.nic_share, self.nvls_algbw)

    def replace(self, **changes) -> "Hardware":
        return dataclasses.replace(self, **changes)


def _preset(name, description, intra, inter, flops_tf, memory_bytes, sources, nics=8, gpus=8,
            nvls=0.0, hbm_tbps=0.0) -> Hardware:
    return Hardware(name, description, intra, inter, gpus, flops_tf * 1e12, memory_bytes,
                    NCCL_BASE_LATENCY, tuple(sources), nics_per_node=nics, nvls_algbw=nvls,
                    memory_bandwidth=hbm_tbps * 1e12)


PRESETS: dict[str, Hardware] = {
    "h100": _preset("h100", "8x H100 SXM5 80GB per node, NVLink 4 + NVSwitch (NVLS), 8x 400G NDR",
                    NVLINK4, IB_NDR, 989.5, 81559 * MiB,
                    ["NVIDIA H100 datasheet: BF16 1,979 TFLOPS with sparsity, NVLink 900 GB/s, 3.35 TB/s HBM3",
                     "nvidia-smi memory.total of an H100 80GB HBM3: 81,559 MiB (79.6 GiB)",
                     "DGX H100: 8x ConnectX-7 400 Gb/s InfiniBand NDR (compute fabric)",
                     "nccl-tests #212, #290: NVLink 370 GB/s, NVLS all-reduce busbw ~480 GB/s, 46-48 GB/s per NIC"],
                    nvls=NVLS_H100_ALGBW, hbm_tbps=3.35),
    "h200": _preset("h200", "8x H200 SXM 141GB per node, NVLink 4 + NVSwitch (NVLS), 8x 400G NDR",
                    NVLINK4, IB_NDR, 989.5, 143771 * MiB,
                    ["NVIDIA H200 datasheet: BF16 1,979 TFLOPS with sparsity, NVLink 900 GB/s, 4.8 TB/s HBM3e",
                     "nvidia-smi memory.total of an H200: 143,771 MiB (140.4 GiB; 141 GB marketed)",
                     "8x 400 Gb/s InfiniBand NDR per node as DGX H100/H200",
                     "NVLink and NIC efficiencies as H100 (same NVLink 4 and ConnectX-7)"],
                    nvls=NVLS_H100_ALGBW, hbm_tbps=4.8),
    "h800": _preset("h800", "8x H800 SXM5 80GB per node, NVLink 400 GB/s + NVSwitch, 8x 400G NDR",
                    NVLINK4_H800, IB_NDR, 989.5, 81559 * MiB,
                    ["NVIDIA H800 datasheet: BF16 1,979 TFLOPS with sparsity, NVLink 400 GB/s, 80 GB",
                     "DeepSeek-V3 technical report (arXiv 2412.19437) sec. 3.2.2: NVLink 160 GB/s, IB 50 GB/s "
                     "per GPU (8 NICs per node)", "memory as H100 80GB (81,559 MiB)"], hbm_tbps=3.35),
    "a100": _preset("a100", "8x A100 SXM4 80GB per node, NVLink 3 + NVSwitch, 8x 200G HDR",
                    NVLINK3, IB_HDR, 312, 80 * GB,
                    ["NVIDIA A100 datasheet: BF16 312 TFLOPS dense, NVLink 600 GB/s, 80 GB, 2,039 GB/s HBM2e",
                     "DGX A100: 8x ConnectX-6 200 Gb/s InfiniBand HDR (compute fabric); nccl #812: 192 GB/s"],
                    hbm_tbps=2.039),
    "h100-pcie": _preset("h100-pcie", "8x H100 PCIe 80GB per node over PCIe Gen5, 8x 400G NDR",
                         PCIE5, IB_NDR, 756.5, 80 * GB,
                         ["NVIDIA H100 PCIe product brief: BF16 1,513 TFLOPS with sparsity, "
                          "PCIe Gen5 128 GB/s, 80 GB, 2.0 TB/s HBM2e", "400 Gb/s InfiniBand NDR per GPU (assumed)"],
                         hbm_tbps=2.0),
    "b200": _preset("b200", "8x B200 180GB per node (DGX B200), NVLink 5 + NVSwitch, 8x 400G NDR",
                    NVLINK5, IB_NDR, 2250, 180 * GB,
                    ["HGX B200 (1,000 W): BF16 2,250 TFLOPS dense, 4,500 with sparsity; 8 TB/s HBM3e",
                     "DGX B200 user guide: 8 B200 with 1,440 GB total, 8x ConnectX-7 400 Gb/s, NVLink 5 "
                     "1.8 TB/s per GPU"], hbm_tbps=8.0),
    "gb200-nvl72": _preset("gb200-nvl72", "GB200 NVL72: 72 B200 in one NVLink 5 domain, 400G NDR per GPU",
                           NVLINK5, IB_NDR, 2500, 186 * GB,
                           ["GB200 (1,200 W): BF16 2,500 TFLOPS dense; NVL72: 72 GPUs, 13.4 TB HBM3e "
                            "(186 GB each), 130 TB/s NVLink (1.8 TB/s per GPU), 8 TB/s HBM3e",
                            "one 400 Gb/s NIC per GPU assumed (as DGX B200; no source found here)"],
                           nics=72, gpus=72, hbm_tbps=8.0),
}

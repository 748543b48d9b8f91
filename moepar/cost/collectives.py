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

Machines (``Hardware``): presets with cited public figures (``moepar.cost.presets``, which
lists every figure's source), or calibrated JSON profiles (``moepar.cost.profiles``, whose
``get_hardware`` takes a preset's name or a profile's path). A ``Hardware`` prices a
collective with its measured curve when it has one for that (op, group size) on one node (a
profile written by ``python -m moepar calibrate``), and with the two-link model above
otherwise: the intra-node link per GPU, and ``nics_per_node`` NICs shared by the node's GPUs.
Each link carries its line rate and the fraction of it NCCL achieves (``Link.efficiency``).
Latencies are NCCL's own tuning model (src/graph/tuning.cc): model constants, not
measurements; ``calibrate`` replaces them.
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
    fp8_flops: float = 0.0            # dense FP8 (and MXFP8) FLOP/s per GPU; 0: FP8 GEMMs at ``flops``
    generation: str = ""              # GPU generation (moepar.cost.compute's efficiency table); "": none
    nvlink_domain: int = 0            # GPUs one NVLink domain can hold; 0: ``gpus_per_node``

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
        for name in ("nvls_algbw", "memory_bandwidth", "base_latency", "fp8_flops"):
            v = getattr(self, name)
            if not (v >= 0 and v < float("inf")):
                raise ValueError(f"hardware {self.name!r}: {name}={v} must be a finite number >= 0")

    @property
    def domain(self) -> int:
        """GPUs of one NVLink domain (a DGX node's 8, an NVL72 rack's 72); ``gpus_per_node`` of
        them are used when a run leaves part of it idle (64 of 72)."""
        return max(self.nvlink_domain, self.gpus_per_node)

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s of one GPU for GEMMs in ``dtype``: the FP8 rate for fp8 and mxfp8
        (where the GPU has one), the BF16 rate (``flops``) otherwise."""
        return self.fp8_flops if dtype in ("fp8", "mxfp8") and self.fp8_flops else self.flops

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

    def node_limited_all_to_all(self, placement: Placement, nbytes: float, inter_fraction: float) -> float:
        """An all-to-all whose tokens reach each destination node over the network once and are
        forwarded inside it over NVLink (DeepEP's normal kernels; DeepSeek-V3 report sec. 3.2.2):
        ``inter_fraction`` of the ``nbytes`` cross the network, (m-1)/m of them NVLink, both at
        once: a0 + a_x + max((m-1)/m·S/B_i, f·S/b_x). One node: the plain all-to-all."""
        if placement.nodes == 1 or self.curve_for("all_to_all", placement) is not None:
            return self.collective_time("all_to_all", placement, nbytes)
        m = placement.per_node
        b_x = self.inter.achievable * self.nic_share
        return (self.base_latency + self.inter.latency
                + max((m - 1) / m * nbytes / self.intra.achievable, inter_fraction * nbytes / b_x))

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

"""Alpha-beta models of the collectives, on nodes x GPUs-per-node with two kinds of link.

Conventions are nccl-tests' (``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests): ``S`` is the
"size" column, bytes per rank (all-reduce: the tensor; all-gather: the gathered output;
reduce-scatter: the input; all-to-all: this rank's send buffer), ``algbw = S / t`` and
``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all-reduce and ``(n-1)/n`` for
all-gather, reduce-scatter and all-to-all. ``busbw`` is the rate each rank's link carries,
so ``S * factor`` is the number of bytes each rank sends: that is what every formula here
divides by a link bandwidth.

Legend: n ranks in the group, m of them per node, g = n / m nodes spanned. B_i is the
intra-node link's achievable bandwidth per GPU per direction (line rate x efficiency);
the inter-node link is one NIC, and b_x = NIC rate x efficiency x NICs per GPU is each
GPU's share of its node's NICs (every group of a layout runs at once, so a node's NICs are
shared by all its GPUs). a_i, a_x: latency per algorithm step on NVLink/PCIe and on the
network; a0 a start-up latency per collective.

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
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from typing import Mapping, Sequence

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


@dataclasses.dataclass(frozen=True)
class Curve:
    """A measured time-vs-size curve for one (op, group size): the calibrated table.

    ``predict`` first makes the measured times non-decreasing in size (pool-adjacent-
    violators: a bigger message never takes less time, so a dip is noise), then
    interpolates linearly between neighbouring sizes (between two points the alpha-beta
    law is a straight line) and extrapolates with the nearest segment's slope.
    """

    op: str
    group_size: int
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    alpha: float          # fitted latency, s
    beta: float           # fitted s/byte (size convention); busbw = factor / beta

    def __post_init__(self) -> None:
        check_op(self.op)
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ValueError(f"curve {self.op}/{self.group_size}: need as many sizes as times (>0)")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"curve {self.op}/{self.group_size}: sizes must be strictly increasing")

    @property
    def busbw(self) -> float:
        """Fitted bus bandwidth, bytes/s."""
        return bus_factor(self.op, self.group_size) / self.beta if self.beta > 0 else math.inf

    def fit_time(self, nbytes: float) -> float:
        """The plain alpha-beta line."""
        return self.alpha + self.beta * nbytes

    @functools.cached_property
    def monotone(self) -> tuple[float, ...]:
        return tuple(isotonic(self.seconds))

    def predict(self, nbytes: float) -> float:
        xs, ys = self.sizes, self.monotone
        if len(xs) == 1:
            return max(self.fit_time(nbytes), 0.0)
        i = bisect.bisect_left(xs, nbytes)
        if i < len(xs) and xs[i] == nbytes:
            return ys[i]
        lo = min(max(i - 1, 0), len(xs) - 2)  # segment [lo, lo+1], the nearest one outside
        slope = (ys[lo + 1] - ys[lo]) / (xs[lo + 1] - xs[lo])
        if nbytes > xs[-1] and slope <= 0:
            slope = self.beta
        t = ys[lo] + slope * (nbytes - xs[lo])
        floor = max(min(self.alpha, ys[0]), 0.0) if nbytes < xs[0] else 0.0
        return max(t, floor, 1e-9)


def isotonic(ys: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit of ``ys`` (pool adjacent violators)."""
    blocks: list[list[float]] = []          # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least squares of ``t = alpha + beta * S`` on relative residuals (sizes span decades).

    A negative intercept is refitted through the origin; a negative slope is clipped to 0.
    """
    if len(sizes) != len(seconds) or not sizes:
        raise ValueError("fit needs as many sizes as times, at least one")
    if len(sizes) == 1:
        return 0.0, seconds[0] / sizes[0] if sizes[0] else 0.0
    w = [1.0 / t for t in seconds]
    # Weighted normal equations for [alpha, beta].
    a11 = sum(wi * wi for wi in w)
    a12 = sum(wi * wi * s for wi, s in zip(w, sizes))
    a22 = sum(wi * wi * s * s for wi, s in zip(w, sizes))
    b1 = sum(wi * wi * t for wi, t in zip(w, seconds))
    b2 = sum(wi * wi * s * t for wi, s, t in zip(w, sizes, seconds))
    det = a11 * a22 - a12 * a12
    alpha, beta = ((a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det) if det else (0.0, 0.0)
    if alpha < 0 or not det:
        alpha, beta = 0.0, b2 / a22
    return alpha, max(beta, 0.0)


def curves_to_dict(curves: Mapping[tuple[str, int], Curve]) -> list[dict]:
    return [dataclasses.asdict(c) for _, c in sorted(curves.items())]


def curves_from_dict(items: Sequence[dict]) -> dict[tuple[str, int], Curve]:
    out = {}
    for d in items:
        c = Curve(d["op"], int(d["group_size"]), tuple(int(s) for s in d["sizes"]),
                  tuple(float(t) for t in d["seconds"]), float(d["alpha"]), float(d["beta"]))
        out[(c.op, c.group_size)] = c
    return out

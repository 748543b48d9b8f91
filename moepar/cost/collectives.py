"""Alpha-beta models of the collectives, on nodes x GPUs-per-node with two kinds of link.

Conventions are nccl-tests' (``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests): ``S`` is the
"size" column, bytes per rank (all-reduce: the tensor; all-gather: the gathered output;
reduce-scatter: the input; all-to-all: this rank's send buffer), ``algbw = S / t`` and
``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all-reduce and ``(n-1)/n`` for
all-gather, reduce-scatter and all-to-all. ``busbw`` is the rate each rank's link carries,
so ``S * factor`` is the number of bytes each rank sends: that is what every formula here
divides by a link bandwidth.

Legend: n ranks in the group, m of them per node, g = n / m nodes spanned; B_intra,
B_inter bandwidth per rank per direction of the intra-node link (NVLink, PCIe) and of the
inter-node link (the GPU's NIC), a_intra, a_inter latency per algorithm step on that link,
a0 a fixed start-up latency per collective.

    op              algo          time
    all_reduce      ring          a0 + 2(n-1) a + 2(n-1)/n S / B          (B, a: slowest hop)
    all_reduce      tree          a0 + 2[(m-1) a_intra + ceil(log2 g) a_inter] + 2 S / B
    all_gather      ring          a0 + (n-1) a + (n-1)/n S / B
    reduce_scatter  ring          a0 + (n-1) a + (n-1)/n S / B
    all_to_all      pairwise      a0 + max((m-1) a_intra + (m-1)/n S / B_intra,
                                           (n-m) a_inter + (n-m)/n S / B_inter)
    all_to_all      hierarchical  a0 + (m-1) a_intra + (m-1)/m S / B_intra
                                     + (g-1) a_inter + (g-1)/g S / B_inter

The ring's slowest hop is the inter-node link once the group spans nodes. The tree is
NCCL's: a chain inside each node and a (double) binary tree across nodes, pipelined, so
each rank sends about 2 S. Pairwise all-to-all drives both links at once; the two-level
(hierarchical) one first exchanges inside the node so that the inter-node step sends g-1
messages of S/g instead of n-m messages of S/n: the same inter-node bytes, fewer and
larger messages (Tutel's 2DH all-to-all, DeepSpeed-MoE's hierarchical all-to-all).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from typing import Mapping, Sequence

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
ALGOS = {"all_reduce": ("ring", "tree"), "all_gather": ("ring",), "reduce_scatter": ("ring",),
         "all_to_all": ("pairwise", "hierarchical")}
DEFAULT_ALGO = {"all_reduce": "ring", "all_gather": "ring", "reduce_scatter": "ring",
                "all_to_all": "pairwise"}


def check_op(op: str, algo: str | None = None) -> str:
    """Validate ``op`` (and ``algo``); return the algorithm to use."""
    if op not in ALGOS:
        raise ValueError(f"op={op!r} is not a known collective; valid: {', '.join(OPS)}")
    algo = DEFAULT_ALGO[op] if algo is None else algo
    if algo not in ALGOS[op]:
        raise ValueError(f"algo={algo!r} is not valid for {op}; valid: {', '.join(ALGOS[op])}")
    return algo


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor: 2(n-1)/n for all-reduce, (n-1)/n otherwise."""
    check_op(op)
    if n < 1:
        raise ValueError(f"group size n={n} must be >= 1")
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
    """One kind of link: bandwidth per rank per direction (bytes/s), latency per step (s)."""

    name: str
    bandwidth: float
    latency: float
    source: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"link {self.name!r}: bandwidth={self.bandwidth} must be > 0 bytes/s")
        if self.latency < 0:
            raise ValueError(f"link {self.name!r}: latency={self.latency} must be >= 0 s")


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


def link_time(op: str, placement: Placement, nbytes: float, intra: Link, inter: Link,
              algo: str | None = None, base_latency: float = 0.0) -> float:
    """Seconds for one collective of ``nbytes`` (size convention) on the two-link model."""
    algo = check_op(op, algo)
    n, m, g = placement.size, placement.per_node, placement.nodes
    if n == 1:
        return 0.0
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    S = float(nbytes)
    # The slowest hop of a ring (or of a tree's pipeline) is the inter-node link if any.
    slow = inter if g > 1 else intra
    bw = min(intra.bandwidth, inter.bandwidth) if g > 1 else intra.bandwidth
    if op == "all_reduce" and algo == "ring":
        return base_latency + 2 * (n - 1) * slow.latency + 2 * (n - 1) / n * S / bw
    if op == "all_reduce":  # tree: chain inside the node, binary tree across nodes
        steps = (m - 1) * intra.latency + math.ceil(math.log2(g)) * inter.latency if g > 1 \
            else (m - 1) * intra.latency
        return base_latency + 2 * steps + 2 * S / bw
    if op in ("all_gather", "reduce_scatter"):
        return base_latency + (n - 1) * slow.latency + (n - 1) / n * S / bw
    if algo == "pairwise":
        t_intra = (m - 1) * intra.latency + (m - 1) / n * S / intra.bandwidth
        t_inter = (n - m) * inter.latency + (n - m) / n * S / inter.bandwidth
        return base_latency + max(t_intra, t_inter)
    # hierarchical: intra-node all-to-all among m, then inter-node among g (same local rank)
    t = (m - 1) * intra.latency + (m - 1) / m * S / intra.bandwidth
    if g > 1:
        t += (g - 1) * inter.latency + (g - 1) / g * S / inter.bandwidth
    return base_latency + t


def sent_bytes(op: str, placement: Placement, nbytes: float, algo: str | None = None) -> float:
    """Bytes each rank sends (the numerators above); 2 S for the tree all-reduce."""
    algo = check_op(op, algo)
    n, m, g = placement.size, placement.per_node, placement.nodes
    if n == 1:
        return 0.0
    if op == "all_reduce" and algo == "tree":
        return 2.0 * nbytes
    if op == "all_to_all" and algo == "hierarchical":
        return (m - 1) / m * nbytes + ((g - 1) / g * nbytes if g > 1 else 0.0)
    return bus_bytes(op, n, nbytes)


FORMULAS = {
    ("all_reduce", "ring"): "2(n-1)/n·S / B + 2(n-1)·a",
    ("all_reduce", "tree"): "2·S / B + 2[(m-1)·a_intra + log2(g)·a_inter]",
    ("all_gather", "ring"): "(n-1)/n·S / B + (n-1)·a",
    ("reduce_scatter", "ring"): "(n-1)/n·S / B + (n-1)·a",
    ("all_to_all", "pairwise"): "max((m-1)/n·S / B_intra, (n-m)/n·S / B_inter) + steps·a",
    ("all_to_all", "hierarchical"): "(m-1)/m·S / B_intra + (g-1)/g·S / B_inter + steps·a",
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

"""Expert placement with redundant copies (torch-free): which EP rank holds which expert.

``plan_placement(loads, E, X, ep)`` gives each of the ``ep`` ranks ``(E + X) / ep`` slots,
every expert at least one copy and the X extra copies to the hottest experts, then splits
each replicated expert's routes among its copies so that the most-loaded rank's expected
load is as close to the mean as the slot map allows. ``split_counts`` turns a copy's share
into whole routes, the same way on every rank. Algorithm, guarantee and figures:
docs/routing.md, "Expert replication: placement". ``python -m moepar.moe.placement``
prints the Zipf table shown there.

Legend (docs/moe.md): E logical experts, X redundant expert slots in all (``redundant_experts``).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Sequence

from ..checks import finite, int_at_least, positive_int

MAX_PASSES = 10_000   # water-filling passes; the loop usually settles in a few dozen
SWAP_WORK = 20_000    # pours (and trials) the local search may spend (bounds its time)
TRIAL_PASSES = 4      # warm water-filling passes that judge one trial swap
NODE_SLACK = 0.01     # keeping copies in a node may cost the most-loaded rank this much


@dataclasses.dataclass(frozen=True)
class Copy:
    """One copy of a logical expert: ``slots[rank][slot]`` holds it, and it receives
    ``share`` of that expert's routes (an expert's shares sum to 1)."""

    rank: int
    slot: int
    share: float


@dataclasses.dataclass(frozen=True)
class Placement:
    """A slot map. ``slots[rank]``: the logical expert ids EP rank ``rank`` holds, by id
    (``slots_per_rank`` each); ``copies[e]``: expert e's copies by rank; ``loads[e]``: the
    load the plan was made for (routes, rows or any unit)."""

    num_experts: int
    redundant_experts: int
    ep_size: int
    loads: tuple[float, ...]
    slots: tuple[tuple[int, ...], ...]
    copies: tuple[tuple[Copy, ...], ...]

    @property
    def slots_per_rank(self) -> int:
        return (self.num_experts + self.redundant_experts) // self.ep_size

    def shares(self, expert: int) -> tuple[float, ...]:
        """Expert ``expert``'s split among its copies, in ``copies[expert]`` order."""
        return tuple(c.share for c in self.copies[expert])

    def rank_loads(self) -> tuple[float, ...]:
        """Expected load per EP rank: the sum over its copies of load x share."""
        out = [0.0] * self.ep_size
        for e, cs in enumerate(self.copies):
            for c in cs:
                out[c.rank] += self.loads[e] * c.share
        return tuple(out)

    def max_over_mean(self) -> float:
        """The most-loaded rank's expected load over the mean (1.0: balanced; also 1.0 when
        every load is zero, as there is nothing to balance)."""
        per_rank = self.rank_loads()
        mean = sum(per_rank) / self.ep_size
        return max(per_rank) / mean if mean > 0 else 1.0


def check_placement_args(loads, num_experts, redundant_experts, ep_size, ranks_per_node=None) -> list[float]:
    """Every rule ``plan_placement`` enforces, one ValueError naming the value and the rule
    (no process needed, so every rank fails alike before any collective); the loads as floats."""
    positive_int("ep_size", ep_size)
    positive_int("num_experts", num_experts)
    int_at_least("redundant_experts", redundant_experts, 0)
    if ranks_per_node is not None:
        positive_int("ranks_per_node", ranks_per_node)
        if ranks_per_node < ep_size and ep_size % ranks_per_node:
            raise ValueError(f"ep_size={ep_size} is not divisible by ranks_per_node={ranks_per_node} "
                             "(EP rank r sits on node r // ranks_per_node; nodes hold equal numbers of ranks)")
    if redundant_experts % ep_size:
        raise ValueError(f"redundant_experts={redundant_experts} is not divisible by ep_size={ep_size} "
                         "(every EP rank holds the same number of extra slots)")
    if (num_experts + redundant_experts) % ep_size:
        raise ValueError(f"num_experts + redundant_experts = {num_experts} + {redundant_experts} slots is not "
                         f"divisible by ep_size={ep_size} (every EP rank holds the same number of slots)")
    if redundant_experts > num_experts * (ep_size - 1):
        raise ValueError(f"redundant_experts={redundant_experts} > num_experts x (ep_size - 1) = "
                         f"{num_experts} x {ep_size - 1}: an expert has at most one copy per EP rank, "
                         f"so at most {num_experts * (ep_size - 1)} extra copies fit")
    if isinstance(loads, (str, bytes)) or not hasattr(loads, "__len__"):
        raise ValueError(f"loads={loads!r} must be a sequence of num_experts={num_experts} numbers")
    if len(loads) != num_experts:
        raise ValueError(f"len(loads)={len(loads)} must equal num_experts={num_experts} (one load per expert)")
    for i, v in enumerate(loads):
        finite(f"loads[{i}]", v, at_least=0)
    return [float(v) for v in loads]


def plan_placement(loads: Sequence[float], num_experts: int, redundant_experts: int, ep_size: int, *,
                   ranks_per_node: int | None = None, owner_slack: float = 0.0) -> Placement:
    """The slot map for ``num_experts`` logical experts and ``redundant_experts`` extra copies
    over ``ep_size`` EP ranks, from per-expert ``loads`` (non-negative finite numbers, e.g. a
    ``tokens_per_expert`` count's ``.tolist()``). ``ranks_per_node``: EP ranks per node (EP
    rank r on node r // ranks_per_node; None: one node); copies of one expert then stay in
    one node when a node has room, unless that raises the most-loaded rank's load by more
    than NODE_SLACK. Deterministic: ties go to the lower expert id, then rank.

    ``redundant_experts=0`` is the unreplicated layout moepar uses: expert g on rank
    ``g // (E / ep)``. Otherwise the greedy EPLB plan (with and without the node
    preference), or the unreplicated layout with the extra slots filled greedily if that
    has a lower maximum rank load, so the result is never worse than no replication.
    ``owner_slack`` >= 0: the unreplicated layout plus copies also wins when its most-loaded
    rank is within this fraction of the best plan's (in the layer only the copies' weights
    then travel each forward, ``moepar.moe.replicas``). Shares by water-filling (``_Fill``).
    """
    finite("owner_slack", owner_slack, at_least=0)
    loads = check_placement_args(loads, num_experts, redundant_experts, ep_size, ranks_per_node)
    E, X, ep = num_experts, redundant_experts, ep_size
    per_rank = (E + X) // ep
    if X == 0:
        held = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep)]
        return _build(loads, held)
    plans = []   # (plan, how much worse than the best it may be and still win), preferred first
    node = ep if ranks_per_node is None else min(ranks_per_node, ep)
    if 1 < node < ep:
        plans.append((_swap_down(loads, _pack_eplb(loads, X, ep, per_rank, node), node), NODE_SLACK))
    plans.append((_swap_down(loads, _pack_eplb(loads, X, ep, per_rank, ep), ep), 1e-9))
    identity = _Fill(loads, _pack_from_identity(loads, X, ep, per_rank))
    identity.pour(range(E))
    plans.append((_build(loads, identity.held, identity.share), 0.0))
    least = min(max(p.rank_loads()) for p, _ in plans)
    if owner_slack > 0 and max(plans[-1][0].rank_loads()) <= least * (1 + owner_slack):
        return plans[-1][0]
    flat = max(math.fsum(loads[r * (E // ep):(r + 1) * (E // ep)]) for r in range(ep))   # X = 0's maximum
    return next((p for p, slack in plans if max(p.rank_loads()) <= min(least * (1 + slack), flat * (1 + 1e-9))),
                plans[-1][0])


def split_counts(count: int, shares: Sequence[float]) -> tuple[int, ...]:
    """``count`` routes split among copies with ``shares`` (normalised by their sum): each
    copy gets floor(count x share), and the routes left over go one each to the largest
    remainders, ties to the earlier copy. Sums to ``count`` exactly; a pure function of
    its inputs, so every rank computes the same split."""
    int_at_least("count", count, 0)
    if isinstance(shares, (str, bytes)) or not hasattr(shares, "__len__") or len(shares) == 0:
        raise ValueError(f"shares={shares!r} must be a non-empty sequence of numbers")
    for i, s in enumerate(shares):
        finite(f"shares[{i}]", s, at_least=0)
    total = math.fsum(shares)
    if total <= 0:
        raise ValueError(f"shares={list(shares)!r} must have a positive sum")
    exact = [count * s / total for s in shares]
    out = [min(count, math.floor(x)) for x in exact]
    left = count - sum(out)
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in by_remainder[:left]:
        out[i] += 1
    return tuple(out)


def _copy_counts(loads: list[float], X: int, ep: int) -> list[int]:
    """EPLB's replication: each extra copy to the expert with the largest load per copy
    (ties: lower id), at most ``ep`` copies each."""
    counts = [1] * len(loads)
    for _ in range(X):
        e = min((e for e in range(len(loads)) if counts[e] < ep), key=lambda e: (-loads[e] / counts[e], e))
        counts[e] += 1
    return counts


def _realizable(demands: list[int], free: list[int]) -> bool:
    """Gale-Ryser: copies ``demands`` (one per expert, each on distinct ranks) fit ranks
    with ``free`` slots (same totals) iff every k largest demands fit sum(min(free, k))."""
    demands = sorted(demands, reverse=True)
    acc = 0
    for k, d in enumerate(demands[:max(free, default=0)], start=1):
        acc += d
        if acc > sum(min(f, k) for f in free):
            return False
    return True


def _pack_eplb(loads: list[float], X: int, ep: int, per_rank: int, node: int) -> list[list[int]]:
    """Copies heaviest-per-copy first, each expert's copies onto the least-loaded ranks with
    a free slot, distinct ranks, inside one node when one has room. A choice that would leave
    the remaining copies unplaceable on distinct ranks falls back to the ranks with the most
    free slots, which always keeps them placeable (the Gale-Ryser construction)."""
    counts = _copy_counts(loads, X, ep)
    order = sorted(range(len(loads)), key=lambda e: (-loads[e] / counts[e], e))
    held, load, free = [[] for _ in range(ep)], [0.0] * ep, [per_rank] * ep
    for i, e in enumerate(order):
        c = counts[e]
        open_ranks = sorted((r for r in range(ep) if free[r]), key=lambda r: (load[r], r))
        choice = open_ranks[:c]
        if 1 < c <= node < ep:
            in_node = [[r for r in open_ranks if r // node == n][:c] for n in range(ep // node)]
            fits = [rs for rs in in_node if len(rs) == c]
            if fits:
                choice = min(fits, key=lambda rs: (max(load[r] for r in rs), sum(load[r] for r in rs), rs[0]))
        rest = [counts[x] for x in order[i + 1:]]
        if not _realizable(rest, [free[r] - (r in choice) for r in range(ep)]):
            choice = sorted(open_ranks, key=lambda r: (-free[r], load[r], r))[:c]
        for r in choice:
            held[r].append(e)
            load[r] += loads[e] / c
            free[r] -= 1
    return held


def _pack_from_identity(loads: list[float], X: int, ep: int, per_rank: int) -> list[list[int]]:
    """The unreplicated layout (expert g on rank g // (E / ep)) plus X extra copies: each to
    the expert with the largest load per copy that some rank with a free slot lacks, on the
    least-loaded such rank. Water-filling can leave the extras idle, so this plan is never
    worse than no replication."""
    E = len(loads)
    home = E // ep
    held = [list(range(r * home, (r + 1) * home)) for r in range(ep)]
    counts = [1] * E
    for _ in range(X):
        load = [sum(loads[e] / counts[e] for e in h) for h in held]
        open_ranks = [r for r in range(ep) if len(held[r]) < per_rank]
        # some expert is always missing from an open rank: that rank holds fewer than E
        for e in sorted(range(E), key=lambda e: (-loads[e] / counts[e], e)):
            lacking = [r for r in open_ranks if e not in held[r]]
            if lacking:
                break
        r = min(lacking, key=lambda r: (load[r], r))
        held[r].append(e)
        counts[e] += 1
    return held


class _Fill:
    """A slot map with its shares ``share[e, rank]`` and rank loads, refined in place by
    water-filling: block coordinate descent on the sum of squared rank loads. A pass takes
    the replicated experts in id order and pours each one's load over its copies' ranks
    like water (the lowest first, to one common level), given every other expert's split.
    Each step is that expert's exact minimiser, so the passes converge to the least-squares
    split, which also minimises the maximum rank load (the rank-load vectors form a
    polymatroid's base polytope, whose min-norm point is lexicographically optimal)."""

    def __init__(self, loads: list[float], held: list[list[int]]):
        self.loads, self.held = loads, held
        self.where: list[list[int]] = [sorted(r for r, h in enumerate(held) if e in h) for e in range(len(loads))]
        self.share = {(e, r): 1.0 / len(rs) for e, rs in enumerate(self.where) for r in rs}
        self.rank_load = [math.fsum(loads[e] * self.share[e, r] for e in h) for r, h in enumerate(held)]
        self.tol = 1e-12 * math.fsum(loads)

    def pour(self, experts, passes: int = MAX_PASSES) -> int:
        """Up to ``passes`` passes over ``experts`` (until no rank moves by more than
        1e-12 x the total); returns the number of pours."""
        hot = [e for e in sorted(experts) if len(self.where[e]) > 1 and self.loads[e] > 0]
        share, rank_load, done = self.share, self.rank_load, 0
        while hot and done < passes:
            done += 1
            moved = 0.0
            for e in hot:
                rs, amount = self.where[e], self.loads[e]
                base = [rank_load[r] - amount * share[e, r] for r in rs]
                for r, b, x in zip(rs, base, _pour(base, amount)):
                    moved = max(moved, amount * abs(x - share[e, r]))
                    share[e, r], rank_load[r] = x, b + amount * x
            if moved <= self.tol:
                break
        return done * len(hot)

    def swap(self, a: int, top: int, b: int, r: int) -> None:
        """a's copy on ``top`` and b's on ``r`` trade places, keeping their shares."""
        self.held[top][self.held[top].index(a)], self.held[r][self.held[r].index(b)] = b, a
        la, lb = self.loads[a] * self.share[a, top], self.loads[b] * self.share[b, r]
        self.rank_load[top] += lb - la
        self.rank_load[r] += la - lb
        for e, src, dst in ((a, top, r), (b, r, top)):
            self.share[e, dst] = self.share.pop((e, src))
            self.where[e] = sorted(dst if x == src else x for x in self.where[e])

    def score(self) -> tuple[float, float]:
        return max(self.rank_load), math.fsum(x * x for x in self.rank_load)


def _swap_down(loads: list[float], held: list[list[int]], node: int) -> Placement:
    """Local search after the greedy: swap a slot of the most-loaded rank with a slot of
    another rank (least-loaded ranks first), keeping copies on distinct ranks and no expert
    on more nodes, when that lowers (max rank load, sum of squares). A trial is judged by a
    few warm water-filling passes over the experts on the two ranks (a valid split, so an
    improvement it shows is real). Stops at the mean, when no swap helps, or after
    SWAP_WORK pours and trials; then water-fills to convergence."""
    fill = _Fill(loads, held)
    work = fill.pour(range(len(loads)))
    best, mean, improved = fill.score(), math.fsum(loads) / len(held), True
    while improved and work < SWAP_WORK and best[0] > mean * (1 + 1e-9):
        improved = False
        top = max(range(len(held)), key=lambda r: (fill.rank_load[r], -r))
        others = sorted((r for r in range(len(held)) if r != top), key=lambda r: (fill.rank_load[r], r))
        trials = ((a, r, b) for a in sorted(held[top]) for r in others for b in sorted(held[r])
                  if a not in held[r] and b not in held[top] and (r // node == top // node or node == 1
                                                                  or _spread_kept(fill.where, node, a, top, r, b)))
        for a, r, b in trials:
            if work >= SWAP_WORK:
                break
            touched = set(held[top]) | set(held[r])
            saved = ({(e, x): fill.share[e, x] for e in touched for x in fill.where[e]}, list(fill.rank_load))
            fill.swap(a, top, b, r)
            work += fill.pour(touched, TRIAL_PASSES) + 1
            s, eps = fill.score(), 1e-12 * best[0]
            if s[0] < best[0] - eps or (s[0] <= best[0] + eps and s[1] < best[1] * (1 - 1e-12)):
                best, improved = s, True
                break
            fill.swap(b, top, a, r)
            fill.share.update(saved[0])
            fill.rank_load[:] = saved[1]
    fill.pour(range(len(loads)))
    return _build(loads, held, fill.share)


def _spread_kept(where: list[list[int]], node: int, a: int, top: int, r: int, b: int) -> bool:
    """Whether moving a's copy from rank ``top`` to ``r`` and b's the other way keeps the
    number of nodes each of a and b spans."""
    def nodes(e: int, src: int, dst: int) -> int:
        return len({(dst if x == src else x) // node for x in where[e]})
    return nodes(a, top, r) <= nodes(a, -1, -1) and nodes(b, r, top) <= nodes(b, -1, -1)


def _pour(base: list[float], amount: float) -> list[float]:
    """Water-filling: fractions of ``amount`` poured over levels ``base`` so that every
    level it reaches ends at one common height, and the rest get nothing."""
    order = sorted(range(len(base)), key=lambda j: (base[j], j))
    level, acc = base[order[0]] + amount, base[order[0]]
    for k in range(2, len(base) + 1):
        if base[order[k - 1]] >= level:
            break
        acc += base[order[k - 1]]
        level = (amount + acc) / k
    out = [max(0.0, level - b) for b in base]
    total = math.fsum(out)
    return [x / total for x in out]


def _build(loads: list[float], held: list[list[int]], share: dict | None = None) -> Placement:
    slots = tuple(tuple(sorted(h)) for h in held)
    found: list[list[Copy]] = [[] for _ in loads]
    for r, rank_slots in enumerate(slots):
        for i, e in enumerate(rank_slots):
            found[e].append(Copy(r, i, 1.0 if share is None else share[e, r]))
    X = len(slots) * len(slots[0]) - len(loads)
    return Placement(len(loads), X, len(slots), tuple(loads), slots, tuple(tuple(c) for c in found))


def zipf_loads(num_experts: int, exponent: float) -> list[float]:
    """Zipf-like loads normalised to sum 1: expert i (from 0) gets 1 / (i + 1) ** exponent."""
    raw = [1.0 / (i + 1) ** exponent for i in range(num_experts)]
    total = math.fsum(raw)
    return [x / total for x in raw]


def zipf_table(num_experts: int = 16, ep_size: int = 4, redundant: Sequence[int] = (0, 4, 8),
               exponents: Sequence[float] = (0.5, 1.0, 1.5, 2.0), ranks_per_node: int | None = None) -> str:
    """Markdown table: the most-loaded rank's expected load over the mean for Zipf loads
    (expert 0 the hottest) at each ``redundant`` count (X=0: no replication)."""
    rows = ["| Zipf exponent | hottest expert | " + " | ".join(f"X={X}" for X in redundant) + " |",
            "|" + "---|" * (len(redundant) + 2)]
    for s in exponents:
        loads = zipf_loads(num_experts, s)
        plans = [plan_placement(loads, num_experts, X, ep_size, ranks_per_node=ranks_per_node) for X in redundant]
        cells = [f"{p.max_over_mean():.3f}" for p in plans]
        rows.append(f"| {s:g} | {loads[0]:.1%} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Max/mean rank load of plan_placement on Zipf-like loads.")
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--ep-size", type=int, default=4)
    p.add_argument("--redundant", type=int, nargs="+", default=[0, 4, 8])
    p.add_argument("--exponents", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0])
    p.add_argument("--ranks-per-node", type=int, default=None)
    a = p.parse_args(argv)
    print(zipf_table(a.num_experts, a.ep_size, a.redundant, a.exponents, a.ranks_per_node))


if __name__ == "__main__":
    main()

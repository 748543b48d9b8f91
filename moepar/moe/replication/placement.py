"""Expert placement with redundant copies (torch-free): which EP rank holds which expert.

``plan_placement(loads, E, X, ep)`` gives each of the ``ep`` ranks ``(E + X) / ep`` slots,
every expert at least one copy and the extra copies to the experts that need them, and
splits each replicated expert's routes among its copies so that the most-loaded rank's
expected load is as close to the mean as the slot map allows (the slot map is built in
``placement_pack``, the split found in ``placement_split``). ``split_counts`` turns a copy's
share into whole routes, the same way on every rank. Algorithm, guarantee and figures:
docs/routing.md, "Expert replication: placement". ``python -m moepar.moe.replication.placement``
prints the Zipf table shown there (``--time N``: with each plan's seconds).

Legend (docs/moe.md): E logical experts, X redundant expert slots in all (``redundant_experts``).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from typing import Sequence

from ...checks import finite, int_at_least, positive_int
from .placement_pack import construct, identity
from .placement_split import Fill

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
    ``g // (E / ep)``. Otherwise the plan built to the mean (``placement_pack.construct``;
    with and without the node preference), or the unreplicated layout with the extra slots
    filled greedily if that has a lower maximum rank load, so the result is never worse than
    no replication. ``owner_slack`` >= 0: the unreplicated layout plus copies also wins when
    its most-loaded rank is within this fraction of the best plan's (in the layer only the
    copies' weights then travel each forward, ``moepar.moe.replication.replicas``); with it > 0 the built
    plans' ranks are also relabelled so that owners keep as many of their experts as the
    packing allows (free: the packing does not care which rank is which). Shares: the least
    maximum the slot map allows (``placement_split.Fill``).
    """
    finite("owner_slack", owner_slack, at_least=0)
    loads = check_placement_args(loads, num_experts, redundant_experts, ep_size, ranks_per_node)
    E, X, ep = num_experts, redundant_experts, ep_size
    per_rank = (E + X) // ep
    if X == 0:
        held = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep)]
        return _build(loads, held)
    mean = math.fsum(loads) / ep
    own = Fill(loads, identity(loads, X, ep, per_rank))
    own.settle()
    owners = _build(loads, own.held, own.share())
    if owner_slack > 0 and max(owners.rank_loads()) <= mean * (1 - 1e-12) * (1 + owner_slack):
        return owners   # no plan goes below the mean, so none beats this one by more than the slack
    plans = []   # (plan, how much worse than the best it may be and still win), preferred first
    node = ep if ranks_per_node is None else min(ranks_per_node, ep)
    if 1 < node < ep:
        plans.append((_built(loads, X, ep, node, owner_slack > 0), NODE_SLACK))
    if not plans or plans[0][0] is None or max(plans[0][0].rank_loads()) > mean * (1 + 1e-9):
        plans.append((_built(loads, X, ep, ep, owner_slack > 0), 1e-9))   # (a node plan at the mean wins anyway)
    plans = [(p, slack) for p, slack in plans if p is not None] + [(owners, 0.0)]
    least = min(max(p.rank_loads()) for p, _ in plans)
    if owner_slack > 0 and max(owners.rank_loads()) <= least * (1 + owner_slack):
        return owners
    flat = max(math.fsum(loads[r * (E // ep):(r + 1) * (E // ep)]) for r in range(ep))   # X = 0's maximum
    return next((p for p, slack in plans if max(p.rank_loads()) <= min(least * (1 + slack), flat * (1 + 1e-9))),
                owners)


def _built(loads: list[float], X: int, ep: int, node: int, owners: bool) -> Placement | None:
    """``construct``'s slot map (``node`` < ep: with the node preference; ``owners``: its ranks
    relabelled to keep experts on their owners), water-filled; None when the rule found no fit."""
    got = construct(loads, X, ep, node, NODE_SLACK / 10, owners)
    if got is None:
        return None
    fill = Fill(loads, *got)
    fill.settle()
    return _build(loads, fill.held, fill.share())


def placement_values(placement: Placement) -> list[float]:
    """``placement`` as one flat list of numbers: every rank's slots (expert ids, by rank, in
    ``slots`` order), then each slot's share. ``placement_from_values`` rebuilds it exactly, so
    a plan made on one rank reaches the others in one numeric collective."""
    ids = [float(e) for held in placement.slots for e in held]
    share = {(c.rank, c.slot): c.share for copies in placement.copies for c in copies}
    return ids + [share[r, i] for r, held in enumerate(placement.slots) for i in range(len(held))]


def placement_from_values(loads: Sequence[float], num_experts: int, redundant_experts: int, ep_size: int,
                          values: Sequence[float]) -> Placement:
    """The ``Placement`` that ``placement_values`` flattened, for ``loads`` (the load it was
    planned from). ValueError when ``values`` is not such a list."""
    loads = check_placement_args(loads, num_experts, redundant_experts, ep_size)
    E, H = num_experts, (num_experts + redundant_experts) // ep_size
    n = ep_size * H
    if len(values) != 2 * n:
        raise ValueError(f"len(values)={len(values)} must be 2 x ep_size x slots per rank = {2 * n}")
    held = [[int(v) for v in values[r * H:(r + 1) * H]] for r in range(ep_size)]
    shares = [float(v) for v in values[n:]]
    for r, h in enumerate(held):
        if h != sorted(set(h)) or not all(0 <= e < E for e in h) or any(float(e) != values[r * H + i]
                                                                          for i, e in enumerate(h)):
            raise ValueError(f"values: rank {r}'s slots {values[r * H:(r + 1) * H]} must be distinct expert ids "
                             f"in [0, {E}), ascending")
    if {e for h in held for e in h} != set(range(E)):
        raise ValueError(f"values: every expert of {E} must hold a slot")
    return _build(loads, held, {(e, r): shares[r * H + i] for r, h in enumerate(held) for i, e in enumerate(h)})


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
               exponents: Sequence[float] = (0.5, 1.0, 1.5, 2.0), ranks_per_node: int | None = None,
               repeats: int = 0) -> str:
    """Markdown table: the most-loaded rank's expected load over the mean for Zipf loads
    (expert 0 the hottest) at each ``redundant`` count (X=0: no replication); ``repeats`` > 0:
    each cell also gives the median seconds of that many ``plan_placement`` calls."""
    rows = ["| Zipf exponent | hottest expert | " + " | ".join(f"X={X}" for X in redundant) + " |",
            "|" + "---|" * (len(redundant) + 2)]
    for s in exponents:
        loads = zipf_loads(num_experts, s)
        cells = []
        for X in redundant:
            seconds = []
            for _ in range(max(repeats, 1)):
                start = time.perf_counter()
                p = plan_placement(loads, num_experts, X, ep_size, ranks_per_node=ranks_per_node)
                seconds.append(time.perf_counter() - start)
            cells.append(f"{p.max_over_mean():.3f}" + (f" ({statistics.median(seconds):.3f} s)" if repeats else ""))
        rows.append(f"| {s:g} | {loads[0]:.1%} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Max/mean rank load of plan_placement on Zipf-like loads.")
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--ep-size", type=int, default=4)
    p.add_argument("--redundant", type=int, nargs="+", default=[0, 4, 8])
    p.add_argument("--exponents", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0])
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--time", type=int, default=0, metavar="N",
                   help="also time each plan: the median seconds of N calls")
    a = p.parse_args(argv)
    print(zipf_table(a.num_experts, a.ep_size, a.redundant, a.exponents, a.ranks_per_node, a.time))


if __name__ == "__main__":
    main()

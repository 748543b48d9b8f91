"""The split of a slot map's load among its copies (torch-free).

``Fill`` holds a slot map with its shares and refines them by water-filling until the most
loaded rank is proven the least the map allows (``Fill.settle``), finishing with a
max-flow step (``Fill.reach``) where the passes close in slowly. Used by
``moepar.moe.replication.placement.plan_placement``.

Legend (docs/moe.md): E logical experts, X redundant expert slots in all.
"""
from __future__ import annotations

import math

from .placement_pack import level

MAX_PASSES = 10_000   # water-filling passes; a slot map built to the mean settles in one


class Fill:
    """A slot map with its shares (``sh[e]`` in ``where[e]`` order, ranks ascending) and rank
    loads, refined in place by water-filling: block coordinate descent on the sum of squared
    rank loads. A pass takes the replicated experts in id order and pours each one's load
    over its copies' ranks like water (the lowest first, to one common level), given every
    other expert's split. Each step is that expert's exact minimiser, so the passes converge
    to the least-squares split, which also minimises the maximum rank load (the rank-load
    vectors form a polymatroid's base polytope, whose min-norm point is lexicographically
    optimal). A pour never raises the highest of its ranks, so no pass raises the maximum.
    An expert none of whose ranks moved since its last pour is skipped: it would not move.
    ``settle`` stops as soon as the maximum meets a lower bound (``bound``): the split's
    maximum is then the least the slot map allows, and the passes that would only even out
    the ranks below it (most of them) are not spent."""

    def __init__(self, loads: list[float], held: list[list[int]], share: dict | None = None):
        self.loads, self.held = loads, held
        self.where: list[list[int]] = [[] for _ in loads]
        for r, h in enumerate(held):
            for e in h:
                self.where[e].append(r)
        self.sh = [self._start(e, share) for e in range(len(loads))]
        self.rank_load = [0.0] * len(held)
        for r, h in enumerate(held):
            self.rank_load[r] = math.fsum(loads[e] * self.sh[e][self.where[e].index(r)] for e in h)
        self.tol = 1e-12 * math.fsum(loads)
        self.clock = 0
        self.stamp = [0] * len(held)      # when each rank's load last moved by more than tol
        self.poured = [-1] * len(loads)   # when each expert was last poured

    def _start(self, e: int, share: dict | None) -> list[float]:
        rs = self.where[e]
        given = [share.get((e, r), 0.0) for r in rs] if share is not None and self.loads[e] > 0 else []
        total = math.fsum(given)
        return [s / total for s in given] if total > 0 else [1.0 / len(rs)] * len(rs)

    def pour(self, experts, passes: int = MAX_PASSES) -> int:
        """Up to ``passes`` passes over ``experts`` (until no rank moves by more than 1e-12 x
        the total); returns the number of pours made."""
        hot = [e for e in sorted(experts) if len(self.where[e]) > 1 and self.loads[e] > 0]
        rank_load, stamp, poured, tol = self.rank_load, self.stamp, self.poured, self.tol
        work = 0
        for _ in range(passes):
            moved = False
            for e in hot:
                rs, sh = self.where[e], self.sh[e]
                if max(stamp[r] for r in rs) <= poured[e]:
                    continue
                self.clock += 1
                poured[e], work, amount = self.clock, work + 1, self.loads[e]
                base = [rank_load[r] - amount * s for r, s in zip(rs, sh)]
                new = _pour(base, amount)
                for i, (r, b, x) in enumerate(zip(rs, base, new)):
                    if abs(amount * (x - sh[i])) > tol:
                        stamp[r], moved = self.clock, True
                    rank_load[r] = b + amount * x
                self.sh[e] = new
            if not moved:
                break
        return work

    def bound(self) -> float:
        """A lower bound on any split's maximum: the largest, over the sets of the k most-loaded
        ranks, of the load of the experts whose copies all lie in the set, divided by k (the
        min-cut formula; at the optimum the top level's ranks are such a set)."""
        order = sorted(range(len(self.held)), key=lambda r: -self.rank_load[r])
        pos = [0] * len(order)
        for i, r in enumerate(order):
            pos[r] = i
        confined = [0.0] * len(order)   # by the position of an expert's last rank in the order
        for e, rs in enumerate(self.where):
            confined[max(pos[r] for r in rs)] += self.loads[e]
        acc, best = 0.0, 0.0
        for k, x in enumerate(confined, start=1):
            acc += x
            best = max(best, acc / k)
        return best

    def settle(self) -> int:
        """Passes over every expert until the maximum is within 1e-10 of ``bound`` (proven
        least) or nothing moves; returns the number of pours. When many ranks share the top
        level the passes close in slowly (each moves load one expert further), so after 8,
        16, 32, ... passes ``reach`` tries to finish at the bound directly."""
        work, everyone, tries = 0, range(len(self.loads)), 8
        for done_passes in range(1, MAX_PASSES + 1):
            done = self.pour(everyone, 1)
            work += done
            low = self.bound()
            if done == 0 or max(self.rank_load) <= low * (1 + 1e-10):
                break
            if done_passes == tries:
                tries *= 2
                if self.reach(low):
                    break
        return work

    def reach(self, level: float) -> bool:
        """Moves the split so that no rank exceeds ``level``, if a split can: the excess above it
        is taken off the replicated experts there, then placed again along augmenting paths
        (an expert moves part of its load to another copy's rank, and so on, to a rank below
        ``level``), as in a max-flow. Returns False, the split unchanged, when no path is left."""
        loads, where, held, tol = self.loads, self.where, self.held, self.tol
        flexible = [len(rs) > 1 and a > 0 for rs, a in zip(where, loads)]
        x = [[a * s for s in sh] for a, sh in zip(loads, self.sh)]   # load of each copy
        load, short = list(self.rank_load), [0.0] * len(loads)
        for r in range(len(held)):
            for e in held[r]:
                over = load[r] - level
                if over <= 0:
                    break
                if flexible[e]:
                    i = where[e].index(r)
                    take = min(x[e][i], over)
                    x[e][i] -= take
                    short[e] += take
                    load[r] -= take
            if load[r] - level > tol:
                return False   # the experts with one copy alone exceed the level
        paths = 4 * (len(loads) + len(held))   # each path fills a rank, an expert or a copy to zero
        for start in [e for e in range(len(loads)) if short[e] > 0]:
            while short[start] > tol:
                paths -= 1
                if paths < 0:
                    return False
                reached, came, queue, found = {}, {start: -1}, [start], None
                for e in queue:   # breadth first: ranks by the expert that reaches them
                    for r in where[e]:
                        if r in reached:
                            continue
                        reached[r] = e
                        if level - load[r] > tol * 1e-3:
                            found = r
                            break
                        for g in held[r]:
                            if g not in came and flexible[g] and x[g][where[g].index(r)] > 0:
                                came[g] = r
                                queue.append(g)
                    if found is not None:
                        break
                if found is None:
                    return False
                steps, r = [], found   # back from the free rank to the start: (expert, rank it adds to)
                while True:
                    e = reached[r]
                    steps.append((e, r))
                    if e == start:
                        break
                    r = came[e]
                amount = min(short[start], level - load[found],
                             *(x[e][where[e].index(came[e])] for e, _ in steps if e != start))
                for e, r in steps:
                    x[e][where[e].index(r)] += amount
                    if e != start:
                        x[e][where[e].index(came[e])] -= amount
                load[found] += amount
                short[start] -= amount
        for e, rs in enumerate(where):
            if short[e] > 0:   # rounding dust: onto the lightest copy
                i = min(range(len(rs)), key=lambda i: load[rs[i]])
                x[e][i] += short[e]
            if flexible[e]:
                total = math.fsum(x[e])
                self.sh[e] = [max(0.0, v) / total for v in x[e]]
        self.rank_load = [math.fsum(loads[e] * self.sh[e][where[e].index(r)] for e in h) for r, h in enumerate(held)]
        self.touch(range(len(held)))
        return True

    def touch(self, ranks) -> None:
        """Marks ``ranks`` as moved, so that the next pour revisits their experts."""
        self.clock += 1
        for r in ranks:
            self.stamp[r] = self.clock

    def share(self) -> dict:
        """{(expert, rank): share} of every copy."""
        return {(e, r): s for e, (rs, sh) in enumerate(zip(self.where, self.sh)) for r, s in zip(rs, sh)}


def _pour(base: list[float], amount: float) -> list[float]:
    """Water-filling: fractions of ``amount`` poured over levels ``base`` so that every
    level it reaches ends at one common height, and the rest get nothing."""
    if len(base) == 2:   # most replicated experts have two copies
        lo, hi = base
        if hi - lo >= amount:
            return [1.0, 0.0]
        if lo - hi >= amount:
            return [0.0, 1.0]
        x = 0.5 + (hi - lo) / (2 * amount)
        return [x, 1.0 - x]
    height = level(base, amount)
    out = [max(0.0, height - b) for b in base]
    total = math.fsum(out)
    return [x / total for x in out]

"""The slot maps ``moepar.moe.replication.placement.plan_placement`` chooses from (torch-free).

``construct``: a slot map built to reach the mean rank load directly. An expert whose copies
share its load can be split anywhere, so the plan is McNaughton's wrap-around rule with
whole items: the lighter experts go whole to the ranks (largest first, each to the least
loaded rank with a slot to spare), and the heaviest ("fillers") are poured, one after the
other, into what every rank lacks below a common level, each filler over consecutive ranks
of that stream. With ``ranks_per_node`` the same rule runs twice: experts over nodes, then
each node's share over its ranks, so only the fillers of the node level span nodes.
``identity``: the unreplicated layout plus the extra copies (never worse than X = 0). The
splits of either: ``moepar.moe.replication.placement_split``.

Legend (docs/moe.md): E logical experts, X redundant expert slots in all, H expert slots one
EP rank holds; one level of the packing fills ``bins`` (ranks or nodes) of ``slots`` items.
"""
from __future__ import annotations

import bisect
import heapq
import math

FILLER_TRIES = (0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233)   # fillers beyond the must-split ones


def level(base: list[float], amount: float) -> float:
    """The common height ``amount`` poured over ``base`` reaches (bins above it keep theirs)."""
    lows = sorted(base)
    acc, height = 0.0, lows[0] + amount
    for k, b in enumerate(lows, start=1):
        if b >= height:
            break
        acc += b
        height = (amount + acc) / k
    return height


def _lpt(whole: list[tuple[int, float]], caps: list[int]) -> tuple[list[list], list[float]]:
    """Largest first, each to the least-loaded bin b holding fewer than ``caps[b]`` (ties: lower b)."""
    heap = [(0.0, b) for b, c in enumerate(caps) if c > 0]
    out, load = [[] for _ in caps], [0.0] * len(caps)
    for e, a in whole:
        _, b = heapq.heappop(heap)
        out[b].append((e, a))
        load[b] += a
        if len(out[b]) < caps[b]:
            heapq.heappush(heap, (load[b], b))
    return out, load


def _stream(fillers: list[tuple[int, float]], res: list[float], loose: set[int], out: list[list],
            slots: int, eps: float) -> list[tuple[int, float]]:
    """Pours ``fillers`` in order into the bins' residuals ``res``, one bin after another, so each
    filler lies on consecutive bins of the stream (distinct bins). A tight bin has one slot
    left: the current filler covers it whole (the largest residual it can). A filler ends in
    a ``loose`` bin (two slots left), the one whose residual exceeds what is left of the
    filler by the least, and the next filler fills the rest of it. Appends the pieces to
    ``out``; returns what found no slot."""
    todo = [b for b in range(len(res)) if res[b] > eps]
    loose_left = sum(1 for b in todo if b in loose)
    fi, (e, q) = 0, fillers[0]
    while fi < len(fillers) and todo:
        spare_loose = loose_left > len(fillers) - fi - 1   # more loose bins than ends to come
        cover = [b for b in todo if res[b] <= q + eps and (spare_loose or b not in loose)]
        if cover:
            b = max(cover, key=lambda b: (res[b], -b))
        else:
            land = [b for b in todo if b in loose and res[b] > q + eps]
            if land:
                b = min(land, key=lambda b: (res[b], b))
            else:
                b = max(todo, key=lambda b: (slots - len(out[b]), res[b], -b))
        todo.remove(b)
        loose_left -= b in loose
        while res[b] > eps and len(out[b]) < slots and fi < len(fillers):
            take = min(q, res[b])
            q -= take
            if q <= eps:   # a filler's last piece takes its rounding dust
                take, q = take + q, 0.0
            out[b].append((e, take))
            res[b] -= take
            if q == 0.0:
                fi += 1
                if fi < len(fillers):
                    e, q = fillers[fi]
    left = [(e, q)] if fi < len(fillers) else []   # (a filler of no load still needs its slot)
    return left + fillers[fi + 1:]


def _even(out: list[list], load: list[float], caps: list[int], eps: float, rounds: int = 200) -> None:
    """Swaps (or moves, where the lighter bin has room) whole items between the heaviest bin
    and the lightest one that gains from it, in place: each step takes the pair whose
    difference is closest to half the gap, so the heavier of the two bins drops most. Stops
    when no such pair lowers the heaviest bin, or after ``rounds`` steps."""
    for _ in range(rounds):
        hi = max(range(len(out)), key=lambda b: (load[b], -b))
        done = False
        for lo in sorted(range(len(out)), key=lambda b: (load[b], b)):
            gap = load[hi] - load[lo]
            if gap <= eps:
                break
            lows = sorted((a, i) for i, (_, a) in enumerate(out[lo]))
            if len(out[lo]) < caps[lo]:
                lows.insert(0, (0.0, -1))   # a move: the lighter bin takes an item for nothing
            best = None
            for j, (_, a) in enumerate(out[hi]):
                at = bisect.bisect_left(lows, (a - gap / 2, -2))
                for b, i in lows[max(at - 1, 0):at + 1]:
                    step = a - b
                    if eps < step < gap - eps and (best is None or abs(step - gap / 2) < abs(best[0] - gap / 2)):
                        best = (step, j, i)
            if best is not None:
                step, j, i = best
                item = out[hi].pop(j)
                if i >= 0:
                    out[hi].append(out[lo].pop(i))
                out[lo].append(item)
                load[hi] -= step
                load[lo] += step
                done = True
                break
        if not done:
            return


def _attempt(order: list[tuple[int, float]], f: int, bins: int, slots: int, eps: float):
    """The ``f`` heaviest items as fillers, the rest whole: pieces per bin and the largest bin
    total, or None when the whole items do not fit or a filler finds no slot. The f - 1 bins
    where a filler ends keep two slots (``loose``), the others one; the whole items go
    largest first to the least-loaded bin with room (LPT), so a loose bin, one item short,
    keeps a large residual to land an end in. With no filler, swaps even the bins (``_even``)."""
    fillers, whole = order[:f], order[f:]
    n_loose = max(f - 1, 0)
    if n_loose > bins:
        return None
    cap = slots - 1 if f else slots   # every bin keeps a slot for the filler stream
    caps = [cap] * (bins - n_loose) + [cap - 1] * n_loose
    if len(whole) > sum(caps):
        return None
    loose = set(range(bins - n_loose, bins))
    out, load = _lpt(whole, caps)
    if not f:   # nothing to even the bins out afterwards: even them by swaps
        _even(out, load, caps, eps)
    if f:
        filled = level(load, math.fsum(a for _, a in fillers))
        for e, q in _stream(fillers, [max(0.0, filled - x) for x in load], loose, out, slots, eps):
            mine = [b for b in range(bins) if any(x == e for x, _ in out[b])]
            if mine:   # the rest of a started filler rides on its lightest piece's bin
                b = min(mine, key=lambda b: (load[b], b))
                out[b] = [(x, a + q if x == e else a) for x, a in out[b]]
            else:
                free = [b for b in range(bins) if len(out[b]) < slots]
                if not free:
                    return None
                b = min(free, key=lambda b: (load[b], b))
                out[b].append((e, q))
            load[b] += q
        load = [math.fsum(a for _, a in o) for o in out]
    return out, max(load)


def pack_level(items: list[tuple[int, float]], bins: int, slots: int, slack: float = 0.0, owner=None):
    """``items`` (expert, amount; each expert once) into ``bins`` bins of ``slots`` items, every
    bin's total as close to the mean as the rule finds: per bin a list of (expert, amount),
    an expert's pieces on distinct bins, their amounts summing to its own. Tries more fillers
    until no bin ends above the mean by more than ``slack`` (a fraction); None if no try fits.
    With ``owner`` (expert -> rank that holds its parameters), every try is made, and of those
    within the slack the one whose busiest owner has the fewest pieces to send wins (more
    fillers, each over fewer bins, spread the copies of the hot experts' weights)."""
    total = math.fsum(a for _, a in items)
    mean, eps = total / bins, 1e-12 * total
    order = sorted(items, key=lambda it: (-it[1], it[0]))
    must = sum(1 for _, a in order if a > mean + eps)   # more than a bin holds: split it
    best, best_key, tried = None, None, set()
    owners = {e: owner(e) for e, _ in items} if owner else None
    for extra in FILLER_TRIES:
        f = min(must + extra, len(order))
        if f in tried:
            break
        tried.add(f)
        got = _attempt(order, f, bins, slots, eps)
        if got is None:
            continue
        good = got[1] <= mean * (1 + slack) + eps
        key = (not good, _busiest(got[0], owners) if good and owners else 0, got[1] if not good else 0.0)
        if best_key is None or key < best_key:
            best, best_key = got[0], key
        if good and owner is None:
            break
    return best


def _busiest(bins: list[list], owner: dict) -> int:
    """The most pieces in ``bins`` of the experts of one owner (``owner[e]``)."""
    sent: dict[int, int] = {}
    for items in bins:
        for e, _ in items:
            o = owner[e]
            sent[o] = sent.get(o, 0) + 1
    return max(sent.values(), default=0)


def construct(loads: list[float], X: int, ep: int, node: int, node_slack: float = 0.0,
              owners: bool = False) -> tuple[list[list[int]], dict] | None:
    """The built slot map: ``held[rank]`` and the shares it was built with ({(e, rank): share});
    spare slots take extra copies (``add_copies``). ``node`` < ep: two levels (nodes, then
    ranks), a node's total within ``node_slack`` of the mean before an expert is split
    across nodes to even them. ``owners``: the nodes and ranks are relabelled so that as
    many experts as the packing allows sit on their owners (``_to_owners``). None when the
    rule does not fit (the caller has other plans)."""
    E = len(loads)
    H = (E + X) // ep
    items = list(enumerate(loads))
    home = E // ep
    if 1 < node < ep:
        # a node keeps node - 1 slots for the crossings of its own ranks' stream; whole experts
        # evened out by swaps win when within node_slack (no expert spans nodes, and each
        # owner sends fewest), else only the node level's fillers span nodes
        per_node = pack_level(items, ep // node, node * H - node + 1, node_slack, lambda e: e // home)
        if per_node is None:
            return None
        ranks = []
        for part in (_to_owners(per_node, lambda e: e // (home * node)) if owners else per_node):
            inner = pack_level(part, node, H, 0.0, lambda e: e // home) if part else [[] for _ in range(node)]
            if inner is None:
                return None
            ranks.extend(inner)
    else:
        ranks = pack_level(items, ep, H, 0.0, lambda e: e // home)
        if ranks is None:
            return None
    held = [[e for e, _ in r] for r in ranks]
    add_copies(loads, held, H, node, [math.fsum(a for _, a in p) for p in ranks])
    for r, h in enumerate(held):   # the copies added carry no load yet
        ranks[r] = ranks[r] + [(e, 0.0) for e in h[len(ranks[r]):]]
    size = node if 1 < node < ep else ep
    for first in range(0, ep if owners else 0, size):
        ranks[first:first + size] = _to_owners(ranks[first:first + size], lambda e: e // home - first)
    held = [[e for e, _ in r] for r in ranks]
    share = {(e, r): (a / loads[e] if loads[e] > 0 else 0.0) for r, pieces in enumerate(ranks) for e, a in pieces}
    return held, share


def _to_owners(bins: list[list], owner) -> list[list]:
    """``bins`` reordered (the packing does not care which bin is which) so that as many items
    as the greedy finds sit in the bin of their ``owner`` (an index into ``bins``, or outside
    it): there a slot reads the owner's parameters in place, and no weights travel."""
    gain: dict[tuple[int, int], int] = {}
    for b, items in enumerate(bins):
        for e, _ in items:
            o = owner(e)
            if 0 <= o < len(bins):
                gain[b, o] = gain.get((b, o), 0) + 1
    to, taken = [-1] * len(bins), set()
    for (b, o), _ in sorted(gain.items(), key=lambda kv: (-kv[1], kv[0])):
        if to[b] < 0 and o not in taken:
            to[b] = o
            taken.add(o)
    rest = iter(o for o in range(len(bins)) if o not in taken)
    out: list[list] = [[] for _ in bins]
    for b, items in enumerate(bins):
        out[to[b] if to[b] >= 0 else next(rest)] = items
    return out


def add_copies(loads: list[float], held: list[list[int]], H: int, node: int, rank_load: list[float]) -> None:
    """Fills the free slots of ``held`` in place: each next copy to the expert with the largest
    load per copy (ties: lower id) that a rank with a free slot lacks, on such a rank with the
    most free slots (keeps the rest placeable), then the least load, then the lower id. With
    nodes (``node`` < ep), node by node, from the experts the node already holds first, so
    that a copy adds no node to its expert's span where it can; then from the experts whose
    owners are in the node (their weights need not leave it)."""
    ep, E = len(held), len(loads)
    counts = [0] * E
    holders: list[set[int]] = [set() for _ in range(E)]
    for r, h in enumerate(held):
        for e in h:
            counts[e] += 1
            holders[e].add(r)
    free = [H - len(h) for h in held]
    size, home = (node if 1 < node < ep else ep), E // ep
    for first in range(0, ep, size):
        group = range(first, first + size)
        near = {e for r in group for e in held[r]} if size < ep else range(E)
        owned = range(first * home, (first + size) * home)   # their owners are in this node
        for pool in (near, owned, range(E)):   # the node's experts, its owners' experts, any
            heap = [(-loads[e] / counts[e], e) for e in pool]
            heapq.heapify(heap)
            while heap and any(free[r] for r in group):
                _, e = heapq.heappop(heap)
                open_ = [r for r in group if free[r] and r not in holders[e]]
                if not open_:
                    continue   # ranks only fill up: it never fits this group again
                r = min(open_, key=lambda r: (-free[r], rank_load[r], r))
                held[r].append(e)
                holders[e].add(r)
                counts[e] += 1
                free[r] -= 1
                heapq.heappush(heap, (-loads[e] / counts[e], e))


def identity(loads: list[float], X: int, ep: int, per_rank: int) -> list[list[int]]:
    """The unreplicated layout (expert g on rank g // (E / ep)) plus X extra copies: each to
    the expert with the largest load per copy that some rank with a free slot lacks, on the
    least-loaded such rank (load: the sum of load / copies over its experts). Water-filling
    can leave the extras idle, so this plan is never worse than no replication."""
    E = len(loads)
    home = E // ep
    held = [list(range(r * home, (r + 1) * home)) for r in range(ep)]
    holders = [{e // home} for e in range(E)]
    counts = [1] * E
    load = [sum(loads[e] / counts[e] for e in h) for h in held]
    heap = [(-loads[e], e) for e in range(E)]
    heapq.heapify(heap)
    for _ in range(X):
        while True:   # a rank with a free slot always lacks some expert: it holds fewer than E
            key, e = heapq.heappop(heap)
            lacking = [r for r in range(ep) if len(held[r]) < per_rank and r not in holders[e]]
            if lacking:
                break   # else: ranks only fill up, so e never fits again
        r = min(lacking, key=lambda r: (load[r], r))
        held[r].append(e)
        holders[e].add(r)
        counts[e] += 1
        heapq.heappush(heap, (-loads[e] / counts[e], e))
        for x in holders[e]:   # the same sums, in the same order, as a fresh count
            load[x] = sum(loads[g] / counts[g] for g in held[x])
    return held

"""The planner's parts (``moepar.moe.replication.placement_pack`` / ``placement_split``): the packing that
builds a slot map to the mean, and the split that proves its maximum least.

Pure functions, no processes. The split is checked against the exact min-cut formula on
small slot maps (the least achievable maximum rank load of a slot map is the largest, over
sets S of ranks, of the load of the experts whose copies all lie in S, divided by |S|), the
packing against its own accounting (every item's amount, distinct bins, slots).
"""
import itertools
import math
import random

import pytest

from moepar.moe.replication import placement as P
from moepar.moe.replication import placement_pack as K
from moepar.moe.replication.placement_split import Fill, MAX_PASSES


def _min_cut(loads, held):
    """The least maximum rank load any split achieves on ``held`` (every set of ranks)."""
    ep, best = len(held), 0.0
    for k in range(1, ep + 1):
        for ranks in itertools.combinations(range(ep), k):
            confined = math.fsum(l for e, l in enumerate(loads) if all(r in ranks for r in range(ep) if e in held[r]))
            best = max(best, confined / k)
    return best


def _amounts(rng, n):
    kind = rng.choice(["pareto", "ints", "zeros", "equal"])
    if kind == "pareto":
        return [rng.paretovariate(1.1) for _ in range(n)]
    if kind == "ints":
        return [float(rng.choice([0, 1, 2, 3, 7, 50])) for _ in range(n)]
    if kind == "equal":
        return [3.0] * n
    out = [0.0] * n
    out[rng.randrange(n)] = rng.random()
    return out


def _random_map(rng):
    """A random slot map: ``ep`` ranks of S distinct experts, every expert somewhere."""
    ep, S = rng.randint(2, 5), rng.randint(2, 4)
    E = rng.randint(S, min(ep * S, 9))
    while True:
        held = [rng.sample(range(E), S) for _ in range(ep)]
        if set().union(*held) == set(range(E)):
            return _amounts(rng, E), held


@pytest.mark.parametrize("base,amount", [([0.0, 0.0], 2.0), ([1.0, 5.0], 2.0), ([1.0, 2.0, 9.0], 4.0),
                                         ([3.0], 0.5), ([2.0, 2.0, 2.0], 0.0), ([0.0, 1.0, 1.0, 4.0], 10.0)])
def test_level_is_the_height_the_amount_reaches(base, amount):
    height = K.level(base, amount)
    assert math.fsum(max(0.0, height - b) for b in base) == pytest.approx(amount, abs=1e-12)
    assert height >= min(base) and (amount == 0 or height > min(base))


def test_pack_level_places_every_amount_on_distinct_bins_and_reaches_the_mean():
    """Every item's pieces sum to its amount, lie on distinct bins, and no bin holds more than
    K; with the slots McNaughton's rule needs (a crossing per bin boundary), every bin ends
    at the mean on every sample."""
    rng = random.Random(0)
    for _ in range(400):
        bins, slots = rng.randint(1, 8), rng.randint(2, 6)
        amounts = _amounts(rng, rng.randint(1, bins * (slots - 1) + 1))
        out = K.pack_level(list(enumerate(amounts)), bins, slots, 0.0, lambda e: e % 3)
        assert out is not None and len(out) == bins
        for b in out:
            assert len(b) <= slots and len({e for e, _ in b}) == len(b), b
        for e, a in enumerate(amounts):
            assert math.fsum(x for b in out for g, x in b if g == e) == pytest.approx(a, rel=1e-12, abs=1e-12)
        mean = math.fsum(amounts) / bins
        assert max(math.fsum(x for _, x in b) for b in out) <= mean * (1 + 1e-9) + 1e-12, (bins, slots, amounts)


def test_a_filler_ends_where_two_slots_are_left():
    # 4 bins of 3 slots, mean 4: the 10 (2.5 bins) must run over three bins and end in a
    # bin that keeps a slot for the next filler; the whole 1s fill the rest
    out = K.pack_level(list(enumerate([10.0, 3.0, 1.0, 1.0, 1.0])), 4, 3, 0.0, lambda e: 0)
    assert [math.fsum(x for _, x in b) for b in out] == pytest.approx([4.0] * 4)
    assert sum(1 for b in out for e, _ in b if e == 0) == 3


def test_construct_keeps_the_experts_on_their_owners_where_the_bins_allow():
    # the packing leaves which bin is which rank free: the relabelling (owner_slack > 0)
    # puts owned experts home
    loads = P.zipf_loads(256, 0.3)
    held, _ = K.construct(loads, 64, 64, 64, 0.0, owners=True)
    home = sum(1 for r, h in enumerate(held) for e in h if e // 4 == r)
    shuffled = K.pack_level(list(enumerate(loads)), 64, 5, 0.0, lambda e: e // 4)
    before = sum(1 for r, b in enumerate(shuffled) for e, _ in b if e // 4 == r)
    assert home >= 60 > before, (home, before)


@pytest.mark.parametrize("E,X,ep,node", [(256, 64, 64, 64), (256, 64, 64, 8), (256, 128, 64, 8), (16, 4, 4, 2)])
@pytest.mark.parametrize("exponent", [0.5, 1.0, 1.5, 2.0])
def test_construct_reaches_the_mean_on_the_documented_zipf_cases(E, X, ep, node, exponent):
    loads = P.zipf_loads(E, exponent)
    fill = Fill(loads, *K.construct(loads, X, ep, node, 0.0))
    fill.settle()
    assert max(fill.rank_load) == pytest.approx(1 / ep, rel=1e-9)
    S = (E + X) // ep
    assert all(len(h) == S == len(set(h)) for h in fill.held)
    if node < ep:   # only the node level's fillers span nodes: one expert per boundary at most
        L = E // ep   # (a copy in its owner's node sends no weights out of it)
        spanning = [e for e, rs in enumerate(fill.where)
                    if len({r // node for r in rs if r // node != e // L // node}) > 1]
        must = [e for e in range(E) if loads[e] > node / ep]   # more than a node's mean
        assert len(spanning) <= len(must) + ep // node - 1, (spanning, must)


def test_settle_reaches_the_min_cut_optimum_of_random_slot_maps():
    rng = random.Random(1)
    for _ in range(200):
        loads, held = _random_map(rng)
        fill = Fill(loads, [list(h) for h in held])
        fill.settle()
        best = _min_cut(loads, held)
        assert fill.bound() <= best * (1 + 1e-12) + 1e-12
        assert max(fill.rank_load) <= best * (1 + 1e-9) + 1e-12, (loads, held)
        for rs, sh in zip(fill.where, fill.sh):
            assert len(rs) == len(sh) and min(sh) >= 0 and math.fsum(sh) == pytest.approx(1.0, abs=1e-12)


def test_reach_meets_the_optimum_and_refuses_below_it():
    rng = random.Random(2)
    for _ in range(200):
        loads, held = _random_map(rng)
        best = _min_cut(loads, held)
        if best <= 0:
            continue
        fill = Fill(loads, [list(h) for h in held])
        fill.pour(range(len(loads)), 2)   # a rough split to start from
        kept = [list(s) for s in fill.sh]
        assert not fill.reach(best * (1 - 1e-3))
        assert fill.sh == kept   # a refusal leaves the split as it was
        assert fill.reach(best * (1 + 1e-12)), (loads, held)
        assert max(fill.rank_load) <= best * (1 + 1e-9)
        assert math.fsum(fill.rank_load) == pytest.approx(math.fsum(loads), rel=1e-12)


def test_settle_stops_once_the_maximum_is_proven():
    # the unreplicated layout plus copies at DeepSeek-V3 size: the passes alone take thousands
    # of pours to even out every rank; the maximum is proven after a few hundred
    rng = random.Random(4)
    loads = [rng.paretovariate(1.5) for _ in range(256)]
    held = K.identity(loads, 64, 64, 5)
    full = Fill(loads, [list(h) for h in held])
    passes = full.pour(range(256), MAX_PASSES)
    fill = Fill(loads, [list(h) for h in held])
    pours = fill.settle()
    assert max(fill.rank_load) <= max(full.rank_load) * (1 + 1e-9)
    assert max(fill.rank_load) <= fill.bound() * (1 + 1e-9)
    assert pours * 5 < passes, (pours, passes)


def test_whole_experts_alone_are_evened_by_swaps():
    # Zipf 0.3 over 256 experts into 8 nodes of 33 items: largest-first alone leaves a node
    # 1.9 % above the mean; swaps between the heaviest and the lightest bring it within 0.01 %,
    # so the node plan needs no expert across nodes
    loads = P.zipf_loads(256, 0.3)
    order = sorted(enumerate(loads), key=lambda it: (-it[1], it[0]))
    out, load = K._lpt(order, [33] * 8)
    assert max(load) * 8 > 1.015
    bins, top = K._attempt(order, 0, 8, 33, 1e-12)
    assert sorted(e for b in bins for e, _ in b) == list(range(256)) and all(len(b) <= 33 for b in bins)
    assert top * 8 <= 1.0001
    p = P.plan_placement(loads, 256, 64, 64, ranks_per_node=8)
    assert p.max_over_mean() <= 1.001
    assert all(len({c.rank // 8 for c in cs}) == 1 for cs in p.copies)

"""``moepar.moe.replication.placement``: the expert slot map with redundant copies, and the route split.

Pure functions, no processes. The greedy is checked against an exhaustive search over every
slot map on tiny layouts, with each map's best split from the exact min-cut formula: the
least achievable maximum rank load of a slot map is the largest, over sets S of ranks, of
(the load of the experts whose copies all lie in S) / |S|.
"""
import itertools
import math
import os
import random

import pytest

from moepar.moe.replication import placement as P
from moepar.moe.replication.placement import Copy, plan_placement, split_counts, zipf_loads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _best_max_for(loads, slots):
    """The least maximum rank load any split achieves on ``slots`` (min-cut formula)."""
    ep, best = len(slots), 0.0
    for k in range(1, ep + 1):
        for ranks in itertools.combinations(range(ep), k):
            confined = math.fsum(l for e, l in enumerate(loads)
                                 if all(r in ranks for r in range(ep) if e in slots[r]))
            best = max(best, confined / k)
    return best


def _check_invariants(p, loads, E, R, ep):
    S = (E + R) // ep
    assert p.slots_per_rank == S and len(p.slots) == ep
    for r, held in enumerate(p.slots):
        assert len(held) == S and len(set(held)) == S, f"rank {r} holds {held}"
        assert list(held) == sorted(held)
    assert sorted(e for held in p.slots for e in set(held)) == sorted(e for e, cs in enumerate(p.copies) for _ in cs)
    assert sum(len(cs) for cs in p.copies) == E + R
    for e, cs in enumerate(p.copies):
        assert 1 <= len(cs) <= ep
        assert len({c.rank for c in cs}) == len(cs), f"expert {e} has two copies on one rank: {cs}"
        assert [c.rank for c in cs] == sorted(c.rank for c in cs)
        for c in cs:
            assert p.slots[c.rank][c.slot] == e and c.share >= 0
        assert math.isclose(math.fsum(p.shares(e)), 1.0, abs_tol=1e-12)
    assert math.isclose(math.fsum(p.rank_loads()), math.fsum(loads), rel_tol=1e-9, abs_tol=1e-12)


def _random_case(rng):
    ep = rng.choice([1, 2, 3, 4, 6, 8])
    E = ep * rng.randint(1, 6)
    R = ep * rng.randint(0, min(4, E * (ep - 1) // ep))
    kind = rng.choice(["pareto", "ints", "zeros"])
    if kind == "pareto":
        loads = [rng.paretovariate(1.1) for _ in range(E)]
    elif kind == "ints":
        loads = [rng.choice([0, 1, 2, 3, 7, 50]) for _ in range(E)]
    else:
        loads = [0.0] * E
        loads[rng.randrange(E)] = rng.random()
    rpn = rng.choice([None, 1, 2, ep])
    return loads, E, R, ep, (rpn if rpn is None or rpn >= ep or ep % rpn == 0 else None)


@pytest.mark.parametrize("E,ep", [(8, 1), (8, 2), (16, 4), (12, 3), (64, 8)])
def test_no_redundant_experts_is_the_dispatchers_layout(E, ep):
    # the Dispatcher's rule: global expert g on EP rank g // L as its local expert g % L
    L = E // ep
    loads = [float((7 * g) % 5) for g in range(E)]   # the layout must not depend on the loads
    p = plan_placement(loads, E, 0, ep)
    assert p.slots == tuple(tuple(range(r * L, (r + 1) * L)) for r in range(ep))
    assert p.copies == tuple((Copy(g // L, g % L, 1.0),) for g in range(E))
    assert p.rank_loads() == tuple(sum(loads[r * L:(r + 1) * L]) for r in range(ep))


def test_random_layouts_keep_every_invariant():
    rng = random.Random(0)
    for _ in range(150):
        loads, E, R, ep, rpn = _random_case(rng)
        _check_invariants(plan_placement(loads, E, R, ep, ranks_per_node=rpn), loads, E, R, ep)


@pytest.mark.parametrize("ep,R", [(4, 4), (4, 8), (8, 8), (8, 16)])
def test_one_expert_with_every_route_gets_a_copy_on_every_rank(ep, R):
    loads = [0.0] * 16
    loads[5] = 1000.0
    p = plan_placement(loads, 16, R, ep)
    _check_invariants(p, loads, 16, R, ep)
    assert [c.rank for c in p.copies[5]] == list(range(ep))
    assert p.max_over_mean() == pytest.approx(1.0, abs=1e-9), f"max/mean {p.max_over_mean()} (no replication: {ep})"
    assert plan_placement(loads, 16, 0, ep).max_over_mean() == pytest.approx(ep)


@pytest.mark.parametrize("R", [0, 4, 8, 12])
def test_equal_loads_stay_balanced_and_copies_go_to_the_lowest_ids(R):
    p = plan_placement([3.0] * 16, 16, R, 4)
    assert p.max_over_mean() == pytest.approx(1.0, abs=1e-12)
    assert [len(cs) for cs in p.copies] == [2] * R + [1] * (16 - R)


def test_all_zero_loads_are_a_valid_even_split():
    p = plan_placement([0] * 16, 16, 8, 4)
    _check_invariants(p, [0] * 16, 16, 8, 4)
    assert p.rank_loads() == (0.0,) * 4 and p.max_over_mean() == 1.0
    for e, cs in enumerate(p.copies):
        assert p.shares(e) == (1.0 / len(cs),) * len(cs)


def test_an_expert_with_no_load_still_has_its_slot():
    loads = [4.0] * 16
    loads[0] = 0.0
    for R in (4, 8):
        p = plan_placement(loads, 16, R, 4)
        _check_invariants(p, loads, 16, R, 4)
        before = plan_placement(loads, 16, 0, 4).max_over_mean()
        assert len(p.copies[0]) == 1 and p.max_over_mean() <= 1.15, f"R={R}: {before:.3f} -> {p.max_over_mean():.3f}"


@pytest.mark.parametrize("R", [4, 8])
@pytest.mark.parametrize("exponent", [0.5, 1.0, 1.5, 2.0])
def test_zipf_loads_at_ep4_come_within_1_15_of_the_mean(exponent, R):
    loads = zipf_loads(16, exponent)
    before = plan_placement(loads, 16, 0, 4).max_over_mean()
    after = plan_placement(loads, 16, R, 4).max_over_mean()
    msg = f"Zipf {exponent} over 16 experts, ep4, R={R}: max/mean {before:.3f} -> {after:.3f}"
    assert after <= 1.15, msg
    assert after <= before, msg


def test_never_worse_than_without_replication():
    rng = random.Random(1)
    for _ in range(150):
        loads, E, R, ep, rpn = _random_case(rng)
        before = max(plan_placement(loads, E, 0, ep).rank_loads())
        after = max(plan_placement(loads, E, R, ep, ranks_per_node=rpn).rank_loads())
        assert after <= before * (1 + 1e-9) + 1e-12, (loads, E, R, ep, rpn, before, after)
    balanced = [8.0, 1.0, 1.0, 1.0] * 4   # R = 0 is already perfect: replication may not cost anything
    for R, rpn in itertools.product((4, 8, 12), (None, 2)):
        assert plan_placement(balanced, 16, R, 4, ranks_per_node=rpn).max_over_mean() == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("E,R,ep,cases", [(4, 2, 2, 60), (4, 4, 2, 40), (4, 4, 4, 40), (6, 3, 3, 20)])
def test_greedy_matches_an_exhaustive_search_on_tiny_layouts(E, R, ep, cases):
    """Every slot map (each rank any S distinct experts, every expert somewhere), each with
    its best split: the plan's max rank load equals that optimum to 1e-9 on every sample."""
    S = (E + R) // ep
    subsets = [ranks for k in range(1, ep + 1) for ranks in itertools.combinations(range(ep), k)]
    cuts = set()   # a slot map matters only through its (confined experts, |ranks|) pairs
    for slots in itertools.product(itertools.combinations(range(E), S), repeat=ep):
        if set().union(*slots) == set(range(E)):
            home = [{r for r in range(ep) if e in slots[r]} for e in range(E)]
            cuts.add(frozenset((frozenset(e for e in range(E) if home[e] <= set(ranks)), len(ranks))
                               for ranks in subsets))
    rng = random.Random(E * 100 + R * 10 + ep)
    worst = 1.0
    for _ in range(cases):
        loads = [rng.choice([0, 1, 2, 3, 5, 8, 13, 40]) for _ in range(E)]
        if not any(loads):
            continue
        optimum = min(max(sum(loads[e] for e in m) / k for m, k in c) for c in cuts)
        got = max(plan_placement(loads, E, R, ep).rank_loads())
        worst = max(worst, got / optimum)
        assert got <= optimum * (1 + 1e-9), f"loads {loads}: plan {got}, optimum {optimum}"
    assert worst <= 1 + 1e-9


def test_the_split_is_the_best_for_its_slot_map():
    rng = random.Random(2)
    for _ in range(80):
        loads, E, R, ep, rpn = _random_case(rng)
        p = plan_placement(loads, E, R, ep, ranks_per_node=rpn)
        best = _best_max_for(loads, p.slots)
        assert max(p.rank_loads()) <= best * (1 + 1e-9) + 1e-12, (loads, E, R, ep, p.slots)


def test_ranks_per_node_keeps_an_experts_copies_in_one_node():
    loads = zipf_loads(16, 1.0)
    spans = {None: [], 2: []}
    for R, rpn in itertools.product((4, 8), (None, 2)):
        p = plan_placement(loads, 16, R, 4, ranks_per_node=rpn)
        _check_invariants(p, loads, 16, R, 4)
        assert p.max_over_mean() <= 1.15
        spans[rpn] += [e for e, cs in enumerate(p.copies) if len(cs) <= 2 and len({c.rank // 2 for c in cs}) > 1]
    assert spans[2] == [], spans
    assert spans[None], "without ranks_per_node some expert's two copies span both nodes"


def test_one_node_or_one_rank_per_node_is_no_preference():
    loads = zipf_loads(16, 1.2)
    plain = plan_placement(loads, 16, 8, 4)
    for rpn in (1, 4, 8):
        assert plan_placement(loads, 16, 8, 4, ranks_per_node=rpn) == plain


def test_the_plan_is_deterministic():
    rng = random.Random(3)
    for _ in range(30):
        loads, E, R, ep, rpn = _random_case(rng)
        a = plan_placement(loads, E, R, ep, ranks_per_node=rpn)
        assert plan_placement(tuple(loads), E, R, ep, ranks_per_node=rpn) == a


def test_layouts_of_deepseek_v3_size():
    rng = random.Random(4)
    loads = [rng.paretovariate(1.5) for _ in range(256)]
    for R, ep, rpn in ((32, 32, None), (64, 64, 8)):
        p = plan_placement(loads, 256, R, ep, ranks_per_node=rpn)
        _check_invariants(p, loads, 256, R, ep)
        before = plan_placement(loads, 256, 0, ep).max_over_mean()
        assert p.max_over_mean() <= 1.15, f"R={R} ep={ep}: {before:.3f} -> {p.max_over_mean():.3f}"


def test_split_counts_sums_exactly_and_stays_within_one_route():
    rng = random.Random(5)
    for _ in range(500):
        shares = [rng.random() ** 3 for _ in range(rng.randint(1, 8))]
        if sum(shares) == 0:
            continue
        count = rng.randint(0, 10_000)
        out = split_counts(count, shares)
        assert sum(out) == count and all(x >= 0 for x in out)
        total = math.fsum(shares)
        assert all(abs(x - count * s / total) < 1 for x, s in zip(out, shares))
        assert split_counts(count, tuple(shares)) == out


@pytest.mark.parametrize("count,shares,want", [
    (1, [0.5, 0.5], (1, 0)), (2, [1 / 3] * 3, (1, 1, 0)), (3, [1 / 3] * 3, (1, 1, 1)),
    (10, [0.25, 0.75], (3, 7)), (10, [1, 3], (3, 7)), (0, [0.2, 0.8], (0, 0)),
    (7, [1.0], (7,)), (5, [0.0, 1.0], (0, 5)), (100, [0.1, 0.2, 0.7], (10, 20, 70)),
    (3, [0.3, 0.3, 0.4], (1, 1, 1)), (4, [0.45, 0.45, 0.1], (2, 2, 0)),
])
def test_split_counts_largest_remainder_ties_to_the_earlier_copy(count, shares, want):
    assert split_counts(count, shares) == want


@pytest.mark.parametrize("count,shares,match", [
    (-1, [1.0], r"count=-1 must be an integer >= 0"), (1.5, [1.0], r"count=1.5"),
    (True, [1.0], r"count=True"), (3, [], r"shares=\[\] must be a non-empty"),
    (3, "ab", r"shares='ab'"), (3, [0.5, -0.1], r"shares\[1\]=-0.1 must be a finite number >= 0"),
    (3, [float("nan")], r"shares\[0\]=nan"), (3, [0.0, 0.0], r"must have a positive sum"),
])
def test_split_counts_rejects_bad_input(count, shares, match):
    with pytest.raises(ValueError, match=match):
        split_counts(count, shares)


@pytest.mark.parametrize("args,kw,match", [
    (([1.0] * 4, 4, 0, 0), {}, r"ep_size=0 must be a positive integer"),
    (([], 0, 0, 1), {}, r"num_experts=0 must be a positive integer"),
    (([1.0] * 4, 4, -2, 2), {}, r"redundant_experts=-2 must be an integer >= 0"),
    (([1.0] * 8, 8, 2, 4), {}, r"redundant_experts=2 is not divisible by ep_size=4"),
    (([1.0] * 10, 10, 4, 4), {}, r"num_experts \+ redundant_experts = 10 \+ 4 slots is not divisible by ep_size=4"),
    (([1.0] * 4, 4, 6, 2), {}, r"redundant_experts=6 > num_experts x \(ep_size - 1\) = 4 x 1"),
    (([1.0] * 4, 4, 2, 1), {}, r"redundant_experts=2 > num_experts x \(ep_size - 1\) = 4 x 0"),
    (([1.0] * 3, 4, 0, 2), {}, r"len\(loads\)=3 must equal num_experts=4"),
    (([1.0, -1.0, 1.0, 1.0], 4, 2, 2), {}, r"loads\[1\]=-1.0 must be a finite number >= 0"),
    (([1.0, float("nan"), 1.0, 1.0], 4, 2, 2), {}, r"loads\[1\]=nan"),
    (([1.0, 1.0, float("inf"), 1.0], 4, 2, 2), {}, r"loads\[2\]=inf"),
    (([1.0, "2", 1.0, 1.0], 4, 2, 2), {}, r"loads\[1\]='2'"),
    (("abcd", 4, 2, 2), {}, r"loads='abcd' must be a sequence"),
    ((None, 4, 2, 2), {}, r"loads=None must be a sequence"),
    (([1.0] * 4, 4, 4, 4), {"ranks_per_node": 0}, r"ranks_per_node=0 must be a positive integer"),
    (([1.0] * 12, 12, 6, 6), {"ranks_per_node": 4}, r"ep_size=6 is not divisible by ranks_per_node=4"),
])
def test_bad_input_names_the_value_and_the_rule(args, kw, match):
    with pytest.raises(ValueError, match=match):
        plan_placement(*args, **kw)


def test_the_docs_table_is_what_the_function_prints(capsys):
    P.main([])
    printed = capsys.readouterr().out.strip()
    assert printed == P.zipf_table()
    with open(os.path.join(ROOT, "docs", "routing.md")) as f:
        page = f.read()
    assert printed in page, "docs/routing.md's placement table is stale: rerun python -m moepar.moe.replication.placement"
    # DeepSeek-V3's layout (its row of the docs: --num-experts 256 --ep-size 64 --redundant 0 64 128
    # --ranks-per-node 8); the previous planner stopped at 1.090 for Zipf 2 at X = 64
    big = P.zipf_table(256, 64, (0, 64, 128), ranks_per_node=8)
    assert big in page, "docs/routing.md's DeepSeek-V3 table is stale"


def test_a_placement_travels_as_numbers_and_comes_back_equal():
    rng = random.Random(6)
    for _ in range(40):
        loads, E, R, ep, rpn = _random_case(rng)
        p = plan_placement(loads, E, R, ep, ranks_per_node=rpn)
        values = P.placement_values(p)
        assert all(isinstance(v, float) for v in values) and len(values) == 2 * (E + R)
        assert P.placement_from_values(loads, E, R, ep, values) == p
    p = plan_placement([3.0] * 8, 8, 4, 4)
    good = P.placement_values(p)
    for bad, match in ((good[:-1], r"len\(values\)=23 must be 2 x ep_size x slots per rank = 24"),
                       ([good[1], good[0]] + good[2:], r"rank 0's slots .* ascending"),
                       ([0.5] + good[1:], r"rank 0's slots"), ([8.0] + good[1:], r"in \[0, 8\)")):
        with pytest.raises(ValueError, match=match):
            P.placement_from_values([3.0] * 8, 8, 4, 4, bad)

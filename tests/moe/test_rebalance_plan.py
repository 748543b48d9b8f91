"""``moepar.rebalance`` plans the stage's layers in parallel over its ranks.

Each rank of the stage group plans its share of the layers (layer j on rank j mod n) and one
all-reduce hands every plan to every rank. Checked on 4 gloo ranks against the serial
reference (``plan_placement`` of the summed counts, in this process): every rank ends with
the same slot maps, bit for bit; each rank plans only its share; a rank whose planning raises
makes every rank raise, and no rank is left waiting in the collective.
"""
import functools

import torch

import moepar
from moepar.moe.replication import rebalance as RB
from moepar.moe.replication.placement import plan_placement
from moepar.moe.replication.replicas import OWNER_SLACK
from moepar.parallel import comm

from ..helpers.multiproc import run_ranks

E, D, R, EP, LAYERS = 16, 8, 4, 4, 5


def _counts(rank, layer):
    """A skewed routes-per-expert count, different on every rank and layer."""
    return [(rank + 1) * ((7 * e + 3 * layer) % 11) + (40 if e == layer else 0) for e in range(E)]


def _rebalanced(configs):
    """Per config (``fail_on``: the rank whose planning raises; ``spread``: spread these small
    layers anyway; rebalance's own options) a fresh model, its counts set, one rebalance."""
    state = moepar.init_parallel(1, EP, 1, verbose=False)
    return [_one(state, **kw) for kw in configs]


def _one(state, fail_on=None, spread=True, **options):
    model = torch.nn.Sequential(*(moepar.MoE(D, E, EP, redundant_experts=R, init_seed=i, state=state)
                                  for i in range(LAYERS)))
    for i, m in enumerate(model):
        m.replicas.loads_E = torch.tensor(_counts(state.rank, i))
        if i == 3:
            m.replicas.loads_E.zero_()   # a layer that saw no route keeps its slot map
    calls, plan = [], RB.plan_placement

    @functools.wraps(plan)
    def counted(*args, **kwargs):
        calls.append(args[0])
        if state.rank == fail_on:
            raise ArithmeticError("planning went wrong on this rank")
        return plan(*args, **kwargs)

    RB.plan_placement, threshold = counted, RB.SPREAD_SLOTS
    RB.SPREAD_SLOTS = 0 if spread else threshold   # these layers are small: spread them anyway
    try:
        with comm.track() as stats:
            out = moepar.rebalance(model, **options)
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    finally:
        RB.plan_placement, RB.SPREAD_SLOTS = plan, threshold
    return {"placements": [m.placement for m in model], "calls": len(calls), "loads": [r.loads for r in out],
            "collectives": [(e.op, e.nbytes) for e in stats.events]}


def test_every_rank_gets_the_serial_plans_and_plans_only_its_share():
    width = 1 + 2 * (E + R)
    configs = [{}, {"owner_slack": 0.0, "ranks_per_node": 2}, {"spread": False}]
    for kw, results in zip(configs, zip(*run_ranks(_rebalanced, 4, configs))):
        first = results[0]["placements"]
        assert all(res["placements"] == first for res in results)
        spread = kw.get("spread", True)
        # 4 layers saw routes: one plan on each rank, none twice (small stages: all on each)
        assert [res["calls"] for res in results] == ([1, 1, 1, 1] if spread else [4, 4, 4, 4])
        # the counts' all-reduce, then (spread) the plans' [layers, 1 + 2 x (E + X)] float64
        assert results[0]["collectives"] == [("all_reduce", LAYERS * E * 8)] + \
            ([("all_reduce", LAYERS * width * 8)] if spread else [])
        for layer, placement in enumerate(first):
            summed = [float(sum(_counts(rank, layer)[e] for rank in range(4))) for e in range(E)]
            if layer == 3:   # kept: the start, the plan for uniform load
                assert placement == plan_placement([1.0] * E, E, R, EP, owner_slack=OWNER_SLACK)
                continue
            assert list(results[0]["loads"][layer]) == summed
            want = plan_placement(summed, E, R, EP, owner_slack=kw.get("owner_slack", OWNER_SLACK),
                                  ranks_per_node=kw.get("ranks_per_node"))
            assert placement == want, layer


def test_a_rank_that_fails_to_plan_makes_every_rank_raise():
    results = [res[0] for res in run_ranks(_rebalanced, 4, [{"fail_on": 1}], timeout=60)]
    assert results[1] == {"raised": "ArithmeticError", "message": "planning went wrong on this rank"}
    for rank in (0, 2, 3):
        assert results[rank]["raised"] == "RuntimeError", results[rank]
        assert "planning layer '1' failed on rank 1 of the stage group" in results[rank]["message"]

"""Checkpoints true to every rank: what a rank counts comes back to that rank, what a
pipeline stage holds comes back to that stage, a replicated layer resumed at another ep or
number of copies is re-planned from its saved load, and a load that one rank refuses is
refused by every rank before DCP (none hangs)."""
from __future__ import annotations

import os
import re
import shutil
import warnings

import torch
from torch import nn

import moepar
from moepar import checkpoint
from moepar.checkpoint import CheckpointError
from moepar.moe.replication.placement import plan_placement
from moepar.moe.replication.rebalance import placement_plain
from moepar.moe.replication.replicas import OWNER_SLACK

from ..helpers.multiproc import run_ranks


class _Two(nn.Module):
    """Two replicated MoE layers whose routers balance by expert bias (``load_accum``)."""

    def __init__(self, state, copies, seed):
        super().__init__()
        kw = dict(k=2, ffn_hidden=16, redundant_experts=copies, expert_bias=True, state=state)
        self.a = moepar.MoE(8, 4, state.ep_size, init_seed=seed, **kw)
        self.b = moepar.MoE(8, 4, state.ep_size, init_seed=seed + 1, **kw)

    def forward(self, x):
        return self.b(self.a(x))


def _x(i, rank):
    return torch.randn(6 + 3 * rank, 8, generator=torch.Generator().manual_seed(100 * i + rank)) * (1 + rank)


def _counted(model):
    return {n: (m.replicas.loads_E.tolist() if m.replicas.loads_E is not None else None,
                m.router.load_accum.tolist()) for n, m in (("a", model.a), ("b", model.b))}


def _save_two(path):
    state = moepar.init_parallel(1, 2, verbose=False)
    model = _Two(state, 2, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for i in range(2):
        model(_x(i, state.rank)).square().mean().backward()
        moepar.allreduce_gradients(model, state)
        opt.step()
        opt.zero_grad()
        moepar.rebalance(model)
    model(_x(7, state.rank))   # counted since the last rebalance, by this rank only
    checkpoint.save(path, model, opt)
    return _counted(model), {n: (placement_plain(m.placement), m.replicas.planned_loads)
                             for n, m in (("a", model.a), ("b", model.b))}


def _load_two(path, ep, copies):
    state = moepar.init_parallel(1, ep, verbose=False)
    model = _Two(state, copies, 40)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load(path, model, opt)
    return _counted(model), {n: placement_plain(m.placement) for n, m in (("a", model.a), ("b", model.b))}, \
        [str(w.message) for w in caught]


def test_each_rank_gets_its_counters_back_and_copies_are_replanned_elsewhere(tmp_path):
    """Saved at ep2 with 2 copies per layer, each rank having counted other routes. Loaded at
    ep2: every rank gets its own counted routes (replicas and ``load_accum``) and the slot
    maps back. At ep2 with 4 copies and at ep4 with 4 copies: the slot maps are the plans of
    the saved loads; at ep4 the routes counted by both saved ranks go, summed, to the first
    rank (the next rebalance sums over the stage) and ``load_accum`` is left out with a
    warning. Checked to fail without the fix: every rank got one rank's ``load_accum`` (a
    replicated entry), the counted routes and slot maps were not in the checkpoint at all."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_two, 2, path)
    assert saved[0][0] != saved[1][0]   # the ranks counted differently
    for rank, (counted, placements, _) in enumerate(run_ranks(_load_two, 2, path, 2, 2)):
        assert counted == saved[rank][0], rank
        assert placements == {n: p for n, (p, _) in saved[0][1].items()}
    for ep, runs in ((2, run_ranks(_load_two, 2, path, 2, 4)), (4, run_ranks(_load_two, 4, path, 4, 4))):
        for rank, (counted, placements, warned) in enumerate(runs):
            for name, (_, planned) in saved[0][1].items():
                assert placements[name] == placement_plain(plan_placement(planned, 4, 4, ep, owner_slack=OWNER_SLACK))
                mine = counted[name][0]
                if ep == 2:
                    assert counted[name] == saved[rank][0][name], (ep, rank)
                else:
                    summed = [a + b for a, b in zip(saved[0][0][name][0], saved[1][0][name][0])]
                    assert mine == (summed if rank == 0 else None) and not any(counted[name][1]), (rank, mine)
            assert (ep == 4) == any("update_expert_bias since its last call are not restored" in w for w in warned)


def _partial_update(kind):
    state = moepar.init_parallel(1, 2, verbose=False)
    model = _Two(state, 2, 3)
    model(_x(0, state.rank))
    moepar.rebalance(model)
    good = moepar.placement_state(model)
    before = {n: placement_plain(m.placement) for n, m in (("a", model.a), ("b", model.b))}
    other = dict(good)
    other["a"] = (good["a"][0], [5, 0, 0, 0], good["a"][2])   # a change the refusal must not apply
    if kind == "experts":   # layer b's state is of a layer with 8 experts
        other["b"] = (placement_plain(plan_placement([1.0] * 8, 8, 2, 2)), None, None)
    else:
        other["b"] = ({"slots": "?"}, None, None)
    try:
        moepar.load_placement_state(model, other)
    except ValueError as e:
        return str(e), before == {n: placement_plain(m.placement) for n, m in (("a", model.a), ("b", model.b))}, \
            model.a.replicas.loads_E
    return None, None, None


def test_load_placement_state_checks_every_layer_before_changing_any():
    """Checked to fail without the fix: layer a's state was applied, then layer b's raised."""
    for kind, message in (("experts", r"layer 'b'.*E=8 experts, but the layer has E=4"),
                          ("malformed", r"layer 'b'.*not a slot map")):
        for error, unchanged, loads in run_ranks(_partial_update, 2, kind):
            assert error is not None and re.search(message, error), error
            assert unchanged and loads is None


def _different_views(path, damaged):
    state = moepar.init_parallel(1, 2, verbose=False)
    model = _Two(state, 2, 3)
    try:   # rank 1 sees a damaged copy (another mount, a file still being copied)
        checkpoint.load(damaged if state.rank == 1 else path, model)
    except (CheckpointError, FileNotFoundError) as e:
        return type(e).__name__, str(e)
    return None


def test_a_load_refused_on_one_rank_is_refused_on_every_rank(tmp_path):
    """Checked to fail without the fix: rank 1 raised alone, rank 0 entered DCP's
    collectives and waited for it until the call's timeout (a hang)."""
    path, damaged = str(tmp_path / "ckpt"), str(tmp_path / "damaged")
    run_ranks(_save_two, 2, path)
    shutil.copytree(path, damaged)
    with open(os.path.join(damaged, "__1_0.distcp"), "r+b") as f:
        f.truncate(10)
    (kind0, msg0), (kind1, msg1) = run_ranks(_different_views, 2, path, damaged, timeout=60)
    assert kind0 == kind1 == "CheckpointError"
    assert "truncated shard" in msg1 and msg0.startswith("rank 1 of 2 refused this load (CheckpointError): ")
    assert msg1 in msg0


def _stage(seed, lrs):
    """This rank's pipeline stage of the example GPT (pp2 x ep2, 2 copies per layer) and an
    AdamW whose param groups differ from stage to stage (stage 0: one, stage 1: two)."""
    from examples.gpt_moe import GPT, GPTConfig
    state = moepar.init_parallel(1, 2, pipeline_parallel_size=2, verbose=False)
    cfg = GPTConfig(vocab_size=64, context=4, layers=4, hidden=8, heads=2, experts=4, topk=2, expert_ffn=8,
                    dense_ffn=8, redundant_experts=2, init_seed=seed)
    model = GPT(cfg, state, stage=(state.pp_rank, 2))
    params = list(model.parameters())
    groups = [{"params": params, "lr": lrs[0]}] if state.pp_rank == 0 else \
        [{"params": params[:2], "lr": lrs[1]}, {"params": params[2:], "lr": lrs[2]}]
    return state, model, torch.optim.AdamW(groups, lr=1.0)


def _stage_state(model, opt):
    layers = {n: (placement_plain(m.placement), m.replicas.planned_loads) for n, m in model.named_modules()
              if isinstance(m, moepar.MoE)}
    moments = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters() if opt.state.get(p)}
    return layers, [g["lr"] for g in opt.param_groups], moments


def _save_stages(path):
    state, model, opt = _stage(3, (0.1, 0.2, 0.3))
    for i in range(2):   # the stage's layers on inputs of this stage's own (no pipeline schedule needed)
        for name, m in model.named_modules():
            if isinstance(m, moepar.MoE):
                m(_x(i + 10 * state.pp_rank, state.rank)).square().mean().backward()
        (sum(p.sum() for p in model.parameters()) * 1e-3).backward()   # every parameter trains
        moepar.allreduce_gradients(model, state)   # replicas stay equal, as in training
        opt.step()
        opt.zero_grad()
        moepar.rebalance(model)   # over the stage's ranks: each stage plans from its own loads
    checkpoint.save(path, model, opt)
    return state.pp_rank, _stage_state(model, opt)


def _load_stages(path):
    state, model, opt = _stage(9, (1.0, 1.0, 1.0))
    checkpoint.load(path, model, opt)
    return state.pp_rank, _stage_state(model, opt)


def test_each_pipeline_stage_gets_its_own_state_back(tmp_path):
    """pp2 x ep2: stage 0's and stage 1's param groups (settings and number), slot maps and
    planned loads differ; after a load each stage has its own. Checked to fail without the
    fix: the param groups were one entry, which DCP wrote once, so every stage got one stage's
    (stage 0 got lr 0.2, stage 1's first group's, for its 0.1); the slot maps were not in the
    checkpoint (stage 0 came back with the maps for uniform load)."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_stages, 4, path)   # ranks 0, 1: stage 0; ranks 2, 3: stage 1
    assert [s[0] for s in saved] == [0, 0, 1, 1]
    assert saved[0][1][1] == [0.1] and saved[2][1][1] == [0.2, 0.3] and saved[0][1][0].keys().isdisjoint(saved[2][1][0])
    for rank, (pp_rank, (layers, lrs, moments)) in enumerate(run_ranks(_load_stages, 4, path)):
        mine = saved[rank][1]
        assert (layers, lrs) == mine[:2], (rank, layers, lrs)
        assert moments.keys() == mine[2].keys() and all(torch.equal(v, mine[2][k]) for k, v in moments.items())

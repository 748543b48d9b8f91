"""Expert replication (``MoE(..., redundant_experts=R)``, ``moepar.rebalance``) is exact.

The replicated layer and the unreplicated one are built from the same seed on the same
ranks: their parameters are the same tensors (ownership never moves), so outputs, input
gradients and every parameter after AdamW steps with rebalances between them must agree
(fp32, 1e-5), at ep2, ep4, tp2·ep2, ep2·etp2 and under FSDP2; a checkpoint saved at one R
loads at another. The route split and the slot tables are checked against slow host
references (``placement.split_counts``)."""
import random
import types

import pytest
import torch

import moepar
from moepar.moe.config import ExchangeConfig, MoEConfig
from moepar.moe.replication.placement import plan_placement, split_counts, zipf_loads
from moepar.moe.replication.replicas import Replicas, SlotMap, local_order, split_counts_device

from ..helpers.multiproc import run_ranks

E, D, F, TOKENS, LR = 8, 16, 32, 16, 1e-2
# A fixed router bias that makes expert 0 several times as hot as the mean.
SKEW = [2.5 / (i + 1) ** 0.5 for i in range(E)]


# ---- host references ------------------------------------------------------------------
def test_split_counts_device_equals_the_host_rule():
    rng = random.Random(0)
    cases = [([0, 5, 7, 1000], [[1.0], [0.5, 0.5], [1 / 3, 1 / 3, 1 / 3], [0.2, 0.0, 0.8]])]
    for _ in range(200):
        m = rng.randint(1, 4)
        shares = [rng.choice([0.0, 0.25, 0.5, rng.random()]) for _ in range(m)]
        if sum(shares) == 0:
            shares[0] = 1.0
        cases.append(([rng.randint(0, 50)], [shares]))
    for counts, share_lists in cases:
        for c in counts:
            for shares in share_lists:
                M = len(shares)
                got = split_counts_device(torch.tensor([c]), torch.tensor([shares], dtype=torch.float64))
                assert tuple(got[0, :M].tolist()) == split_counts(c, shares), (c, shares)


def _state(rank):
    return types.SimpleNamespace(ep_rank=rank)


def test_route_slots_splits_each_experts_routes_in_token_order():
    loads = zipf_loads(E, 1.2)
    rep = Replicas(E, 4, 2, _state(0))
    rep.set_placement(plan_placement(loads, E, 4, 2))
    S = rep.slots_per_rank
    torch.manual_seed(0)
    ids = torch.multinomial(torch.tensor(loads), 200, replacement=True).view(100, 2)
    dropped = torch.rand(100, 2) < 0.1
    slots = rep.route_slots(ids, dropped)
    flat_ids, flat_slots, kept = ids.reshape(-1).tolist(), slots.reshape(-1).tolist(), (~dropped).reshape(-1).tolist()
    held = [SlotMap.of(rep.placement, r).held for r in range(2)]   # each rank's slots, in the layer's order
    position = [{i: at for at, i in enumerate(local_order(rep.placement, r))} for r in range(2)]
    for g, copies in enumerate(rep.placement.copies):
        mine = [s for i, s in zip(flat_ids, flat_slots) if i == g]
        assert all(held[s // S][s % S] == g for s in mine)   # a slot holding g
        got = [s for i, s, k in zip(flat_ids, flat_slots, kept) if i == g and k]
        want = []
        for c, n in zip(copies, split_counts(len(got), [c.share for c in copies])):
            want += [c.rank * S + position[c.rank][c.slot]] * n
        assert got == want   # the first copy's share first, in token order


def test_slot_map_sends_each_remote_copy_from_its_owner():
    p = plan_placement(zipf_loads(16, 1.0), 16, 8, 4)
    maps = [SlotMap.of(p, r) for r in range(4)]
    L = 4
    for r, m in enumerate(maps):
        assert sum(m.send_splits) == len(m.send_local)
        for peer in range(4):
            assert m.recv_splits[peer] == maps[peer].send_splits[r]
        assert sorted(m.held) == sorted(p.slots[r])
        assert m.in_place == (all(g // L == r for g in m.held[:L]) and len({g for g in m.held if g // L == r}) == L)
        for slot, g in enumerate(m.held):
            src = m.slot_source[slot]
            if g // L == r:
                assert src == g - r * L
            else:   # the received row from g's owner, in the order the owner sends them
                owner = maps[g // L]
                at = src - L - sum(m.recv_splits[:g // L])
                lo = sum(owner.send_splits[:r])
                assert owner.send_local[lo + at] == g - (g // L) * L


def test_bad_options_name_the_value_and_the_rule():
    with pytest.raises(ValueError, match="redundant_experts=3 is not divisible by ep_size=2"):
        MoEConfig(D, E, 2, exchange=ExchangeConfig(redundant_experts=3))
    with pytest.raises(ValueError, match=r"redundant_experts=10 > num_experts x \(ep_size - 1\) = 8 x 1"):
        MoEConfig(D, E, 2, exchange=ExchangeConfig(redundant_experts=10))
    with pytest.raises(ValueError, match="redundant_experts=2 needs dropless dispatch"):
        MoEConfig(D, E, 2, exchange=ExchangeConfig(redundant_experts=2), router=moepar.RouterConfig(D, E, pad_to_capacity=True,
                                                                            capacity_factor=1.0))
    with pytest.raises(ValueError, match="redundant_experts=2 > num_experts x"):
        moepar.MoE(D, E, 1, redundant_experts=2)
    with pytest.raises(ValueError, match="holds no moepar.MoE layer with redundant_experts > 0"):
        moepar.rebalance(moepar.MoE(D, E, 1))


# ---- distributed exactness ------------------------------------------------------------
def _layer(state, R, seed=7):
    m = moepar.MoE(D, E, state.ep_size, k=2, ffn_hidden=F, activation="swiglu", bias=True, expert_bias=True,
                   num_shared_experts=1, expert_tensor_parallel_size=state.etp_size, redundant_experts=R,
                   init_seed=seed, state=state)
    with torch.no_grad():
        m.router.expert_bias.copy_(torch.tensor(SKEW))
    return m


def _batch(step, dp_rank):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(TOKENS, D, generator=g), torch.randn(TOKENS, D, generator=g)


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _train(state, R, steps, fsdp, owner_slack=0.05):
    model = _layer(state, R)
    if fsdp:
        moepar.fully_shard(model, state)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    first = None
    overload = []
    for step in range(steps):
        x, g = _batch(step, state.dp_rank)
        x.requires_grad_()
        y = model(x)
        ((y * g).sum() + moepar.aux_loss(model)).backward()
        if first is None:
            first = (y.detach().clone(), x.grad.clone(), moepar.load_report(model).rows[0])
        if not fsdp:
            moepar.allreduce_gradients(model, state)
        opt.step()
        opt.zero_grad()
        overload.append(model.stats.rank_overload)
        if R:
            moepar.rebalance(model, owner_slack=owner_slack)
    return model, opt, first, overload


def _exact(tp, ep, etp, R, fsdp, owner_slack):
    state = moepar.init_parallel(tp, ep, etp, verbose=False)
    plain, _, (y0, dx0, row0), over0 = _train(state, 0, 3, fsdp)
    rep, _, (y1, dx1, row1), over1 = _train(state, R, 3, fsdp, owner_slack)
    params = {n: float((_local(a) - _local(b)).abs().max())
              for (n, a), (_, b) in zip(plain.named_parameters(), rep.named_parameters())}
    return {"y": float((y0 - y1).abs().max()), "dx": float((dx0 - dx1).abs().max()), "params": params,
            "in_place": rep.replicas.map.in_place, "overload": (over0, over1), "rows": (row0, row1), "remote": sum(1 for r, held in enumerate(rep.placement.slots)
                                                      for g in held if g // (E // ep) != r),
            "comm": [(e.op, e.backward, e.nbytes) for e in rep.stats.comm.events if e.group_size == ep]}


# owner_slack 0: the EPLB plans, which move experts away from their owners (slots gathered);
# 0.05: the owners keep their experts (slot weights = parameters + received copies)
@pytest.mark.parametrize("tp,ep,etp,R,fsdp,owner_slack", [
    (1, 2, 1, 2, False, 0.05), (1, 4, 1, 4, False, 0.0), (1, 4, 1, 4, False, 0.05), (2, 2, 1, 2, False, 0.05),
    (1, 2, 2, 4, False, 0.0), (1, 4, 1, 8, True, 0.05)])
def test_replicated_layer_trains_as_the_unreplicated_one(tp, ep, etp, R, fsdp, owner_slack):
    results = run_ranks(_exact, 4, tp, ep, etp, R, fsdp, owner_slack)
    if owner_slack:
        assert all(res["in_place"] for res in results)
    else:
        assert not all(res["in_place"] for res in results), "the case meant to gather slots did not"
    for res in results:
        assert res["y"] <= 1e-6 and res["dx"] <= 1e-6, res
        assert max(res["params"].values()) <= 1e-5, res["params"]
        over0, over1 = res["overload"]
        # after the first rebalance the hot experts' copies take their share of the rows
        assert over1[-1] < over0[-1], res["overload"]
        assert res["remote"] >= R   # copies live away from their owners: weights did travel
        row0, row1 = res["rows"]   # load_report: the load before replication, and after it
        assert row0["unreplicated_overload"] is None
        assert row1["unreplicated_overload"] == pytest.approx(row0["rank_overload"], rel=1e-12)


def _checkpoint_across_r(path, R_save, R_load):
    state = moepar.init_parallel(1, 2, 1, verbose=False)
    from moepar import checkpoint
    model, opt, _, _ = _train(state, R_save, 2, False)
    checkpoint.save(path, model, opt, rng=False)
    other = _layer(state, R_load, seed=99)
    opt2 = torch.optim.AdamW(other.parameters(), lr=LR)
    checkpoint.load(path, other, opt2)
    diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), other.parameters()))
    st = [(opt.state[a], opt2.state[b]) for a, b in zip(model.parameters(), other.parameters())]
    sdiff = max(float((s1[k] - s2[k]).abs().max()) for s1, s2 in st for k in ("exp_avg", "exp_avg_sq"))
    return diff, sdiff, sorted(other.state_dict()) == sorted(model.state_dict())


@pytest.mark.parametrize("R_save,R_load", [(4, 0), (0, 2)])
def test_a_checkpoint_saved_at_one_r_loads_at_another(tmp_path, R_save, R_load):
    for diff, sdiff, same_keys in run_ranks(_checkpoint_across_r, 4, str(tmp_path / "ckpt"), R_save, R_load):
        assert diff == 0.0 and sdiff == 0.0 and same_keys


def _resume_exact(path):
    """3 steps with a rebalance after each, against 2 steps, a checkpoint with the placement
    state beside it, a fresh layer loading both, and the third step: bitwise equal."""
    state = moepar.init_parallel(1, 2, 1, verbose=False)
    from moepar import checkpoint

    def steps(model, opt, lo, hi):
        for step in range(lo, hi):
            x, g = _batch(step, state.dp_rank)
            ((model(x) * g).sum() + moepar.aux_loss(model)).backward()
            moepar.allreduce_gradients(model, state)
            opt.step()
            opt.zero_grad()
            moepar.rebalance(model)

    x, g = _batch(9, state.dp_rank)
    whole = _layer(state, 2)
    opt = torch.optim.AdamW(whole.parameters(), lr=LR)
    steps(whole, opt, 0, 2)
    whole(x)   # a forward after the rebalance: its counted load goes into the next plan
    steps(whole, opt, 2, 3)
    first = _layer(state, 2)
    opt1 = torch.optim.AdamW(first.parameters(), lr=LR)
    steps(first, opt1, 0, 2)
    first(x)   # the same forward: counted load the placement state must keep
    saved = moepar.placement_state(first)
    checkpoint.save(path, first, opt1, extra={"placements": saved}, rng=False)
    resumed = _layer(state, 2, seed=99)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=LR)
    extra = checkpoint.load(path, resumed, opt2, extra_keys=("placements",))
    moepar.load_placement_state(resumed, extra["placements"])
    steps(resumed, opt2, 2, 3)
    return (all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))
            and whole.placement == resumed.placement)


def test_a_resumed_run_with_the_placement_state_equals_the_uninterrupted_one(tmp_path):
    assert all(run_ranks(_resume_exact, 4, str(tmp_path / "ckpt")))


def _decayed(decay):
    state = moepar.init_parallel(1, 2, 1, verbose=False)
    model = _layer(state, 2)
    seen = []
    for step in range(2):
        x, _ = _batch(step, state.dp_rank)
        model(x)
        seen.append(moepar.rebalance(model, decay=decay)[0].loads)
    return seen, model.replicas.planned_loads


def test_rebalance_decay_plans_from_a_moving_average_of_the_loads():
    for (first, second), planned in run_ranks(_decayed, 4, 0.5):
        assert sum(first) > 0 and list(second) == planned
        # the second plan: half the first load plus the routes counted since
        fresh = [b - 0.5 * a for a, b in zip(first, second)]
        assert all(f >= 0 and float(f).is_integer() for f in fresh) and sum(fresh) == sum(first)
    with pytest.raises(ValueError, match=r"decay=1.0 must be a number in \[0, 1\)"):
        moepar.rebalance(torch.nn.Linear(2, 2), decay=1.0)
    for bad in (float("inf"), float("nan"), -0.5, True):   # not finite, negative, a bool
        with pytest.raises(ValueError, match=rf"owner_slack={bad!r} must be a finite number >= 0"):
            moepar.rebalance(torch.nn.Linear(2, 2), owner_slack=bad)

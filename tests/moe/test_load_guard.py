"""Load figures (moe.stats, moepar.load_report) and the receive guard (receive_capacity_factor)
against slow references: plain-Python quotas and drops, and the per-token float64 layer."""
import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

import moepar
from moepar.moe.exchange import guard
from moepar.moe.layer import MoE
from moepar.parallel import allreduce_gradients, init_parallel
from moepar.parallel.groups import ParallelState

from ..helpers import moe_ref
from ..helpers.multiproc import run_ranks


# ---- slow references ---------------------------------------------------------------------
def slow_quotas(load, P, factor):
    """load: [P][E] lists. The rule of moepar/moe/exchange/guard.py, one cell at a time, in Fractions."""
    E = len(load[0])
    L = E // P
    total = sum(map(sum, load))
    cap = math.ceil(Fraction(total, P) * Fraction(repr(float(factor))))
    kept = [row[:] for row in load]
    for r in range(P):
        cells = [(s, r * L + l) for s in range(P) for l in range(L)]   # cell index s*L + l
        M = sum(load[s][e] for s, e in cells)
        if M <= cap:
            continue
        share = [Fraction(cap * load[s][e], M) for s, e in cells]
        q = [math.floor(x) for x in share]
        left = cap - sum(q)
        by_remainder = sorted(range(len(cells)), key=lambda i: (-(share[i] - q[i]), i))
        for i in by_remainder[:left]:
            q[i] += 1
        for i, (s, e) in enumerate(cells):
            kept[s][e] = q[i]
    return kept, cap


def slow_drops(ids, weights, quota):
    """ids/weights [T][K] lists; quota [E]: per expert keep the highest weights, ties to the
    earlier slot-major position (slot j of token t at j*T + t)."""
    T = len(ids)
    K = len(ids[0]) if T else 0
    drop = [[False] * K for _ in range(T)]
    for e in range(len(quota)):
        routes = [(j * T + t, t, j) for j in range(K) for t in range(T) if ids[t][j] == e]
        routes.sort(key=lambda r: (-weights[r[1]][r[2]], r[0]))
        for _, t, j in routes[quota[e]:]:
            drop[t][j] = True
    return drop


# ---- pure functions ------------------------------------------------------------------------
@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0])
def test_quotas_match_the_slow_rule(factor):
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        P, L = (4, 2) if trial % 2 else (2, 3)
        skew = torch.ones(P * L)
        skew[trial % (P * L)] = 20.0                       # one hot expert
        load = torch.poisson(skew.expand(P, -1) * (1 + trial % 3), generator=gen).long()
        kept, cap = guard.quotas(load, factor)
        ref_kept, ref_cap = slow_quotas(load.tolist(), P, factor)
        assert cap == ref_cap and kept.tolist() == ref_kept
        received = kept.view(P, P, L).sum((0, 2))
        assert int(received.max()) <= cap and bool((kept <= load).all())
        before = load.view(P, P, L).sum((0, 2))
        assert torch.equal(received, torch.minimum(before, torch.full_like(before, cap)))


def test_guard_drops_match_the_slow_rule():
    gen = torch.Generator().manual_seed(4)
    T, K, E = 9, 3, 6
    for _ in range(10):
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=gen).round(decimals=1)          # ties on purpose
        prior = torch.rand(T, K, generator=gen) < 0.2                  # capacity drops before
        kept_E = torch.zeros(E, dtype=torch.long).scatter_add_(0, ids[~prior], torch.ones_like(ids[~prior]))
        quota = (kept_E * torch.rand(E, generator=gen)).long()
        got = guard.guard_drops(ids, w, prior, quota)
        ids_l = [[(e if not prior[t, j] else -1) for j, e in enumerate(row)] for t, row in enumerate(ids.tolist())]
        assert got.tolist() == slow_drops(ids_l, w.tolist(), quota.tolist())
        assert not bool((got & prior).any())
        left = torch.zeros(E, dtype=torch.long).scatter_add_(0, ids[~(got | prior)],
                                                             torch.ones_like(ids[~(got | prior)]))
        assert torch.equal(left, quota)


@pytest.mark.parametrize("bad", [0.5, 0.999, float("inf"), float("nan"), True, "2", -1])
def test_bad_receive_capacity_factor_is_refused(bad):
    with pytest.raises(ValueError, match="receive_capacity_factor=.* must be None or a finite number >= 1"):
        moepar.ExchangeConfig(receive_capacity_factor=bad)
    with pytest.raises(ValueError, match="receive_capacity_factor"):
        MoE(8, 4, 1, receive_capacity_factor=bad, state=ParallelState.single())


def test_guard_refuses_padded_capacity():
    with pytest.raises(ValueError, match="needs dropless dispatch"):
        MoE(8, 4, 1, receive_capacity_factor=1.5, capacity_factor=1.0, pad_to_capacity=True,
            state=ParallelState.single())


def test_single_process_figures_and_report():
    moe = moe_ref.build(None, num_experts=4, k=2, receive_capacity_factor=1.0)
    with torch.no_grad():
        moe.router.weight[0] += 3.0                                # expert 0 hot on positive x
    x, _ = moe_ref.replica_input(0, 10)
    moe(x.abs())
    tpe = moe.stats.tokens_per_expert.double()
    assert moe.stats.expert_overload == pytest.approx(float(tpe.max() / tpe.mean()))
    assert moe.stats.expert_overload > 1.5
    assert moe.stats.rank_overload == 1.0 and moe.stats.dropped_fraction == 0.0   # one rank: never cut
    report = moepar.load_report(torch.nn.Sequential(torch.nn.Linear(8, 8), moe))
    assert [r["layer"] for r in report.rows] == ["1"]
    assert report.worst()["expert_overload"] == moe.stats.expert_overload
    # one EP rank: no cap to compute (it could never cut); every route is received
    assert report.rows[0]["receive_cap"] is None and report.rows[0]["max_received"] == 20
    assert "expert_overload" in str(report) and "rank_overload" in report.text
    with pytest.raises(ValueError, match="holds no moepar.MoE layer"):
        moepar.load_report(torch.nn.Linear(8, 8))


# ---- four EP ranks: the layer against the per-token reference --------------------------------
T_RANK, E4 = 6, 8


def _skew(moe):
    with torch.no_grad():   # experts 0 and 1 (EP rank 0's) win on positive inputs
        moe.router.weight[0] += 1.5
        moe.router.weight[1] += 1.0


def _senders(tp, ep, world, etp=1):
    """Each global rank's (dp replica, its token slice, EP group id, EP rank), from the
    layout's rank arithmetic (moepar/parallel/groups.py: rank = edp*(ep*etp) + ep_rank*etp
    + etp_rank): a rank dispatches its replica's tokens, or under TP (no SP) its TP share."""
    out = []
    for R in range(world):
        d, r = divmod(R, tp)
        sizes = [T_RANK // tp + (1 if i < T_RANK % tp else 0) for i in range(tp)]
        lo = sum(sizes[:r])
        out.append((d, slice(lo, lo + sizes[r]), (R // (ep * etp), R % etp), (R // etp) % ep))
    return out


def _guarded_layer(factor, variant, tp=1, ep=4, etp=1):
    state = init_parallel(tp, ep, etp, verbose=False)
    world, me, P = state.world_size, dist.get_rank(), ep
    kw = dict(num_experts=E4, k=2, aux_loss=None, **variant)
    moe = moe_ref.build(state, receive_capacity_factor=factor, **kw)
    single = moe_ref.build(None, **kw)
    _skew(moe)
    _skew(single)
    w = moe_ref.full_weights(single)
    dp = world // tp
    xs = [moe_ref.replica_input(d, T_RANK) for d in range(dp)]
    xs = [(x.abs(), g) for x, g in xs]
    # Reference: every rank's routes, the slow quotas per EP group, the slow drops, the
    # per-token layer over every replica.
    xrs = [x.double().requires_grad_(d == state.dp_rank) for d, (x, _) in enumerate(xs)]
    full = [moe_ref.route_per_token(xr, w, k=2) for xr in xrs]
    senders = _senders(tp, ep, world, etp)
    routes = [([full[d][0][t] for t in range(sl.start, sl.stop)], [full[d][1][t] for t in range(sl.start, sl.stop)])
              for d, sl, _, _ in senders]
    load = [[sum(row.count(e) for row in ids) for e in range(E4)] for ids, _ in routes]
    drops, kept_of, cap_of = [None] * world, {}, {}
    for grp in {g for _, _, g, _ in senders}:
        members = sorted((er, R) for R, (_, _, g, er) in enumerate(senders) if g == grp)
        kept, cap_of[grp] = slow_quotas([load[R] for _, R in members], P, factor)
        kept_of[grp] = kept
        for er, R in members:
            ids, wts = routes[R]
            drops[R] = slow_drops(ids, [[float(v) for v in wt.detach()] for wt in wts], kept[er])
    total = 0.0
    for d, ((x, g), (ids, wts, _)) in enumerate(zip(xs, full)):
        drop_T = [None] * T_RANK
        for R, (dd, sl, _, _) in enumerate(senders):
            if dd == d:
                for i, t in enumerate(range(sl.start, sl.stop)):
                    drop_T[t] = drops[R][i]
        rows = []
        for t in range(T_RANK):
            y = torch.zeros(x.shape[1], dtype=torch.float64)
            for j, e in enumerate(ids[t]):
                if not drop_T[t][j]:
                    y = y + wts[t][j] * moe_ref.expert_ffn(xrs[d][t], w["experts"][e], "gelu")
            rows.append(y)
        y_d = torch.stack(rows)
        if d == state.dp_rank:
            y_ref, x_ref = y_d.detach(), xrs[d]
        total = total + (y_d * g.double()).sum()
    total.backward()
    ref_grads = moe_ref.grads_of(w)
    # The layer, on this rank's tokens; the experts' input rows are what this rank processes.
    seen = []
    moe.experts.register_forward_pre_hook(lambda mod, args: seen.append(int(args[0].shape[0])))
    x, g = xs[state.dp_rank]
    x = x.clone().requires_grad_()
    y = moe(x)
    (y * g).sum().backward()
    allreduce_gradients(moe, state, op="sum")
    grad_err = max(float((p.grad.double() - moe_ref.local_slice(ref_grads[n], p, state)).abs().max())
                   for n, p in moe.named_parameters())
    grp, er = senders[me][2], senders[me][3]
    L = E4 // P
    # With expert TP the experts see the rows of every ETP peer (each capped in its own EP
    # group): ranks me - me % etp ... of this rank's ETP group.
    peers = range(me - me % etp, me - me % etp + etp)
    my_drops = sum(map(sum, drops[me]))
    group_load = [load[R] for R, s_ in enumerate(senders) if s_[2] == grp]
    st = moe.stats
    return {"y": float((y.detach().double() - y_ref).abs().max()), "dx": float((x.grad.double() - x_ref.grad).abs().max()),
            "grads": grad_err, "cap": cap_of[grp], "stats_cap": st.load.cap, "processed": seen[0],
            "ref_received": sum(kept_of[senders[q][2]][s][e] for q in peers for s in range(P)
                                for e in range(er * L, er * L + L)), "etp": etp,
            "dropped": int(st.dropped), "ref_dropped": my_drops, "guard_dropped": st.load.guard_dropped,
            "group_dropped": st.load.group_guard_dropped,
            "ref_group_dropped": sum(sum(map(sum, drops[R])) for R, s_ in enumerate(senders) if s_[2] == grp),
            "fraction": st.dropped_fraction, "ref_fraction": my_drops / max(1, 2 * len(drops[me])),
            "expert_overload": st.expert_overload,
            "ref_expert_overload": max(map(sum, zip(*group_load))) / (sum(map(sum, group_load)) / E4),
            "rank_overload": st.rank_overload, "report": moepar.load_report(moe).rows[0]}


def _guard_workers(factor):
    out = [_guarded_layer(factor, {}), _guarded_layer(factor, dict(dedup="on", cpu_source_major=False)),
           _guarded_layer(factor, {}, tp=2, ep=2), _guarded_layer(factor, {}, ep=2, etp=2)]
    errors = []
    for bad in (0.5, float("nan")):   # every rank raises at construction, before any collective
        try:
            MoE(8, 8, 4, receive_capacity_factor=bad)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    try:
        moepar.load_report(torch.nn.Linear(4, 4))
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    dist.barrier()   # nobody was left waiting in a collective
    return out, errors


def test_guard_on_four_ranks_matches_the_slow_reference():
    for rank, (results, errors) in enumerate(run_ranks(_guard_workers, 4, 1.25)):
        for i, r in enumerate(results):
            assert r["y"] < 1e-5 and r["dx"] < 1e-5 and r["grads"] < 1e-5, (rank, r)
            # ceil(1.25 * 48 / 4); tp = 2, ep = 2: one replica's 12 routes over 2 ranks;
            # ep = 2, etp = 2: two replicas' 24 routes over 2 ranks
            assert r["stats_cap"] == r["cap"] == [15, 15, 8, 15][i]
            # at etp > 1 each ETP peer's receipt is capped; the experts see all the peers' rows
            assert r["processed"] == r["ref_received"] <= r["etp"] * r["cap"]
            assert r["dropped"] == r["guard_dropped"] == r["ref_dropped"]
            assert r["group_dropped"] == r["ref_group_dropped"] > 0
            assert r["fraction"] == pytest.approx(r["ref_fraction"])
            assert r["expert_overload"] == pytest.approx(r["ref_expert_overload"]) and r["expert_overload"] > 2
            assert r["rank_overload"] > 1.25
            assert r["report"]["max_received"] <= r["cap"] and r["report"]["guard_dropped"] == r["group_dropped"]
        assert all("must be None or a finite number >= 1" in e for e in errors[:2]), errors
        assert "holds no moepar.MoE layer" in errors[2]

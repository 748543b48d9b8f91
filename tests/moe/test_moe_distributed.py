"""The expert-parallel layer equals the single-process layer in every layout (gloo, CPU)."""
import pytest
import torch
import torch.distributed as dist

from moepar.moe.layer import MoE, aux_loss
from moepar.parallel import allreduce_gradients, init_parallel
from moepar.parallel import comm
from moepar.parallel.groups import Layout

from ..helpers import moe_ref
from ..helpers.multiproc import run_ranks

LAYOUTS = [(2, 1, 2, 1), (4, 1, 4, 1), (4, 1, 2, 1), (4, 2, 2, 1), (4, 2, 2, 2), (4, 1, 2, 2), (4, 2, 1, 1)]
VARIANTS = [dict(k=k, score_func=s, num_shared_experts=sh)
            for k in (1, 2) for s in ("softmax", "sigmoid") for sh in (0, 1)]


def _tokens(dp_rank: int, uneven: bool) -> int:
    return [5, 0, 3, 7][dp_rank % 4] if uneven else 6


def compare_layouts(tp, ep, etp, variants, uneven=False, layer_kw=None, loss_with_aux=True, dtype=None,
                    hidden=moe_ref.D, sp=False, tokens=None, expert_bias=None):
    """For each variant: distributed vs single-process outputs, dX, and all weight grads.

    ``tokens``: tokens per data-parallel replica (default ``_tokens``); ``sp``: sequence
    parallelism, each TP rank holding its own slice of its replica's tokens (compared with
    the same slice of the reference); ``dtype``/``hidden``: the layer's and the inputs'.
    ``expert_bias``: [E] values put into both routers' expert_bias buffers (expert_bias=True).
    Each result has the max differences, the reference's max magnitudes (``*_scale``) and
    the exchange form the distributed forward took (``form``)."""
    state = init_parallel(tp, ep, etp, verbose=False)
    ntok = (lambda d: tokens[d]) if tokens is not None else (lambda d: _tokens(d, uneven))
    dkw = {} if dtype is None else dict(dtype=dtype)
    results = []
    for variant in variants:
        kw = dict(variant, hidden=hidden, **dkw, **(layer_kw or {}))
        moe = moe_ref.build(state, sequence_parallel=sp, **kw)
        ref = moe_ref.build(None, **kw)
        if expert_bias is not None:
            with torch.no_grad():
                for m in (moe, ref):
                    m.router.expert_bias.copy_(torch.tensor(expert_bias))
        # Reference: every data-parallel replica's batch through the single-process layer,
        # grads accumulated (= the gradient of the sum of the replicas' losses).
        for d in range(state.dp_size):
            xd, gd = moe_ref.replica_input(d, ntok(d), hidden, **dkw)
            yd = ref(xd)
            (((yd * gd).sum() + (aux_loss(ref) if loss_with_aux else 0.0))).backward()
            if d == state.dp_rank:
                x_ref = xd.clone().requires_grad_()
                y_ref = ref(x_ref)
                ref_dropped = int(ref.stats.dropped)   # this replica's (the loop goes on)
                ((y_ref * gd).sum() + (aux_loss(ref) if loss_with_aux else 0.0)).backward(inputs=[x_ref])
        x, g = moe_ref.replica_input(state.dp_rank, ntok(state.dp_rank), hidden, **dkw)
        lo, hi = comm_split(x.shape[0], state) if sp else (0, x.shape[0])
        x, g = x[lo:hi].clone().requires_grad_(), g[lo:hi]
        y = moe(x)
        # Under SP every TP rank's aux loss is the replica's (statistics summed over TP), its
        # gradient flowing through the rank's own tokens: each rank adds it.
        ((y * g).sum() + (aux_loss(moe) if loss_with_aux else 0.0)).backward()
        allreduce_gradients(moe, state, op="sum")
        grads = moe_ref.max_param_diff(moe, ref, state, use_grad=True)
        weights = moe_ref.max_param_diff(moe, ref, state, use_grad=False)
        y_ref, gx_ref = y_ref.detach()[lo:hi], x_ref.grad[lo:hi]
        ref_params = dict(ref.named_parameters())
        grad_scales = {n: float(moe_ref.local_slice(ref_params[n].grad, p, state).abs().max())
                       if ref_params[n].grad is not None and p.numel() else 0.0 for n, p in moe.named_parameters()}
        results.append({"variant": variant, "tokens": hi - lo,
                         "y": float((y.detach() - y_ref).abs().max()) if y.numel() else 0.0,
                         "dx": float((x.grad - gx_ref).abs().max()) if x.numel() else 0.0,
                         "y_scale": float(y_ref.abs().max()) if y_ref.numel() else 0.0,
                         "dx_scale": float(gx_ref.abs().max()) if gx_ref.numel() else 0.0,
                         "grad_scales": grad_scales, "form": moe.stats.exchange_form,
                         "weights": max(weights.values()), "grads": grads,
                         # with SP each TP rank routes (and drops from) its own slice
                         "dropped": int(moe.stats.dropped), "ref_dropped": None if sp else ref_dropped})
    return results


def _assert_close(per_rank, atol=1e-5):
    for rank, results in enumerate(per_rank):
        for r in results:
            where = f"rank {rank} {r['variant']}"
            assert r["weights"] == 0.0, where
            assert r["y"] <= atol and r["dx"] <= atol, (where, r["y"], r["dx"])
            bad = {k: v for k, v in r["grads"].items() if not v <= atol}
            assert not bad, (where, bad)


@pytest.mark.parametrize("world,tp,ep,etp", LAYOUTS)
def test_layouts_match_single_process(world, tp, ep, etp):
    _assert_close(run_ranks(compare_layouts, world, tp, ep, etp, VARIANTS))


_PATHS = {  # mode: the MoE options that force the token exchange into one form
    "regroup": dict(cpu_source_major=False, dedup="off"),   # one all-to-all + regroup (what NCCL uses)
    "source": dict(cpu_source_major=True, dedup="off"),     # one all-to-all, rows left source-major (gloo)
    "dedup": dict(dedup="on"),                              # one row per token and rank (forced)
}


def _compare_dispatch_path(mode, tp, ep, etp, variants, uneven=False, layer_kw=None, *args):
    """compare_layouts with the token exchange forced into one form (``mode``: a _PATHS key, or a
    list of keys, one per rank); returns (source-major used, regroup used, dedup used)
    with compare_layouts's results."""
    from moepar.moe import cpu
    from moepar.moe.exchange import dedup, rows as exchange
    if isinstance(mode, list):
        mode = mode[dist.get_rank()]
    old = (cpu.source_major_segments, exchange.regroup_index, dedup.dedup_send)
    used = {"source": [], "regroup": [], "dedup": []}

    def counting(key, fn):
        def wrapped(*a, **kw):
            used[key].append(1)
            return fn(*a, **kw)
        return wrapped
    cpu.source_major_segments = counting("source", old[0])
    exchange.regroup_index = counting("regroup", old[1])
    dedup.dedup_send = counting("dedup", old[2])
    try:
        results = compare_layouts(tp, ep, etp, variants, uneven, {**(layer_kw or {}), **_PATHS[mode]}, *args)
        forms = {r["form"] for r in results}   # the layer's record agrees with what was called
        assert bool(used["dedup"]) == ("dedup" in forms) and bool(used["source"]) == ("source_major" in forms)
        assert bool(used["regroup"]) == bool(forms & {"regroup", "padded"}) or "padded" in forms, forms
        return bool(used["source"]), bool(used["regroup"]), bool(used["dedup"]), results
    finally:
        cpu.source_major_segments, exchange.regroup_index, dedup.dedup_send = old


@pytest.mark.parametrize("mode", list(_PATHS))
@pytest.mark.parametrize("world,tp,ep,etp,uneven", [(4, 1, 2, 1, False), (4, 2, 2, 1, False), (4, 1, 2, 1, True)])
def test_every_token_exchange_form_matches(mode, world, tp, ep, etp, uneven):
    # Two local experts per rank on gloo: the single all-to-all + regroup, the single
    # all-to-all whose rows the experts take source-major, and the dedup form (one row per
    # token and rank) must all equal the single-process layer, also with 5, 0, 3, 7 tokens
    # on the four ranks. Dedup needs two routes per token (k=2 variants); the others run k=1.
    variants = VARIANTS[4:] if mode == "dedup" else VARIANTS[:4]
    out = run_ranks(_compare_dispatch_path, world, mode, tp, ep, etp, variants, uneven)
    assert all(source == (mode == "source") for source, _, _, _ in out)
    assert all(regrouped == (mode == "regroup") for _, regrouped, _, _ in out)
    assert all(dedup == (mode == "dedup") for _, _, dedup, _ in out)
    _assert_close([r for _, _, _, r in out])


@pytest.mark.parametrize("world,tp,ep,etp", [(4, 1, 4, 1), (2, 1, 2, 1)])
def test_dedup_with_capacity_drops_and_on_four_ranks(world, tp, ep, etp):
    # Forced dedup with 4 EP ranks and with routes dropped over capacity (not padded): the
    # dropped routes send nothing and the rest equals the single-process layer.
    kw = dict(capacity_factor=0.5, min_capacity=1, num_experts=8)
    out = run_ranks(_compare_dispatch_path, world, "dedup", tp, ep, etp, VARIANTS[4:6], False, kw)
    assert all(dedup for _, _, dedup, _ in out)
    _assert_close([r for _, _, _, r in out])
    for _, _, _, results in out:
        assert results[0]["dropped"] > 0 and results[0]["dropped"] == results[0]["ref_dropped"]


def test_one_rank_voting_against_dedup_turns_it_off_everywhere():
    # Rank 0 sets dedup="off", the others force it: the group agrees on no dedup (a rank
    # that sent per-route rows while its peers expected per-token rows would hang or
    # corrupt). One EP group of all four ranks (the vote is per EP group).
    out = run_ranks(_compare_dispatch_path, 4, ["regroup", "dedup", "dedup", "dedup"], 1, 4, 1,
                    VARIANTS[4:6], False, dict(num_experts=8))
    assert not any(dedup for _, _, dedup, _ in out)
    assert all(regrouped for _, regrouped, _, _ in out)
    _assert_close([r for _, _, _, r in out])


@pytest.mark.parametrize("world,tp,ep,etp", [(4, 1, 4, 1), (4, 2, 2, 2)])
def test_uneven_token_counts_including_zero(world, tp, ep, etp):
    # dp replicas hold 5, 0, 3, 7 tokens: one rank sends and (for some experts) receives nothing.
    _assert_close(run_ranks(compare_layouts, world, tp, ep, etp, VARIANTS[:2], True))


def _all_to_one_expert(ep):
    state = init_parallel(1, ep, verbose=False)
    moe = moe_ref.build(state, k=2, num_experts=4)
    with torch.no_grad():  # every token's top choice is expert 3 (ties impossible: big margin)
        moe.router.weight.zero_()
        moe.router.weight[3] = 0.0
        moe.router.weight[3, 0] = 50.0
    ref = moe_ref.build(None, k=2, num_experts=4)
    ref.load_state_dict(moe_state_full(moe, ref))
    x, _ = moe_ref.replica_input(state.dp_rank, 6)
    x = x.abs()  # positive feature 0 -> expert 3 wins everywhere
    y = moe(x)
    return float((y - ref(x)).abs().max()), moe.stats.tokens_per_expert.tolist()


def moe_state_full(moe, ref):
    sd = ref.state_dict()
    sd["router.weight"] = moe.router.weight.detach().clone()
    return sd


def test_all_tokens_on_one_expert():
    for diff, tpe in run_ranks(_all_to_one_expert, 4, 4):
        assert diff <= 1e-5
        assert tpe[3] == 6 and sum(tpe) == 12


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("uneven", [False, True])
def test_capacity_mode_with_drops_counts_and_matches(pad, uneven):
    # uneven: 5, 0, 3, 7 tokens on the data-parallel replicas. With padding, the rank with
    # no tokens still sends E*C zero slots and gets their gradients back (its backward used
    # to raise alone while its peers waited in the all-to-all: a hang).
    kw = dict(capacity_factor=0.5, min_capacity=1, pad_to_capacity=pad)
    per_rank = run_ranks(compare_layouts, 4, 2, 2, 1, VARIANTS[2:3], uneven, kw)
    _assert_close(per_rank)
    for results in per_rank:
        assert results[0]["dropped"] == results[0]["ref_dropped"]
    assert all(results[0]["dropped"] > 0 for results in per_rank) if not uneven else \
        sum(results[0]["dropped"] for results in per_rank) > 0


def _dedup_collectives():
    state = init_parallel(1, 2, verbose=False)
    moe = moe_ref.build(state, k=2, num_experts=8, dedup="on")
    x, g = moe_ref.replica_input(state.dp_rank, 6)
    y = moe(x.requires_grad_())
    (y * g).sum().backward()
    ev = [(e.nbytes, e.backward) for e in moe.stats.comm.events if e.op == "all_to_all"]
    return ev


def test_ranks_with_different_switches_agree_on_one_form():
    # cpu_source_major differs across the ranks of one EP group: the group takes the
    # source-major rows only if every rank allows them, here not (each rank regroups).
    out = run_ranks(_compare_dispatch_path, 4, ["regroup", "source", "source", "source"], 1, 4, 1,
                    VARIANTS[:2], False, dict(num_experts=8))
    assert not any(source for source, _, _, _ in out)
    assert all(regrouped for _, regrouped, _, _ in out)
    _assert_close([r for _, _, _, r in out])


def _dedup_and_routes_in(dtype_name):
    """The same layer and batch with dedup on and off: outputs, input and weight grads."""
    dtype = getattr(torch, dtype_name)
    state = init_parallel(1, 2, verbose=False)
    x, g = moe_ref.replica_input(state.dp_rank, 9, dtype=dtype)
    out, calls = {}, {}
    for env, mode in (("1", "on"), ("0", "off")):
        moe = moe_ref.build(state, k=2, num_experts=8, dedup=mode).to(dtype)
        xi = x.clone().requires_grad_()
        y = moe(xi)
        (y.float() * g.float()).sum().backward()
        out[env] = [y.detach().float(), xi.grad.float()] + [p.grad.float() for p in moe.parameters()]
        calls[env] = sum(e.op == "all_to_all" and not e.backward for e in moe.stats.comm.events)
    return calls, max(float((a - b).abs().max() / (b.abs().max() + 1e-6)) for a, b in zip(out["1"], out["0"]))


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 2e-2), ("float64", 1e-6)])
def test_dedup_equals_one_row_per_route_in_other_dtypes(dtype, tol):
    # bf16 rows with the fp32 side message (weights and their gradients), and float64. Both
    # forms combine with fp32 weights and accumulation (unpermute's contract), in a different
    # order: float64 agrees to fp32 rounding.
    for calls, rel in run_ranks(_dedup_and_routes_in, 2, dtype):
        assert calls == {"1": 3, "0": 2}     # the side message: dedup ran, then did not
        assert rel <= tol


def test_dedup_collectives_and_bytes():
    # Forced dedup: forward = tokens, side message, tokens back (the counts travel in an
    # all-gather before them); backward = the mirror of the three. The side message carries
    # 2K fp32 per token row.
    D, K = moe_ref.D, 2
    for ev in run_ranks(_dedup_collectives, 4):
        fwd = [n for n, b in ev if not b]
        assert len(fwd) == 3 and sum(b for _, b in ev) == 3
        tokens, side, back = fwd      # bytes each rank sends (back: the rows it received)
        assert tokens % (D * 4) == 0 and side == tokens // (D * 4) * (2 * K * 4)
        assert 6 <= tokens // (D * 4) <= 6 * K - 1  # each token once, fewer rows than routes


def _bad_inputs():
    state = init_parallel(1, 2, verbose=False)
    errors = []
    for build in (lambda: MoE(8, 5, 2, state=state), lambda: MoE(8, 4, 4, state=state),
                  lambda: MoE(8, 4, 2, k=5, state=state)):
        try:
            build()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    moe = moe_ref.build(state)
    try:  # every rank passes a wrong hidden size
        moe(torch.randn(3, 7))
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    try:  # only rank 1 passes a wrong hidden size: rank 0 must not hang in the all-to-all
        moe(torch.randn(3, 8 if dist.get_rank() == 0 else 6))
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    try:  # dtypes differ across ranks
        moe(torch.randn(3, 8, dtype=torch.float32 if dist.get_rank() == 0 else torch.float64))
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    try:  # the dispatcher called directly; only rank 1 sends an expert id out of range
        ids = torch.tensor([[0, 1], [2, 7 if dist.get_rank() == 1 else 3]])
        moe.dispatcher.dispatch(torch.randn(2, 8), ids, None, torch.full((2, 2), 0.5))
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    try:  # only rank 1 passes routing weights of the wrong shape (combine would reject them)
        ids = torch.tensor([[0, 1], [2, 3]])
        moe.dispatcher.dispatch(torch.randn(2, 8), ids, None, torch.full((2, 3 if dist.get_rank() == 1 else 2), 0.5))
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    try:  # only rank 1 has an out-of-range id, on a dropped route (the permute rejects it too)
        ids = torch.tensor([[0, 1], [2, -3 if dist.get_rank() == 1 else 3]])
        dropped = torch.tensor([[False, False], [False, True]])
        moe.dispatcher.dispatch(torch.randn(2, 8), ids, dropped, torch.full((2, 2), 0.5))
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_bad_input_raises_on_every_rank():
    for rank, errors in enumerate(run_ranks(_bad_inputs, 2)):
        assert "num_experts=5 is not divisible by ep_size=2" in errors[0]
        assert "ep_size=4 does not match the parallel state's expert_parallel_size=2" in errors[1]
        assert "k=5" in errors[2]
        assert "hidden=8" in errors[3]
        assert errors[4] is not None and errors[5] is not None, errors
        assert ("x's last dim is (6,) but the MoE layer has hidden=8" if rank == 1
                else "MoE forward aborted: rank(s) [1] reported invalid input (see their error); this is rank 0") \
            in errors[4]
        assert "dtypes ['torch.float32', 'torch.float64'] of ranks [0, 1] differ" in errors[5]
        for e in errors[6:9:2]:
            assert ("outside [0, num_experts=4)" if rank == 1 else "rank(s) [1] reported invalid input") in e
        assert ("weights_TK must be a floating-point tensor of expert_ids_TK's shape (2, 2), got torch.float32 "
                "of shape (2, 3)" if rank == 1 else "rank(s) [1] reported invalid input") in errors[7]


def _one_rank_bad_hidden(tp, ep, etp, sp):
    state = init_parallel(tp, ep, etp, verbose=False)
    moe = moe_ref.build(state, k=2, num_shared_experts=1, sequence_parallel=sp)
    x = torch.randn(4, moe_ref.D + (1 if dist.get_rank() == 0 else 0))
    try:
        moe(x)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world,tp,ep,etp,sp", [(*lay, False) for lay in LAYOUTS] +
                         [(*lay, True) for lay in LAYOUTS if lay[1] > 1])
def test_one_rank_with_a_wrong_hidden_size_raises_on_every_rank_of_its_block(world, tp, ep, etp, sp):
    # Only global rank 0 passes a wrong hidden size. Its EP, ETP, TP (and SP) peers, the
    # ranks of its MoE block, all wait in later collectives of the forward unless they learn
    # of it first: each must raise, rank 0 with its own error, the others naming rank 0 (a
    # hang fails by timeout). The other blocks share no collective with it in this layer:
    # they finish their forward (no barrier over the world).
    block = Layout(world, tp, ep, etp).moe
    for rank, msg in enumerate(run_ranks(_one_rank_bad_hidden, world, tp, ep, etp, sp)):
        if rank >= block:
            assert msg is None, (rank, msg)
            continue
        expected = (f"x's last dim is ({moe_ref.D + 1},) but the MoE layer has hidden={moe_ref.D}" if rank == 0
                    else f"MoE forward aborted: rank(s) [0] reported invalid input (see their error); this is rank {rank}")
        assert msg is not None and expected in msg, (rank, msg)


def _groups_kept():
    # The layer and its dispatcher read the groups from the ParallelState at call time
    # (destroy_parallel must be able to free them): none is held in their own attributes.
    state = init_parallel(1, 2, verbose=False)
    moe = moe_ref.build(state, k=2)
    moe(torch.randn(3, moe_ref.D))
    held = [f"moe.{k}" for k, v in vars(moe).items() if isinstance(v, dist.ProcessGroup)]
    held += [f"dispatcher.{k}" for k, v in vars(moe.dispatcher).items()
             if isinstance(v, dist.ProcessGroup) or (isinstance(v, tuple) and any(isinstance(g, dist.ProcessGroup)
                                                                                   for g in v))]
    return held, moe.dispatcher.ep_group is state.ep_group


def test_layer_and_dispatcher_hold_no_process_group():
    for held, reads_state in run_ranks(_groups_kept, 2):
        assert held == [] and reads_state


def _nan_tokens(check, dispatch_dtype=None):
    state = init_parallel(1, 2, verbose=False)
    moe = moe_ref.build(state, k=2, check_finite=check, dispatch_dtype=dispatch_dtype)
    x, _ = moe_ref.replica_input(state.dp_rank, 5)
    if dist.get_rank() == 1:
        x[2, 3] = float("nan")
    try:
        y = moe(x)
    except ValueError as e:
        return "raised", str(e)
    ref = moe_ref.build(None, k=2)
    y_ref = ref(x)
    finite_rows = torch.isfinite(x).all(dim=1)
    a, b = y[finite_rows], y_ref[finite_rows]
    if dispatch_dtype is None:
        ok = torch.allclose(a, b, atol=1e-5)
    else:   # FP8 rows: finite and within the quantization's error, the NaN kept on its token
        ok = bool(torch.isfinite(a).all()) and float((a - b).norm() / b.norm()) < 0.1
    return "ran", (ok, torch.isnan(y[~finite_rows]).all().item() if (~finite_rows).any() else True)


@pytest.mark.parametrize("dispatch_dtype", [None, "fp8"])
def test_nonfinite_input_raises_in_debug_mode_else_stays_on_its_token(dispatch_dtype):
    for rank, (kind, msg) in enumerate(run_ranks(_nan_tokens, 2, True, dispatch_dtype)):
        assert kind == "raised"
        assert ("check_finite=True: non-finite values in the MoE layer input" if rank == 1
                else "MoE forward aborted: rank(s) [1] reported invalid input") in msg, msg
    for kind, (others_ok, nan_row_nan) in run_ranks(_nan_tokens, 2, False, dispatch_dtype):
        assert kind == "ran" and others_ok and nan_row_nan


def _global_aux(tp, ep, sp):
    state = init_parallel(tp, ep, verbose=False)
    kw = dict(k=2, aux_loss_scope="global", aux_loss_coeff=0.5, z_loss_coeff=0.1)
    moe = moe_ref.build(state, sequence_parallel=sp, **kw)
    ref = moe_ref.build(None, **kw)
    xs, gs = zip(*[moe_ref.replica_input(d, _tokens(d, True) + 1) for d in range(state.dp_size)])
    # Reference: the whole global batch in one process, objective mean_d(task_d) + aux(all).
    y_ref = ref(torch.cat(xs))
    ((y_ref * torch.cat(gs)).sum() / state.dp_size + aux_loss(ref)).backward()
    x, g = xs[state.dp_rank], gs[state.dp_rank]
    if sp:  # this TP rank's own slice of the replica's tokens
        n = comm_split(x.shape[0], state)
        x, g = x[n[0]:n[1]], g[n[0]:n[1]]
    y = moe(x)
    ((y * g).sum() + aux_loss(moe)).backward()
    allreduce_gradients(moe, state, op="mean")
    return (float((aux_loss(moe) - aux_loss(ref)).abs()),
            float((moe.router.weight.grad - ref.router.weight.grad).abs().max()))


def comm_split(n, state):
    from moepar.parallel.comm import split_sizes
    sizes = split_sizes(n, state.tp_size)
    lo = sum(sizes[:state.tp_rank])
    return lo, lo + sizes[state.tp_rank]


@pytest.mark.parametrize("tp,ep,sp", [(1, 4, False), (2, 2, False), (2, 2, True)])
def test_global_aux_loss_scope_equals_the_global_batch_loss(tp, ep, sp):
    for aux_diff, grad_diff in run_ranks(_global_aux, 4, tp, ep, sp):
        assert aux_diff <= 1e-6 and grad_diff <= 1e-5, (aux_diff, grad_diff)


def test_sequence_parallel_shared_experts_with_uneven_token_slices():
    # 5 and 1 tokens per replica over tp=2: slices of 3/2 and 1/0 tokens. The shared
    # experts' all-gather and reduce-scatter take each TP rank's own count (they assumed
    # equal slices and failed with a collective size mismatch).
    out = run_ranks(compare_layouts, 4, 2, 2, 1, [dict(k=2, num_shared_experts=1)], False, None, True,
                    None, moe_ref.D, True, [5, 1])
    assert sorted(r[0]["tokens"] for r in out) == [0, 1, 2, 3]
    _assert_close(out)


def _serial_vs_overlapped(tp, ep, sp, dispatch_dtype=None):
    """The same layer with the shared experts computed during the dispatch all-to-all and
    after the combine: outputs, input and every weight gradient (FP8 rows too: their
    exchange is in flight while the shared experts run, dequantized at its wait)."""
    state = init_parallel(tp, ep, verbose=False)
    x, g = moe_ref.replica_input(state.dp_rank, 7)
    if sp:
        lo, hi = comm_split(x.shape[0], state)
        x, g = x[lo:hi].clone(), g[lo:hi]
    out = {}
    for overlap in (True, False):
        moe = moe_ref.build(state, k=2, num_shared_experts=1, shared_expert_gate=True, sequence_parallel=sp,
                            overlap_shared_experts=overlap, dispatch_dtype=dispatch_dtype)
        xi = x.clone().requires_grad_()
        with comm.track() as seen:   # every collective, the shared experts' TP ones included
            y = moe(xi)
        ((y * g).sum() + aux_loss(moe)).backward()
        out[overlap] = [y.detach(), xi.grad] + [p.grad for p in moe.parameters()]
        assert moe.stats.comm.count("all_to_all", backward=False) == (2 if ep > 1 else 0)
        if tp > 1 and not sp:   # overlapped: the shared experts' TP all-reduce ran (and was
            # recorded) while the dispatch all-to-all was in flight, before its wait recorded it
            ops = [e.op for e in seen.events]
            assert (ops.index("all_reduce") < ops.index("all_to_all")) == overlap, ops
    return all(torch.equal(a, b) for a, b in zip(out[True], out[False]))


@pytest.mark.parametrize("tp,ep,sp,dispatch", [(1, 2, False, None), (2, 2, False, None), (2, 2, True, None),
                                               (1, 4, False, None), (2, 2, False, "fp8"), (1, 4, False, "fp8")])
def test_shared_experts_overlapped_with_the_dispatch_give_the_same_numbers(tp, ep, sp, dispatch):
    assert all(run_ranks(_serial_vs_overlapped, 4, tp, ep, sp, dispatch))


def _autocast_bytes():
    state = init_parallel(1, 2, verbose=False)
    moe = moe_ref.build(state, k=2)
    x, _ = moe_ref.replica_input(state.dp_rank, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    sends = [e.nbytes for e in moe.stats.comm.events if e.op == "all_to_all"]
    rows = sum(moe.stats.load.load_PE[moe.stats.load.rank].tolist())   # routes this rank sent
    return y.dtype, sends[0], rows


def test_autocast_sends_the_rows_in_the_autocast_dtype():
    # The tokens are cast once before the dispatch: the all-to-all carries bf16 rows
    # (2 bytes an element), not the fp32 input's 4.
    for dtype, sent, rows in run_ranks(_autocast_bytes, 2):
        assert dtype == torch.bfloat16 and sent == rows * moe_ref.D * 2

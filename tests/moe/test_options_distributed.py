"""Every layer option, distributed, deterministic, against the per-token reference.

Four gloo ranks at tp=2, ep=2 (two data-parallel replicas, each TP pair sharing its
replica's tokens and dispatching half of its routes each), one worker call per test that
loops over the cases. fp32 and fp64 layers (and one bf16 case, held to the relative bf16
tolerance); all tolerances come from tests/helpers/tolerances.py. Also: a nonzero expert bias and
``update_expert_bias``, noisy gating (the TP ranks must draw the same noise), eval mode
with ``eval_capacity_factor``, and ``grad_norm`` / ``clip_grad_norm_`` at etp=2.
"""
import torch

from moepar.parallel import allreduce_gradients, clip_grad_norm_, grad_norm, init_parallel

from ..helpers import moe_ref
from ..helpers.moe_ref import EXPERT_BIAS, grad_ratios, layer_kw, per_token_reference, set_expert_bias
from ..helpers.multiproc import run_ranks
from ..helpers.tolerances import error_ratio

OPTION_CASES = [
    dict(k=2, activation="relu"),
    dict(k=2, activation="swiglu", bias=True),
    dict(k=2, bias=True, normalize_weights=True, scaling_factor=2.5),
    dict(k=2, score_func="sigmoid", normalize_weights=False, scaling_factor=0.5),
    dict(k=2, score_func="softmax_after_topk"),
    dict(k=3, num_experts=6),
    dict(k=4, num_experts=8, score_func="sigmoid", activation="swiglu"),
    dict(k=2, capacity_factor=0.5, min_capacity=1, drop_policy="probs"),
    dict(k=2, capacity_factor=0.5, min_capacity=1, drop_policy="position", bias=True),
    dict(k=3, num_experts=6, capacity_factor=0.75, min_capacity=0, drop_policy="position"),
    dict(k=2, capacity_factor=0.5, min_capacity=1, pad_to_capacity=True),
    dict(k=2, expert_bias=True),
    dict(k=2, score_func="sigmoid", expert_bias=True, num_shared_experts=1),
    dict(k=2, bias=True, num_shared_experts=1, dtype=torch.float64),
    dict(k=3, num_experts=6, activation="swiglu", capacity_factor=0.75, min_capacity=1, dtype=torch.float64),
    dict(k=2, bias=True, activation="swiglu", num_shared_experts=1, dtype=torch.bfloat16),
    # Hugging Face families' layer options (moepar.hf)
    dict(k=2, num_shared_experts=1, shared_expert_gate=True, activation="swiglu"),
    dict(k=2, num_shared_experts=1, shared_expert_gate=True, router_bias=True, dtype=torch.float64),
    dict(k=2, score_before_experts=True, bias=True),
    dict(k=2, score_before_experts=True, capacity_factor=0.5, min_capacity=1, drop_policy="position"),
    dict(k=2, activation="clamped_swiglu", bias=True, router_bias=True, activation_limit=0.5),
]
TOKENS = 7   # per replica: an odd count, so the two TP ranks' route shares differ in size


def _options(tp, ep, etp, cases, training=True):
    state = init_parallel(tp, ep, etp, verbose=False)
    out = []
    for case in cases:
        kw = layer_kw(case)
        dtype = kw.get("dtype", torch.float32)
        moe = moe_ref.build(state, **kw)
        set_expert_bias(moe)
        moe.train(training)
        xs, gs = zip(*[moe_ref.replica_input(d, TOKENS, dtype=dtype) for d in range(state.dp_size)])
        ys, dxs, ref_grads, _, routings = per_token_reference(kw, xs, gs, training)
        x = xs[state.dp_rank].clone().requires_grad_()
        y = moe(x)
        (y * gs[state.dp_rank]).sum().backward()
        allreduce_gradients(moe, state, op="sum")
        dropped = sum(not k for row in routings[state.dp_rank][1] for k in row)
        out.append({"case": case, "y": error_ratio(y, ys[state.dp_rank], dtype),
                    "dx": error_ratio(x.grad, dxs[state.dp_rank], dtype),
                    "grads": grad_ratios(moe, ref_grads, state, dtype),
                    "dropped": (int(moe.stats.dropped), dropped)})
    return out


def _assert_all_close(per_rank):
    for rank, results in enumerate(per_rank):
        for r in results:
            bad = {n: v for n, v in r["grads"].items() if not v <= 1}
            assert r["y"] <= 1 and r["dx"] <= 1 and not bad, (rank, r)
            assert r["dropped"][0] == r["dropped"][1], (rank, r)
            if r["case"].get("capacity_factor") is not None:
                assert r["dropped"][1] > 0, r["case"]   # the drops the case is about happen


def test_options_at_tp2_ep2_equal_the_per_token_reference():
    _assert_all_close(run_ranks(_options, 4, 2, 2, 1, OPTION_CASES))


def test_eval_mode_uses_eval_capacity_factor_at_tp2_ep2():
    # capacity_factor=2 in training (nothing dropped), eval_capacity_factor=0.5 in eval.
    cases = [dict(k=2, capacity_factor=2.0, eval_capacity_factor=0.5, min_capacity=1),
             dict(k=2, capacity_factor=2.0, eval_capacity_factor=0.5, min_capacity=1, pad_to_capacity=True,
                  noisy_gate_policy="jitter")]   # no noise in eval either
    _assert_all_close(run_ranks(_options, 4, 2, 2, 1, cases, False))


def _expert_bias_update(tp, ep, rate):
    """Two training forwards, update_expert_bias(rate), then a forward with the new bias."""
    state = init_parallel(tp, ep, verbose=False)
    kw = layer_kw(dict(k=2, expert_bias=True))
    moe = moe_ref.build(state, **kw)
    set_expert_bias(moe)
    batches = [[moe_ref.replica_input(d + 10 * i, TOKENS) for d in range(state.dp_size)] for i in range(2)]
    load = torch.zeros(moe.num_experts, dtype=torch.int64)
    for batch in batches:
        moe(batch[state.dp_rank][0])
        for ids, _ in per_token_reference(kw, [x for x, _ in batch], [g for _, g in batch])[4]:
            for row in ids:
                for e in row:
                    load[e] += 1
    moe.update_expert_bias(rate)
    expected = torch.tensor(EXPERT_BIAS[:moe.num_experts]) + rate * torch.sign(load.double().mean() - load.double())
    bias_err = float((moe.router.expert_bias - expected.float()).abs().max())
    # The next forward routes with the updated bias (the reference given that bias).
    x, g = moe_ref.replica_input(state.dp_rank, TOKENS)
    single = moe_ref.build(None, **kw)
    with torch.no_grad():
        single.router.expert_bias.copy_(expected.float())
    w = moe_ref.full_weights(single)
    y_ref, _ = moe_ref.moe_per_token(x, w, **moe_ref.route_options(kw))
    with torch.no_grad():
        y = moe(x)
    return bias_err, error_ratio(y, y_ref, torch.float32), load.tolist()


def test_nonzero_expert_bias_and_update_expert_bias_at_tp2_ep2():
    for bias_err, y_ratio, load in run_ranks(_expert_bias_update, 4, 2, 2, 0.125):
        assert len(set(load)) > 1   # an uneven load: the update moves the bias both ways
        assert bias_err <= 1e-7 and y_ratio <= 1, (bias_err, y_ratio, load)


def _noisy(tp, ep, policy):
    """Noisy gating, training: (1) without reseeding, the TP ranks (same tokens) route
    alike; (2) given the same noise stream, the layer equals the single-process layer."""
    state = init_parallel(tp, ep, verbose=False)
    kw = dict(k=2, noisy_gate_policy=policy, aux_loss=None)
    moe = moe_ref.build(state, **kw)
    x, g = moe_ref.replica_input(state.dp_rank, TOKENS)
    moe(x)
    tpe_plain = moe.stats.tokens_per_expert.clone()
    torch.manual_seed(4321)
    xg = x.clone().requires_grad_()
    y = moe(xg)
    tpe_seeded = moe.stats.tokens_per_expert.clone()
    (y * g).sum().backward()
    allreduce_gradients(moe, state, op="sum")
    ref = moe_ref.build(None, **kw)
    # The reference sees each replica's tokens after the same reseed (grads summed).
    y_ref = None
    for d in range(state.dp_size):
        xd, gd = moe_ref.replica_input(d, TOKENS)
        torch.manual_seed(4321)
        yd = ref(xd)
        (yd * gd).sum().backward()
        if d == state.dp_rank:
            y_ref, tpe_ref = yd.detach(), ref.stats.tokens_per_expert.clone()
    grads = max(moe_ref.max_param_diff(moe, ref, state, use_grad=True).values())
    with torch.no_grad():   # the noise does something: eval mode (no noise) differs
        y_clean = moe.eval()(x)
    return (state.dp_rank, tpe_plain.tolist(), tpe_seeded.tolist(), tpe_ref.tolist(),
            error_ratio(y, y_ref, torch.float32), grads, error_ratio(y, y_clean, torch.float32))


def _check_noisy(out):
    by_replica = {}
    for dp_rank, plain, seeded, ref, y_ratio, grads, noise_effect in out:
        by_replica.setdefault(dp_rank, []).append((plain, seeded))
        assert seeded == ref and y_ratio <= 1 and grads <= 1e-5, (dp_rank, seeded, ref, y_ratio, grads)
        assert noise_effect > 10, noise_effect
    for dp_rank, ranks in by_replica.items():
        assert len(ranks) == 2 and ranks[0] == ranks[1], (dp_rank, ranks)   # both TP ranks alike


def test_noisy_gating_jitter_at_tp2_ep2_routes_alike_on_tp_ranks():
    _check_noisy(run_ranks(_noisy, 4, 2, 2, "jitter"))


def test_noisy_gating_rsample_at_tp2_ep2_routes_alike_on_tp_ranks():
    _check_noisy(run_ranks(_noisy, 4, 2, 2, "rsample"))


def _norms(tp, ep, etp):
    """grad_norm and clip_grad_norm_ of the distributed layer against the norm of the
    per-token reference's full gradient (objective: mean over replicas)."""
    state = init_parallel(tp, ep, etp, verbose=False)
    kw = layer_kw(dict(k=2, bias=True, num_shared_experts=1, activation="swiglu"))
    moe = moe_ref.build(state, **kw)
    xs, gs = zip(*[moe_ref.replica_input(d, TOKENS) for d in range(state.dp_size)])
    _, _, ref_grads, _, _ = per_token_reference(kw, xs, gs)
    ref_grads = {n: t / state.dp_size for n, t in ref_grads.items()}
    ref_norm = float(torch.sqrt(sum((t.double() ** 2).sum() for t in ref_grads.values())))
    y = moe(xs[state.dp_rank])
    (y * gs[state.dp_rank]).sum().backward()
    allreduce_gradients(moe, state, op="mean")
    norm = float(grad_norm(moe, state))
    returned = float(clip_grad_norm_(moe, ref_norm / 2, state))
    after = float(grad_norm(moe, state))
    clipped = {n: t * (ref_norm / 2) / ref_norm for n, t in ref_grads.items()}
    return norm, returned, after, ref_norm, max(grad_ratios(moe, clipped, state).values())


def test_grad_norm_and_clipping_at_etp2():
    # tp=1 ep=2 etp=2 (four data-parallel replicas) and tp=2 ep=2 etp=2: expert slices cut
    # over ETP, b2 replicated over ETP (counted once), shared experts cut over TP.
    for layout in [(1, 2, 2), (2, 2, 2)]:
        for norm, returned, after, ref_norm, ratio in run_ranks(_norms, 4, *layout):
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (layout, norm, ref_norm)
            assert returned == norm
            assert abs(after - ref_norm / 2) <= 1e-5 * ref_norm, (layout, after, ref_norm)
            assert ratio <= 1, (layout, ratio)

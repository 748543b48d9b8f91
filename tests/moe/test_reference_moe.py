"""The layer against the independent per-token reference (tests/helpers/moe_ref.moe_per_token).

The distributed tests elsewhere compare a layout with the same layer built for one
process: that proves layout-invariance. Here the layer (one process, and one distributed
layout) is compared with a restatement of the maths, token by token in float64: routing
(scores, top-k, bias, normalisation, scaling, capacity drops), every expert's FFN and the
shared experts, for the outputs, dX and every weight gradient.
"""
import pytest
import torch

from moepar.parallel import allreduce_gradients, init_parallel
from moepar.parallel.groups import ParallelState

from ..helpers import moe_ref
from ..helpers.multiproc import run_ranks
from ..helpers.moe_ref import grad_ratios, layer_kw, per_token_reference, set_expert_bias
from ..helpers.tolerances import error_ratio

# Options one at a time and in combinations (fp32 layer; the reference is float64).
CASES = [
    dict(k=1, activation="relu"),
    dict(k=2, activation="swiglu", bias=True),
    dict(k=3, num_experts=6, score_func="sigmoid"),                    # normalised by default
    dict(k=2, score_func="sigmoid", normalize_weights=False, scaling_factor=2.5),
    dict(k=2, score_func="softmax_after_topk", bias=True),
    dict(k=2, normalize_weights=True, scaling_factor=0.5, activation="relu"),
    dict(k=2, capacity_factor=0.5, min_capacity=1, drop_policy="probs"),
    dict(k=2, capacity_factor=0.5, min_capacity=1, drop_policy="position", activation="swiglu"),
    dict(k=3, num_experts=6, capacity_factor=0.75, min_capacity=0, drop_policy="probs", bias=True),
    dict(k=2, expert_bias=True),
    dict(k=2, score_func="sigmoid", expert_bias=True, capacity_factor=1.0, min_capacity=1),
    dict(k=4, num_experts=4, activation="relu"),
    dict(k=1, score_func="sigmoid", scaling_factor=3.0),
    dict(k=2, capacity_factor=0.5, min_capacity=1, pad_to_capacity=True, bias=True),
    dict(k=2, num_shared_experts=1),
    dict(k=1, num_shared_experts=2, activation="swiglu", shared_ffn_hidden=10),
    dict(k=3, num_experts=8, num_shared_experts=1, bias=True, score_func="sigmoid", scaling_factor=2.0),
    # Hugging Face families' layer options (moepar.hf): Qwen2-MoE's shared-expert gate,
    # a router bias, Llama 4's score_before_experts, GPT-OSS's clamped SwiGLU (a small limit
    # so that the clamps bite, see test_clamped_swiglu_case_clamps).
    dict(k=2, num_shared_experts=1, shared_expert_gate=True),
    dict(k=2, num_shared_experts=1, shared_expert_gate=True, activation="swiglu", router_bias=True),
    dict(k=2, score_before_experts=True, bias=True),
    dict(k=2, score_before_experts=True, capacity_factor=0.5, min_capacity=1, activation="swiglu"),
    dict(k=2, score_before_experts=True, capacity_factor=0.5, min_capacity=1, pad_to_capacity=True, bias=True),
    dict(k=2, activation="clamped_swiglu", bias=True, router_bias=True, activation_limit=0.5),
    dict(k=3, num_experts=6, activation="clamped_swiglu", activation_limit=0.4, activation_alpha=1.0,
         score_before_experts=True),
]

@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("tokens", [1, 13])
def test_single_process_layer_equals_the_per_token_reference(case, tokens):
    kw = layer_kw(case)
    moe = moe_ref.build(None, **kw)
    set_expert_bias(moe)
    x, g = moe_ref.replica_input(0, tokens)
    ys, dxs, ref_grads, _, routings = per_token_reference(kw, [x], [g])
    x = x.clone().requires_grad_()
    y = moe(x)
    (y * g).sum().backward()
    assert error_ratio(y, ys[0], torch.float32) <= 1, (y, ys[0])
    assert error_ratio(x.grad, dxs[0], torch.float32) <= 1
    bad = {n: r for n, r in grad_ratios(moe, ref_grads, ParallelState.single()).items() if not r <= 1}
    assert not bad, bad
    ids, kept = routings[0]
    dropped = sum(not k for row in kept for k in row)
    assert int(moe.stats.dropped) == dropped
    if case.get("capacity_factor") is not None and tokens > 1:
        assert dropped > 0   # the case exercises the drops it claims to
    load = torch.zeros(moe.num_experts, dtype=torch.int64)
    for row, krow in zip(ids, kept):
        for e, keep in zip(row, krow):
            load[e] += int(keep)
    assert moe.stats.tokens_per_expert.tolist() == load.tolist()


def test_clamped_swiglu_case_clamps():
    # The clamped_swiglu cases above would pass with the clamps ignored if no pre-activation
    # left [-limit, limit]: check that both the gate's (above) and the up projection's (both
    # sides) do on that input.
    for limit in (0.5, 0.4):
        moe = moe_ref.build(None, **layer_kw(dict(activation="clamped_swiglu", activation_limit=limit)))
        x, _ = moe_ref.replica_input(0, 13)
        h1 = torch.einsum("td,edf->etf", x, moe.experts.w1.detach())
        h3 = torch.einsum("td,edf->etf", x, moe.experts.w3.detach())
        assert (h1 > limit).any() and (h1 < limit).any()
        assert (h3 > limit).any() and (h3 < -limit).any() and (h3.abs() < limit).any()


def test_eval_mode_uses_eval_capacity_factor():
    # Training capacity 2.0 (nothing dropped), evaluation capacity 0.5 (routes dropped).
    kw = layer_kw(dict(k=2, capacity_factor=2.0, eval_capacity_factor=0.5, min_capacity=1))
    moe = moe_ref.build(None, **kw).eval()
    x, g = moe_ref.replica_input(0, 12)
    ys, _, _, _, routings = per_token_reference(kw, [x], [g], training=False)
    with torch.no_grad():
        y = moe(x)
    assert error_ratio(y, ys[0], torch.float32) <= 1
    dropped = sum(not k for row in routings[0][1] for k in row)
    assert dropped > 0 and int(moe.stats.dropped) == dropped


def test_shared_experts_alone_equal_a_dense_ffn_per_token():
    # The shared experts' own output (the routed part subtracted through a second layer
    # without shared experts, same seed) equals the per-token dense FFN.
    for act in ("gelu", "swiglu", "relu"):
        kw = layer_kw(dict(k=1, num_shared_experts=1, activation=act))
        with_shared = moe_ref.build(None, **kw)
        x, _ = moe_ref.replica_input(0, 7)
        with torch.no_grad():
            shared_y = with_shared.shared(x)
        w = moe_ref.full_weights(with_shared)
        ref = torch.stack([moe_ref.shared_ffn(x[t].double(), w["shared"], act) for t in range(7)])
        assert error_ratio(shared_y, ref, torch.float32) <= 1, act


def _distributed_vs_per_token(tp, ep, etp, cases, tokens=6, sp=False):
    """Each rank: its replica through the distributed layer, compared with the per-token
    reference; weight grads (summed over replicas) compared with the reference's slices.
    ``sp``: sequence parallelism, each TP rank holding its own slice of the replica."""
    from moepar.parallel.comm import split_sizes
    state = init_parallel(tp, ep, etp, verbose=False)
    sizes = split_sizes(tokens, state.tp_size) if sp else [tokens]
    lo = sum(sizes[:state.tp_rank]) if sp else 0
    hi = lo + sizes[state.tp_rank if sp else 0]
    results = []
    for case in cases:
        kw = layer_kw(case)
        moe = moe_ref.build(state, sequence_parallel=sp, **kw)
        set_expert_bias(moe)
        xs, gs = zip(*[moe_ref.replica_input(d, tokens) for d in range(state.dp_size)])
        ys, dxs, ref_grads, _, _ = per_token_reference(kw, xs, gs)
        x = xs[state.dp_rank][lo:hi].clone().requires_grad_()
        y = moe(x)
        (y * gs[state.dp_rank][lo:hi]).sum().backward()
        allreduce_gradients(moe, state, op="sum")
        results.append({"case": case, "y": error_ratio(y, ys[state.dp_rank][lo:hi], torch.float32),
                        "dx": error_ratio(x.grad, dxs[state.dp_rank][lo:hi], torch.float32),
                        "grads": grad_ratios(moe, ref_grads, state)})
    return results


def test_distributed_layer_equals_the_per_token_reference():
    # tp=2, ep=2, etp=2 on four ranks (two data-parallel replicas): every collective of the
    # layer runs (TP share of the routes, token all-to-alls, expert-TP gather/reduce-scatter,
    # the shared experts' all-reduce), compared with the maths rather than the layer.
    cases = [dict(k=2, num_shared_experts=1, bias=True),
             dict(k=3, num_experts=8, activation="swiglu", score_func="sigmoid", expert_bias=True),
             dict(k=2, capacity_factor=0.5, min_capacity=1, drop_policy="position", bias=True),
             dict(k=2, num_shared_experts=1, shared_expert_gate=True, activation="swiglu", router_bias=True,
                  score_before_experts=True),
             dict(k=2, activation="clamped_swiglu", bias=True, activation_limit=0.5)]
    for rank, results in enumerate(run_ranks(_distributed_vs_per_token, 4, 2, 2, 2, cases)):
        for r in results:
            bad = {n: v for n, v in r["grads"].items() if not v <= 1}
            assert r["y"] <= 1 and r["dx"] <= 1 and not bad, (rank, r)


def test_sequence_parallel_layer_equals_the_per_token_reference():
    # tp=2 ep=2 with sequence parallelism: 7 tokens a replica cut 4 + 3 over the TP ranks;
    # dropless (capacity is per rank's own slice under SP, not the replica's).
    cases = [dict(k=2, num_shared_experts=1, bias=True), dict(k=3, num_experts=8, expert_bias=True),
             # the gate and router bias see only this rank's tokens: grads summed over TP
             dict(k=2, num_shared_experts=1, shared_expert_gate=True, router_bias=True, score_before_experts=True)]
    for rank, results in enumerate(run_ranks(_distributed_vs_per_token, 4, 2, 2, 1, cases, 7, True)):
        for r in results:
            bad = {n: v for n, v in r["grads"].items() if not v <= 1}
            assert r["y"] <= 1 and r["dx"] <= 1 and not bad, (rank, r)

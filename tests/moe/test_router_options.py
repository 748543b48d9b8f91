"""The routing and layer options HF families need, each against a slow,
obvious reference: group scores (sum of top-n, max), per-sequence absolute capacity, the
HF aux-loss convention, the clamped SwiGLU, weights applied before the experts, the
shared-expert gate and the router bias."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import moepar
from moepar.moe.config import make_config

from moepar.moe.experts.activations import ClampedSwiGLU, clamped_swiglu_reference
from moepar.moe.experts.grouped import GroupedExperts
from moepar.moe.layer import MoE
from moepar.moe.routing.router import RouterConfig, TopKRouter
from moepar.parallel.groups import ParallelState


def _group_reference(scores_TE, k, groups, topk_groups, topn):
    """Per token, in Python: group score = sum of its top-n scores, best groups (lower
    index on ties), then the top-k scores inside them."""
    T, E = scores_TE.shape
    per = E // groups
    out = []
    for t in range(T):
        s = scores_TE[t].tolist()
        g_score = [sum(sorted(s[g * per:(g + 1) * per], reverse=True)[:topn]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: (-g_score[g], g))[:topk_groups]
        allowed = [e for e in range(E) if e // per in best]
        out.append(sorted(sorted(allowed, key=lambda e: (-s[e], e))[:k]))
    return out


@pytest.mark.parametrize("score_func,group_score,topn", [("sigmoid", "sum_topn", 2), ("softmax", "max", None),
                                                         ("sigmoid", "sum_topn", None)])
def test_group_scores_match_reference(score_func, group_score, topn):
    E, G, M, k = 8, 4, 2, 3
    r = TopKRouter(16, E, k, score_func=score_func, num_groups=G, topk_groups=M, group_score=group_score,
                   group_score_topn=topn, aux_loss=None, init_seed=3, normalize_weights=False)
    x = torch.randn(200, 16)
    out = r(x)
    scores = out.scores.detach()
    n = 1 if group_score == "max" else (topn or max(1, k // M))
    ref = _group_reference(scores, k, G, M, n)
    assert [sorted(row) for row in out.expert_ids.tolist()] == ref
    torch.testing.assert_close(out.weights, scores.gather(1, out.expert_ids), rtol=0, atol=0)
    if topn == 2:   # HF's top-2 group score picks other experts than Megatron's k // topk_groups = 1
        assert ref != _group_reference(scores, k, G, M, 1)


def test_group_score_options_are_validated():
    with pytest.raises(ValueError, match="group_score='mean'"):
        RouterConfig(8, 8, 2, num_groups=4, topk_groups=2, group_score="mean")
    with pytest.raises(ValueError, match="group_score_topn=3 must be <= experts per group 2"):
        RouterConfig(8, 8, 2, num_groups=4, topk_groups=2, group_score_topn=3)
    with pytest.raises(ValueError, match="goes with group_score='sum_topn'"):
        RouterConfig(8, 8, 2, num_groups=4, topk_groups=2, group_score="max", group_score_topn=2)


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_per_sequence_expert_capacity_matches_reference(policy):
    E, k, L, C, Bn = 4, 2, 6, 2, 3
    r = TopKRouter(8, E, k, expert_capacity=C, seq_len=L, drop_policy=policy, aux_loss=None, init_seed=5)
    x = torch.randn(Bn * L, 8)
    out = r(x)
    ids = out.expert_ids.tolist()
    w = out.scores.detach().gather(1, out.expert_ids)   # the weights before any drop
    ref = torch.zeros(Bn * L, k, dtype=torch.bool)
    for b in range(Bn):
        for e in range(E):
            # routes of sequence b to expert e, slot-major arrival order (or by weight)
            routes = [(t, j) for j in range(k) for t in range(b * L, (b + 1) * L) if ids[t][j] == e]
            if policy == "probs":
                routes = sorted(routes, key=lambda tj: -float(w[tj[0], tj[1]]))   # stable: ties by arrival
            for t, j in routes[C:]:
                ref[t, j] = True
    assert torch.equal(out.dropped, ref)
    assert out.capacity == Bn * C
    assert bool(out.dropped.any())
    assert torch.equal(out.weights[out.dropped], torch.zeros(int(out.dropped.sum())))


def test_expert_capacity_validation_and_whole_sequences():
    with pytest.raises(ValueError, match="are exclusive"):
        RouterConfig(8, 4, 1, expert_capacity=2, capacity_factor=1.0)
    with pytest.raises(ValueError, match="expert_capacity=0"):
        RouterConfig(8, 4, 1, expert_capacity=0)
    moe = MoE(8, 4, 1, k=1, ffn_hidden=8, expert_capacity=2, seq_len=4, state=ParallelState.single(), init_seed=1)
    with pytest.raises(ValueError, match="6 tokens are not a whole number of sequences of seq_len=4"):
        moe(torch.randn(6, 8))


def test_hf_aux_loss_convention():
    E, k, T = 6, 2, 40
    x = torch.randn(T, 8)
    ours = TopKRouter(8, E, k, aux_loss_coeff=1.0, init_seed=2)(x)
    hf = TopKRouter(8, E, k, aux_loss_coeff=1.0, aux_loss_convention="hf", init_seed=2)(x)
    # transformers' load_balancing_loss_func, one layer, no mask: E * sum_e f_e * P_e
    logits = F.linear(x, TopKRouter(8, E, k, init_seed=2).weight)
    p = torch.softmax(logits, -1)
    sel = torch.topk(p, k, dim=-1).indices
    f = torch.bincount(sel.reshape(-1), minlength=E).float() / T
    ref = E * (f * p.mean(0)).sum()
    torch.testing.assert_close(hf.aux_loss, ref)
    torch.testing.assert_close(hf.aux_loss, k * ours.aux_loss)
    with pytest.raises(ValueError, match="aux_loss_convention='deepspeed'"):
        RouterConfig(8, E, k, aux_loss_convention="deepspeed")


def test_clamped_swiglu_backward_matches_autograd():
    act = ClampedSwiGLU(limit=1.5, alpha=1.702)
    h1 = torch.linspace(-4, 4, 97).repeat(3, 1) + 0.013
    h3 = torch.linspace(4, -4, 97).repeat(3, 1) - 0.007
    h1[0, :3], h3[0, :3] = 1.5, -1.5   # exactly at the limits: torch.clamp passes the gradient
    a1, a3 = h1.clone().requires_grad_(), h3.clone().requires_grad_()
    y = clamped_swiglu_reference(a1, a3, 1.5, 1.702)
    ga = torch.randn_like(y)
    y.backward(ga)
    torch.testing.assert_close(act.forward(h1, h3), y.detach())
    gh1, gh3 = act.backward(ga, h1, h3)
    torch.testing.assert_close(gh1, a1.grad)
    torch.testing.assert_close(gh3, a3.grad)
    with pytest.raises(ValueError, match="activation_limit=-1"):
        ClampedSwiGLU(limit=-1)


@pytest.mark.parametrize("path", ["loop", "grouped_mm", "bmm"])
def test_grouped_experts_clamped_swiglu_matches_loop_reference(path):
    E, D, Fh = 3, 16, 8
    ex = GroupedExperts(E, D, Fh, "clamped_swiglu", bias=True, init_seed=4, gemm_path=path,
                        activation_limit=2.0, activation_alpha=1.5)
    counts = [5, 0, 7]
    x = (torch.randn(sum(counts), D) * 3).requires_grad_()
    y = ex(x, torch.tensor(counts))
    g = torch.randn_like(y)
    y.backward(g)
    params = {n: p.detach().clone().requires_grad_() for n, p in ex.named_parameters()}
    xr = x.detach().clone().requires_grad_()
    outs, r0 = [], 0
    for e, c in enumerate(counts):
        xe = xr[r0:r0 + c]
        h1 = xe @ params["w1"][e] + params["b1"][e]
        h3 = xe @ params["w3"][e] + params["b3"][e]
        outs.append(clamped_swiglu_reference(h1, h3, 2.0, 1.5) @ params["w2"][e] + params["b2"][e])
        r0 += c
    yr = torch.cat(outs)
    yr.backward(g)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(x.grad, xr.grad)
    for n, p in ex.named_parameters():
        torch.testing.assert_close(p.grad, params[n].grad, msg=n)


def _expert(moe, e, x):
    ex = moe.experts
    return (F.silu(x @ ex.w1[e]) * (x @ ex.w3[e])) @ ex.w2[e]


def test_score_before_experts_matches_loop_reference():
    moe = MoE(8, 4, 1, k=2, ffn_hidden=12, activation="swiglu", score_func="sigmoid", normalize_weights=False,
              score_before_experts=True, aux_loss=None, state=ParallelState.single(), init_seed=9)
    x = torch.randn(7, 8, requires_grad=True)
    g = torch.randn(7, 8)
    (moe(x) * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad()
    xr = x.detach().clone().requires_grad_()
    r = moe.router(xr)
    yr = torch.stack([sum(_expert(moe, int(r.expert_ids[t, j]), xr[t] * r.weights[t, j]) for j in range(2))
                      for t in range(7)])
    (yr * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    assert float(moe.router.weight.grad.abs().max()) > 0   # the weights get gradient
    for n, p in moe.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)


def test_shared_expert_gate_and_router_bias():
    kw = dict(k=2, ffn_hidden=12, activation="swiglu", num_shared_experts=1, aux_loss=None,
              state=ParallelState.single(), init_seed=11)
    gated = MoE(8, 4, 1, shared_expert_gate=True, router_bias=True, **kw)
    assert tuple(gated.shared.gate.weight.shape) == (1, 8) and tuple(gated.router.bias.shape) == (4,)
    x = torch.randn(5, 8)
    with torch.no_grad():
        y = gated(x)
        gate_mod, gated.shared.gate = gated.shared.gate, None
        y_plain, shared = gated(x), gated.shared(x)
        ref = y_plain - shared + torch.sigmoid(x @ gate_mod.weight.t()) * shared
    torch.testing.assert_close(y, ref)
    with pytest.raises(ValueError, match="shared_expert_gate=True needs num_shared_experts"):
        MoE(8, 4, 1, shared_expert_gate=True, state=ParallelState.single())


def test_hf_options_are_config_fields_and_router_fields_route_by_name():
    # The layer options are fields of MoEConfig's hf group; the routing ones reach RouterConfig through
    # MoE(...)'s generic keyword routing (no forwarding written for them).
    single = ParallelState.single()
    moe = MoE(8, 4, 1, k=2, num_shared_experts=1, shared_expert_gate=True, router_bias=True,
              score_before_experts=True, num_groups=2, topk_groups=1, group_score="sum_topn", group_score_topn=2,
              expert_capacity=3, seq_len=4, aux_loss_convention="hf", noise_eps=0.05, state=single, init_seed=1)
    c = moe.config
    assert (c.hf.shared_expert_gate, c.hf.router_bias, c.hf.score_before_experts) == (True, True, True)
    r = c.router
    assert (r.bias, r.group_score, r.group_score_topn, r.expert_capacity, r.seq_len, r.aux_loss_convention,
            r.noise_eps) == (True, "sum_topn", 2, 3, 4, "hf", 0.05)
    assert moe.router.config == dataclasses.replace(r, init_seed=1)
    assert moe.router.bias is not None and moe.shared.gate is not None
    # router_bias and a RouterConfig(bias=True) are one switch: either turns it on
    via_router = moepar.MoEConfig(8, 4, router=RouterConfig(8, 4, bias=True))
    assert via_router.router.bias and not moepar.MoEConfig(8, 4).router.bias
    clamped = MoE(8, 4, 1, activation="clamped_swiglu", activation_limit=3.0, activation_alpha=1.5, state=single)
    assert clamped.experts.w3 is not None and clamped.experts._act == ClampedSwiGLU(3.0, 1.5)


@pytest.mark.parametrize("kw, match", [
    (dict(shared_expert_gate=True), r"shared_expert_gate=True needs num_shared_experts >= 1 .*got "
                                    r"num_shared_experts=0"),
    (dict(activation="clamped_swiglu", num_shared_experts=1), r"activation='clamped_swiglu' is for the routed "
                                                              r"experts only, but num_shared_experts=1"),
    (dict(activation_limit=0.0), r"activation_limit=0.0 must be a finite number > 0"),
    (dict(activation_alpha=float("inf")), r"activation_alpha=inf must be a finite number > 0"),
    (dict(activation_limit=True), r"activation_limit=True must be a finite number > 0"),
    (dict(score_before_experts=1), r"score_before_experts=1 must be True or False"),
    (dict(router_bias="yes"), r"router_bias='yes' must be True or False"),
    (dict(shared_expert_gate=None, num_shared_experts=1), r"shared_expert_gate=None must be True or False"),
    (dict(activation="clamped"), r"activation='clamped' must be one of .*'clamped_swiglu'"),
])
def test_hf_option_errors_name_the_value_and_the_rule(kw, match):
    with pytest.raises(ValueError, match=match):
        make_config(8, 4, 1, **kw)
    with pytest.raises(ValueError, match=match):
        MoE(8, 4, 1, state=ParallelState.single(), **kw)

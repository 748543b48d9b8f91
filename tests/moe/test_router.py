"""TopKRouter against the slow per-token reference in tests/helpers/router_reference.py, for every
option: forward values and gradients (gate weight, gate bias, input). Legend: T tokens, D hidden, E, K."""
import math

import pytest
import torch
import torch.distributed as dist

from moepar.moe.routing.router import Routing, RouterConfig, TopKRouter, capacity_of, normalizes
from moepar_kernels import routing as rk

from ..helpers.multiproc import run_ranks
from ..helpers.router_reference import grads, logits_of, score_row, slow_aux, slow_route, slow_z


# ---- scores, normalisation, scaling: forward and gradients ------------------------------

@pytest.mark.parametrize("gate_bias", [False, True])
@pytest.mark.parametrize("normalize", [None, True, False])
@pytest.mark.parametrize("score_func", ["softmax", "softmax_after_topk", "sigmoid"])
def test_forward_and_gradients_match_slow_reference(score_func, normalize, gate_bias):
    T, D, E, k = 9, 5, 6, 2
    r = TopKRouter(D, E, k, score_func=score_func, normalize_weights=normalize, scaling_factor=1.7,
                   bias=gate_bias, z_loss_coeff=0.1, aux_loss_coeff=0.3, init_seed=3)
    x = torch.randn(T, D, requires_grad=True)
    c = torch.randn(T, k)
    out = r(x)
    loss = (out.weights * c).sum() + out.aux_loss + out.z_loss
    params = [r.weight] + ([r.bias] if gate_bias else [])
    got = grads(loss, x, *params)

    logits = logits_of(r, x)
    norm = normalize if normalize is not None else (score_func == "sigmoid")
    ids, w = slow_route(logits, k, score_func, norm, 1.7)
    aux = 0.3 * slow_aux(logits, ids, k, score_func)
    z = 0.1 * slow_z(logits)
    assert torch.equal(out.expert_ids, ids)
    torch.testing.assert_close(out.weights, w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.aux_loss, aux, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.z_loss, z, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.scores, torch.stack([score_row(l, score_func) for l in logits]), atol=1e-6, rtol=0)
    assert out.capacity is None and not out.dropped.any()
    assert out.tokens_per_expert.tolist() == torch.bincount(ids.flatten(), minlength=E).tolist()
    want = grads((w * c).sum() + aux + z, x, *params)
    for a, b in zip(got, want):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_bf16_input_gives_fp32_logits_and_bf16_input_grad():
    r = TopKRouter(7, 5, 2, init_seed=1, bias=True)
    x = torch.randn(4, 7).to(torch.bfloat16).requires_grad_()
    out = r(x)
    ref = r.route_logits(torch.nn.functional.linear(x.detach().float(), r.weight, r.bias))
    assert out.weights.dtype == torch.float32 and out.scores.dtype == torch.float32
    assert torch.equal(out.scores, ref.scores)           # fp32 gate, not a bf16 matmul
    out.weights.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and r.weight.grad.dtype == torch.float32


def test_one_token_and_k_equals_e():
    r = TopKRouter(3, 4, 4, init_seed=0)
    out = r(torch.randn(1, 3))
    assert sorted(out.expert_ids[0].tolist()) == [0, 1, 2, 3]
    torch.testing.assert_close(out.weights.sum(), torch.tensor(1.0))   # all softmax mass


# ---- aux-loss-free balancing -----------------------------------------------------------

@pytest.mark.parametrize("score_func", ["sigmoid", "softmax", "softmax_after_topk"])
def test_expert_bias_selects_but_never_weights(score_func):
    T, E, k = 12, 8, 2
    r = TopKRouter(4, E, k, score_func=score_func, expert_bias=True)
    r.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, -5.0]))
    logits = torch.randn(T, E, requires_grad=True)
    out = r.route_logits(logits)
    ids, w = slow_route(logits, k, score_func, normalizes(r.config), 1.0, r.expert_bias)
    assert torch.equal(out.expert_ids, ids)
    assert bool((out.expert_ids == 6).any(dim=1).all()) and not bool((out.expert_ids == 7).any())
    torch.testing.assert_close(out.weights, w, atol=1e-6, rtol=1e-5)
    g1 = grads((out.weights ** 2).sum(), logits)[0]
    torch.testing.assert_close(g1, grads((w ** 2).sum(), logits)[0], atol=1e-6, rtol=1e-5)
    assert "expert_bias" not in dict(r.named_parameters()) and "expert_bias" in r.state_dict()


def test_update_expert_bias_sign_rule_and_reset():
    E = 4
    r = TopKRouter(2, E, 1, expert_bias=True)
    logits = torch.tensor([[5.0, 0, 0, 0]] * 5 + [[0, 5.0, 0, 0]] * 2 + [[0, 0, 5.0, 0]])  # loads 5, 2, 1, 0
    r.route_logits(logits)
    r.route_logits(logits)                       # accumulates: 10, 4, 2, 0 (mean 4)
    r.eval()
    r.route_logits(logits)                       # eval forwards do not count
    r.train()
    load = r.update_expert_bias(0.25)
    assert load.tolist() == [10, 4, 2, 0]
    assert r.expert_bias.tolist() == [-0.25, 0.0, 0.25, 0.25]
    assert r.load_accum.tolist() == [0, 0, 0, 0]
    r.update_expert_bias(0.25)                   # nothing counted: every load equals the mean
    assert r.expert_bias.tolist() == [-0.25, 0.0, 0.25, 0.25]
    with pytest.raises(ValueError, match="expert_bias=True"):
        TopKRouter(2, E, 1).update_expert_bias(0.1)


def _bias_update_over_group():
    rank = dist.get_rank()
    r = TopKRouter(2, 4, 1, expert_bias=True)
    hot = 0 if rank == 0 else 3        # rank 0 loads expert 0 x3, rank 1 expert 3 x1
    n = 3 if rank == 0 else 1
    r.route_logits(torch.nn.functional.one_hot(torch.full((n,), hot), 4).float() * 5)
    load = r.update_expert_bias(1.0, group=dist.group.WORLD)
    return load.tolist(), r.expert_bias.tolist()


def test_update_expert_bias_sums_load_over_group():
    for load, bias in run_ranks(_bias_update_over_group, 2):
        assert load == [3, 0, 0, 1]                # mean 1: experts 1, 2 under, 0 over, 3 equal
        assert bias == [-1.0, 1.0, 1.0, 0.0]


# ---- group-limited routing ---------------------------------------------------------------

@pytest.mark.parametrize("score_func, expert_bias", [("sigmoid", True), ("softmax", False),
                                                     ("softmax_after_topk", False)])
def test_group_limited_routing_matches_slow(score_func, expert_bias):
    T, E, k, G, M = 16, 12, 4, 4, 2
    r = TopKRouter(4, E, k, score_func=score_func, expert_bias=expert_bias, num_groups=G, topk_groups=M)
    if expert_bias:
        r.expert_bias.copy_(torch.linspace(-0.1, 0.1, E))
    logits = torch.randn(T, E, requires_grad=True)
    with torch.no_grad():
        logits[0] = 0.5                          # all equal: groups 0, 1 -> experts 0,1,2,3
    out = r.route_logits(logits)
    ids, w = slow_route(logits, k, score_func, normalizes(r.config), 1.0, r.expert_bias, groups=(G, M))
    assert torch.equal(out.expert_ids, ids)
    groups_used = (out.expert_ids // (E // G))
    assert all(len(set(row)) <= M for row in groups_used.tolist())
    if not expert_bias:
        assert out.expert_ids[0].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(out.weights, w, atol=1e-6, rtol=1e-5)
    c = torch.randn(T, k)
    torch.testing.assert_close(grads((out.weights * c).sum(), logits)[0], grads((w * c).sum(), logits)[0],
                               atol=1e-6, rtol=1e-5)


# ---- noisy gating ------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("policy", ["jitter", "rsample"])
def test_noisy_gating_in_training_matches_slow_with_same_draws(policy, k):
    T, D, E = 10, 6, 7
    r = TopKRouter(D, E, k, noisy_gate_policy=policy, noise_eps=0.2, init_seed=4)
    x = torch.randn(T, D, requires_grad=True)
    torch.manual_seed(123)
    out = r(x)
    torch.manual_seed(123)
    if policy == "jitter":   # the router's draw: fp32 U(1-eps, 1+eps) of x's shape
        noise = torch.empty(T, D).uniform_(0.8, 1.2)
        ids, w = slow_route(logits_of(r, x * noise), k)
    else:                    # the router's draw: Gumbel from U[0,1) of the logits' shape
        u = torch.rand(T, E).clamp_min(torch.finfo(torch.float32).tiny)
        ids, w = slow_route(logits_of(r, x), k, noise_TE=-torch.log(-torch.log(u)))
    assert torch.equal(out.expert_ids, ids)
    torch.testing.assert_close(out.weights, w, atol=1e-6, rtol=1e-5)
    gx, gw = grads((out.weights ** 2).sum(), x, r.weight)
    ex, ew = grads((w ** 2).sum(), x, r.weight)
    torch.testing.assert_close(gx, ex, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw, ew, atol=1e-5, rtol=1e-4)
    # eval is deterministic and noise-free
    r.eval()
    a, b = r(x), r(x)
    clean = TopKRouter(D, E, k, init_seed=4).eval()(x)
    assert torch.equal(a.expert_ids, b.expert_ids) and torch.equal(a.weights, b.weights)
    assert torch.equal(a.expert_ids, clean.expert_ids) and torch.equal(a.weights, clean.weights)


def test_rsample_k1_samples_the_softmax():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    r = TopKRouter(2, 4, 1, noisy_gate_policy="rsample")
    out = r.route_logits(probs.log().expand(40000, 4))
    freq = torch.bincount(out.expert_ids.flatten(), minlength=4).float() / 40000
    torch.testing.assert_close(freq, probs, atol=0.012, rtol=0)   # Gumbel-max trick
    torch.testing.assert_close(out.weights[:, 0], probs[out.expert_ids[:, 0]])   # clean weights


# ---- capacity ----------------------------------------------------------------------------

# 6 tokens, 4 experts, k=2, capacity max(ceil(6*2/4*0.5), 1) = 2. Top-2 (first, second):
#   t0 (0,1)  t1 (2,3)  t2 (1,0)  t3 (0,1)  t4 (2,3)  t5 (0,3)
# softmax weights: t0 .682 .251 | t1 .610 .225 | t2 .586 .356 | t3 .920 .046 | t4 .533 .323 | t5 .427 .259
CAP_LOGITS = torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 0.0, 2.0, 1.0], [2.5, 3.0, 0.0, 0.0],
                           [4.0, 1.0, 0.0, 0.0], [0.0, 0.0, 2.0, 1.5], [1.0, 0.0, 0.0, 0.5]])
CAP_IDS = [[0, 1], [2, 3], [1, 0], [0, 1], [2, 3], [0, 3]]
# position: every first choice in token order, then the second choices.
#   e0: t0, t3 (1st) kept | t5 (1st), t2 (2nd) dropped   (token-major order would keep t2)
#   e1: t2 (1st), t0 (2nd) kept | t3 (2nd) dropped       e2: t1, t4 kept
#   e3: t1, t4 (2nd) kept | t5 (2nd) dropped             -> t5 loses both routes
CAP_DROPPED_POSITION = [[False, False], [False, False], [False, True], [False, True], [False, False], [True, True]]
# probs: the highest weights per expert.
#   e0: t3 .920, t0 .682 kept | t5 .427, t2 .356 dropped
#   e1: t2 .586, t0 .251 kept | t3 .046 dropped          e2: t1, t4 kept
#   e3: t4 .323, t5 .259 kept | t1 .225 dropped
CAP_DROPPED_PROBS = [[False, False], [False, True], [False, True], [False, True], [False, False], [True, False]]


@pytest.mark.parametrize("policy, table", [("position", CAP_DROPPED_POSITION), ("probs", CAP_DROPPED_PROBS)])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_capacity_hand_worked(policy, table, use_kernel):
    r = TopKRouter(2, 4, 2, capacity_factor=0.5, min_capacity=1, drop_policy=policy, use_kernel=use_kernel)
    logits = CAP_LOGITS.clone().requires_grad_()
    out = r.route_logits(logits)
    assert out.capacity == 2
    assert out.expert_ids.tolist() == CAP_IDS
    assert out.dropped.tolist() == table
    s = torch.softmax(CAP_LOGITS, -1).gather(1, torch.tensor(CAP_IDS))
    expect = torch.where(torch.tensor(table), torch.zeros_like(s), s)
    torch.testing.assert_close(out.weights, expect, atol=1e-6, rtol=0)
    assert out.tokens_per_expert.tolist() == [2, 2, 2, 2]
    g = grads(out.weights.sum(), logits)[0]
    assert torch.equal(g[5] == 0, torch.full((4,), policy == "position"))   # t5 fully dropped


def test_capacity_probs_ties_fall_back_to_position():
    r = TopKRouter(2, 2, 1, capacity_factor=1.0, min_capacity=0, drop_policy="probs")
    out = r.route_logits(torch.tensor([[0.0, -1.0]] * 3 + [[2.0, 0.0]]))   # t3 weighs more
    assert out.capacity == 2 and out.dropped.flatten().tolist() == [False, True, True, False]


def test_capacity_formula_and_eval_factor():
    cfg = RouterConfig(4, 4, 2, capacity_factor=0.5, min_capacity=1, eval_capacity_factor=2.0)
    assert capacity_of(cfg, 6, True) == 2 and capacity_of(cfg, 6, False) == 6
    assert capacity_of(RouterConfig(4, 4, 2, capacity_factor=1.0), 6, True) == 4          # min_capacity
    assert capacity_of(RouterConfig(4, 4, 1, capacity_factor=1.1, min_capacity=0), 10, True) == 3
    assert capacity_of(RouterConfig(4, 4, 2, capacity_factor=1.0, min_capacity=0), 6, True) == 3  # exact
    assert capacity_of(RouterConfig(4, 4, 2), 6, True) is None
    r = TopKRouter(2, 4, 2, capacity_factor=0.5, min_capacity=1, eval_capacity_factor=2.0)
    assert r.route_logits(CAP_LOGITS).dropped.any()
    r.eval()
    ev = r.route_logits(CAP_LOGITS)
    assert ev.capacity == 6 and not ev.dropped.any()
    assert TopKRouter(2, 4, 2, capacity_factor=0.5, pad_to_capacity=True).pad_to_capacity


# ---- aux and z losses ----------------------------------------------------------------------

@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_seq_aux_loss_matches_slow(score_func):
    T, E, k, L = 12, 5, 2, 4
    r = TopKRouter(3, E, k, score_func=score_func, aux_loss="seq", seq_len=L, aux_loss_coeff=0.5)
    logits = torch.randn(T, E, requires_grad=True)
    out = r.route_logits(logits)
    want = 0.5 * slow_aux(logits, out.expert_ids, k, score_func, seq_len=L)
    torch.testing.assert_close(out.aux_loss, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads(out.aux_loss, logits)[0], grads(want, logits)[0], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="not a whole number of sequences of seq_len=4"):
        r.route_logits(torch.randn(10, E))


def test_losses_off_and_counted_before_drops():
    r = TopKRouter(2, 4, 2, aux_loss=None)
    out = r.route_logits(CAP_LOGITS)
    assert out.aux_loss.item() == 0.0 and out.z_loss.item() == 0.0
    capped = TopKRouter(2, 4, 2, capacity_factor=0.5, min_capacity=1, aux_loss_coeff=1.0)
    want = slow_aux(CAP_LOGITS, torch.tensor(CAP_IDS), 2, "softmax")    # all 12 routes
    torch.testing.assert_close(capped.route_logits(CAP_LOGITS).aux_loss, want, atol=1e-6, rtol=1e-6)


def _split_losses(aux, seq, sizes, x_full, c_full):
    """Each rank routes its slice; stats over the world must give the full-batch losses."""
    rank = dist.get_rank()
    r = TopKRouter(6, 8, 2, score_func="sigmoid", aux_loss=aux, seq_len=seq and seq // 2,
                   z_loss_coeff=0.1, init_seed=7)
    if seq:   # rank r holds half of every sequence
        B = x_full.shape[0] // seq
        idx = torch.cat([torch.arange(b * seq + rank * seq // 2, b * seq + (rank + 1) * seq // 2) for b in range(B)])
    else:
        idx = torch.arange(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    x = x_full[idx].clone().requires_grad_()
    out = r(x, stats_group=dist.group.WORLD)
    loss = out.aux_loss + out.z_loss + (out.weights * c_full[idx]).sum()
    loss.backward()
    g = r.weight.grad.clone()
    dist.all_reduce(g)    # the layer's job: sum the router grad over the stats group
    return out.aux_loss.item(), out.z_loss.item(), g, idx, x.grad


@pytest.mark.parametrize("aux, seq, sizes", [("switch", None, [5, 8]), ("seq", 6, None)])
def test_losses_invariant_to_token_split_over_ranks(aux, seq, sizes):
    torch.manual_seed(1)
    T = 13 if seq is None else 18
    x, c = torch.randn(T, 6), torch.randn(T, 2)
    full = TopKRouter(6, 8, 2, score_func="sigmoid", aux_loss=aux, seq_len=seq, z_loss_coeff=0.1, init_seed=7)
    xx = x.clone().requires_grad_()
    out = full(xx)
    (out.aux_loss + out.z_loss + (out.weights * c).sum()).backward()
    results = run_ranks(_split_losses, 2, aux, seq, sizes, x, c)
    for a, z, g, idx, gx in results:
        torch.testing.assert_close(torch.tensor(a), out.aux_loss.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(z), out.z_loss.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(g, full.weight.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(gx, xx.grad[idx], atol=1e-5, rtol=1e-4)


# ---- non-finite logits, kernel selection, validation ------------------------------------------

@pytest.mark.parametrize("use_kernel", [False, True])
def test_nonfinite_raise_names_count_and_first_token(use_kernel):
    r = TopKRouter(3, 4, 2, use_kernel=use_kernel)
    logits = torch.randn(8, 4)
    logits[3, 1] = float("nan")
    logits[5, 0] = float("inf")
    with pytest.raises(ValueError, match=r"NaN or inf for 2 of 8 tokens \(first: token 3\)"):
        r.route_logits(logits)
    x = torch.randn(4, 3)
    x[2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"for 1 of 4 tokens \(first: token 2\)"):
        r(x)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_nonfinite_propagate_gives_nan_weights_not_expert0(use_kernel, capacity_factor):
    E, k = 6, 2
    r = TopKRouter(3, E, k, nonfinite="propagate", use_kernel=use_kernel, capacity_factor=capacity_factor,
                   min_capacity=0, drop_policy="position")
    logits = torch.randn(9, E)
    logits[0, 2] = float("nan")                 # first token: it must not take capacity
    logits[4, 5] = float("-inf")
    out = r.route_logits(logits)
    good = [1, 2, 3, 5, 6, 7, 8]
    alone = TopKRouter(3, E, k, capacity_factor=capacity_factor, min_capacity=0,
                       drop_policy="position").route_logits(logits[good])
    for t in (0, 4):
        assert out.expert_ids[t].tolist() == [0, 1] and bool(torch.isnan(out.weights[t]).all())
    if capacity_factor is None:    # dropless: the others are exactly as if alone
        assert torch.equal(out.expert_ids[good], alone.expert_ids)
        torch.testing.assert_close(out.weights[good], alone.weights)
    else:                          # capacity 3 (9 tokens) vs 2 alone: no good route lost
        assert not out.dropped[good][~alone.dropped].any()
    assert torch.isnan(out.aux_loss)


def test_kernel_and_reference_routers_agree(monkeypatch):
    calls = []
    real = rk.routing_full
    monkeypatch.setattr(rk, "routing_full", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kw = dict(score_func="sigmoid", expert_bias=True, capacity_factor=1.0, drop_policy="probs",
              scaling_factor=2.0, z_loss_coeff=0.01, init_seed=2, noisy_gate_policy="jitter")
    rk_, rr = TopKRouter(10, 16, 4, use_kernel=True, **kw), TopKRouter(10, 16, 4, use_kernel=None, **kw)
    for r in (rk_, rr):
        r.expert_bias.copy_(torch.linspace(-0.05, 0.05, 16))
        r.eval()    # no jitter draw: both see the same input
    x = torch.randn(50, 10)
    outs = []
    for r in (rk_, rr):
        xx = x.clone().requires_grad_()
        o = r(xx)
        (o.weights.square().sum() + o.aux_loss + o.z_loss).backward()
        outs.append((o, xx.grad, r.weight.grad))
    assert len(calls) == 1          # auto on CPU is the reference, True forces the kernel
    (a, gxa, gwa), (b, gxb, gwb) = outs
    for f in ("expert_ids", "dropped", "tokens_per_expert"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    for f in ("weights", "aux_loss", "z_loss", "scores"):
        torch.testing.assert_close(getattr(a, f), getattr(b, f), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gxa, gxb, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gwa, gwb, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(k=9), r"k=9 must be <= num_experts=8"),
    (dict(k=0), r"k=0 must be an integer >= 1"),
    (dict(num_groups=3, topk_groups=1), r"num_experts=8 is not divisible by num_groups=3"),
    (dict(num_groups=4, topk_groups=5), r"topk_groups=5 must be <= num_groups=4"),
    (dict(num_groups=4), r"needs both"),
    (dict(k=5, num_groups=4, topk_groups=2), r"k=5 must be <= topk_groups=2 x experts per group 2 = 4"),
    (dict(capacity_factor=0.0), r"capacity_factor=0.0 must be a finite number > 0"),
    (dict(capacity_factor=-1.0), r"capacity_factor=-1.0"),
    (dict(eval_capacity_factor=0), r"eval_capacity_factor=0"),
    (dict(min_capacity=-1), r"min_capacity=-1"),
    (dict(score_func="relu"), r"score_func='relu' must be one of"),
    (dict(drop_policy="random"), r"drop_policy='random'"),
    (dict(noisy_gate_policy="Jitter"), r"noisy_gate_policy='Jitter'"),
    (dict(noise_eps=1.5), r"noise_eps=1.5 must be in \(0, 1\)"),
    (dict(pad_to_capacity=True), r"pad_to_capacity=True needs a capacity_factor"),
    (dict(aux_loss="seq"), r"aux_loss='seq' needs seq_len"),
    (dict(aux_loss="gshard"), r"aux_loss='gshard'"),
    (dict(aux_loss_coeff=-0.1), r"aux_loss_coeff=-0.1"),
    (dict(z_loss_coeff=float("nan")), r"z_loss_coeff=nan"),
    (dict(scaling_factor=0), r"scaling_factor=0"),
    (dict(nonfinite="ignore"), r"nonfinite='ignore'"),
    (dict(use_kernel=True, num_groups=2, topk_groups=1), r"use_kernel=True but the routing kernel does not cover group"),
    (dict(use_kernel=True, noisy_gate_policy="rsample"), r"does not cover noisy_gate_policy='rsample'"),
    (dict(init_std=0.0), r"init_std=0.0"),
])
def test_bad_options_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TopKRouter(4, 8, **({"k": 2} | kwargs))


def test_bad_shapes_raise():
    r = TopKRouter(4, 8, 2)
    with pytest.raises(ValueError, match=r"router input must be \[T, hidden=4\], got \(3, 5\)"):
        r(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"logits must be \[T, num_experts=8\]"):
        r.route_logits(torch.zeros(3, 7))


def test_init_seed_and_std():
    a, b = TopKRouter(64, 8, init_seed=5), TopKRouter(64, 8, init_seed=5)
    assert torch.equal(a.weight, b.weight) and a.weight.dtype == torch.float32
    assert not torch.equal(a.weight, TopKRouter(64, 8, init_seed=6).weight)
    assert float(a.weight.detach().abs().max()) <= 1 / math.sqrt(64)
    n = TopKRouter(64, 8, init_seed=5, init_std=0.02)
    assert abs(float(n.weight.detach().std()) - 0.02) < 0.003


def test_routing_is_frozen():
    out = TopKRouter(2, 4, 2).route_logits(CAP_LOGITS)
    assert isinstance(out, Routing)
    with pytest.raises(AttributeError):
        out.capacity = 3


def test_torch_compile_matches_eager():
    kw = dict(score_func="softmax", capacity_factor=1.0, drop_policy="probs", z_loss_coeff=0.01,
              expert_bias=True, init_seed=9, use_kernel=False)
    eager, comp = TopKRouter(8, 6, 2, **kw), TopKRouter(8, 6, 2, **kw)
    compiled = torch.compile(comp, backend="aot_eager")
    x = torch.randn(20, 8)
    res = []
    for r, fn in ((eager, eager), (comp, compiled)):
        xx = x.clone().requires_grad_()
        o = fn(xx)
        (o.weights.square().sum() + o.aux_loss + o.z_loss).backward()
        res.append((o.expert_ids, o.weights.detach(), o.dropped, o.aux_loss.detach(), xx.grad, r.weight.grad,
                    r.load_accum.clone()))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

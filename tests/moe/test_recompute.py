"""Activation recompute around an MoE layer: counted once, routed as the forward was, the
aux and z losses' gradients intact (torchtitan #1593: the aux loss counted twice under
recompute; here, before the fix: ``load_accum`` doubled under either checkpoint flavour and, under
the reentrant one, no aux-loss gradient reached the router).

Checked: counting in the recompute as in a forward (the old behaviour) fails the counters
and micro-batch tests for both flavours (load_accum 2x); routing afresh in the recompute
fails the jitter and micro-batch tests for both flavours and, under the reentrant flavour,
the router gradient (no aux-loss gradient reaches it).
"""
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import moepar
from moepar.moe.routing import recompute
from moepar.parallel.groups import ParallelState

from ..helpers.multiproc import run_ranks

D, T = 8, 12
FLAVOURS = ["none", "non_reentrant", "reentrant", "recompute_experts"]


class Block(nn.Module):
    def __init__(self, flavour, state=None, **kw):
        super().__init__()
        state = state or ParallelState.single()
        self.flavour = flavour
        self.proj = nn.Linear(D, D)
        torch.nn.init.normal_(self.proj.weight, std=0.3, generator=torch.Generator().manual_seed(3))
        self.moe = moepar.MoE(D, 4, state.ep_size, state=state, ffn_hidden=8, k=2, init_seed=5,
                              recompute_experts=kw.pop("recompute_experts", flavour == "recompute_experts"), **kw)

    def _inner(self, x):
        return x + self.moe(torch.tanh(self.proj(x)))

    def forward(self, x, preserve_rng_state=True):
        if self.flavour in ("non_reentrant", "reentrant"):
            return checkpoint(self._inner, x, use_reentrant=self.flavour == "reentrant",
                              preserve_rng_state=preserve_rng_state)
        return self._inner(x)


def _data(step):
    gen = torch.Generator().manual_seed(40 + step)
    return torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)


def _train(flavour, steps=3, state=None, **kw):
    torch.manual_seed(0)
    block = Block(flavour, state, **kw)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    out = {"aux": [], "router_grad": [], "load": [], "stats": []}
    for step in range(steps):
        x, g = _data(step + (0 if state is None else 10 * state.rank))
        x.requires_grad_()
        y = block(x)
        aux = moepar.aux_loss(block)
        ((y * g).sum() + aux).backward()
        out["aux"].append(float(aux.detach()))
        out["router_grad"].append(block.moe.router.weight.grad.clone())
        out["load"].append(block.moe.router.load_accum.clone())
        out["stats"].append(block.moe.stats.tokens_per_expert.clone())
        del y
        assert len(block.moe._replay) == 0, "a record outlived its graph"
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("flavour", FLAVOURS[1:])
def test_counters_and_gradients_equal_the_run_without_recompute(flavour):
    kw = dict(expert_bias=True, z_loss_coeff=1e-2, capacity_factor=1.0, min_capacity=1)
    want, got = _train("none", **kw), _train(flavour, **kw)
    for step in range(3):
        assert torch.equal(got["load"][step], want["load"][step]), (step, got["load"][step], want["load"][step])
        assert torch.equal(got["stats"][step], want["stats"][step])
        assert abs(got["aux"][step] - want["aux"][step]) <= 1e-6
        torch.testing.assert_close(got["router_grad"][step], want["router_grad"][step], atol=1e-6, rtol=0)


def _ids_per_call(block):
    """Every router call's expert ids, in call order."""
    calls = []
    forward = block.moe.router.forward

    def spy(*a, **k):
        r = forward(*a, **k)
        calls.append(r.expert_ids.clone())
        return r
    block.moe.router.forward = spy
    return calls


@pytest.mark.parametrize("flavour", ["non_reentrant", "reentrant"])
def test_noisy_gate_recompute_routes_as_the_forward(flavour):
    """Jitter on, the checkpoint told not to preserve the RNG, random numbers drawn between
    the forward and the backward: the recompute still routes every token as the forward did
    and the gradients equal the run without recompute."""
    kw = dict(noisy_gate_policy="jitter", noise_eps=0.5)
    grads = {}
    for name in ("none", flavour):
        torch.manual_seed(1)
        block = Block(name, **kw)
        calls = _ids_per_call(block)
        x, g = _data(0)
        x.requires_grad_()
        y = block(x, preserve_rng_state=False)
        torch.rand(1000)   # the generator moves on before the recompute
        ((y * g).sum() + moepar.aux_loss(block)).backward()
        if name != "none":
            assert len(calls) == 2 and torch.equal(calls[0], calls[1])
        grads[name] = [p.grad.clone() for p in block.parameters()]
    for a, b in zip(grads["none"], grads[flavour]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("flavour", ["non_reentrant", "reentrant"])
def test_micro_batches_replay_in_order(flavour):
    """Two micro-batches forward, then both backward in the same order (1F1B's order): each
    recompute takes its own forward's routing."""
    kw = dict(noisy_gate_policy="jitter", noise_eps=0.5, expert_bias=True)
    result = {}
    for name in ("none", flavour):
        torch.manual_seed(2)
        block = Block(name, **kw)
        losses = []
        for mb in range(2):
            x, g = _data(mb)
            x.requires_grad_()
            losses.append((block(x, preserve_rng_state=False) * g).sum() + moepar.aux_loss(block))
        for loss in losses:
            loss.backward()
        result[name] = ([p.grad.clone() for p in block.parameters()], block.moe.router.load_accum.clone())
    assert torch.equal(result["none"][1], result[flavour][1])
    for a, b in zip(result["none"][0], result[flavour][0]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_nothing_is_kept_past_its_use():
    block = Block("none", expert_bias=True)
    y = block(torch.randn(T, D))
    assert len(block.moe._replay) == 0          # a forward nothing can recompute keeps nothing
    with torch.no_grad():                       # nor does a training-mode forward under no_grad
        block(torch.randn(T, D))
    assert len(block.moe._replay) == 0 and block.moe._loss_cell is None
    block = Block("non_reentrant", expert_bias=True)
    y = block(torch.randn(T, D, requires_grad=True))
    assert len(block.moe._replay) == 1          # held by the graph until the backward ...
    del y
    assert len(block.moe._replay) == 0          # ... or until the graph is freed
    block = Block("reentrant", expert_bias=True)
    y = block(torch.randn(T, D, requires_grad=True))
    node = y.grad_fn                            # the reentrant checkpoint's Function node
    assert recompute.scoped(node) == 1 and len(block.moe._replay) == 1
    del y, node
    gc.collect()
    assert len(block.moe._replay) == 0          # the record went with the node


def test_is_recompute_only_inside_a_backward():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(recompute.in_recompute())
            return g
    assert not recompute.in_recompute()
    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [True]


def _at_ep2(kw):
    state = moepar.init_parallel(1, 2, verbose=False)
    return {flavour: _train(flavour, state=state, **kw) for flavour in FLAVOURS}


def test_recompute_at_ep2_reruns_the_exchange_and_counts_once():
    """Two EP ranks: the recompute's counts exchange and all-to-alls run inside the backward
    on both ranks (no hang), and every rank's counters and router gradient equal its run
    without recompute."""
    kw = dict(expert_bias=True, z_loss_coeff=1e-2, noisy_gate_policy="jitter")
    for runs in run_ranks(_at_ep2, 2, kw):
        want = runs["none"]
        for flavour in FLAVOURS[1:]:
            for step in range(3):
                assert torch.equal(runs[flavour]["load"][step], want["load"][step]), flavour
                torch.testing.assert_close(runs[flavour]["router_grad"][step], want["router_grad"][step],
                                           atol=1e-6, rtol=0)


def _live_activations(F_):
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dim() == 2 and o.shape[1] == F_]


@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
def test_recomputation_drops_the_experts_activations(activation):
    """The experts' [N, F] activations reach saved-tensor hooks, so that activation
    recomputation drops them: with recompute_experts=True the forward's graph holds none
    (before, the experts kept them on their node, beside the hooks: the recompute saved no
    memory), and the hooks see them under a checkpoint of the caller's."""
    F_ = 24
    x = torch.randn(T, D, requires_grad=True)
    moe = moepar.MoE(D, 4, 1, ffn_hidden=F_, k=2, init_seed=5, activation=activation, recompute_experts=True)
    y = moe(x)
    assert _live_activations(F_) == []
    y.sum().backward()
    shapes = []
    moe = moepar.MoE(D, 4, 1, ffn_hidden=F_, k=2, init_seed=5, activation=activation)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        y = moe(x)
    assert any(len(s) == 2 and s[1] == F_ for s in shapes)   # [rows, F] pre-activations
    del y

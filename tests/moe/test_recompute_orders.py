"""Routing replay in every order users run a checkpointed MoE block: each recompute routes as
its own forward did (moepar.moe.routing.recompute), whatever ran before it, in whichever order the
backwards come, nested or not.

Before records were tied to their forward (the recompute took the oldest record of its token
count), the block ``x + MoE(tanh(Linear(x)))`` (T 12, D 8, E 4, k 2) under either checkpoint
flavour got gradients off by up to 1.12 with a no_grad forward first and 0.57-0.74 with two
forwards and one backward, with no error; the orders below each failed then.
"""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import moepar
from moepar.moe.routing import recompute

from .test_recompute import Block, D, T, _data

FLAVOURS = ["non_reentrant", "reentrant"]
NOISY = dict(noisy_gate_policy="jitter", noise_eps=0.5)


def _spy(block):
    """Every router call: (input, ids it routed with, the replayed ids or None, in a recompute)."""
    calls, forward = [], block.moe.router.forward

    def spy(x_TD, **kw):
        r = forward(x_TD, **kw)
        replay = kw.get("replay")
        calls.append((x_TD.detach().clone(), r.expert_ids.clone(),
                      None if replay is None else replay.ids_TK.clone(), recompute.in_recompute()))
        return r
    block.moe.router.forward = spy
    return calls


def _check_replays(calls):
    """Every recompute replayed the ids of the forward whose input it recomputes."""
    forwards = [(x, ids) for x, ids, _, rec in calls if not rec]
    recomputes = [(x, replay) for x, _, replay, rec in calls if rec]
    assert recomputes
    for x, replay in recomputes:
        assert replay is not None, "a recompute routed afresh"
        own = [ids for fx, ids in forwards if fx.shape == x.shape and torch.equal(fx, x)]
        assert own and torch.equal(replay, own[-1]), "a recompute replayed another forward's routing"


def _run(flavour, order, **kw):
    """Parameters' gradients and every router call, for one order of forwards and backwards."""
    torch.manual_seed(3)
    block = Block(flavour, **kw)
    calls = _spy(block)
    xs = [_data(i) for i in range(3)]

    def loss(i):
        x, g = xs[i]
        x = x.clone().requires_grad_()
        return (block(x, preserve_rng_state=False) * g).sum() + moepar.aux_loss(block)

    if order == "no_grad_first":          # validation without eval(), a rollout, reference log-probs
        with torch.no_grad():
            block(xs[2][0])
        loss(0).backward()
    elif order == "two_forwards_one_backward":   # DPO's chosen and rejected; summed micro-batches
        (loss(0) + loss(1)).backward()
    elif order == "backwards_reversed":
        a, b = loss(0), loss(1)
        torch.rand(100)                    # the generator moves on between forward and backward
        b.backward()
        a.backward()
    elif order == "interleaved":           # forward, forward, backward, forward, backward, backward
        a, b = loss(0), loss(1)
        b.backward()
        c = loss(2)
        a.backward()
        c.backward()
    grads = [p.grad.clone() for p in block.parameters()]
    return grads, calls


ORDERS = ["no_grad_first", "two_forwards_one_backward", "backwards_reversed", "interleaved"]


@pytest.mark.parametrize("noisy", [False, True], ids=["deterministic", "jitter"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_order_replays_its_own_forward(flavour, order, noisy):
    kw = dict(NOISY if noisy else {}, z_loss_coeff=1e-2)
    want, _ = _run("none", order, **kw)
    got, calls = _run(flavour, order, **kw)
    _check_replays(calls)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


class Nested(nn.Module):
    """``outer(x) = x + inner(proj(x))``, ``inner`` the checkpointed MoE block: a checkpoint
    inside a checkpoint, each of either flavour."""

    def __init__(self, outer: str, inner: str, **kw):
        super().__init__()
        self.outer = outer
        self.proj = nn.Linear(D, D)
        self.block = Block(inner, **kw)
        self.moe = self.block.moe

    def _outer(self, x):
        return x + self.block(torch.tanh(self.proj(x)), preserve_rng_state=False)

    def forward(self, x, preserve_rng_state=True):
        if self.outer == "none":
            return self._outer(x)
        return checkpoint(self._outer, x, use_reentrant=self.outer == "reentrant",
                          preserve_rng_state=preserve_rng_state)


@pytest.mark.parametrize("inner", FLAVOURS)
@pytest.mark.parametrize("outer", FLAVOURS)
def test_nested_checkpoints_replay_their_forward(outer, inner):
    grads = {}
    for name in ("reference", "nested"):
        torch.manual_seed(4)
        model = Nested("none", "none", **NOISY) if name == "reference" else Nested(outer, inner, **NOISY)
        calls = _spy(model)
        losses = []
        for i in range(2):
            x, g = _data(i)
            x.requires_grad_()
            losses.append((model(x, preserve_rng_state=False) * g).sum() + moepar.aux_loss(model))
        losses[1].backward()
        losses[0].backward()
        if name == "nested":
            _check_replays(calls)
        grads[name] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["reference"], grads["nested"]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_retained_graph_replays_in_each_backward(flavour):
    """backward(retain_graph=True) twice (the experts recompute their activations, which their
    backward frees otherwise): both recomputes replay the forward's routing, and the second
    backward adds the same gradients again."""
    torch.manual_seed(5)
    block = Block(flavour, recompute_experts=True, **NOISY)
    calls = _spy(block)
    x, g = _data(0)
    x.requires_grad_()
    loss = (block(x, preserve_rng_state=False) * g).sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in block.parameters()]
    loss.backward()
    assert sum(rec for *_, rec in calls) == 2
    _check_replays(calls)
    for a, b in zip(first, block.parameters()):
        torch.testing.assert_close(b.grad, 2 * a, atol=1e-6, rtol=0)


def test_second_backward_through_freed_experts_is_an_error():
    """Without recompute_experts the experts' backward frees its activations: a second
    backward through a retained graph raises, naming the fix, instead of returning the
    uninitialised gradient buffers it used to (values up to 1e33)."""
    block = Block("none")
    x, g = _data(0)
    loss = (block(x.requires_grad_()) * g).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recompute_experts=True"):
        loss.backward()

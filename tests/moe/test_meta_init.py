"""``moepar.MoE`` built on the meta device: no ``init_seed`` needed, and after ``to_empty``
its ``reset_parameters()`` (or every submodule's) gives exactly the tensors of a layer built
on the CPU from the same RNG state: the router's ``expert_bias`` zeros, the shared experts'
weights drawn too. The same on 2 gloo ranks (ep2, tp2) and after ``moepar.fully_shard``."""
import pytest
import torch
from torch import nn

import moepar
from moepar.parallel.fsdp import copy_local
from moepar.parallel.groups import ParallelState

from ..helpers.multiproc import run_ranks

OPTS = dict(k=2, ffn_hidden=24, activation="swiglu", num_shared_experts=1, shared_ffn_hidden=20,
            shared_expert_gate=True, expert_bias=True, router_bias=True, bias=True)


def _build(state, meta: bool, seed: int = 3, **opts):
    torch.manual_seed(seed)   # the layer draws its init_seed from the default RNG
    if not meta:
        return moepar.MoE(16, 4, state.ep_size, state=state, **{**OPTS, **opts})
    with torch.device("meta"):
        moe = moepar.MoE(16, 4, state.ep_size, state=state, **{**OPTS, **opts})
    assert all(t.is_meta for t in moe.state_dict().values())
    return moe


def _garbage(module):
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            t.fill_(123.0)   # what to_empty may leave behind


def _worst(a: nn.Module, b: nn.Module) -> float:
    sa, sb = dict(a.named_buffers()), dict(b.named_buffers())   # load_accum is not persistent
    sa.update(a.state_dict())
    sb.update(b.state_dict())
    assert sorted(sa) == sorted(sb)
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


def _meta_vs_cpu(state, per_module: bool, **opts) -> float:
    ref = _build(state, meta=False, **opts)
    moe = _build(state, meta=True, **opts).to_empty(device="cpu")
    _garbage(moe)
    if per_module:   # torchtitan's way: every module that has one
        for m in moe.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    else:
        moe.reset_parameters()
    return _worst(moe, ref)


@pytest.mark.parametrize("per_module", [False, True])
@pytest.mark.parametrize("opts", [{}, dict(activation="gelu", bias=False, init_std=0.02, init_seed=5)])
def test_meta_build_then_reset_equals_cpu_build(per_module, opts):
    assert _meta_vs_cpu(ParallelState.single(), per_module, **opts) == 0.0


def test_meta_built_layer_trains():
    moe = _build(ParallelState.single(), meta=True, aux_loss="switch").to_empty(device="cpu")
    moe.reset_parameters()
    x = torch.randn(2, 5, 16, requires_grad=True)
    (moe(x).square().sum() + moepar.aux_loss(moe)).backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in moe.parameters())


def _layout_case(tp, ep):
    state = moepar.init_parallel(tp, ep, verbose=False)
    return _meta_vs_cpu(state, False), _meta_vs_cpu(state, True)


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1)])
def test_meta_build_then_reset_on_2_ranks(tp, ep):
    for worst in run_ranks(_layout_case, 2, tp, ep):
        assert worst == (0.0, 0.0)


class _Stack(nn.Module):
    def __init__(self, state):
        super().__init__()
        self.layers = nn.ModuleList([moepar.MoE(16, 4, state.ep_size, state=state, init_seed=11, **OPTS)])
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.layers[0](x))


def _fsdp_case(ep):
    state = moepar.init_parallel(1, ep, verbose=False)
    ref = _Stack(state)
    with torch.device("meta"):
        model = _Stack(state)
    moepar.fully_shard(model, state)
    model.to_empty(device="cpu")
    _garbage(model)
    for m in model.modules():
        if hasattr(m, "reset_parameters") and not isinstance(m, nn.Linear):
            m.reset_parameters()
    for p, q in zip(model.head.parameters(), ref.head.parameters()):   # not the MoE's: plain torch
        copy_local(p, q)
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        worst = max(worst, float((p.full_tensor() - q).abs().max()))
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        worst = max(worst, float((b.double() - c.double()).abs().max()))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(state.dp_rank))
    model(x).square().sum().backward()
    finite = all(torch.isfinite(p.grad.full_tensor()).all() for p in model.parameters() if p.grad is not None)
    return worst, bool(finite)


@pytest.mark.parametrize("ep", [1, 2])
def test_meta_build_fully_shard_then_reset(ep):
    for worst, finite in run_ranks(_fsdp_case, 2, ep):
        assert worst == 0.0 and finite

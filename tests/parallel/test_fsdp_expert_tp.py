"""moepar.fully_shard with expert tensor parallelism (etp 2), exact against one process.

Megatron-Bridge #1363 and DeepSpeed #5794 are expert-TP / ZeRO hangs; moepar had its own:
at tp1 · ep2 · etp2 with ``bias=True`` the output bias b2 was added on expert-TP
rank 0 only, so it had a gradient there and none on rank 1, FSDP2 leaves a parameter
without a gradient out of its reduce-scatter, and the two ranks entered reduce-scatters of
different sizes: the first ``backward`` never returned. Checked: with the old
``if etp_rank == 0: add b2`` restored in ``MoE._run_experts`` the bias cases here fail with
``run_ranks``' hang timeout; with the fix all cases are exact.

Each case trains a two-layer stack of MoE blocks for 4 AdamW steps on 4 gloo ranks and
compares every parameter with the same stack trained in one process on the same replicas'
batches (the objective: the mean of the replicas' losses).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import moepar
from moepar.parallel.groups import ParallelState

from ..helpers.moe_ref import local_slice
from ..helpers.multiproc import run_ranks

STEPS, TOKENS, D, LR = 4, 8, 8, 1e-2

CASES = {
    "plain": {},
    "bias": dict(bias=True),
    "bias_shared": dict(bias=True, num_shared_experts=1),
    "swiglu_bias_shared_gate": dict(activation="swiglu", bias=True, num_shared_experts=1, shared_expert_gate=True),
    "dedup_bias": dict(bias=True, dedup="on"),
    "padded_bias": dict(bias=True, capacity_factor=1.0, min_capacity=1, pad_to_capacity=True),
}


class Stack(nn.Module):
    """Two residual MoE blocks: the ModuleList makes each block an FSDP unit."""

    def __init__(self, state: ParallelState, **kw):
        super().__init__()
        self.blocks = nn.ModuleList(
            moepar.MoE(D, 4, state.ep_size, expert_tensor_parallel_size=state.etp_size, state=state,
                       ffn_hidden=8, k=2, init_seed=31 + i, **kw) for i in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _replica(d):
    gen = torch.Generator().manual_seed(500 + d)
    return torch.randn(TOKENS, D, generator=gen), torch.randn(TOKENS, D, generator=gen)


def _loss(model, x, g):
    return (model(x) * g).sum() / TOKENS + moepar.aux_loss(model)


def _reference(kw, dp):
    """One process: each step the mean over the dp replicas of each replica's loss."""
    model = Stack(ParallelState.single(), **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        total = 0.0
        for d in range(dp):
            x, g = _replica(100 * step + d)
            total = total + _loss(model, x, g) / dp
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded(tp, ep, etp, cases, refs):
    state = moepar.init_parallel(tp, ep, etp, verbose=False)
    out = {}
    for name in cases:
        model = moepar.fully_shard(Stack(state, **CASES[name]), state)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(STEPS):
            x, g = _replica(100 * step + state.dp_rank)
            _loss(model, x, g).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        worst = 0.0
        for pname, p in model.named_parameters():
            mine = p.full_tensor()   # this rank's TP/EP/ETP slice, gathered over its FSDP group
            worst = max(worst, float((mine - local_slice(refs[name][pname], p, state)).abs().max()))
        out[name] = worst
        dist.barrier()
    return out


@pytest.mark.parametrize("tp,ep,etp", [(1, 2, 2), (2, 2, 2)])
def test_fully_shard_at_expert_tp2_matches_one_process(tp, ep, etp):
    dp = 4 // tp
    names = list(CASES) if tp == 1 else ["bias_shared", "padded_bias"]
    refs = {name: _reference(CASES[name], dp) for name in names}
    for rank, worst in enumerate(run_ranks(_sharded, 4, tp, ep, etp, names, refs, timeout=240)):
        bad = {n: w for n, w in worst.items() if not w <= 1e-5}
        assert not bad, (rank, bad)

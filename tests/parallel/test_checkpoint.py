"""Checkpoints saved under one layout load under others with identical outputs."""
import os

import torch
from torch import nn

import moepar
from moepar import checkpoint
from moepar.moe.layer import MoE
from moepar.parallel import ColumnParallelLinear, allreduce_gradients, init_parallel
from moepar.parallel.groups import ParallelState

from ..helpers import moe_ref
from ..helpers.multiproc import run_ranks

D = 8


class _Net(nn.Module):
    """Dense TP-sliced params, a replicated router, experts and shared experts."""

    def __init__(self, state, seed):
        super().__init__()
        self.inp = ColumnParallelLinear(D, D, gather_output=True, init_seed=seed, state=state)
        self.moe = MoE(D, 4, state.ep_size, k=2, ffn_hidden=12, num_shared_experts=1,
                       expert_tensor_parallel_size=state.etp_size, state=state, init_seed=seed + 1)

    def forward(self, x):
        return self.moe(self.inp(x))


def _inputs(d):
    return moe_ref.replica_input(d, 5)[0]


def _save(path, layout):
    state = init_parallel(*layout, verbose=False)
    net = _Net(state, seed=10)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(_inputs(state.dp_rank)).sum().backward()
    allreduce_gradients(net, state)  # replicas must stay identical, as in training
    opt.step()
    checkpoint.save(path, net, opt, extra={"step": 1})
    with torch.no_grad():
        return state.dp_rank, net(_inputs(state.dp_rank))


def _load(path, layout):
    state = init_parallel(*layout, verbose=False)
    net = _Net(state, seed=99)  # different init: everything must come from the file
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    extra = checkpoint.load(path, net, opt, extra_keys=("step",))
    with torch.no_grad():
        y = net(_inputs(state.dp_rank))
    exp_avg_ok = all(opt.state[p]["exp_avg"].abs().sum() > 0 for p in net.parameters() if p.requires_grad
                     and opt.state[p]["exp_avg"].numel())
    return state.dp_rank, y, extra["step"], exp_avg_ok


def _assert_loads_elsewhere(path, saved, loads):
    """Each (loader, layout) of ``loads`` and a single process (no torch.distributed) read the
    checkpoint at ``path`` back: every replica's output equals ``saved`` up to fp32 summation
    order (expert-TP sums partial products), the step count and Adam's exp_avg survive."""
    for load, layout in loads:
        for d, y, step, exp_avg_ok in run_ranks(load, 4, path, layout):
            assert torch.allclose(y, saved[d], atol=1e-6, rtol=0), (layout, d, (y - saved[d]).abs().max())
            assert step == 1 and exp_avg_ok
    net = _Net(ParallelState.single(), seed=5)
    checkpoint.load(path, net)
    with torch.no_grad():
        for d in range(4):
            assert torch.allclose(net(_inputs(d)), saved[d], atol=1e-6, rtol=0)


def test_save_at_one_layout_load_at_two_others_and_single_process(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = {d: y for d, y in run_ranks(_save, 4, path, (1, 4, 1))}
    assert os.path.exists(os.path.join(path, ".metadata"))
    _assert_loads_elsewhere(path, saved, [(_load, (2, 2, 2)), (_load, (2, 1, 1))])


def _save_fsdp(path, layout):
    state = init_parallel(*layout, verbose=False)
    net = moepar.fully_shard(_Net(state, seed=10), state)
    kinds = sorted({p.moepar_fsdp_kind for p in net.parameters()})
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(_inputs(state.dp_rank)).sum().backward()  # FSDP reduces the gradients
    opt.step()
    with torch.no_grad():
        y = net(_inputs(state.dp_rank))
    checkpoint.save(path, net, opt, extra={"step": 1})  # after a forward: the root's params gathered
    return state.dp_rank, y, kinds


def _load_fsdp(path, layout):
    state = init_parallel(*layout, verbose=False)
    net = moepar.fully_shard(_Net(state, seed=99), state)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    extra = checkpoint.load(path, net, opt, extra_keys=("step",))
    exp_avg_ok = all(float(opt.state[p]["exp_avg"].full_tensor().abs().sum()) > 0 for p in net.parameters())
    with torch.no_grad():
        y = net(_inputs(state.dp_rank))
    return state.dp_rank, y, extra["step"], exp_avg_ok


def test_fully_sharded_checkpoint_loads_sharded_unsharded_and_single_process(tmp_path):
    path = str(tmp_path / "fsdp")
    runs = run_ranks(_save_fsdp, 4, path, (1, 2, 1))  # dp 4, edp 2
    saved = {d: y for d, y, _ in runs}
    assert runs[0][2] == ["dense", "expert"]
    # Sharded at tp2 ep2 etp2 (TP-sliced dense, ETP-sliced experts), unsharded at tp2 ep1.
    _assert_loads_elsewhere(path, saved, [(_load_fsdp, (2, 2, 2)), (_load, (2, 1, 1))])


def test_atomic_checkpoint_directories(tmp_path):
    net = _Net(ParallelState.single(), seed=3)
    root = str(tmp_path / "run")
    assert checkpoint.latest_checkpoint(root) is None
    checkpoint.save_checkpoint(root, 5, net)
    checkpoint.save_checkpoint(root, 10, net)
    os.makedirs(os.path.join(root, ".tmp_step_15"))  # a save killed midway
    os.makedirs(os.path.join(root, "step_20"))       # a directory without metadata
    assert checkpoint.latest_checkpoint(root).endswith("step_10")

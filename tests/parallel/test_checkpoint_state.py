"""Checkpointed optimizer state has the right values, saved from tp > 1 and etp > 1.

The reference is one process training the same network on the whole global batch (the
mean of the replicas' losses) with the same AdamW: its ``exp_avg`` / ``exp_avg_sq`` /
``step`` and weights are the truth that every rank's slice must equal, before saving, after
loading into another layout, and after loading into a single process. The network has
TP-sliced dense weights with bias, expert weights with bias (b2 replicated over expert-TP),
shared experts, and a nonzero ``expert_bias`` moved by ``update_expert_bias``. After the
load, one more training step must equal the reference's third step (the state is used,
not only stored).
"""
import torch
from torch import nn

from moepar import checkpoint
from moepar.moe.layer import MoE
from moepar.parallel import ColumnParallelLinear, allreduce_gradients, init_parallel
from moepar.parallel.groups import ParallelState, reset_parallel_state

from ..helpers import moe_ref
from ..helpers.multiproc import run_ranks
from ..helpers.tolerances import error_ratio

D, TOKENS, LR = 8, 5, 1e-2


class _Net(nn.Module):
    def __init__(self, state, seed):
        super().__init__()
        self.inp = ColumnParallelLinear(D, D, bias=True, gather_output=True, init_seed=seed, state=state)
        self.moe = MoE(D, 4, state.ep_size, k=2, ffn_hidden=12, bias=True, expert_bias=True, num_shared_experts=1,
                       aux_loss=None, expert_tensor_parallel_size=state.etp_size, state=state, init_seed=seed + 1)
        with torch.no_grad():
            self.moe.router.expert_bias.copy_(torch.tensor(moe_ref.EXPERT_BIAS[:4]))

    def forward(self, x):
        return self.moe(self.inp(x))


def _batch(step, d):
    return moe_ref.replica_input(100 * step + d, TOKENS)


def _train_step(net, opt, step, state, dp_size):
    """One AdamW step on the global batch of ``step``: this rank's replica (distributed) or
    every replica in turn (``state`` None: the single-process reference)."""
    opt.zero_grad()
    if state is None:
        for d in range(dp_size):
            x, g = _batch(step, d)
            ((net(x) * g).sum() / dp_size).backward()
    else:
        x, g = _batch(step, state.dp_rank)
        (net(x) * g).sum().backward()
        allreduce_gradients(net, state, op="mean")
    opt.step()
    if step == 0:
        net.moe.update_expert_bias(0.05)


def _reference(dp_size, steps):
    torch.manual_seed(0)
    net = _Net(ParallelState.single(), seed=10)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    for step in range(steps):
        _train_step(net, opt, step, None, dp_size)
    return net, opt


def _compare(net, opt, ref_net, ref_opt, state):
    """Worst error ratio of this rank's weights, exp_avg, exp_avg_sq (against its slice of the
    reference's) and whether every ``step`` and the expert bias match."""
    ref_params = dict(ref_net.named_parameters())
    worst = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    steps_ok = True
    for name, p in net.named_parameters():
        rp = ref_params[name]
        pairs = [("param", p.detach(), rp.detach())] + [
            (key, opt.state[p][key], ref_opt.state[rp][key]) for key in ("exp_avg", "exp_avg_sq")]
        for key, mine, ref in pairs:
            worst[key] = max(worst[key], error_ratio(mine, moe_ref.local_slice(ref, p, state), torch.float32))
        steps_ok &= float(opt.state[p]["step"]) == float(ref_opt.state[rp]["step"])
    bias_err = float((net.moe.router.expert_bias - ref_net.moe.router.expert_bias).abs().max())
    return worst, steps_ok, bias_err


def _save(path, layout):
    state = init_parallel(*layout, verbose=False)
    net = _Net(state, seed=10)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    for step in range(2):
        _train_step(net, opt, step, state, state.dp_size)
    checkpoint.save(path, net, opt, extra={"step": 2})
    ref_net, ref_opt = _reference(state.dp_size, 2)
    return _compare(net, opt, ref_net, ref_opt, state)


def _load(path, layout, saved_dp):
    state = init_parallel(*layout, verbose=False)
    net = _Net(state, seed=99)   # another init and bias: everything must come from the file
    with torch.no_grad():
        net.moe.router.expert_bias.zero_()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    checkpoint.load(path, net, opt, extra_keys=("step",))
    ref_net, ref_opt = _reference(saved_dp, 2)
    loaded = _compare(net, opt, ref_net, ref_opt, state)
    # The third step, on the saving run's global batch: the same replicas where the dp
    # sizes match, every replica in turn in a single process.
    if state.dp_size == saved_dp or state.world_size == 1:
        _train_step(net, opt, 2, state if state.world_size > 1 else None, saved_dp)
        _train_step(ref_net, ref_opt, 2, None, saved_dp)
        return loaded, _compare(net, opt, ref_net, ref_opt, state)
    return loaded, None


def _assert_matches(result, what):
    worst, steps_ok, bias_err = result
    assert all(v <= 1 for v in worst.values()) and steps_ok and bias_err <= 1e-7, (what, worst, steps_ok, bias_err)


def test_adam_state_values_saved_at_tp2_etp2_and_loaded_elsewhere(tmp_path):
    path = str(tmp_path / "ckpt")
    for rank, result in enumerate(run_ranks(_save, 4, path, (2, 2, 2))):   # dp=2
        _assert_matches(result, f"saving rank {rank}")
    # (1, 2, 2): dp=4 (no third step: other replicas); (2, 1, 1): dp=2, then a third step.
    for layout in [(1, 2, 2), (2, 1, 1)]:
        for rank, (loaded, after) in enumerate(run_ranks(_load, 4, path, layout, 2)):
            _assert_matches(loaded, f"loaded at {layout}, rank {rank}")
            if layout[0] == 2:
                _assert_matches(after, f"step after loading at {layout}, rank {rank}")
    # One process reads the whole state.
    try:
        loaded, after = _load(path, (1, 1, 1), 2)
    finally:
        reset_parallel_state()
    _assert_matches(loaded, "single process")
    _assert_matches(after, "step after loading in a single process")


def test_adam_state_values_saved_at_tp2_ep1(tmp_path):
    # Dense TP slices, every expert whole on every rank (ep=1), loaded at ep=4.
    path = str(tmp_path / "ckpt")
    for rank, result in enumerate(run_ranks(_save, 4, path, (2, 1, 1))):
        _assert_matches(result, f"saving rank {rank}")
    for rank, (loaded, after) in enumerate(run_ranks(_load, 4, path, (1, 4, 1), 2)):
        _assert_matches(loaded, f"loaded at (1, 4, 1), rank {rank}")

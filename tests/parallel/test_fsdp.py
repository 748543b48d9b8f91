"""moepar.fully_shard (FSDP2 with expert parallelism) trains exactly like one process.

SGD, so that a wrong gradient scale (pytorch #160285: doubled at EP=2) shows in the
parameters; losses and every parameter are compared with the single-process run.
"""
import pytest
import torch
import torch.distributed as dist

import moepar
from examples.gpt_moe import GPT, GPTConfig
from moepar.parallel import grad_norm
from moepar.parallel.groups import ParallelState

from ..helpers.multiproc import run_ranks

STEPS, BATCH, LR = 4, 4, 0.5


def _cfg(sp=False):
    return GPTConfig(vocab_size=32, context=8, layers=2, hidden=16, heads=2, experts=4, topk=2, moe_every=1,
                     expert_ffn=16, dense_ffn=16, sequence_parallel=sp, init_seed=7)


def _batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 32, (BATCH, 8), generator=gen)
    return x, torch.roll(x, -1, dims=1)


def _local_slice(name, full, p, state):
    """The slice of the single-process parameter ``full`` that this rank's ``p`` holds."""
    t = full
    if getattr(p, "moepar_expert", False):
        n = t.shape[0] // state.ep_size
        t = t[state.ep_rank * n:(state.ep_rank + 1) * n]
    elif getattr(p, "tensor_model_parallel", False):
        n = t.shape[p.partition_dim] // state.tp_size
        t = t.narrow(p.partition_dim, state.tp_rank * n, n)
    return t


def _train(model, state, fsdp):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        n = BATCH // state.dp_size
        x, y = x[state.dp_rank * n:(state.dp_rank + 1) * n], y[state.dp_rank * n:(state.dp_rank + 1) * n]
        loss = model(x, y) + moepar.aux_loss(model)
        loss.backward()
        if not fsdp:
            moepar.allreduce_gradients(model, state)
        norms.append(float(grad_norm(model, state)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        v = loss.detach().reshape(1).clone()
        if state.dp_size > 1:
            dist.all_reduce(v, group=state.dp_group)
        losses.append(float(v) / state.dp_size)
    return losses, norms


def _reference(sp):
    state = ParallelState.single()
    model = GPT(_cfg(sp), state)
    losses, norms = _train(model, state, fsdp=False)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded_run(tp, ep, sp, ref_params):
    state = moepar.init_parallel(tp, ep, verbose=False)
    model = moepar.fully_shard(GPT(_cfg(sp), state), state)
    kinds = sorted({p.moepar_fsdp_kind for p in model.parameters()})
    losses, norms = _train(model, state, fsdp=True)
    worst = 0.0
    for name, p in model.named_parameters():
        mine = p.full_tensor()  # this rank's TP/EP slice, all-gathered over its FSDP group
        worst = max(worst, float((mine - _local_slice(name, ref_params[name], p, state)).abs().max()))
    return losses, norms, worst, kinds


@pytest.mark.parametrize("tp,ep,sp", [(1, 2, False), (1, 4, False), (2, 2, False), (2, 2, True)])
def test_fully_sharded_training_matches_one_process(tp, ep, sp):
    ref_losses, ref_norms, ref_params = _reference(sp)
    for losses, norms, worst, kinds in run_ranks(_sharded_run, 4, tp, ep, sp, ref_params):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
        # moepar.grad_norm (hence clip_grad_norm_) of the sharded gradients: the global norm.
        assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) < 1e-5, (norms, ref_norms)
        assert worst < 1e-5, worst
        assert kinds == (["dense", "expert", "sp"] if sp else ["dense", "expert"])
    # The run moves the parameters: a wrong scale would show.
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-2


def _two_worlds(store_path, ref_params):
    first = _sharded_run(1, 2, False, ref_params)  # in the world the test pool set up
    rank = dist.get_rank()
    moepar.destroy_parallel()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 4), rank=rank, world_size=4)
    return first, _sharded_run(2, 2, False, ref_params)


def test_a_second_world_in_one_process_shards_on_its_own_groups(tmp_path):
    # DTensor caches output specs keyed by meshes that compare by ranks, not by group: without
    # destroy_parallel emptying those caches, the second world's expert parameters carried
    # the first world's (destroyed) group and full_tensor failed to resolve it.
    ref_losses, _, ref_params = _reference(False)
    for first, second in run_ranks(_two_worlds, 4, str(tmp_path / "store"), ref_params):
        for losses, _, worst, _ in (first, second):
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5 and worst < 1e-5


def _bad_input(case):
    state = moepar.init_parallel(1, 2, verbose=False)
    if case == "dense":
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        moepar.fully_shard(model, state)
    else:
        moepar.fully_shard(GPT(_cfg(), state), state, mesh=None)


@pytest.mark.parametrize("case,needle", [("dense", "has no MoE layer"), ("mesh", "got ['mesh']")])
def test_bad_input_raises_on_every_rank_before_any_collective(case, needle):
    with pytest.raises(Exception) as info:
        run_ranks(_bad_input, 2, case)
    text = str(info.value)
    assert "failed on ranks [0, 1]" in text and text.count("ValueError") >= 2 and needle in text.replace("\n", " ")


def test_without_distributed_is_a_clear_error():
    with pytest.raises(ValueError, match="needs torch.distributed"):
        moepar.fully_shard(GPT(_cfg(), ParallelState.single()))

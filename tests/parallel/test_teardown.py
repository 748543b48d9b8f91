"""A finished job exits cleanly: no ProcessGroup pinned by a default argument,
destroy_parallel() frees every group while the interpreter is intact, modules read their
groups from the state, and the test helper fails ranks that exit abnormally."""
import atexit
import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist

import moepar
from moepar.parallel.groups import Layout, ParallelState

from ..helpers.multiproc import RankFailure, run_ranks


def _pinned_defaults():
    import torch.distributed.nn.functional as F
    return [name for name, fn in vars(F).items() if callable(fn) and any(
        isinstance(d, dist.ProcessGroup) for d in (getattr(fn, "__defaults__", None) or ()))]


def _unpin_after_late_import():
    import torch.distributed.nn.functional as F
    # What importing torch.distributed.nn after init_process_group does: bind the live world group.
    F.all_reduce.__defaults__ = (dist.ReduceOp.SUM, dist.group.WORLD)
    before = _pinned_defaults()
    moepar.init_parallel(1, 2, verbose=False)
    return before, _pinned_defaults()


def test_init_parallel_unpins_groups_bound_as_defaults():
    for before, after in run_ranks(_unpin_after_late_import, 2):
        assert before == ["all_reduce"] and after == []


def _step_then_destroy(tp, ep):
    state = moepar.init_parallel(tp, ep, verbose=False)
    inp = moepar.ColumnParallelLinear(8, 8, gather_output=True, init_seed=1, state=state)
    moe = moepar.MoE(8, 4, ep, k=2, ffn_hidden=16, state=state, init_seed=2)
    torch.manual_seed(state.dp_rank)
    moe(inp(torch.randn(5, 8))).sum().backward()
    moepar.allreduce_gradients(moe, state)
    refs = [weakref.ref(g) for g in state.groups.values() if g is not None] + [weakref.ref(dist.group.WORLD)]
    moepar.destroy_parallel()
    # The TP module outlives the teardown but holds no group: it reads it from the state.
    # (The MoE layer is dropped first: its last forward's aux loss, kept as moe.aux_loss and
    # not part of this loss, keeps that forward's autograd graph, whose collective nodes
    # hold the groups they ran on.)
    del moe
    gc.collect()
    alive = sum(r() is not None for r in refs)
    return len(refs), alive, inp.group, dist.is_initialized(), moepar.get_parallel_state().world_size


@pytest.mark.parametrize("tp,ep", [(2, 2)])
def test_destroy_parallel_frees_every_group_and_ranks_exit_zero(tp, ep):
    # fresh=True: new processes whose exit codes are checked after the call.
    for n_groups, alive, group, initialized, world in run_ranks(_step_then_destroy, 4, tp, ep, fresh=True):
        assert n_groups >= 3 and alive == 0
        assert group is None and not initialized and world == 1


def test_destroy_parallel_without_distributed_forgets_the_state():
    moepar.init_parallel(verbose=False)
    moepar.destroy_parallel()
    assert moepar.get_parallel_state().world_size == 1


def test_tp_modules_read_their_group_from_the_state():
    sentinel = object()
    state = ParallelState(Layout(1), 0, {"tp": sentinel})
    lin = moepar.ColumnParallelLinear(4, 4, state=state)
    assert lin.group is sentinel
    state.groups.clear()  # what destroy_parallel does to the live state
    assert lin.group is None


def _abort_at_exit_on_rank1():
    if dist.get_rank() == 1:
        atexit.register(os.abort)  # the call succeeds; the process dies in teardown
    return dist.get_rank()


def _die_on_rank1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_helper_fails_ranks_that_exit_abnormally():
    with pytest.raises(RankFailure, match=r"rank 1: exit code -6"):
        run_ranks(_abort_at_exit_on_rank1, 2, fresh=True)
    with pytest.raises(RankFailure, match=r"ranks \[1\] died during _die_on_rank1 \(exit codes \{1: 3\}\)"):
        run_ranks(_die_on_rank1, 2, fresh=True)

"""Rank layout: hand-worked group tables, coordinates, validation, state and seeds."""
import pytest
import torch

import moepar
from moepar.parallel.groups import Layout, ParallelState, init_parallel

from ..helpers.multiproc import run_ranks


def test_world8_tp2_ep4_table():
    lay = Layout(8, tp=2, ep=4)
    assert lay.dp == 4 and lay.edp == 2
    assert lay.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.etp_groups() == [[r] for r in range(8)]
    assert lay.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.edp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(3) == {"tp": 1, "dp": 1, "etp": 0, "ep": 3, "edp": 0, "moe": 3, "pp": 0}
    assert lay.coords(6) == {"tp": 0, "dp": 3, "etp": 0, "ep": 2, "edp": 1, "moe": 2, "pp": 0}
    # one MoE layer's block: the closure of its TP and EP groups, lcm(2, 4) = 4 ranks
    assert lay.moe_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    rows = lay.moe_rows(6)   # rank 6 is row 2 of block [4..7]; its TP peers 6, 7 are rows 2, 3
    assert (rows.me, rows.sub, rows.ep_rows, rows.tp_rows) == (2, 0, (0, 1, 2, 3), (2, 3))


def test_world16_tp2_ep4_etp2_table():
    lay = Layout(16, tp=2, ep=4, etp=2)
    assert lay.dp == 8 and lay.edp == 2
    assert lay.tp_groups() == [[2 * i, 2 * i + 1] for i in range(8)]
    assert lay.dp_groups() == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert lay.etp_groups() == [[2 * i, 2 * i + 1] for i in range(8)]
    assert lay.ep_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert lay.edp_groups() == [[j, j + 8] for j in range(8)]
    assert lay.coords(13) == {"tp": 1, "dp": 6, "etp": 1, "ep": 2, "edp": 1, "moe": 5, "pp": 0}
    assert lay.moe_groups() == [list(range(8)), list(range(8, 16))]   # lcm(2, 4 x 2) = 8
    rows = lay.moe_rows(13)   # EP peers 9, 11, 13, 15 (etp index 1); TP peers 12, 13
    assert (rows.me, rows.sub, rows.ep_rows, rows.tp_rows) == (5, 0, (1, 3, 5, 7), (4, 5))


def test_world16_tp4_ep2_table():
    lay = Layout(16, tp=4, ep=2)
    assert lay.tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert lay.dp_groups() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lay.ep_groups() == [[2 * i, 2 * i + 1] for i in range(8)]
    assert lay.edp_groups() == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert lay.moe_groups() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    rows = lay.moe_rows(11)   # block [8..11]: EP peers 10, 11 are rows 2, 3; TP peers all four
    assert (rows.me, rows.sub, rows.ep_rows, rows.tp_rows) == (3, 2, (2, 3), (0, 1, 2, 3))


@pytest.mark.parametrize("world,tp,ep,etp", [(1, 1, 1, 1), (4, 2, 2, 1), (8, 2, 4, 1), (8, 1, 2, 4),
                                             (16, 4, 8, 2), (12, 3, 2, 2)])
def test_every_family_partitions_the_world(world, tp, ep, etp):
    lay = Layout(world, tp, ep, etp)
    for kind, groups in lay.all_groups().items():
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), kind
        for g in groups:
            for r in g:  # coords agree with membership: position inside the group
                assert g.index(r) == lay.coords(r)[kind], (kind, r)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world_size=4, tp=3), "world_size=4 is not divisible by tensor_parallel_size=3"),
    (dict(world_size=8, ep=3), "expert_parallel_size=3 x expert_tensor_parallel_size=1 = 3"),
    (dict(world_size=8, ep=4, etp=4), "= 16"),
    (dict(world_size=4, tp=0), "tensor_parallel_size=0 must be a positive integer"),
])
def test_layout_rejects_bad_sizes(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("+", r"\+")):
        Layout(**kwargs)


def test_init_without_distributed_is_a_world_of_one(capsys):
    state = init_parallel(seed=7)
    assert (state.world_size, state.tp_size, state.ep_size, state.edp_size) == (1, 1, 1, 1)
    assert state.get_model_parallel_world_size() == 1 and state.get_data_parallel_group() is None
    assert moepar.get_parallel_state() is state
    assert capsys.readouterr().out == ""            # it prints only when asked
    init_parallel(seed=7, verbose=True)
    assert "model parallel seed 2725, data parallel seed 7" in capsys.readouterr().out


def test_init_without_distributed_rejects_sizes_above_one():
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*need torch.distributed to be initialised"):
        init_parallel(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="expert_parallel_size=4"):
        init_parallel(expert_parallel_size=4)


def test_model_parallel_rng_fork_is_a_separate_stream():
    state = init_parallel(seed=11, verbose=False)
    torch.manual_seed(5)
    a = torch.rand(3)
    torch.manual_seed(5)
    with state.fork_model_parallel_rng():
        b = torch.rand(3)
    c = torch.rand(3)
    assert not torch.equal(a, b)  # different stream inside
    assert torch.equal(a, c)      # default stream untouched by the fork
    gen = torch.Generator().manual_seed(11 + 2718)
    assert torch.equal(b, torch.rand(3, generator=gen))


def _state_on_rank(tp, ep, etp, pp=1):
    import torch.distributed as dist
    state = init_parallel(tp, ep, etp, seed=1234, pipeline_parallel_size=pp)
    out = {"line": state.describe(), "sizes": (state.tp_size, state.dp_size, state.ep_size,
                                                state.etp_size, state.edp_size)}
    # The groups hold the ranks the layout says: all-reduce each rank's id in each group.
    for kind in ("tp", "dp", "ep", "etp", "edp", "moe", "pp"):
        t = torch.tensor([1 << dist.get_rank()])
        g = state.group(kind)
        if g is not None:
            dist.all_reduce(t, group=g)
        out[kind] = sorted(r for r in range(dist.get_world_size()) if int(t) >> r & 1)
    out["mpu"] = (state.get_model_parallel_rank(), state.get_data_parallel_rank(),
                  state.get_data_parallel_world_size())
    out["pipeline"] = (state.get_pipeline_model_parallel_rank(), state.get_pipeline_model_parallel_world_size(),
                       state.is_pipeline_first_stage(), state.is_pipeline_last_stage(),
                       state.get_pipeline_model_parallel_group() is state.pp_group)
    t = torch.tensor([1 << dist.get_rank()])
    if state.stage_group is not None:
        dist.all_reduce(t, group=state.stage_group)
    out["stage"] = sorted(r for r in range(dist.get_world_size()) if int(t) >> r & 1)
    return out


def test_groups_on_four_ranks_with_pipeline_stages():
    # pp 2 x ep 2: stage 0 = ranks 0, 1 and stage 1 = ranks 2, 3; every other group inside a stage.
    results = run_ranks(_state_on_rank, 4, 1, 2, None, 2)
    lay = Layout(4, 1, 2, 1, pp=2)
    for rank, res in enumerate(results):
        for kind, groups in lay.all_groups().items():
            assert res[kind] == next(g for g in groups if rank in g), (rank, kind)
        assert res["stage"] == ([0, 1] if rank < 2 else [2, 3])
        assert res["pipeline"] == (rank // 2, 2, rank < 2, rank >= 2, True)
    assert [r["pp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert "pipeline stage 1 of 2" in results[3]["line"]


def _bad_pipeline_init(pp):
    try:
        init_parallel(1, 1, pipeline_parallel_size=pp)
    except ValueError as e:
        return str(e)
    return None


def test_pipeline_not_dividing_the_world_raises_on_every_rank():
    msgs = run_ranks(_bad_pipeline_init, 4, 3)
    assert all(m and "world_size=4 is not divisible by pipeline_parallel_size=3" in m for m in msgs), msgs


def test_groups_on_four_ranks():
    results = run_ranks(_state_on_rank, 4, 2, 2, None)
    lay = Layout(4, 2, 2, 1)
    for rank, res in enumerate(results):
        for kind, groups in lay.all_groups().items():
            assert res[kind] == next(g for g in groups if rank in g), (rank, kind)
        assert res["sizes"] == (2, 2, 2, 1, 2)
        c = lay.coords(rank)
        assert res["mpu"] == (c["tp"], c["dp"], 2)
    assert results[3]["line"] == ("initializing model parallel with size 2: global rank 3, tp rank 1, "
                                  "ep rank 1, dp rank 1, model parallel seed 3953, data parallel seed 1234")


def test_groups_on_four_ranks_with_expert_tp():
    results = run_ranks(_state_on_rank, 4, 1, 2, 2)
    assert [r["etp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ep"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["edp"] for r in results] == [[0], [1], [2], [3]]


def _bad_init(tp, ep):
    try:
        init_parallel(tp, ep, verbose=False)
    except ValueError as e:
        return str(e)
    return None


def test_bad_sizes_raise_on_every_rank():
    msgs = run_ranks(_bad_init, 4, 3, 1)
    assert all(m and "world_size=4 is not divisible by tensor_parallel_size=3" in m for m in msgs)
    msgs = run_ranks(_bad_init, 4, 1, 3)
    assert all(m and "expert_parallel_size=3" in m for m in msgs)


def test_parallel_state_single_answers_mpu_names():
    s = ParallelState.single()
    assert s.get_expert_model_parallel_world_size() == 1
    assert s.get_tensor_model_parallel_rank() == 0
    assert s.get_pipeline_model_parallel_world_size() == 1
    assert s.is_pipeline_first_stage() and s.is_pipeline_last_stage() and s.stage_group is None

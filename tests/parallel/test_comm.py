"""Autograd collectives (the EP all-to-all in ``comm``, the TP region ops in ``regions``):
forward values, backward values, uneven splits, no-op at size 1."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from moepar.parallel import comm, regions
from moepar.parallel.groups import init_parallel

from ..helpers.multiproc import run_ranks


def _a2a_round_trip():
    rank, world = dist.get_rank(), dist.get_world_size()
    # rank r sends (r + j) % 3 rows to rank j: some blocks are empty.
    send = [(rank + j) % 3 for j in range(world)]
    recv = [(r + rank) % 3 for r in range(world)]
    rows = [torch.tensor([[100.0 * rank + 10 * j + i, -1.0]]) for j in range(world) for i in range(send[j])]
    x = (torch.cat(rows) if rows else torch.zeros(0, 2)).requires_grad_()
    with comm.track() as stats:
        y = comm.all_to_all(x, None if world == 1 else dist.group.WORLD, recv, send)
        back = comm.all_to_all(y, dist.group.WORLD, send, recv)
        # d loss / d y = rank + 1 for every row this rank received.
        (y.sum(dim=1) * (rank + 1)).sum().backward()
    expect_y = [100.0 * r + 10 * rank + i for r in range(world) for i in range(recv[r])]
    expect_grad = [float(j + 1) for j in range(world) for _ in range(send[j])]
    return (y[:, 0].tolist() == expect_y, torch.equal(back, x.detach()),
            x.grad[:, 0].tolist() == expect_grad, x.grad[:, 1].tolist() == expect_grad,
            stats.count("all_to_all", backward=False), stats.count("all_to_all", backward=True))


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_all_to_all_round_trip_and_gradient(world):
    for res in run_ranks(_a2a_round_trip, world):
        assert res == (True, True, True, True, 2, 1)


def _region_ops(sizes):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = dist.group.WORLD
    rows = sizes[rank] if sizes else 2
    base = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) + 1000 * rank
    out = {}
    # gather_from_region along dim 0: forward cat, backward own block of the grad.
    x = base.clone().requires_grad_()
    y = regions.gather_from_region(x, g, dim=0, sizes=sizes)
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    out["gather"] = (y.detach(), x.grad.clone())
    # gather_partial_grads: forward cat, backward reduce-scatter (sum over ranks).
    x = base.clone().requires_grad_()
    y = regions.gather_partial_grads(x, g, dim=0, sizes=sizes)
    (y * (rank + 1)).sum().backward()
    out["gather_seq"] = (y.detach(), x.grad.clone())
    # reduce_scatter_to_region: input is the full [sum(sizes), 3], forward sum + own block.
    full = torch.arange(sum(sizes) * 3 if sizes else world * 6, dtype=torch.float64).reshape(-1, 3)
    x = (full * (rank + 1)).requires_grad_()
    y = regions.reduce_scatter_to_region(x, g, dim=0, sizes=sizes)
    (y * 2).sum().backward()
    out["reduce_scatter"] = (y.detach(), x.grad.clone())
    # scatter_to_region along the last dim (even): forward own columns, backward all-gather.
    x = torch.arange(4.0 * world, dtype=torch.float64).reshape(2, 2 * world).requires_grad_()
    y = regions.scatter_to_region(x, g, dim=-1)
    (y * (rank + 1)).sum().backward()
    out["scatter"] = (y.detach(), x.grad.clone())
    # copy_to_region / reduce_from_region.
    x = torch.full((3,), float(rank + 1), dtype=torch.float64, requires_grad=True)
    y = regions.copy_to_region(x, g)
    (y * (rank + 1)).sum().backward()
    out["copy"] = (y.detach(), x.grad.clone())
    x = torch.full((3,), float(rank + 1), dtype=torch.float64, requires_grad=True)
    y = regions.reduce_from_region(x, g)
    (y * (rank + 1)).sum().backward()
    out["reduce"] = (y.detach(), x.grad.clone())
    return out


@pytest.mark.parametrize("world,sizes", [(2, None), (4, None), (4, [3, 0, 1, 2])])
def test_region_ops_forward_and_backward(world, sizes):
    results = run_ranks(_region_ops, world, sizes)
    rows = sizes or [2] * world
    bases = [torch.arange(n * 3, dtype=torch.float64).reshape(n, 3) + 1000 * r for r, n in enumerate(rows)]
    cat = torch.cat(bases)
    starts = [sum(rows[:r]) for r in range(world)]
    weights = torch.arange(cat.numel(), dtype=torch.float64).reshape(cat.shape)
    tri = world * (world + 1) / 2
    full = torch.arange(sum(rows) * 3, dtype=torch.float64).reshape(-1, 3)
    for r, res in enumerate(results):
        own = slice(starts[r], starts[r] + rows[r])
        y, gx = res["gather"]
        assert torch.equal(y, cat) and torch.equal(gx, weights[own])
        y, gx = res["gather_seq"]
        assert torch.equal(y, cat) and torch.equal(gx, torch.full_like(gx, tri))
        y, gx = res["reduce_scatter"]
        assert torch.equal(y, full[own] * tri) and torch.equal(gx, torch.full_like(full, 2.0))
        y, gx = res["scatter"]
        whole = torch.arange(4.0 * world, dtype=torch.float64).reshape(2, 2 * world)
        assert torch.equal(y, whole[:, 2 * r:2 * r + 2])
        expect = torch.cat([torch.full((2, 2), float(q + 1), dtype=torch.float64) for q in range(world)], 1)
        assert torch.equal(gx, expect)
        y, gx = res["copy"]
        assert torch.equal(y, torch.full((3,), r + 1.0, dtype=torch.float64)) and torch.equal(gx, torch.full((3,), tri, dtype=torch.float64))
        y, gx = res["reduce"]
        assert torch.equal(y, torch.full((3,), tri, dtype=torch.float64)) and torch.equal(gx, torch.full((3,), r + 1.0, dtype=torch.float64))


def test_every_collective_is_skipped_at_group_size_one(monkeypatch):
    calls = []
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                 "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "broadcast"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: calls.append(_n))
    state = init_parallel(verbose=False)  # world of one: every group is None
    x = torch.randn(4, 6, requires_grad=True)
    with comm.track() as stats:
        ys = [regions.copy_to_region(x, state.tp_group), regions.reduce_from_region(x, state.tp_group),
              regions.scatter_to_region(x, state.tp_group), regions.gather_from_region(x, state.tp_group),
              regions.gather_partial_grads(x, state.tp_group),
              regions.reduce_scatter_to_region(x, state.tp_group),
              comm.all_to_all(x, state.ep_group, [4], [4])]
        sum(y.sum() for y in ys).backward()
        comm.all_reduce_(x.detach().clone(), state.dp_group)
    assert all(y is x for y in ys)
    assert calls == [] and stats.events == []
    assert torch.equal(x.grad, torch.full_like(x, 7.0))


def test_split_sizes():
    assert comm.split_sizes(10, 4) == [3, 3, 2, 2]
    assert comm.split_sizes(1, 3) == [1, 0, 0]
    assert sum(comm.split_sizes(4097, 8)) == 4097


def _late_rank_all_reduce(wait):
    import time
    t = torch.ones(4)
    with comm.track() as stats, (comm.peer_wait_timing() if wait else contextlib.nullcontext()):
        if dist.get_rank() == 1:
            time.sleep(0.5)  # rank 1 arrives late: rank 0 waits for it
        comm.all_reduce_(t, dist.group.WORLD)
        comm.all_reduce_(t, dist.group.WORLD)  # both ranks aligned: no wait
    return [(e.seconds, e.wait_seconds) for e in stats.events], t.tolist()


def test_peer_wait_timing_splits_the_late_rank_from_the_transfer():
    plain, waited = run_ranks(_late_rank_all_reduce, 2, False), run_ranks(_late_rank_all_reduce, 2, True)
    # Without the barrier rank 0's first all-reduce includes the 0.5 s it waited for rank 1.
    (first, _), (second, _) = plain[0][0]
    assert first > 0.4 and second < 0.2 and all(w == 0.0 for _, w in plain[0][0])
    # With it the wait is recorded apart and the call itself is short; the values still add.
    (first, wait1), (second, wait2) = waited[0][0]
    assert wait1 > 0.4 and first < 0.2 and wait2 < 0.2 and second < 0.2
    assert all(values == [4.0] * 4 for _, values in waited)


def _flat_collectives():
    """On (fake) NCCL: the row gather and reduce-scatter over 2 ranks, equal and uneven
    sizes: the collectives each uses and the device ops (copies) around them."""
    from tests.helpers import fake_cuda
    state = init_parallel(2, 1, verbose=False)
    out = {}
    with fake_cuda.session(strict=True) as rec:
        for name, sizes in (("equal", None), ("uneven", [3, 1])):
            rows = 3 if sizes is None else sizes[state.rank]
            x = fake_cuda.to_cuda(torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) + 10 * state.rank)
            with rec.phase("gather " + name):
                g = comm.all_gather_rows(x, state.tp_group, sizes)
            y = fake_cuda.to_cuda(torch.ones(4 if sizes is None else 4, 2) * (state.rank + 1))
            with rec.phase("scatter " + name):
                s = comm.reduce_scatter_rows(y, state.tp_group, None if sizes is None else [3, 1])
            out[name] = {p: ([c.op for c in rec.collectives(p)], sorted(rec.device_ops(p)))
                         for p in ("gather " + name, "scatter " + name)}
            out[name]["values"] = (fake_cuda.to_cpu(g).tolist(), fake_cuda.to_cpu(s).tolist())
    return out


def test_row_gather_and_reduce_scatter_copy_nothing_around_the_collective():
    """NCCL's flat forms, no concatenation after the gather (it used to concatenate the
    chunks of the buffer it had gathered into: a full copy of every TP/SP/ETP gather) and no
    list form for the reduce-scatter (NCCL stages a flat copy of it); an uneven gather or
    reduce-scatter copies once, to drop or add the padding."""
    for rank, r in enumerate(run_ranks(_flat_collectives, 2, fake_cuda=True)):
        ops, copies = r["equal"]["gather equal"]
        assert ops == ["all_gather_into_tensor"] and copies == [], (rank, ops, copies)
        ops, copies = r["equal"]["scatter equal"]
        assert ops == ["reduce_scatter_tensor"] and copies == [], (rank, ops, copies)
        g, s = r["equal"]["values"]
        assert g == (torch.arange(12.).view(3, 4).tolist() + (torch.arange(12.).view(3, 4) + 10).tolist())
        assert s == [[3.0, 3.0], [3.0, 3.0]]
        g, s = r["uneven"]["values"]
        assert g == torch.arange(12.).view(3, 4).tolist() + [[10.0, 11.0, 12.0, 13.0]]
        assert s == ([[3.0, 3.0]] * 3 if rank == 0 else [[3.0, 3.0]])

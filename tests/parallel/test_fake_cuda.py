"""The fake-CUDA instrument itself (tests/helpers/fake_cuda): it counts what a GPU would pay, fails
where a GPU would fail, and changes no number.

Every check runs in gloo workers started with the shim preloaded
(``run_ranks(..., fake_cuda=True)``): the pytest process itself has no "cuda" device.
"""
import pytest
import torch
import torch.distributed as dist

from ..helpers import fake_cuda
from ..helpers.multiproc import RankFailure, run_ranks


def _run(fn, world_size=1, *args, **kw):
    return run_ranks(fn, world_size, *args, fake_cuda=True, **kw)


# ---- host reads: each kind counted exactly once, the sync-free forms not at all -------------

def _setup():
    x = fake_cuda.to_cuda(torch.tensor([[1.0, -2.0], [3.0, 0.0]]))
    m = fake_cuda.to_cuda(torch.tensor([[True, False], [True, True]]))
    i = fake_cuda.to_cuda(torch.tensor([1, 0, 1]))
    return x, m, i


HOST_READS = {   # name: (expected kind, what a GPU would sync on)
    "item": ("item", lambda x, m, i: x.sum().item()),
    "int": ("item", lambda x, m, i: int(i[0])),
    "bool": ("item", lambda x, m, i: bool(m.any())),
    "float": ("item", lambda x, m, i: float(x[0, 0])),
    "cpu": ("d2h", lambda x, m, i: x.cpu()),
    "to_cpu": ("d2h", lambda x, m, i: x.to("cpu")),
    "tolist": ("tolist", lambda x, m, i: i.tolist()),
    "copy_into_cpu": ("d2h", lambda x, m, i: torch.empty(2, 2).copy_(x)),
    "nonzero": ("nonzero", lambda x, m, i: torch.nonzero(m)),
    "where_cond": ("nonzero", lambda x, m, i: torch.where(m)),
    "masked_select": ("masked_select", lambda x, m, i: torch.masked_select(x, m)),
    "bool_index": ("bool_index", lambda x, m, i: x[m]),
    "bool_index_put": ("bool_index", lambda x, m, i: x.__setitem__(m, x[1, 1])),   # a device value
    "repeat_interleave": ("repeat_interleave", lambda x, m, i: torch.repeat_interleave(i)),
    "repeat_interleave_dim": ("repeat_interleave", lambda x, m, i: x.repeat_interleave(i[:2], dim=0)),
    "bincount": ("bincount", lambda x, m, i: torch.bincount(i)),
    "unique": ("unique", lambda x, m, i: torch.unique(i)),
    "unique_consecutive": ("unique", lambda x, m, i: torch.unique_consecutive(i)),
    "equal": ("equal", lambda x, m, i: torch.equal(x, x)),
    "allclose": ("allclose", lambda x, m, i: torch.allclose(x, x)),
    "is_nonzero": ("item", lambda x, m, i: x[0, 0].is_nonzero()),
    "masked_fill_device_value": ("item", lambda x, m, i: x.masked_fill(m, x[0, 0])),
    "event_synchronize": ("event_sync", lambda x, m, i: torch.Event(x.device).synchronize()),
    "cuda_event_synchronize": ("event_sync", lambda x, m, i: torch.cuda.Event().synchronize()),
    "cuda_synchronize": ("device_sync", lambda x, m, i: torch.cuda.synchronize()),
    "stream_synchronize": ("sync", lambda x, m, i: torch.accelerator.current_stream(x.device).synchronize()),
}
SYNC_FREE = {   # the forms the layer should use instead: nothing counted
    "nonzero_static": lambda x, m, i: torch.nonzero_static(m, size=4),
    "repeat_interleave_output_size": lambda x, m, i: torch.repeat_interleave(i, output_size=2),
    "repeat_interleave_int": lambda x, m, i: x.repeat_interleave(2, dim=0),
    "repeat_interleave_dim_output_size": lambda x, m, i: x.repeat_interleave(i[:2], dim=0, output_size=1),
    "masked_fill_scalar": lambda x, m, i: x.masked_fill(m, 1.0),
    "where_3": lambda x, m, i: torch.where(m, x, 0.0),
    "long_index": lambda x, m, i: x[i[:2]],
    "bool_mask_set_scalar": lambda x, m, i: x.__setitem__(m, 0.0),   # CUDA takes the masked_fill path
    "factories": lambda x, m, i: (x.new_zeros(3), torch.zeros(3, device=x.device), torch.arange(4, device="cuda"),
                                  torch.full((2,), 3, device="cuda"), torch.empty_like(x), torch.cumsum(i, 0)),
    "cpu_scalar_operand": lambda x, m, i: x * torch.tensor(2.0),
    "reductions_sort": lambda x, m, i: (x.sum(), x.max(), torch.sort(i), torch.topk(x, 1), x.all()),
    "streams": lambda x, m, i: _streams(x),
}


def _streams(x):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert torch.accelerator.current_stream(x.device).stream_id == s.stream_id
    e = torch.cuda.Event()
    e.record(s)
    torch.cuda.current_stream().wait_event(e)
    assert e.query() and isinstance(torch.accelerator.current_stream(x.device), torch.Stream)
    assert isinstance(torch.Stream(device="cuda"), torch.Stream) and isinstance(e, torch.Event)


def _count_one(name):
    with fake_cuda.session(strict=True) as rec:
        x, m, i = _setup()
        fn = HOST_READS[name][1] if name in HOST_READS else SYNC_FREE[name]
        with rec.phase("op"):
            fn(x, m, i)
    return ([(e.kind, e.op) for e in rec.host_reads("op")], len(rec.blocking_h2d("op")),
            len(rec.host_reads("other")), rec.report())


@pytest.mark.parametrize("name", sorted(HOST_READS))
def test_each_host_read_is_counted_once(name):
    reads, h2d, setup_reads, report = _run(_count_one, 1, name)[0]
    assert [k for k, _ in reads] == [HOST_READS[name][0]], report
    assert h2d == 0 and setup_reads == 0, report


@pytest.mark.parametrize("name", sorted(SYNC_FREE))
def test_sync_free_forms_count_nothing(name):
    reads, h2d, _, report = _run(_count_one, 1, name)[0]
    assert reads == [] and h2d == 0, report


# ---- inside a custom op's body (the kernels' ops under torch.compile run there) ----------------
# Below autograd, ``.cpu()`` and ``.item()`` reach the mode whole (aten.to, aten.item), not as the
# _to_copy / _local_scalar_dense they decompose to elsewhere: each must still count once.

@torch.library.custom_op("fake_cuda_check::host_read", mutates_args=())
def _host_read_op(x: torch.Tensor, how: int) -> torch.Tensor:
    if how == 0:
        x.sum().cpu()
    elif how == 1:
        x.sum().item()
    else:
        x = x + torch.ones(x.shape).to(x.device)   # a blocking host -> device copy
    return x.clone()


_host_read_op.register_fake(lambda x, how: torch.empty_like(x))


def _in_custom_op(how):
    with fake_cuda.session(strict=False) as rec:
        x = fake_cuda.to_cuda(torch.ones(3))
        with rec.phase("op"):
            y = _host_read_op(x, how)
        return [e.kind for e in rec.host_reads("op")], len(rec.blocking_h2d("op")), fake_cuda.is_fake(y)


@pytest.mark.parametrize("how, reads, h2d", [(0, ["d2h"], 0), (1, ["item"], 0), (2, [], 1)])
def test_host_reads_inside_a_custom_op_body_are_counted_once(how, reads, h2d):
    assert _run(_in_custom_op, 1, how)[0] == (reads, h2d, True)


# ---- host -> device copies -------------------------------------------------------------------

def _copies():
    out = {}
    with fake_cuda.session(strict=True) as rec:
        x = fake_cuda.to_cuda(torch.zeros(3))
        pinned = torch.randn(3).pin_memory()
        cases = {
            "torch.tensor": lambda: torch.tensor([1, 2], device="cuda"),
            "new_tensor": lambda: x.new_tensor([1.0, 2.0]),
            "to_cuda": lambda: torch.randn(3).to("cuda"),
            "cuda()": lambda: torch.randn(3).cuda(),
            "non_blocking_pageable": lambda: torch.randn(3).to("cuda", non_blocking=True),
            "pinned_blocking": lambda: pinned.to("cuda"),
            "copy_from_cpu": lambda: x.copy_(torch.randn(3)),
            "pinned_non_blocking": lambda: pinned.to("cuda", non_blocking=True),
            "pinned_copy_non_blocking": lambda: x.copy_(pinned, non_blocking=True),
        }
        for name, fn in cases.items():
            with rec.phase(name):
                y = fn()
            out[name] = (len(rec.blocking_h2d(name)), len(rec.async_h2d(name)), len(rec.host_reads(name)),
                         y.device.type)
    out["pinned"] = pinned.is_pinned()
    return out


def test_host_to_device_copies():
    out = _run(_copies)[0]
    assert out.pop("pinned") is True
    for name in ("torch.tensor", "new_tensor", "to_cuda", "cuda()", "non_blocking_pageable", "pinned_blocking",
                 "copy_from_cpu"):
        assert out[name] == (1, 0, 0, "cuda"), (name, out[name])
    for name in ("pinned_non_blocking", "pinned_copy_non_blocking"):
        assert out[name] == (0, 1, 0, "cuda"), (name, out[name])


# ---- what a GPU would crash on ---------------------------------------------------------------

def _cpu_tensor_in_all_reduce(strict):
    t = torch.full((2,), float(dist.get_rank() + 1))   # a CPU tensor: NCCL refuses it
    try:
        with fake_cuda.session(strict=strict) as rec:
            dist.all_reduce(t)
    except RuntimeError as e:
        return "raised", str(e)
    return rec.violations, t.tolist(), [(c.op, c.ranks) for c in rec.collectives()]


def test_cpu_tensor_in_a_collective_raises_in_strict_mode():
    for kind, msg in _run(_cpu_tensor_in_all_reduce, 2, True):
        assert kind == "raised"
        assert "NCCL needs CUDA tensors: all_reduce over ranks [0, 1] got a cpu tensor" in msg


def test_cpu_tensor_in_a_collective_is_recorded_in_lenient_mode():
    for violations, values, colls in _run(_cpu_tensor_in_all_reduce, 2, False):
        assert len(violations) == 1 and "all_reduce over ranks [0, 1] got a cpu tensor" in violations[0]
        assert values == [3.0, 3.0] and colls == [("all_reduce", (0, 1))]   # and it still ran


def _device_mix(strict):
    out = {}
    try:
        with fake_cuda.session(strict=strict) as rec:
            x = fake_cuda.to_cuda(torch.ones(2, 3))
            out["scalar_ok"] = fake_cuda.to_cpu(x * torch.tensor(2.0)).tolist()   # 0-dim CPU: allowed
            y = x + torch.ones(2, 3)
            out["result"] = fake_cuda.to_cpu(y).tolist()
    except RuntimeError as e:
        out["raised"] = str(e)
    out["violations"] = rec.violations
    return out


def test_device_mix_raises_in_strict_mode():
    out = _run(_device_mix, 1, True)[0]
    assert "device mix in aten.add.Tensor: cpu(2, 3)" in out["raised"], out
    assert out["scalar_ok"] == [[2.0] * 3] * 2


def test_device_mix_is_recorded_in_lenient_mode():
    out = _run(_device_mix, 1, False)[0]
    assert "raised" not in out and out["result"] == [[2.0] * 3] * 2
    assert len(out["violations"]) == 1 and "Expected all tensors to be on the same device" in out["violations"][0]


# ---- nothing changes the numbers -------------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 3))
    model[0].weight.moepar_expert = True                      # attributes survive to_cuda
    model.weights = [model[0].weight, model[2].weight]        # and references to parameters
    x = torch.randn(4, 5, requires_grad=True)
    ref = [p.detach().clone() for p in model.parameters()]
    y = model(x)
    (y * torch.arange(3.0)).sum().backward()
    cpu = [y.detach(), x.grad] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with fake_cuda.session(strict=True) as rec:
        model = fake_cuda.to_cuda(model)
        xc = fake_cuda.to_cuda(x.detach()).requires_grad_()
        w = fake_cuda.to_cuda(torch.arange(3.0))
        with rec.phase("forward"):
            yc = model(xc)
        with rec.phase("backward"):
            (yc * w).sum().backward()
    params = list(model.parameters())
    fake = [yc.detach(), xc.grad] + [p.grad for p in params]
    return {"equal": [torch.equal(a, fake_cuda.to_cpu(b)) for a, b in zip(cpu, fake)],
            "devices": {str(t.device) for t in fake}, "summary": rec.summary(), "report": rec.report(),
            "params_moved": all(isinstance(p, torch.nn.Parameter) and p.is_cuda for p in params),
            "weights_equal": all(torch.equal(a, fake_cuda.to_cpu(p).detach()) for a, p in zip(ref, params)),
            "attribute": getattr(params[0], "moepar_expert", None), "grad_leaf": params[0].grad is not None,
            "references": model.weights[0] is params[0] and model.weights[1] is params[2]}


def test_mlp_forward_backward_equals_cpu_and_reads_nothing():
    out = _run(_mlp)[0]
    assert all(out["equal"]) and out["devices"] == {"cuda:0"}, out
    assert out["params_moved"] and out["weights_equal"] and out["attribute"] is True and out["grad_leaf"]
    assert out["references"]
    for phase in ("forward", "backward"):
        s = out["summary"][phase] if phase in out["summary"] else {}
        assert s.get("host_reads", 0) == 0 and s.get("blocking_h2d", 0) == 0, out["report"]
    assert out["summary"]["all"]["violations"] == 0


def _views_and_inplace():
    with fake_cuda.session(strict=True):
        base = fake_cuda.to_cuda(torch.zeros(2, 3))
        base[1].fill_(2.0)                      # through a view
        base.t()[0].add_(1.0)                   # through a transposed view
        out = fake_cuda.to_cuda(torch.empty(2, 3))
        torch.add(base, 1.0, out=out)           # out= writes the wrapper it was given
        base.mul_(2.0)
    return fake_cuda.to_cpu(base).tolist(), fake_cuda.to_cpu(out).tolist()


def test_views_share_storage_and_inplace_ops_write_through():
    base, out = _run(_views_and_inplace)[0]
    assert base == [[2.0, 0.0, 0.0], [6.0, 4.0, 4.0]]
    assert out == [[2.0, 1.0, 1.0], [4.0, 3.0, 3.0]]


def _collectives():
    rank = dist.get_rank()
    x = torch.arange(6.0) + 10 * rank
    splits_in = [1, 5] if rank == 0 else [4, 2]
    splits_out = [1, 4] if rank == 0 else [5, 2]

    def run(t):
        a = t.clone()
        dist.all_reduce(a)
        g = t.new_empty(12)
        dist.all_gather_into_tensor(g, t)
        rs = t.new_empty(3)
        dist.reduce_scatter_tensor(rs, t)
        o = t.new_empty(sum(splits_out))
        work = dist.all_to_all_single(o, t, splits_out, splits_in, async_op=True)
        work.wait()
        b = t.clone()
        dist.broadcast(b, src=1)
        return [a, g, rs, o, b]
    cpu = run(x)
    with fake_cuda.session(strict=True) as rec:
        with rec.phase("comm"):
            fake = run(fake_cuda.to_cuda(x))
        devices = {str(t.device) for t in fake}
    return ([torch.equal(a, fake_cuda.to_cpu(b)) for a, b in zip(cpu, fake)], devices,
            [(c.op, c.ranks, c.nbytes, c.phase, c.async_op) for c in rec.collectives()], rec.report())


def test_collectives_on_fake_cuda_give_the_numbers_of_gloo():
    for equal, devices, records, report in _run(_collectives, 2):
        assert all(equal) and devices == {"cuda:0"}, (equal, report)
        assert records == [("all_reduce", (0, 1), 24, "comm", False),
                           ("all_gather_into_tensor", (0, 1), 24, "comm", False),
                           ("reduce_scatter_tensor", (0, 1), 24, "comm", False),
                           ("all_to_all_single", (0, 1), 24, "comm", True),
                           ("broadcast", (0, 1), 24, "comm", False)], records


# ---- Triton kernels run in the interpreter on fake-CUDA tensors ------------------------------

def _routing(on_cpu):
    from moepar_kernels import routing
    torch.manual_seed(0)
    logits = torch.randn(9, 6)
    ids_ref, w_ref, hist_ref = routing.routing_reference(logits, 2)
    try:
        with fake_cuda.session(strict=True) as rec:
            x = logits if on_cpu else fake_cuda.to_cuda(logits)
            with rec.phase("kernel"):
                ids, w, hist = routing.routing(x, 2)
    except RuntimeError as e:
        return {"raised": str(e)}
    return {"equal": [torch.equal(ids_ref, fake_cuda.to_cpu(ids)), torch.allclose(w_ref, fake_cuda.to_cpu(w)),
                      torch.equal(hist_ref, fake_cuda.to_cpu(hist))],
            "devices": {str(t.device) for t in (ids, w, hist)}, "launches": rec.launches("kernel"),
            "reads": len(rec.host_reads("kernel")) + len(rec.blocking_h2d("kernel"))}


def test_triton_routing_kernel_runs_on_fake_cuda_and_equals_its_reference():
    out = _run(_routing, 1, False)[0]
    assert all(out["equal"]) and out["devices"] == {"cuda:0"}, out
    assert out["launches"] == ["_routing_kernel"] and out["reads"] == 0, out


def test_triton_launch_with_a_cpu_tensor_raises_in_strict_mode():
    out = _run(_routing, 1, True)[0]
    assert "Triton kernel _routing_kernel got a cpu tensor" in out["raised"], out


# ---- the process setup -----------------------------------------------------------------------

def _world():
    with fake_cuda.session():
        t = torch.zeros(1, device="cuda")   # factory calls need a session (its dispatch mode)
        dist.all_reduce(t)
    return fake_cuda.available(), dist.get_world_size(), t.device.type


def test_world_of_one_worker_has_the_shim_and_a_gloo_world():
    assert _run(_world, 1) == [(True, 1, "cuda")]


def test_without_the_shim_a_session_refuses_to_start():
    assert not fake_cuda.available()     # the pytest process was not started with it
    with pytest.raises(RuntimeError, match="LD_PRELOAD"):
        with fake_cuda.session():
            pass


def _strict_failure_fails_the_call():
    with fake_cuda.session(strict=True):
        dist.all_reduce(torch.ones(1))


def test_a_violation_fails_run_ranks():
    with pytest.raises(RankFailure, match="NCCL needs CUDA tensors"):
        _run(_strict_failure_fails_the_call, 1)

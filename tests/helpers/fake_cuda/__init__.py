"""Fake CUDA on a CPU-only machine: run code on tensors whose device is "cuda" (data on the
CPU) with collectives that behave like NCCL's, and count what a real GPU would pay for
(host reads, blocking host->device copies) or crash on (CPU tensors in collectives, Triton
launches or ops next to CUDA tensors). Why: moepar's GPU discipline (docs: DESIGN.md,
"GPU discipline, proven on the CPU") must be checked on machines without a GPU.

The process must be started with the shim (shim.cpp, compiled by build.py) in LD_PRELOAD:
``tests.helpers.multiproc.run_ranks(fn, n, fake_cuda=True)`` does that for gloo workers,
``ensure_preloaded()`` re-executes a script with it. Then::

    from tests.helpers import fake_cuda
    fake_cuda.available()                       # True: the shim is loaded
    with fake_cuda.session(strict=True) as rec: # patches dist / triton / torch.cuda
        model = fake_cuda.to_cuda(model)        # params and buffers -> fake CUDA (attributes kept)
        x = fake_cuda.to_cuda(x_cpu)
        with rec.phase("forward"):
            y = model(x)
        with rec.phase("backward"):
            y.sum().backward()
    rec.host_reads("forward"), rec.blocking_h2d(), rec.async_h2d(), rec.collectives()
    rec.violations, rec.summary(), fake_cuda.to_cpu(y)

strict=True raises RuntimeError at the first violation (as a GPU would fail); strict=False
records it in ``rec.violations`` and runs on. Triton kernels run in Triton's interpreter
(TRITON_INTERPRET=1 must be set before triton is imported). Outside a session, ops on
fake-CUDA tensors still run (nothing is recorded), but factory calls with device="cuda"
need the session's dispatch mode. Known gaps: ops whose CUDA kernel syncs only on some
inputs and that are not in tensor.SYNC_OPS (e.g. isin's sorting path), collectives called
through torch.distributed.distributed_c10d directly, and NCCL-only collective forms that
gloo lacks (they fail as gloo errors). The other modules: tensor.py
(the wrapper tensor and the op table), patches.py (dist, triton, torch.cuda), record.py
(events, phases, summary), build.py (compiling the shim).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys

__all__ = ["available", "require", "ensure_preloaded", "session", "to_cuda", "to_cpu", "is_fake",
           "library_path", "preload_env"]


def library_path() -> str:
    """The compiled shim (compiled now if not cached); no torch import."""
    from .build import library_path as path
    return path()


def preload_env(env: dict | None = None) -> dict:
    """A copy of ``env`` (default os.environ) with the shim first in LD_PRELOAD."""
    from .build import preload_env as make
    return make(env)


def available() -> bool:
    """True when this process was started with the shim preloaded."""
    try:
        return bool(ctypes.CDLL(None).moepar_fake_cuda_loaded())
    except (AttributeError, OSError):
        return False


def require() -> None:
    if not available():
        raise RuntimeError(
            "fake_cuda: the shim is not loaded in this process; start it with "
            "LD_PRELOAD=$(python -m tests.helpers.fake_cuda.build) (it must be loaded before torch), or use "
            "tests.helpers.multiproc.run_ranks(..., fake_cuda=True) / fake_cuda.ensure_preloaded()")


def ensure_preloaded() -> None:
    """Re-execute this script with the shim in LD_PRELOAD unless it is loaded already (call
    it first thing in main(), before torch is imported)."""
    if available():
        return
    if os.environ.get("MOEPAR_FAKE_CUDA_REEXEC") == "1":
        require()
    env = preload_env()
    env["MOEPAR_FAKE_CUDA_REEXEC"] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def is_fake(t) -> bool:
    from .tensor import FakeCudaTensor
    return isinstance(t, FakeCudaTensor)


@contextlib.contextmanager
def session(strict: bool = True):
    """Everything inside runs as on a GPU with NCCL; yields the Recorder."""
    require()
    import torch  # noqa: F401
    from . import state
    from .patches import Patches, shim_syncs
    from .record import Recorder
    from .tensor import FakeCudaMode
    if state.active() is not None:
        raise RuntimeError("fake_cuda: sessions do not nest")
    rec = Recorder(strict=strict)
    patches = Patches(rec)
    patches.apply()
    state.set_active(rec)
    rec.start_sync_count(shim_syncs)
    try:
        with FakeCudaMode(rec):
            yield rec
    finally:
        rec.reconcile_syncs()
        state.set_active(None)
        patches.restore()


def _tensor_to_cuda(t, requires_grad=None):
    import torch
    from torch.utils._mode_utils import no_dispatch
    from .tensor import FakeCudaTensor
    if isinstance(t, FakeCudaTensor):
        return t
    rg = t.requires_grad if requires_grad is None else requires_grad
    with no_dispatch():
        inner = t.detach().clone()
    if type(inner) is not torch.Tensor:
        inner = inner.as_subclass(torch.Tensor)
    return FakeCudaTensor(inner, requires_grad=rg)


def _convert_module(module, fn):
    """Replace every parameter and buffer by ``fn(t)``. A wrapper tensor cannot take over a
    Parameter's data in place (as ``module.cuda()`` does), so the objects change: attributes
    are copied, and a module's other references to them (an alias, a list or dict of its
    parameters) follow. Hooks on a parameter cannot follow: that is an error."""
    import torch
    memo: dict[int, torch.Tensor] = {}
    keep = []   # the old tensors stay alive until the end: their ids key ``memo``
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
                raise RuntimeError(f"fake_cuda: parameter {name} of {type(mod).__name__} has hooks, which "
                                   f"cannot follow it to the new device tensor; register them after conversion")
            if id(p) not in memo:
                new = torch.nn.Parameter(fn(p.detach(), False), requires_grad=p.requires_grad)
                for k, v in p.__dict__.items():
                    if k not in ("inner", "_is_param"):
                        setattr(new, k, v)
                if p.grad is not None:
                    new.grad = fn(p.grad, False)
                memo[id(p)] = new
                keep.append(p)
            mod._parameters[name] = memo[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in memo:
                    memo[id(b)] = fn(b, False)
                    keep.append(b)
                mod._buffers[name] = memo[id(b)]

    def swap(v):
        return memo.get(id(v), v) if isinstance(v, torch.Tensor) else v
    for mod in module.modules():
        for k, v in list(vars(mod).items()):
            if k in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(v, torch.Tensor) and id(v) in memo:
                object.__setattr__(mod, k, memo[id(v)])
            elif isinstance(v, list):
                v[:] = [swap(e) for e in v]
            elif isinstance(v, tuple) and any(isinstance(e, torch.Tensor) and id(e) in memo for e in v):
                object.__setattr__(mod, k, type(v)(*map(swap, v)) if hasattr(v, "_fields") else
                                   tuple(map(swap, v)))
            elif isinstance(v, dict):
                for dk, dv in list(v.items()):
                    if isinstance(dv, torch.Tensor) and id(dv) in memo:
                        v[dk] = memo[id(dv)]
    del keep
    return module


def to_cuda(obj):
    """A tensor, module (in place: parameters and buffers, their attributes kept, as
    ``module.cuda()`` does) or list/tuple/dict of them, on fake CUDA. Tensors are copied
    (as ``.cuda()`` does); nothing is recorded."""
    import torch
    from torch.utils._pytree import tree_map
    if isinstance(obj, torch.nn.Module):
        return _convert_module(obj, _tensor_to_cuda)
    return tree_map(lambda t: _tensor_to_cuda(t) if isinstance(t, torch.Tensor) else t, obj)


def _tensor_to_cpu(t):
    return t.inner if is_fake(t) else t


def to_cpu(obj):
    """The inner CPU tensor(s) of fake-CUDA tensors (shared, not copied, not recorded); a
    module is converted back in place. Anything else is returned as it is."""
    import torch
    from torch.utils._pytree import tree_map
    if isinstance(obj, torch.nn.Module):
        return _convert_module(obj, lambda t, rg: t.inner if is_fake(t) else t)
    return tree_map(_tensor_to_cpu, obj)

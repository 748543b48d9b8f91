"""What a session patches, and why.

* ``torch.distributed`` (the package's attributes, which moepar calls as ``dist.xxx``): every
  collective checks that its tensors are fake-CUDA (NCCL refuses CPU tensors: a violation),
  records ``(op, global ranks of the group, bytes sent, phase, async_op)``, then runs the
  original gloo function on the inner CPU tensors, so numbers are real and exact; a Work
  handle comes back when ``async_op=True``. ``get_backend`` answers "nccl" (the processes
  underneath really are gloo ranks). ``barrier`` and the object collectives also count as
  host reads: on NCCL they block the host. Code that calls
  ``torch.distributed.distributed_c10d.xxx`` directly is not seen.
* Triton's interpreter launch (``InterpretedFunction.run``, used for ``@triton.jit`` under
  ``TRITON_INTERPRET=1``): fake-CUDA arguments are unwrapped, a CPU tensor is a violation (a
  real launch would fault), every launch is recorded by kernel name.
* ``torch.cuda``: a CPU build has no CUDA runtime; the layer asks for the capability
  ((9, 0): an H100/H200), device properties, streams and events. ``is_available()`` stays
  False, so moepar's RNG tracker and timing syncs keep their CPU branch. ``synchronize``
  counts as a host read. ``torch.Event`` / ``torch.Stream`` become subclasses whose
  ``synchronize()`` counts as a host read.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import types

import torch
import torch.distributed as dist

from .tensor import FakeCudaTensor

# op -> parameter names whose tensors this rank sends (for the byte count)
COLLECTIVES = {
    "all_reduce": ("tensor",), "all_gather": ("tensor",), "all_gather_into_tensor": ("input_tensor",),
    "reduce_scatter": ("input_list",), "reduce_scatter_tensor": ("input",),
    "all_to_all_single": ("input",), "all_to_all": ("input_tensor_list",), "broadcast": ("tensor",),
    "reduce": ("tensor",), "gather": ("tensor",), "scatter": ("scatter_list",), "barrier": (),
    "send": ("tensor",), "recv": ("tensor",), "isend": ("tensor",), "irecv": ("tensor",),
}
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


def _ranks(group) -> tuple[int, ...]:
    try:
        return tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
    except Exception:
        return tuple(range(dist.get_world_size(group)))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _unwrap(value, on_cpu):
    """``value`` with fake-CUDA tensors replaced by their inner ones; ``on_cpu(t)`` is
    called for each plain CPU tensor."""
    if isinstance(value, FakeCudaTensor):
        return value.inner
    if isinstance(value, torch.Tensor):
        on_cpu(value)
        return value
    if isinstance(value, list):
        return [_unwrap(v, on_cpu) for v in value]
    if isinstance(value, tuple):
        return type(value)(*(_unwrap(v, on_cpu) for v in value)) if hasattr(value, "_fields") else \
            tuple(_unwrap(v, on_cpu) for v in value)
    return value


def _collective(rec, name: str, orig):
    sig = inspect.signature(orig)
    sends = COLLECTIVES[name]

    @functools.wraps(orig)
    def patched(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        ranks = _ranks(group)
        nbytes = sum(t.numel() * t.element_size() for p in sends for t in _tensors(bound.arguments.get(p)))
        async_op = bool(bound.arguments.get("async_op", name in ("isend", "irecv")))
        rec.add_collective(name, ranks, nbytes, async_op)

        def on_cpu(t):
            rec.violation(f"NCCL needs CUDA tensors: {name} over ranks {list(ranks)} got a cpu tensor "
                          f"{tuple(t.shape)} {t.dtype}")
        for key, value in list(bound.arguments.items()):
            bound.arguments[key] = _unwrap(value, on_cpu)
        if name == "barrier" and not async_op:
            rec.add("host_read", "barrier", "dist.barrier")   # NCCL's barrier syncs the device
        return orig(*bound.args, **bound.kwargs)
    return patched


def _batch_isend_irecv(rec, orig):
    c10d = dist.distributed_c10d

    @functools.wraps(orig)
    def patched(p2p_op_list):
        ops = []
        for p in p2p_op_list:
            name = getattr(p.op, "__name__", "isend")
            group = p.group
            ranks = _ranks(group)
            rec.add_collective(f"batch_{name}", ranks, p.tensor.numel() * p.tensor.element_size(), True)

            def on_cpu(t, name=name, ranks=ranks):
                rec.violation(f"NCCL needs CUDA tensors: batch_isend_irecv ({name}) over ranks "
                              f"{list(ranks)} got a cpu tensor {tuple(t.shape)} {t.dtype}")
            ops.append(dist.P2POp(getattr(c10d, name), _unwrap(p.tensor, on_cpu), p.peer, group, p.tag))
        return orig(ops)
    return patched


def _object_collective(rec, name: str, orig):
    @functools.wraps(orig)
    def patched(*args, **kwargs):
        group = kwargs.get("group")
        rec.add_collective(name, _ranks(group), 0, False)
        rec.add("host_read", "object_collective", f"dist.{name}")   # pickles via the host
        return orig(*args, **kwargs)
    return patched


# ---- torch.cuda -----------------------------------------------------------------------------
FAKE_PROPERTIES = types.SimpleNamespace(
    name="NVIDIA H200 (fake_cuda)", major=9, minor=0, multi_processor_count=132,
    total_memory=141 * 1024 ** 3, is_integrated=False, is_multi_gpu_board=False,
    max_threads_per_multi_processor=2048, warp_size=32, L2_cache_size=60 * 1024 ** 2, gcnArchName="")


def _stream_classes(rec):
    base_stream, base_event = torch.Stream, torch.Event

    class _Meta(type(base_stream)):
        # isinstance(torch.accelerator.current_stream(), torch.Stream) stays True while
        # torch.Stream is the subclass below: any instance of the original class passes.
        def __instancecheck__(cls, obj):
            return isinstance(obj, cls.__mro__[1])

        def __subclasscheck__(cls, sub):
            return issubclass(sub, cls.__mro__[1])

    class FakeStream(base_stream, metaclass=_Meta):
        """torch.Stream / torch.cuda.Stream on the fake device; synchronize() is a host read."""
        def __new__(cls, device=None, priority=0, **kwargs):
            return super().__new__(cls, device="cuda", priority=priority)

        def synchronize(self):
            rec.add("host_read", "stream_sync", "Stream.synchronize")
            rec.attributed_syncs += 1
            return super().synchronize()

        @property
        def cuda_stream(self):
            return self.stream_id

    class FakeEvent(base_event, metaclass=_Meta):
        """torch.Event / torch.cuda.Event on the fake device; synchronize() is a host read."""
        def __new__(cls, device=None, *, enable_timing=False, blocking=False, interprocess=False, **kwargs):
            return super().__new__(cls, device="cuda", enable_timing=enable_timing, blocking=blocking,
                                   interprocess=interprocess)

        def __init__(self, *args, **kwargs):
            pass

        def synchronize(self):
            rec.add("host_read", "event_sync", "Event.synchronize")
            rec.attributed_syncs += 1
            return super().synchronize()

    return FakeStream, FakeEvent


def shim_syncs() -> int:
    """Host waits the shim's guard saw (event, stream and device synchronize), all kinds."""
    lib = ctypes.CDLL(None)
    return sum(lib.moepar_fake_cuda_syncs(i) for i in range(3))


class Patches:
    """Apply and restore every patch of one session."""

    def __init__(self, rec):
        self.rec = rec
        self._saved: list[tuple[object, str, object]] = []

    def _set(self, obj, name: str, value) -> None:
        self._saved.append((obj, name, getattr(obj, name, _MISSING)))
        setattr(obj, name, value)

    def apply(self) -> None:
        rec = self.rec
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._set(dist, name, _collective(rec, name, getattr(dist, name)))
        self._set(dist, "batch_isend_irecv", _batch_isend_irecv(rec, dist.batch_isend_irecv))
        for name in OBJECT_COLLECTIVES:
            if hasattr(dist, name):
                self._set(dist, name, _object_collective(rec, name, getattr(dist, name)))
        self._set(dist, "get_backend", lambda group=None: "nccl")
        self._patch_triton()
        self._patch_cuda()
        self._patch_constructors()

    def _patch_triton(self) -> None:
        try:
            from triton.runtime import interpreter
        except Exception:
            return
        rec, orig = self.rec, interpreter.InterpretedFunction.run

        @functools.wraps(orig)
        def run(fn_self, *args, grid, warmup, **kwargs):
            name = getattr(fn_self.fn, "__name__", "kernel")
            if not warmup:
                rec.add_launch(name)

            def on_cpu(t):
                rec.violation(f"Triton kernel {name} got a cpu tensor {tuple(t.shape)} {t.dtype} "
                              f"(a GPU launch would fault)")
            args = tuple(_unwrap(a, on_cpu) for a in args)
            kwargs = {k: _unwrap(v, on_cpu) for k, v in kwargs.items()}
            return orig(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
        self._set(interpreter.InterpretedFunction, "run", run)

    def _patch_cuda(self) -> None:
        rec, cuda = self.rec, torch.cuda
        FakeStream, FakeEvent = _stream_classes(rec)

        def synchronize(device=None):
            rec.add("host_read", "device_sync", "torch.cuda.synchronize")
            rec.attributed_syncs += 1
            torch._C._accelerator_synchronizeDevice(0)

        def accel_synchronize(device=None):
            synchronize(device)

        @contextlib.contextmanager
        def stream(s):
            if s is None:
                yield
                return
            with s:
                yield
        self._set(cuda, "_lazy_init", lambda: None)
        self._set(cuda, "get_device_capability", lambda device=None: (FAKE_PROPERTIES.major, FAKE_PROPERTIES.minor))
        self._set(cuda, "get_device_properties", lambda device=None: FAKE_PROPERTIES)
        self._set(cuda, "get_device_name", lambda device=None: FAKE_PROPERTIES.name)
        self._set(cuda, "current_device", lambda: 0)
        self._set(cuda, "device_count", lambda: 1)
        self._set(cuda, "set_device", lambda device: None)
        self._set(cuda, "synchronize", synchronize)
        self._set(cuda, "Stream", FakeStream)
        self._set(cuda, "Event", FakeEvent)
        self._set(cuda, "current_stream", lambda device=None: torch.accelerator.current_stream(torch.device("cuda", 0)))
        self._set(cuda, "default_stream", lambda device=None: torch.Stream(stream_id=0, device_type=1, device_index=0))
        self._set(cuda, "stream", stream)
        self._set(torch, "Stream", FakeStream)
        self._set(torch, "Event", FakeEvent)
        self._set(torch.accelerator, "synchronize", accel_synchronize)

    def _patch_constructors(self) -> None:
        """torch.tensor / as_tensor / asarray / Tensor.new_tensor build host data in C++ with
        Python dispatch switched off, so the mode never sees them: on "cuda" they are a
        blocking copy of host data to the device, recorded here."""
        rec = self.rec
        orig_tensor, orig_as_tensor, orig_asarray = torch.tensor, torch.as_tensor, torch.asarray

        def make(orig, name, data, dtype=None, device=None, requires_grad=False, pin_memory=False, **kw):
            dev = torch.device(device) if device is not None else None
            if isinstance(data, FakeCudaTensor):   # a copy of a device tensor: ordinary ops
                out = data.detach().clone().to(device=dev or data.device, dtype=dtype or data.dtype)
                return out.requires_grad_(requires_grad)
            if isinstance(data, (list, tuple)) and any(isinstance(d, FakeCudaTensor) for d in data):
                # 0-dim device tensors in a list: each is read on the host (.item(), recorded).
                data = [d.item() if isinstance(d, FakeCudaTensor) else d for d in data]
            if dev is None or dev.type != "cuda":
                return orig(data, dtype=dtype, device=device, requires_grad=requires_grad,
                            **({"pin_memory": pin_memory} if pin_memory else {}), **kw)
            from torch.utils._mode_utils import no_dispatch
            with no_dispatch():
                host = orig(data, dtype=dtype, device="cpu", **kw)
            if isinstance(host, torch.Tensor) and not isinstance(host, FakeCudaTensor):
                rec.add("blocking_h2d", "h2d", name, host.numel() * host.element_size())
                return FakeCudaTensor(host.detach(), requires_grad=requires_grad)
            return host

        def tensor(data, *, dtype=None, device=None, requires_grad=False, pin_memory=False):
            return make(orig_tensor, "torch.tensor", data, dtype, device, requires_grad, pin_memory)

        def as_tensor(data, dtype=None, device=None):
            if isinstance(data, torch.Tensor):
                return orig_as_tensor(data, dtype=dtype, device=device)
            return make(orig_as_tensor, "torch.as_tensor", data, dtype, device)

        def asarray(obj, *, dtype=None, device=None, copy=None, requires_grad=False):
            if isinstance(obj, torch.Tensor):
                return orig_asarray(obj, dtype=dtype, device=device, copy=copy, requires_grad=requires_grad)
            return make(orig_asarray, "torch.asarray", obj, dtype, device, requires_grad)

        def new_tensor(self, data, dtype=None, device=None, requires_grad=False, **kw):
            return make(orig_tensor, "Tensor.new_tensor", data, dtype or self.dtype,
                        device if device is not None else self.device, requires_grad)
        self._set(torch, "tensor", tensor)
        self._set(torch, "as_tensor", as_tensor)
        self._set(torch, "asarray", asarray)
        self._set(torch.Tensor, "new_tensor", new_tensor)

    def restore(self) -> None:
        for obj, name, value in reversed(self._saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        self._saved.clear()


_MISSING = object()

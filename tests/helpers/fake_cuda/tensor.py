"""FakeCudaTensor: a tensor whose device is "cuda" and whose data is a real CPU tensor.

``FakeCudaTensor(inner)`` is a wrapper subclass (``_make_wrapper_subclass``): autograd and
every caller see device ``cuda:0``; ``__torch_dispatch__`` runs each aten op on the inner
CPU tensors and wraps the results again. Views wrap the inner view (in-place ops through a
view show in the base, as on a GPU); in-place and ``out=`` ops return the wrapper they were
given. Inside a session the ``FakeCudaMode`` (a TorchDispatchMode) takes every op first, also
those on plain CPU tensors and factory calls with ``device="cuda"``, and ``dispatch`` below
tells the recorder what a GPU would pay for it (host reads, host->device copies) or crash on
(a CPU tensor mixed into a CUDA op).

Needs the shim (shim.cpp) preloaded: without it a CPU-only torch refuses "cuda" tensors.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


class FakeCudaTensor(torch.Tensor):
    """Device "cuda:0" on the outside, ``self.inner`` (a CPU tensor) on the inside."""

    inner: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor, requires_grad: bool = False):
        assert type(inner) is torch.Tensor and inner.device.type == "cpu", type(inner)
        r = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, layout=inner.layout, device=CUDA, requires_grad=requires_grad)
        r.inner = inner
        return r

    def __repr__(self, *, tensor_contents=None):
        from . import state
        rec = state.active()
        if rec is not None:
            rec.add("host_read", "repr", "Tensor.__repr__", self.inner.nbytes)
        return f"FakeCudaTensor({self.inner!r}, device='cuda:0')"

    def tolist(self):
        # A host read on a GPU (the C++ tolist refuses subclasses, so it is done here).
        from . import state
        rec = state.active()
        if rec is not None:
            rec.add("host_read", "tolist", "Tensor.tolist", self.inner.nbytes)
        return self.inner.tolist()

    def numpy(self, *, force=False):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first. (fake_cuda: as on a GPU)")

    def __array__(self, dtype=None, copy=None):
        return self.numpy()

    def data_ptr(self):
        return self.inner.data_ptr()

    def untyped_storage(self):
        return self.inner.untyped_storage()

    def __reduce_ex__(self, protocol):
        # Pickled (e.g. a gloo worker's result) as the plain CPU tensor it holds.
        return self.inner.detach().clone().__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only outside a session (the mode takes every op first inside one).
        return dispatch(func, args, kwargs or {}, None, None)


def wrap(t: torch.Tensor, requires_grad: bool = False) -> FakeCudaTensor:
    return FakeCudaTensor(t, requires_grad=requires_grad)


class FakeCudaMode(TorchDispatchMode):
    """Active for a session: every aten op comes here first."""

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {}, self.rec, self)


# ---- tables -------------------------------------------------------------------------------
# Ops whose CUDA kernel reads a device value on the host (a stream sync), keyed by the
# overload packet's name, with the kind recorded. Those that are CompositeImplicit in
# torch (is_nonzero, allclose, narrow with a tensor start, where(cond) ...) reach the mode as
# their parts (_local_scalar_dense, nonzero) and need no entry.
SYNC_OPS = {
    "_local_scalar_dense": "item",
    "nonzero": "nonzero",                 # nonzero_static is the sync-free one
    "masked_select": "masked_select",
    "bincount": "bincount",               # max().item() sizes the output
    "_unique": "unique", "_unique2": "unique", "unique_dim": "unique",
    "unique_consecutive": "unique", "unique_dim_consecutive": "unique",
    "equal": "equal",
    "is_nonzero": "item",
    "item": "item",                       # reaches the mode whole below autograd (a custom op's body)
    "_linalg_check_errors": "linalg_check",
    "allclose": "allclose",               # isclose().all().item() inside the kernel
    "multinomial": "multinomial",         # validates the probabilities with .item()
    "embedding_renorm_": "unique",
}
# Ops that take a 0-dim *device* tensor as a value and call .item() on it in their CUDA kernel.
SCALAR_VALUE_OPS = {"masked_fill", "masked_fill_", "index_fill", "index_fill_"}
INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"}
COPY_OPS = {"copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "copy"}
COPY_TO_OPS = ("_to_copy", "to")   # copies to a device named in the call (to: a custom op's body)
# Ops that launch nothing on a GPU: views, metadata, allocations (the caching allocator).
NO_KERNEL_OPS = {"view", "_unsafe_view", "t", "detach", "expand", "as_strided", "reshape", "transpose", "permute",
                 "slice", "select", "unsqueeze", "squeeze", "alias", "split", "split_with_sizes", "unbind",
                 "narrow", "_reshape_alias", "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty",
                 "new_empty_strided", "set_", "resize_", "is_pinned", "_pin_memory", "view_as_real",
                 "view_as_complex", "_has_compatible_shallow_copy_type", "is_same_size", "sym_size", "sym_stride",
                 "sym_numel", "sym_storage_offset", "_local_scalar_dense", "item", "record_stream", "movedim",
                 "unflatten", "flatten", "chunk", "contiguous", "expand_as", "view_as", "squeeze_", "unsqueeze_", "t_",
                 "transpose_", "as_strided_", "detach_"}
# Ops that may take CPU tensors next to CUDA ones on a real GPU.
MIX_ALLOWED = COPY_OPS | INDEX_OPS | {"lift_fresh", "lift_fresh_copy", "tensor_split", "set_",
                                      "_has_compatible_shallow_copy_type", "is_same_size",
                                      "_pin_memory", "is_pinned"}


def _packet(func) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


def _device_of(v) -> torch.device | None:
    if v is None:
        return None
    return torch.device(v) if not isinstance(v, torch.device) else v


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _is_cpu_tensor(a) -> bool:
    return isinstance(a, torch.Tensor) and not isinstance(a, FakeCudaTensor) and a.device.type == "cpu"


def _is_bool_index(i) -> bool:
    return isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)


def _arg(func, args, kwargs, name: str, default=None):
    """The value of argument ``name`` of this call, by the op's schema."""
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) and not a.kwarg_only else default
    return default


def _custom_op_fn(func):
    """The Python implementation of a ``torch.library.custom_op`` (moepar::routing ...), so
    that it runs on the fake-CUDA tensors themselves (its Triton launch then sees them)."""
    ns = getattr(func, "namespace", "aten")
    if ns in ("aten", "prim", "prims", "_c10d_functional", "c10d"):
        return None
    try:
        from torch._library.custom_ops import _maybe_get_opdef
        opdef = _maybe_get_opdef(func._schema.name)
    except Exception:
        return None
    if opdef is None:
        return None
    fns = opdef._backend_fns
    return fns.get("cuda") or fns.get(None)


def _copy_target(func, name: str, args, kwargs) -> torch.device | None:
    """The device a ``_to_copy`` / ``to`` copies to (None: stays where it is)."""
    if name == "to" and len(args) > 1 and isinstance(args[1], torch.Tensor):   # to.other
        return torch.device("cuda") if isinstance(args[1], FakeCudaTensor) else args[1].device
    return _device_of(_arg(func, args, kwargs, "device") if name == "to" else kwargs.get("device"))


def _classify(func, name: str, args, kwargs, flat, fakes, rec, target: torch.device | None) -> None:
    """Tell the recorder what this op costs on a GPU, or that a GPU would refuse it.
    ``target``: where a ``_to_copy`` / ``to`` copies to (``_copy_target``)."""
    if name in COPY_TO_OPS:
        # ``to`` reaches the mode whole (not as _to_copy) below autograd: a custom op's body.
        src, dst = args[0], target
        nb = bool(_arg(func, args, kwargs, "non_blocking", False))
        if isinstance(src, FakeCudaTensor) and dst is not None and dst.type == "cpu":
            rec.add("async_d2h" if nb else "host_read", "d2h", str(func), _nbytes(src))
        elif _is_cpu_tensor(src) and dst is not None and dst.type == "cuda":
            pinned = src.is_pinned()
            rec.add("async_h2d" if (nb and pinned) else "blocking_h2d", "h2d", str(func), _nbytes(src))
        return
    if name in ("copy_", "copy", "_copy_from", "_copy_from_and_resize"):
        dst, src = (args[0], args[1]) if name != "_copy_from" else (args[1], args[0])
        nb = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if isinstance(dst, FakeCudaTensor) and _is_cpu_tensor(src):
            pinned = src.is_pinned()
            rec.add("async_h2d" if (nb and pinned) else "blocking_h2d", "h2d", str(func), _nbytes(src))
        elif _is_cpu_tensor(dst) and isinstance(src, FakeCudaTensor):
            pinned = dst.is_pinned()
            rec.add("async_d2h" if (nb and pinned) else "host_read", "d2h", str(func), _nbytes(src))
        return
    if not fakes:
        return
    kind = SYNC_OPS.get(name)
    if kind is not None:
        rec.add("host_read", kind, str(func))
    elif name == "histc" and _arg(func, args, kwargs, "min", 0) == _arg(func, args, kwargs, "max", 0):
        rec.add("host_read", "histc", str(func))   # min == max: the kernel reads min() and max()
    elif name == "repeat_interleave" and _arg(func, args, kwargs, "output_size") is None and \
            isinstance(_arg(func, args, kwargs, "repeats"), FakeCudaTensor):
        # Tensor repeats and no output_size: the output's length is repeats.sum().item().
        rec.add("host_read", "repeat_interleave", str(func))
    elif name in SCALAR_VALUE_OPS:
        value = args[-1] if args else None
        if isinstance(value, FakeCudaTensor):
            rec.add("host_read", "item", f"{func} (0-dim device value)")
    elif name in INDEX_OPS:
        _classify_index(func, name, args, kwargs, rec)
    elif name == "_pin_memory" and isinstance(args[0], FakeCudaTensor):
        rec.violation(f"{func}: cannot pin a CUDA tensor")
    # A CPU tensor (dim > 0) next to CUDA tensors: "Expected all tensors to be on the same device".
    # Indexing takes CPU indices (copied to the device), not CPU self or values.
    operands = flat if name not in INDEX_OPS else [a for k, a in enumerate(args) if k != 1]
    if (name not in MIX_ALLOWED or name in INDEX_OPS) and "device" not in kwargs:
        mixed = [a for a in operands if _is_cpu_tensor(a) and a.dim() > 0]
        if mixed:
            shapes = ", ".join(f"cpu{tuple(a.shape)}" for a in mixed[:3])
            rec.violation(f"device mix in {func}: {shapes} with cuda tensors "
                          f"(Expected all tensors to be on the same device)")
    gen = kwargs.get("generator")
    if gen is not None and gen.device.type != "cuda":
        rec.violation(f"{func}: a {gen.device.type} generator for a cuda op")


def _classify_index(func, name, args, kwargs, rec) -> None:
    """x[idx] and x[idx] = v as CUDA's index / _index_put_impl_ run them: a device bool mask
    goes through nonzero (a host read), CPU indices are copied to the device (blocking), and
    a CPU scalar value is copied too, except on the masked_fill path (one device bool mask,
    a 1-element CPU value, no accumulate), which reads the value on the host for free."""
    indices = [i for i in (_arg(func, args, kwargs, "indices") or ()) if i is not None]
    if name != "index":
        value = _arg(func, args, kwargs, "values")
        accumulate = bool(_arg(func, args, kwargs, "accumulate", False))
        if (not accumulate and _is_cpu_tensor(value) and value.numel() == 1 and len(indices) == 1
                and _is_bool_index(indices[0]) and isinstance(indices[0], FakeCudaTensor)):
            return                                   # self.masked_fill_(mask, value.item())
        if _is_cpu_tensor(value) and value.dim() == 0:
            rec.add("blocking_h2d", "cpu_scalar_value", str(func), _nbytes(value))
    if any(_is_bool_index(i) and isinstance(i, FakeCudaTensor) for i in indices):
        rec.add("host_read", "bool_index", str(func))
    for i in indices:
        if _is_cpu_tensor(i):
            rec.add("blocking_h2d", "cpu_index", str(func), _nbytes(i))


def dispatch(func, args, kwargs, rec, mode):
    """Run ``func`` on the inner CPU tensors; wrap outputs that would live on the GPU."""
    name = _packet(func)
    flat, spec = tree_flatten((args, kwargs))
    fakes = [a for a in flat if isinstance(a, FakeCudaTensor)]
    dev = _device_of(kwargs.get("device"))
    custom = _custom_op_fn(func)
    if custom is not None:
        if mode is not None:
            with mode:
                return custom(*args, **kwargs)
        return custom(*args, **kwargs)
    target = _copy_target(func, name, args, kwargs) if name in COPY_TO_OPS else None
    if rec is not None:
        _classify(func, name, args, kwargs, flat, fakes, rec, target)
        if (fakes or (dev is not None and dev.type == "cuda")) and name not in NO_KERNEL_OPS:
            rec.add_device_op(name)
    # Which device the result lives on, as CUDA would place it.
    if name in COPY_TO_OPS:
        on_cuda = target.type == "cuda" if target is not None else isinstance(args[0], FakeCudaTensor)
    elif dev is not None:
        on_cuda = dev.type == "cuda"
    else:
        on_cuda = bool(fakes)
    inner_of = {}
    cpu_ids = {id(a) for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, FakeCudaTensor)}
    unflat = []
    for a in flat:
        if isinstance(a, FakeCudaTensor):
            inner_of[id(a.inner)] = a
            unflat.append(a.inner)
        elif isinstance(a, torch.device) and a.type == "cuda":
            unflat.append(CPU)
        else:
            unflat.append(a)
    u_args, u_kwargs = tree_unflatten(unflat, spec)
    if dev is not None and dev.type == "cuda":
        u_kwargs["device"] = CPU
    if name in ("_to_copy", "empty", "empty_strided", "empty_like", "new_empty") and u_kwargs.get("pin_memory") \
            and on_cuda:
        u_kwargs["pin_memory"] = False
    if name == "is_pinned" and fakes:
        return False
    out = func(*u_args, **u_kwargs)
    if name == "to" and (on_cuda != isinstance(args[0], FakeCudaTensor)) and \
            (out is args[0] or out is getattr(args[0], "inner", None)):
        out = out.clone()     # to() of the CPU data returns it as is: a GPU copies across

    def rewrap(o):
        if not isinstance(o, torch.Tensor):
            return o
        w = inner_of.get(id(o))
        if w is not None:     # in-place / out= / copy_: the very wrapper given
            if w.shape != o.shape or w.stride() != o.stride():
                raise NotImplementedError(
                    f"fake_cuda: {func} changed a tensor's shape or strides in place "
                    f"({tuple(w.shape)} -> {tuple(o.shape)}); wrapper metadata cannot follow. "
                    f"Allocate the output at its size instead")
            return w
        if not on_cuda or o.device.type != "cpu" or id(o) in cpu_ids:
            return o
        return FakeCudaTensor(o)

    flat_out, out_spec = tree_flatten(out)
    return tree_unflatten([rewrap(o) for o in flat_out], out_spec)

"""The kernels' custom ops called in eager mode through a plain autograd Function.

``torch.library.custom_op`` is what makes ``permute``, ``unpermute`` and ``routing``
traceable by ``torch.compile``; an eager call of one also pays its Python dispatch
(argument defaults, the autograd wrapper, a redispatch to the backend). On a GPU host that
costs as much as the launch it wraps (measured on an H200: docs/benchmarks.md, "First GPU
run"). ``both(op, impl, setup_context, backward)`` gives one callable: under torch.compile
the registered op, otherwise an autograd Function running the same three functions the op
registers, so the two paths compute, save and differentiate alike. A backward that calls
another op reads ``ctx.eager`` (set on the Function's path only) to stay on its path: a
traced graph never meets the Function.
"""
from __future__ import annotations

from typing import Callable

import torch


def tracing() -> bool:
    """torch.compile / export, or a make_fx trace (fake or proxy tensors): take the ops."""
    if torch.compiler.is_compiling():
        return True
    get, keys = getattr(torch._C, "_get_dispatch_mode", None), getattr(torch._C, "_TorchDispatchModeKey", None)
    return get is not None and keys is not None and (get(keys.FAKE) is not None or get(keys.PROXY) is not None)


def both(op: Callable, impl: Callable, setup_context: Callable | None = None,
         backward: Callable | None = None, grad_args: tuple[int, ...] = (0,)) -> Callable:
    """``op`` while torch.compile traces, else ``impl`` as an autograd Function with the
    op's ``setup_context``/``backward`` (None: not differentiable, a plain call).
    ``grad_args``: the positions of the arguments that may need a gradient; the Function
    takes those and one tuple of the rest (``Function.apply`` pays Python work per argument)."""
    if backward is None:
        def call(*args):
            return op(*args) if tracing() else impl(*args)
        return call

    class Fn(torch.autograd.Function):
        # The forward takes ctx (no separate setup_context): Function.apply then binds no
        # default arguments through inspect.signature, Python work on every call.
        @staticmethod
        def forward(ctx, *inputs):
            args = inputs[-1]   # the given tensors of grad_args are these same objects
            args = args + defaults[len(args) - required:]
            output = impl(*args)
            ctx.eager = True
            setup_context(ctx, args, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            every = backward(ctx, *grads)
            if len(grad_args) == 1:   # no generator: each resumption is a Python call
                return every[grad_args[0]], None
            return tuple([every[i] for i in grad_args]) + (None,)

    # The op's trailing defaults, for a call that leaves them out (setup_context reads all).
    import inspect
    params = list(inspect.signature(impl).parameters.values())
    required = sum(1 for p in params if p.default is inspect.Parameter.empty)
    defaults = tuple(p.default for p in params[required:])
    Fn.__name__ = Fn.__qualname__ = f"{impl.__name__.strip('_')}_eager"

    def call(*args):
        if tracing():
            return op(*args)
        return Fn.apply(*[args[i] for i in grad_args], args)
    return call

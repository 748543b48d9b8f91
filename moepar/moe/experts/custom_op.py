"""GroupedExperts as ``torch.library`` custom ops, the path taken under ``torch.compile``.

The experts need the per-expert row counts on the host to size their GEMMs; traced by
dynamo, that host read (``tolist``) is a graph break. Behind a custom op the read happens
inside the op at run time, and the compiled graph holds one opaque node with a fake
(shape-only) implementation: no break. Eager mode keeps ``ExpertsFunction`` directly.

``moepar::experts_fwd(x, w1, w2, w3?, b1?, b2?, b3?, counts, path, activation) -> y`` runs
the same Function (same GEMM paths, same numbers) without keeping its intermediates;
``moepar::experts_bwd`` recomputes the forward inside and returns every gradient (absent
tensors as empty ones). The price is one extra forward of the experts in backward, like
activation recomputation, and only under ``torch.compile``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .function import ExpertsFunction, check_counts, resolve_gemm_path

_Opt = Optional[torch.Tensor]


def _apply(x, w1, w2, w3, b1, b2, b3, counts_t, path, activation):
    counts = check_counts([int(c) for c in counts_t.tolist()], w1.shape[0], x.shape[0])
    path = resolve_gemm_path(path, x.device, x.dtype, counts, w1.shape[1], w1.shape[2], x.shape[0])
    return ExpertsFunction.apply(x, w1, w2, w3, b1, b2, b3, (counts, None, path, activation, None, None, None))


@torch.library.custom_op("moepar::experts_fwd", mutates_args=())
def experts_fwd(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: _Opt, b1: _Opt, b2: _Opt, b3: _Opt,
                counts: torch.Tensor, path: str, activation: str) -> torch.Tensor:
    with torch.no_grad():
        return _apply(x, w1, w2, w3, b1, b2, b3, counts, path, activation)


@experts_fwd.register_fake
def _(x, w1, w2, w3, b1, b2, b3, counts, path, activation):
    return x.new_empty(x.shape[0], w2.shape[2])


@torch.library.custom_op("moepar::experts_bwd", mutates_args=())
def experts_bwd(gy: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: _Opt, b1: _Opt,
                b2: _Opt, b3: _Opt, counts: torch.Tensor, path: str, activation: str) -> list[torch.Tensor]:
    inputs = [t.detach().requires_grad_() if t is not None else None for t in (x, w1, w2, w3, b1, b2, b3)]
    with torch.enable_grad():
        y = _apply(*inputs, counts, path, activation)
        live = [t for t in inputs if t is not None]
        grads = iter(torch.autograd.grad(y, live, gy, allow_unused=True))
    out = []
    for t in inputs:
        g = next(grads) if t is not None else None
        out.append(g if g is not None else (torch.zeros_like(t) if t is not None else x.new_empty(0)))
    return out


@experts_bwd.register_fake
def _(gy, x, w1, w2, w3, b1, b2, b3, counts, path, activation):
    return [torch.empty_like(t) if t is not None else x.new_empty(0) for t in (x, w1, w2, w3, b1, b2, b3)]


def _setup(ctx, inputs, output):
    x, w1, w2, w3, b1, b2, b3, counts, path, activation = inputs
    ctx.save_for_backward(x, w1, w2, w3, b1, b2, b3, counts)
    ctx.path, ctx.activation = path, activation


def _backward(ctx, gy):
    x, w1, w2, w3, b1, b2, b3, counts = ctx.saved_tensors
    grads = experts_bwd(gy.contiguous(), x, w1, w2, w3, b1, b2, b3, counts, ctx.path, ctx.activation)
    present = (x, w1, w2, w3, b1, b2, b3)
    return (*[g if t is not None else None for g, t in zip(grads, present)], None, None, None)


experts_fwd.register_autograd(_backward, setup_context=_setup)

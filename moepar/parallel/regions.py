"""Tensor-parallel region ops (Megatron's "mappings"): autograd functions whose backward is
their forward's mirror (all-gather <-> split or reduce-scatter, identity <-> all-reduce).
The TP layers (``moepar.parallel.tensor_parallel``), the shared experts and the MoE layer's
TP/ETP steps enter and leave their regions through them. Each is a no-op that issues no
communication call when its group is ``None`` or has one rank.

They are built on the recorded collectives of ``moepar.parallel.comm`` (which also holds the
EP all-to-all), so each call is counted there with its bytes. Legend (docs/moe.md): N rows (tokens or
routes), D hidden (any row width); a group's size is spelled out.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .comm import CommStats, _tuple, all_gather_rows, all_reduce_, group_rank, group_size, reduce_scatter_rows


def _move_first(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if dim == 0 else x.movedim(dim, 0)


def _move_back(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if dim == 0 else x.movedim(0, dim)


def _own_rows(x: torch.Tensor, group, sizes: Sequence[int] | None) -> torch.Tensor:
    size, rank = group_size(group), group_rank(group)
    if sizes is None:
        if x.shape[0] % size:
            raise ValueError(f"cannot split {x.shape[0]} rows evenly over a group of {size} ranks")
        n = x.shape[0] // size
        return x[rank * n:(rank + 1) * n]
    start = sum(sizes[:rank])
    return x[start:start + sizes[rank]]


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce_(g.contiguous().clone(), ctx.group, backward=True, stats=ctx.stats), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):
        return all_reduce_(x.contiguous().clone(), group, stats=stats)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


# The four row-block functions share one signature: (x, group, dim, sizes, stats).
def _gather(ctx, x, backward=False):
    return _move_back(all_gather_rows(_move_first(x, ctx.dim), ctx.group, ctx.sizes, backward, ctx.stats), ctx.dim)


def _split(ctx, x):
    return _move_back(_own_rows(_move_first(x, ctx.dim), ctx.group, ctx.sizes), ctx.dim).contiguous()


def _reduce_scatter(ctx, x, backward=False):
    return _move_back(reduce_scatter_rows(_move_first(x, ctx.dim), ctx.group, ctx.sizes, backward, ctx.stats),
                      ctx.dim)


class _RowBlockOp(torch.autograd.Function):
    """Base: saves (group, dim, sizes, stats); subclasses define fwd/bwd by name."""
    fwd = bwd = None

    @classmethod
    def forward(cls, ctx, x, group, dim, sizes, stats):
        ctx.group, ctx.dim, ctx.sizes, ctx.stats = group, dim, sizes, stats
        return cls.fwd(ctx, x)

    @classmethod
    def backward(cls, ctx, g):
        return cls.bwd(ctx, g), None, None, None, None


class _Split(_RowBlockOp):  # forward: own block; backward: all-gather
    fwd = staticmethod(_split)
    bwd = staticmethod(lambda ctx, g: _gather(ctx, g, backward=True))


class _Gather(_RowBlockOp):  # forward: all-gather; backward: own block (replicated downstream)
    fwd = staticmethod(_gather)
    bwd = staticmethod(_split)


class _GatherPartials(_RowBlockOp):  # forward: all-gather; backward: reduce-scatter
    fwd = staticmethod(_gather)
    bwd = staticmethod(lambda ctx, g: _reduce_scatter(ctx, g, backward=True))


class _ReduceScatter(_RowBlockOp):  # forward: reduce-scatter; backward: all-gather
    fwd = staticmethod(_reduce_scatter)
    bwd = staticmethod(lambda ctx, g: _gather(ctx, g, backward=True))


def copy_to_region(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (entering a TP region)."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group, stats)


def reduce_from_region(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """All-reduce forward (bytes = x bytes), identity backward (leaving a TP region)."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group, stats)


def _row_block(fn_cls, x, group, dim, sizes, stats):
    if group_size(group) == 1:
        return x
    return fn_cls.apply(x, group, dim % x.dim(), _tuple(sizes), stats)


def scatter_to_region(x: torch.Tensor, group, dim: int = -1, sizes: Sequence[int] | None = None,
                      stats: CommStats | None = None) -> torch.Tensor:
    """Keep this rank's block of ``dim`` (even, or ``sizes``); backward all-gathers."""
    return _row_block(_Split, x, group, dim, sizes, stats)


def gather_from_region(x: torch.Tensor, group, dim: int = -1, sizes: Sequence[int] | None = None,
                       stats: CommStats | None = None) -> torch.Tensor:
    """All-gather along ``dim``; backward keeps this rank's block of the gradient."""
    return _row_block(_Gather, x, group, dim, sizes, stats)


def gather_partial_grads(x: torch.Tensor, group, dim: int = 0, sizes: Sequence[int] | None = None,
                         stats: CommStats | None = None) -> torch.Tensor:
    """All-gather along ``dim`` for ranks that each compute a partial sum from the whole
    (sequence parallelism's TP linears, the expert-TP ranks' FFN slices); so backward
    reduce-scatters the gradient: each rank gets its block of the summed partials."""
    return _row_block(_GatherPartials, x, group, dim, sizes, stats)


def reduce_scatter_to_region(x: torch.Tensor, group, dim: int = 0, sizes: Sequence[int] | None = None,
                             stats: CommStats | None = None) -> torch.Tensor:
    """Reduce-scatter along ``dim``; backward all-gathers the gradient."""
    return _row_block(_ReduceScatter, x, group, dim, sizes, stats)

"""Autograd collectives over explicit process groups: each forward collective's backward
is its mirror (all-to-all <-> reverse all-to-all, all-gather <-> split or reduce-scatter,
identity <-> all-reduce), and each is a no-op that issues no communication call when its
group is ``None`` or has one rank.

The recorded collectives they are built on, and the byte/time accounting (``CommStats``,
``track``, bytes per op), live in ``moepar.parallel.collectives`` and are re-exported here:
``comm`` is the one module callers import. Legend: N rows (tokens or routes), D features,
P group size.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

# Re-exported: the plain collectives and their accounting (see the module docstring).
from .collectives import (CommEvent, CommStats, EmptyFn, Pending, all_gather_rows,  # noqa: F401
                          all_reduce_, all_to_all_rows, all_to_all_rows_start, group_rank, group_size,
                          peer_wait_timing, record, reduce_scatter_rows, small_device, split_sizes,
                          synchronized_timing, track)


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


class _GatherSequence(_RowBlockOp):  # forward: all-gather; backward: reduce-scatter
    fwd = staticmethod(_gather)
    bwd = staticmethod(lambda ctx, g: _reduce_scatter(ctx, g, backward=True))


class _ReduceScatter(_RowBlockOp):  # forward: reduce-scatter; backward: all-gather
    fwd = staticmethod(_reduce_scatter)
    bwd = staticmethod(lambda ctx, g: _gather(ctx, g, backward=True))


class _AllToAll(torch.autograd.Function):
    """``raw`` (all_to_all_rows, with an allocator bound) forward; the same with the splits
    swapped backward."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, stats, raw):
        ctx.group, ctx.out_s, ctx.in_s, ctx.stats, ctx.raw = group, out_splits, in_splits, stats, raw
        return raw(x, group, out_splits, in_splits, stats=stats)

    @staticmethod
    def backward(ctx, g):
        return (ctx.raw(g, ctx.group, ctx.in_s, ctx.out_s, backward=True, stats=ctx.stats),
                None, None, None, None, None)


class _AllToAllAsync(torch.autograd.Function):
    """Forward: the all-to-all issued with ``async_op=True`` (its output is filled once the
    ``Pending`` is waited on, ``wait_for``); backward: the reverse all-to-all, synchronous."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, stats, empty, pending):
        ctx.group, ctx.out_s, ctx.in_s, ctx.stats, ctx.empty = group, out_splits, in_splits, stats, empty
        return all_to_all_rows_start(x, group, out_splits, in_splits, pending, stats, empty)

    @staticmethod
    def backward(ctx, g):
        return (all_to_all_rows(g, ctx.group, ctx.in_s, ctx.out_s, backward=True, stats=ctx.stats, empty=ctx.empty),
                None, None, None, None, None, None)


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, pending):
        pending.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        return g, None


def all_to_all_start(x: torch.Tensor, group, output_split_sizes: Sequence[int] | None = None,
                     input_split_sizes: Sequence[int] | None = None, stats: CommStats | None = None,
                     empty: EmptyFn | None = None) -> tuple[torch.Tensor, Pending]:
    """``all_to_all`` issued without waiting: returns (output, pending). Work queued before
    ``wait_for(output, pending)`` overlaps the transfer (on gloo it runs in the group's
    thread; on NCCL on the group's stream); the output must not be read before. Backward:
    the reverse all-to-all, as ``all_to_all``'s."""
    pending = Pending()
    if group_size(group) == 1:
        return x, pending
    return _AllToAllAsync.apply(x, group, _tuple(output_split_sizes), _tuple(input_split_sizes), stats, empty,
                                pending), pending


def wait_for(out: torch.Tensor, pending: Pending) -> torch.Tensor:
    """``out`` once its all-to-all (``all_to_all_start``) has completed."""
    if pending.done:
        return out
    return _Wait.apply(out, pending)


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


def gather_from_sequence_region(x: torch.Tensor, group, dim: int = 0, sizes: Sequence[int] | None = None,
                                stats: CommStats | None = None) -> torch.Tensor:
    """All-gather along the sequence ``dim``; backward reduce-scatters the gradient."""
    return _row_block(_GatherSequence, x, group, dim, sizes, stats)


def reduce_scatter_to_region(x: torch.Tensor, group, dim: int = 0, sizes: Sequence[int] | None = None,
                             stats: CommStats | None = None) -> torch.Tensor:
    """Reduce-scatter along ``dim``; backward all-gathers the gradient."""
    return _row_block(_ReduceScatter, x, group, dim, sizes, stats)


def all_to_all(x: torch.Tensor, group, output_split_sizes: Sequence[int] | None = None,
               input_split_sizes: Sequence[int] | None = None, stats: CommStats | None = None,
               empty: EmptyFn | None = None) -> torch.Tensor:
    """All-to-all-v of the rows of ``x``: row block i goes to rank i (``input_split_sizes``),
    block j of the output came from rank j (``output_split_sizes``); ``None`` = even split.
    Backward is the reverse all-to-all. ``empty`` allocates the outputs (see ``all_to_all_rows``)."""
    if group_size(group) == 1:
        return x
    raw = all_to_all_rows if empty is None else functools.partial(all_to_all_rows, empty=empty)
    return _AllToAll.apply(x, group, _tuple(output_split_sizes), _tuple(input_split_sizes), stats, raw)


def _tuple(sizes: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if sizes is None else tuple(int(s) for s in sizes)

"""Autograd collectives over explicit process groups, with byte/time accounting.

Every function takes ``group``; ``None`` (or a group of one rank) makes it a no-op that
issues no communication call. Each forward collective's backward is its mirror
(all-to-all <-> reverse all-to-all, all-gather <-> split or reduce-scatter, ...).

Byte counts follow nccl-tests' "size" column, per rank: all-reduce = tensor bytes;
all-gather = output (gathered) bytes; reduce-scatter = input bytes; all-to-all = this
rank's send-buffer bytes. The cost model (``moepar.cost``) turns them into bus bytes.
Legend: N rows (tokens or routes), D features, P group size.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from .faults import CollectiveError

# Allocates an output: (shape, dtype, device) -> tensor, like torch.empty.
EmptyFn = Callable[[tuple, torch.dtype, torch.device], torch.Tensor]


@dataclasses.dataclass
class CommEvent:
    op: str            # all_reduce | all_gather | reduce_scatter | all_to_all
    group_size: int
    nbytes: int
    seconds: float
    backward: bool
    # Inside ``peer_wait_timing()``: the barrier before the call, i.e. how long this rank
    # waited for the group's last rank to arrive; ``seconds`` is then the collective alone.
    wait_seconds: float = 0.0


class CommStats:
    """Collects ``CommEvent``s; ``summary()`` groups them by (op, phase)."""

    def __init__(self) -> None:
        self.events: list[CommEvent] = []

    def add(self, event: CommEvent) -> None:
        self.events.append(event)

    def reset(self) -> None:
        self.events.clear()

    def count(self, op: str | None = None, backward: bool | None = None) -> int:
        return sum(1 for e in self.events
                   if (op is None or e.op == op) and (backward is None or e.backward == backward))

    def summary(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for e in self.events:
            key = f"{e.op}.{'bwd' if e.backward else 'fwd'}"
            row = out.setdefault(key, {"calls": 0, "bytes": 0, "seconds": 0.0})
            row["calls"] += 1
            row["bytes"] += e.nbytes
            row["seconds"] += e.seconds
        return out

    def seconds(self, op: str | None = None) -> float:
        return sum(e.seconds for e in self.events if op is None or e.op == op)

    def nbytes(self, op: str | None = None) -> int:
        return sum(e.nbytes for e in self.events if op is None or e.op == op)


_LISTENERS: list[CommStats] = []
# Depth of ``synchronized_timing()`` blocks: while > 0, CUDA is synchronized around each call.
_SYNC_DEPTH = [0]
# Depth of ``peer_wait_timing()`` blocks: while > 0, a barrier on the group precedes each call.
_WAIT_DEPTH = [0]


@contextlib.contextmanager
def track() -> Iterator[CommStats]:
    """Record every collective issued (forward and backward) inside the block."""
    stats = CommStats()
    _LISTENERS.append(stats)
    try:
        yield stats
    finally:
        _LISTENERS.remove(stats)


@contextlib.contextmanager
def synchronized_timing() -> Iterator[None]:
    """Inside the block, each collective's recorded time is its own: the CUDA stream is
    synchronized before and after every call (slow; for measurements such as the cost
    model's calibration). Outside it, times are the host-side launch-to-return times."""
    _SYNC_DEPTH[0] += 1
    try:
        yield
    finally:
        _SYNC_DEPTH[0] -= 1


@contextlib.contextmanager
def peer_wait_timing() -> Iterator[None]:
    """Inside the block, every recorded collective is preceded by a barrier on its group,
    timed apart as ``CommEvent.wait_seconds``. In a training step a collective's time
    includes waiting for the slowest rank to arrive (compute skew, an oversubscribed CPU);
    the barrier separates that wait from the transfer, which is what the cost model prices.
    It adds one small collective per call and aligns the ranks: a measurement mode (the
    example's ``--time-peer-wait``), not for production steps. Collectives on every rank
    must be the same inside it, as they must be anyway."""
    _WAIT_DEPTH[0] += 1
    try:
        yield
    finally:
        _WAIT_DEPTH[0] -= 1


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _timed(op: str, group, nbytes: int, backward: bool, fn, stats: CommStats | None = None) -> None:
    sync = (_SYNC_DEPTH[0] > 0 or _WAIT_DEPTH[0] > 0) and torch.cuda.is_available()
    if sync:
        torch.cuda.synchronize()
    wait = 0.0
    if _WAIT_DEPTH[0] > 0:
        t_arrive = time.perf_counter()
        try:
            dist.barrier(group=group)
        except RuntimeError as e:
            raise CollectiveError.of(e, f"barrier before {op}", group, backward, t_arrive) from e
        if sync:
            torch.cuda.synchronize()
        wait = time.perf_counter() - t_arrive
    t0 = time.perf_counter()
    try:
        fn()
    except RuntimeError as e:   # gloo's timeout / peer reset, NCCL's DistBackendError
        raise CollectiveError.of(e, op, group, backward, t0) from e
    if sync:
        torch.cuda.synchronize()
    record(CommEvent(op, group_size(group), nbytes, time.perf_counter() - t0, backward, wait), stats)


def record(event: CommEvent, stats: CommStats | None = None) -> None:
    """Add ``event`` to every ``track()`` block open now (and to ``stats``): for the
    communication moepar does not issue itself, e.g. the pipeline schedules' sends."""
    for listener in _LISTENERS:
        listener.add(event)
    if stats is not None:
        stats.add(event)


# ---- raw collectives (no autograd), each recorded -------------------------------------
# ``stats`` (optional) receives the event too: layers pass their own CommStats so the
# backward collectives, issued later by autograd, are still attributed to them.

def all_reduce_(t: torch.Tensor, group, op=dist.ReduceOp.SUM, backward: bool = False,
                stats: CommStats | None = None) -> torch.Tensor:
    """In-place all-reduce of ``t``; bytes = t bytes."""
    if group_size(group) > 1:
        _timed("all_reduce", group, _nbytes(t), backward,
               lambda: dist.all_reduce(t, op=op, group=group), stats)
    return t


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def small_device(group, like: torch.Tensor) -> torch.device:
    """Where a small control tensor (counts, sizes) for ``group`` travels: the CPU on gloo,
    else ``like``'s device (NCCL needs CUDA tensors)."""
    return torch.device("cpu") if _is_gloo(group) else like.device


def _all_gather_equal(x: torch.Tensor, group, backward: bool, stats: CommStats | None) -> list[torch.Tensor]:
    """Equal-shape all-gather; bytes = P * x bytes. Gloo gets the list form."""
    size = group_size(group)
    x = x.contiguous()
    if _is_gloo(group):
        parts = [torch.empty_like(x) for _ in range(size)]
        _timed("all_gather", group, size * _nbytes(x), backward,
               lambda: dist.all_gather(parts, x, group=group), stats)
        return parts
    flat = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _timed("all_gather", group, _nbytes(flat), backward,
           lambda: dist.all_gather_into_tensor(flat, x, group=group), stats)
    return list(flat.chunk(size))


def all_gather_rows(x: torch.Tensor, group, sizes: Sequence[int] | None = None,
                    backward: bool = False, stats: CommStats | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0; uneven ``sizes`` are padded to the max."""
    size = group_size(group)
    if size == 1:
        return x
    if sizes is None or len(set(sizes)) == 1:
        return torch.cat(_all_gather_equal(x, group, backward, stats), dim=0)
    padded = x.new_zeros((max(sizes),) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = _all_gather_equal(padded, group, backward, stats)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)


def reduce_scatter_rows(x: torch.Tensor, group, sizes: Sequence[int] | None = None,
                        backward: bool = False, stats: CommStats | None = None) -> torch.Tensor:
    """Sum ``x`` [N, ...] over the group and keep this rank's row block (``sizes`` or N/P)."""
    size = group_size(group)
    if size == 1:
        return x
    if sizes is None:
        if x.shape[0] % size:
            raise ValueError(f"reduce-scatter of {x.shape[0]} rows is not divisible by group size {size}")
        sizes = [x.shape[0] // size] * size
    top = max(sizes)
    chunks = list(torch.split(x, list(sizes), dim=0))
    if len(set(sizes)) > 1:
        chunks = [torch.cat([c, c.new_zeros((top - c.shape[0],) + tuple(c.shape[1:]))]) for c in chunks]
    chunks = [c.contiguous() for c in chunks]
    out = torch.empty_like(chunks[0])
    _timed("reduce_scatter", group, size * _nbytes(out), backward,
           lambda: dist.reduce_scatter(out, chunks, group=group), stats)
    return out[: sizes[group_rank(group)]]


def _new_rows(x: torch.Tensor, rows: int, empty: EmptyFn | None) -> torch.Tensor:
    shape = (rows,) + tuple(x.shape[1:])
    return x.new_empty(shape) if empty is None else empty(shape, x.dtype, x.device)


def all_to_all_rows(x: torch.Tensor, group, output_split_sizes: Sequence[int] | None,
                    input_split_sizes: Sequence[int] | None, backward: bool = False,
                    stats: CommStats | None = None, empty: EmptyFn | None = None) -> torch.Tensor:
    """All-to-all-v along dim 0; bytes = this rank's send buffer. ``empty(shape, dtype,
    device)`` allocates the output (default ``torch.empty``; e.g. a buffer pool)."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    rows = x.shape[0] if output_split_sizes is None else int(sum(output_split_sizes))
    out = _new_rows(x, rows, empty)
    in_s = None if input_split_sizes is None else [int(s) for s in input_split_sizes]
    out_s = None if output_split_sizes is None else [int(s) for s in output_split_sizes]
    _timed("all_to_all", group, _nbytes(x), backward,
           lambda: dist.all_to_all_single(out, x, out_s, in_s, group=group), stats)
    return out


# ---- autograd functions ---------------------------------------------------------------

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


class Pending:
    """An all-to-all in flight (``all_to_all_start``): ``wait`` makes its output usable, then
    runs what was queued with ``then`` (e.g. dequantizing the received FP8 rows)."""

    def __init__(self) -> None:
        self.work = None
        self._record = None
        self._then: list = []
        self.group, self.t0 = None, 0.0   # for the error, should the transfer fail

    def then(self, fn) -> None:
        """Run ``fn()`` once the transfer has completed (at ``wait``)."""
        self._then.append(fn)

    @property
    def done(self) -> bool:
        return self.work is None and self._record is None and not self._then

    def wait(self) -> None:
        if self.work is not None:
            try:
                self.work.wait()   # NCCL: the current stream waits, the host does not
            except RuntimeError as e:
                raise CollectiveError.of(e, "all_to_all", self.group, False, self.t0) from e
            self.work = None
        if self._record is not None:
            self._record(time.perf_counter())
            self._record = None
        then, self._then = self._then, []
        for fn in then:
            fn()


class _AllToAllAsync(torch.autograd.Function):
    """Forward: the all-to-all issued with ``async_op=True`` (its output is filled once the
    ``Pending`` is waited on, ``wait_for``); backward: the reverse all-to-all, synchronous."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, stats, empty, pending):
        ctx.group, ctx.out_s, ctx.in_s, ctx.stats, ctx.empty = group, out_splits, in_splits, stats, empty
        x = x.contiguous()
        out = _new_rows(x, x.shape[0] if out_splits is None else sum(out_splits), empty)
        out_s = None if out_splits is None else list(out_splits)
        in_s = None if in_splits is None else list(in_splits)
        if _SYNC_DEPTH[0] > 0 or _WAIT_DEPTH[0] > 0:   # measurement modes time the call alone
            _timed("all_to_all", group, _nbytes(x), False,
                   lambda: dist.all_to_all_single(out, x, out_s, in_s, group=group), stats)
            return out
        t0 = pending.t0 = time.perf_counter()
        pending.group = group
        try:
            pending.work = dist.all_to_all_single(out, x, out_s, in_s, group=group, async_op=True)
        except RuntimeError as e:
            raise CollectiveError.of(e, "all_to_all", group, False, t0) from e
        nbytes = _nbytes(x)

        def record_end(t_end: float) -> None:   # launch to completion, overlapped work included
            record(CommEvent("all_to_all", group_size(group), nbytes, t_end - t0, False), stats)
        pending._record = record_end
        return out

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


def split_sizes(n: int, parts: int) -> list[int]:
    """Near-even split of ``n`` rows into ``parts`` blocks, larger blocks first."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]

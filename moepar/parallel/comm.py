"""What leaves this device: the collectives the layer issues, each recorded with its
nccl-tests bytes, the autograd functions of the EP exchange, and the forward's one host
read (``read_to_host``, end of the file).

Every function takes ``group``; ``None`` (or a group of one rank) makes it a no-op that
issues no communication call. Each call is recorded as a ``CommEvent`` (op, bytes, time) in
every open ``track()`` block and in the caller's ``CommStats``; a failed call raises a
``CollectiveError`` naming the op and the group. The EP all-to-all (``all_to_all``,
``all_to_all_start`` / ``wait_for``) is differentiable: its backward is the reverse
all-to-all. The tensor-parallel region ops, the autograd functions a TP layer and the shared
experts use, are built on the raw collectives here and live in ``moepar.parallel.regions``.

Byte counts follow nccl-tests' "size" column, per rank: all-reduce = tensor bytes;
all-gather = output (gathered) bytes; reduce-scatter = input bytes; all-to-all = this
rank's send-buffer bytes. The cost model (``moepar.cost``) turns them into bus bytes.
Legend (docs/moe.md): N rows (tokens or routes), D hidden (any row width); a group's size
is spelled out (``n`` in formulas).
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
from .groups import group_kind

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
            raise CollectiveError.of(e, f"barrier before {op}", group, group_kind(group), backward, t_arrive) from e
        if sync:
            torch.cuda.synchronize()
        wait = time.perf_counter() - t_arrive
    t0 = time.perf_counter()
    try:
        fn()
    except RuntimeError as e:   # gloo's timeout / peer reset, NCCL's DistBackendError
        raise CollectiveError.of(e, op, group, group_kind(group), backward, t0) from e
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


def _all_gather_flat(x: torch.Tensor, group, backward: bool, stats: CommStats | None) -> torch.Tensor:
    """Equal-shape all-gather into one buffer [n * rows, ...] (rank i's rows at block i);
    bytes = n * x bytes over n ranks. NCCL gathers into it directly; gloo's list form writes
    into views of it. Either way nothing is copied after the collective."""
    size = group_size(group)
    x = x.contiguous()
    flat = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    if _is_gloo(group):
        parts = list(flat.view((size,) + tuple(x.shape)).unbind(0))
        _timed("all_gather", group, _nbytes(flat), backward, lambda: dist.all_gather(parts, x, group=group), stats)
    else:
        _timed("all_gather", group, _nbytes(flat), backward,
               lambda: dist.all_gather_into_tensor(flat, x, group=group), stats)
    return flat


def all_gather_rows(x: torch.Tensor, group, sizes: Sequence[int] | None = None,
                    backward: bool = False, stats: CommStats | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0; uneven ``sizes`` are padded to the max
    (and the padding dropped after, the one copy an uneven gather needs)."""
    size = group_size(group)
    if size == 1:
        return x
    if sizes is None or len(set(sizes)) == 1:
        return _all_gather_flat(x, group, backward, stats)
    top = max(sizes)
    padded = x.new_zeros((top,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    blocks = _all_gather_flat(padded, group, backward, stats).view((size, top) + tuple(x.shape[1:]))
    return torch.cat([blocks[i, :n] for i, n in enumerate(sizes)], dim=0)


def reduce_scatter_rows(x: torch.Tensor, group, sizes: Sequence[int] | None = None,
                        backward: bool = False, stats: CommStats | None = None) -> torch.Tensor:
    """Sum ``x`` [N, ...] over the group and keep this rank's row block (``sizes`` or N/n over
    n ranks). NCCL reduces from one flat buffer (its list form would stage a copy of it);
    gloo's list form reads views of it. Uneven sizes are padded to the max (one copy)."""
    size = group_size(group)
    if size == 1:
        return x
    if sizes is None:
        if x.shape[0] % size:
            raise ValueError(f"reduce-scatter of {x.shape[0]} rows is not divisible by group size {size}")
        sizes = [x.shape[0] // size] * size
    top = max(sizes)
    x = x.contiguous()
    if len(set(sizes)) > 1:
        flat = x.new_zeros((size * top,) + tuple(x.shape[1:]))
        at = 0
        for i, n in enumerate(sizes):
            flat[i * top:i * top + n] = x[at:at + n]
            at += n
        x = flat
    out = x.new_empty((top,) + tuple(x.shape[1:]))
    if _is_gloo(group):
        chunks = list(x.view((size, top) + tuple(x.shape[1:])).unbind(0))
        _timed("reduce_scatter", group, size * _nbytes(out), backward,
               lambda: dist.reduce_scatter(out, chunks, group=group), stats)
    else:
        _timed("reduce_scatter", group, size * _nbytes(out), backward,
               lambda: dist.reduce_scatter_tensor(out, x, group=group), stats)
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


# ---- an all-to-all in flight ----------------------------------------------------------

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
                raise CollectiveError.of(e, "all_to_all", self.group, group_kind(self.group), False, self.t0) from e
            self.work = None
        if self._record is not None:
            self._record(time.perf_counter())
            self._record = None
        then, self._then = self._then, []
        for fn in then:
            fn()


def all_to_all_rows_start(x: torch.Tensor, group, output_split_sizes: Sequence[int] | None,
                          input_split_sizes: Sequence[int] | None, pending: Pending,
                          stats: CommStats | None = None, empty: EmptyFn | None = None) -> torch.Tensor:
    """``all_to_all_rows`` issued with ``async_op=True``: the output, filled once ``pending``
    is waited on (which records the event, launch to completion, overlapped work included).
    In the measurement modes (``synchronized_timing``, ``peer_wait_timing``) the call is
    synchronous and timed alone; ``pending`` then has nothing to wait for."""
    x = x.contiguous()
    out = _new_rows(x, x.shape[0] if output_split_sizes is None else sum(output_split_sizes), empty)
    out_s = None if output_split_sizes is None else list(output_split_sizes)
    in_s = None if input_split_sizes is None else list(input_split_sizes)
    if _SYNC_DEPTH[0] > 0 or _WAIT_DEPTH[0] > 0:
        _timed("all_to_all", group, _nbytes(x), False,
               lambda: dist.all_to_all_single(out, x, out_s, in_s, group=group), stats)
        return out
    t0 = pending.t0 = time.perf_counter()
    pending.group = group
    try:
        pending.work = dist.all_to_all_single(out, x, out_s, in_s, group=group, async_op=True)
    except RuntimeError as e:
        raise CollectiveError.of(e, "all_to_all", group, group_kind(group), False, t0) from e
    nbytes = _nbytes(x)

    def record_end(t_end: float) -> None:
        record(CommEvent("all_to_all", group_size(group), nbytes, t_end - t0, False), stats)
    pending._record = record_end
    return out


def split_sizes(n: int, parts: int) -> list[int]:
    """Near-even split of ``n`` rows into ``parts`` blocks, larger blocks first."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


# ---- the EP all-to-all, differentiable: backward is the reverse all-to-all -----------

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
    if torch.compiler.is_compiling():   # a graph: the functional collective, the compiler orders it
        return traced_all_to_all(x, group, output_split_sizes, input_split_sizes), pending
    return _AllToAllAsync.apply(x, group, _tuple(output_split_sizes), _tuple(input_split_sizes), stats, empty,
                                pending), pending


def wait_for(out: torch.Tensor, pending: Pending) -> torch.Tensor:
    """``out`` once its all-to-all (``all_to_all_start``) has completed."""
    if pending.done:
        return out
    return _Wait.apply(out, pending)


def all_to_all(x: torch.Tensor, group, output_split_sizes: Sequence[int] | None = None,
               input_split_sizes: Sequence[int] | None = None, stats: CommStats | None = None,
               empty: EmptyFn | None = None) -> torch.Tensor:
    """All-to-all-v of the rows of ``x``: row block i goes to rank i (``input_split_sizes``),
    block j of the output came from rank j (``output_split_sizes``); ``None`` = even split.
    Backward is the reverse all-to-all. ``empty`` allocates the outputs (see ``all_to_all_rows``)."""
    if group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return traced_all_to_all(x, group, output_split_sizes, input_split_sizes)
    raw = all_to_all_rows if empty is None else functools.partial(all_to_all_rows, empty=empty)
    return _AllToAll.apply(x, group, _tuple(output_split_sizes), _tuple(input_split_sizes), stats, raw)


def traced_all_to_all(x: torch.Tensor, group, output_split_sizes: Sequence[int] | None,
                      input_split_sizes: Sequence[int] | None) -> torch.Tensor:
    """The all-to-all as ``torch.compile`` traces it: torch's functional collective with its
    autograd (backward: the reverse all-to-all), which the compiled graph issues and waits
    for itself. Nothing is recorded in ``CommStats`` (a graph runs no Python per call); the
    bytes are the eager path's, ``moepar.moe.traffic`` lists them."""
    from torch.distributed import _functional_collectives as funcol
    out_s = None if output_split_sizes is None else [int(s) for s in output_split_sizes]
    in_s = None if input_split_sizes is None else [int(s) for s in input_split_sizes]
    return funcol.all_to_all_single_autograd(x.contiguous(), out_s, in_s, group)


def _tuple(sizes: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if sizes is None else tuple(int(s) for s in sizes)


# ---- host <-> device ------------------------------------------------------------------
# Moving small values between the host and the device without draining the GPU.
# On CUDA every host read of a device value (``.item()``, ``.tolist()``, ``.cpu()``, ``int(t)``)
# waits until the stream has run everything queued before it, and a copy of host data to the
# device from pageable memory (``torch.tensor(values, device="cuda")``) waits too. The MoE
# forward needs exactly one host read: the counts exchange's result, which sizes the token
# all-to-all (Megatron-Core's ``_maybe_dtoh_and_synchronize`` and torchtitan's dispatcher read
# the same counts once). These two helpers are the only places moepar's hot path crosses:
#
# * ``read_to_host``: a non-blocking copy into pinned memory and a wait on its event. The
#   copy is queued on the current stream: nothing is queued between the exchange and this
#   read that the host could let run ahead (Megatron-Core uses a side stream because it
#   queues its permutation in between), so an event on the current stream waits for exactly
#   what the read needs.
# * ``to_device``: pinned staging and a non-blocking copy, for the rare host-computed
#   tensors the device needs (the receive guard's quotas).
#
# On the CPU both return their argument: there the "device" is the host.


def read_to_host(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values on the host (``t`` itself on the CPU)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    event = torch.Event(t.device)
    event.record(torch.accelerator.current_stream(t.device))
    event.synchronize()
    return out


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on ``device``, queued without blocking the host."""
    if torch.device(device).type == "cpu":
        return host
    if host.numel() == 0:   # nothing to copy (and an empty tensor cannot be pinned)
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    return host.pin_memory().to(device, non_blocking=True)

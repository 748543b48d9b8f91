"""What only the CPU/gloo path of the layer uses: source-major token rows and a pool of
large CPU buffers reused across steps. The callers keep CUDA tensors out (``empty`` hands
them to torch and its caching allocator; the dispatcher asks ``source_major_pays`` for
CPU tensors only).

Source-major rows. The token all-to-all delivers block s from EP peer s, inside it the
peer's rows for each local expert; the grouped GEMM wants each local expert's rows
contiguous, which costs a gather of the received rows and its inverse on the way back. On
gloo with CPU tensors, when the layer opts in (``ExchangeConfig.cpu_source_major``, off by
default) and every rank of the EP group does, the rows are instead left as they arrive and the experts run each
(peer, local expert) block on the expert's weights (GroupedExperts' ``segment_experts``):
``bench dispatch`` measures the dispatch + combine with and without the regroup (figures in
docs/benchmarks.md). NCCL keeps the regroup (cheap in HBM, and one
grouped GEMM per expert is what the GPU wants).

Why. With glibc's allocator a buffer of more than a few MiB is mapped from the kernel when
it is allocated and unmapped when it is freed (or trimmed from the heap top), so every
step's dispatch buffers, all-to-all outputs and expert gradients are faulted in page by
page, zero-filled, again at every step, which costs several times the copy that fills the
buffer (measured: docs/benchmarks.md, docs/moe.md "CPU buffers"). PyTorch's
CUDA caching allocator does not exist on the CPU; jemalloc/tcmalloc or glibc's MALLOC_*
variables fix it process-wide, but a library cannot count on them.

What. ``empty(shape, dtype, device)`` is ``torch.empty`` except for CPU buffers of at least
``MIN_BYTES``: those are views of flat buffers the pool keeps. A buffer is handed out again
only when nothing but the pool references its storage (PyTorch's storage use count: live
tensors, views and tensors saved for backward all count), so a tensor the caller, autograd or
a user still holds is never reused. Sizes are rounded up to a quarter of their octave
(at most 25 % slack) and a free buffer up to twice the request is taken before a new one
is made. Free buffers unused for ``MAX_IDLE_TAKES`` allocations are dropped, and at most
``max_free_bytes`` of free buffers are kept. Only the ops of this package allocate from it
(permute, unpermute's backward, the dispatcher's all-to-alls, the grouped experts); the
memory it holds between steps is what the next step needs again. ``release()`` returns it
all (``moepar.release_cpu_buffers``); ``with moepar.moe.cpu.pool_disabled():`` turns the
pool off inside a block (``POOL.min_bytes`` sets the smallest pooled buffer; the tests set
0 so that their small shapes go through it too). Thread-safe (one lock).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from moepar_kernels import permute as _permute_kernels

# The grouped experts on CPU tensors run in segments of consecutive experts whose [rows, F]
# intermediates stay under this many bytes (an expert larger than that is a segment of its
# own; experts.function.expert_segments). Buffers below glibc's mmap threshold (dynamic, at most
# 32 MiB) are reused from the heap; larger ones are mapped afresh and every page faults on
# first touch at every call. CUDA tensors run as one segment (the caching allocator reuses).
SEGMENT_BYTES = 8 << 20

# Below this glibc serves from the heap anyway (the default of ``CpuBufferPool.min_bytes``).
MIN_BYTES = 1 << 20
MAX_IDLE_TAKES = 4096        # free buffers not reused within this many allocations are dropped


def _use_count(t: torch.Tensor) -> int:
    # Private API, kept: no public one counts a storage's users, and a Python weakref to the
    # handed-out tensor misses the references autograd holds to tensors saved for backward.
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _rounded(nbytes: int) -> int:
    """nbytes rounded up to a multiple of a quarter of its power of two."""
    q = max(1, (1 << (nbytes.bit_length() - 1)) >> 2)
    return -(-nbytes // q) * q


class CpuBufferPool:
    """The pool: ``empty`` hands out views of flat uint8 buffers nobody else references."""

    def __init__(self, max_free_bytes: int = 8 << 30, min_bytes: int = MIN_BYTES):
        self.max_free_bytes = max_free_bytes
        self.min_bytes = min_bytes       # smaller requests go to torch.empty
        self.enabled = True
        self._lock = threading.Lock()
        self._bufs: list[list] = []      # [flat uint8 tensor, base use count, last take tick]
        self._tick = 0
        self.hits = self.misses = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            self._tick += 1
            best = None
            for entry in self._bufs:
                cap = entry[0].numel()
                if nbytes <= cap <= 2 * nbytes and (best is None or cap < best[0].numel()) \
                        and _use_count(entry[0]) == entry[1]:
                    best = entry
            if best is None:
                self.misses += 1
                self._evict()
                flat = torch.empty(_rounded(nbytes), dtype=torch.uint8)
                best = [flat, _use_count(flat), 0]
                self._bufs.append(best)
            else:
                self.hits += 1
            best[2] = self._tick
            return best[0][:nbytes].view(dtype).view(shape)

    def _evict(self) -> None:
        """Drop free buffers idle for too long, then the oldest free ones over the cap."""
        free = [e for e in self._bufs if _use_count(e[0]) == e[1]]
        drop = {id(e) for e in free if self._tick - e[2] > MAX_IDLE_TAKES}
        kept = sorted((e for e in free if id(e) not in drop), key=lambda e: e[2], reverse=True)
        total = 0
        for e in kept:
            total += e[0].numel()
            if total > self.max_free_bytes:
                drop.add(id(e))
        if drop:
            self._bufs = [e for e in self._bufs if id(e) not in drop]

    def release(self) -> None:
        """Forget every buffer (those still in use live on with their users)."""
        with self._lock:
            self._bufs = []

    def stats(self) -> dict[str, int]:
        with self._lock:
            free = [e[0].numel() for e in self._bufs if _use_count(e[0]) == e[1]]
            return {"buffers": len(self._bufs), "held_bytes": sum(e[0].numel() for e in self._bufs),
                    "free_bytes": sum(free), "hits": self.hits, "misses": self.misses}


POOL = CpuBufferPool()


def enabled() -> bool:
    """Whether ``empty`` serves CPU buffers from the pool (see ``pool_disabled``)."""
    return POOL.enabled


@contextlib.contextmanager
def pool_disabled() -> Iterator[None]:
    """Inside the block, every buffer comes from ``torch.empty`` (e.g. to measure without it)."""
    was, POOL.enabled = POOL.enabled, False
    try:
        yield
    finally:
        POOL.enabled = was


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, from the pool for large CPU buffers."""
    device = torch.device(device)
    if device.type == "cpu" and enabled() and not torch.compiler.is_compiling():
        numel = 1
        for s in shape:
            numel *= int(s)
        if numel * dtype.itemsize >= max(POOL.min_bytes, 1):
            return POOL.empty(shape, dtype)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


# The permute kernels' CPU reference outputs come from the pool too (they cannot import moepar).
_permute_kernels.set_cpu_allocator(empty)


def empty_like_rows(x: torch.Tensor, rows: int, cols: int | None = None) -> torch.Tensor:
    """A [rows, cols or x's trailing dims] buffer of x's dtype and device."""
    tail = tuple(x.shape[1:]) if cols is None else (cols,)
    return empty((rows,) + tail, x.dtype, x.device)


def release() -> None:
    """Forget every pooled buffer (``moepar.release_cpu_buffers``)."""
    POOL.release()


def stats() -> dict[str, int]:
    """The pool's buffers, held and free bytes, hits and misses (``moepar.cpu_buffer_stats``)."""
    return POOL.stats()


def source_major_pays(ep_group, num_local_experts: int) -> bool:
    """Whether this rank takes source-major rows (for CPU tensors): on gloo, with more than
    one local expert (with one, source-major already is expert-major)."""
    return num_local_experts > 1 and dist.get_backend(ep_group) == "gloo"


def source_major_segments(counts_SL: torch.Tensor) -> tuple[tuple[int, ...], list[int]]:
    """(local expert of each row block, rows of each block) of source-major rows: block
    (s, l) holds counts_SL[s, l] rows of local expert l."""
    S, L = counts_SL.shape
    return tuple(range(L)) * S, counts_SL.reshape(-1).tolist()

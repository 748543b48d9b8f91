"""Large CPU buffers reused across steps instead of page-faulted afresh at every step.

Why. With glibc's allocator a buffer of more than a few MiB is mapped from the kernel when
it is allocated and unmapped when it is freed (or trimmed from the heap top), so every
step's dispatch buffers, all-to-all outputs and expert gradients are faulted in page by
page, zero-filled, again at every step. On the development VM that costs about 0.5 ms per
MiB, several times the cost of the copy that fills the buffer (docs/bench.md). PyTorch's
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
all (``moepar.release_cpu_buffers``); ``MOEPAR_CPU_BUFFER_POOL=0`` turns the pool off.
Thread-safe (one lock). CUDA tensors always go to torch (its caching allocator).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch

# Below this glibc serves from the heap anyway. The tests set MOEPAR_CPU_POOL_MIN_BYTES=0 so
# that their small shapes go through the pool too.
MIN_BYTES = int(os.environ.get("MOEPAR_CPU_POOL_MIN_BYTES", 1 << 20))
MAX_IDLE_TAKES = 4096        # free buffers not reused within this many allocations are dropped


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _rounded(nbytes: int) -> int:
    """nbytes rounded up to a multiple of a quarter of its power of two."""
    q = max(1, (1 << (nbytes.bit_length() - 1)) >> 2)
    return -(-nbytes // q) * q


class CpuBufferPool:
    def __init__(self, max_free_bytes: int = 8 << 30):
        self.max_free_bytes = max_free_bytes
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
    return os.environ.get("MOEPAR_CPU_BUFFER_POOL", "1") != "0"


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, from the pool for large CPU buffers."""
    device = torch.device(device)
    if device.type == "cpu" and enabled() and not torch.compiler.is_compiling():
        numel = 1
        for s in shape:
            numel *= int(s)
        if numel * dtype.itemsize >= max(MIN_BYTES, 1):
            return POOL.empty(shape, dtype)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def empty_like_rows(x: torch.Tensor, rows: int, cols: int | None = None) -> torch.Tensor:
    """A [rows, cols or x's trailing dims] buffer of x's dtype and device."""
    tail = tuple(x.shape[1:]) if cols is None else (cols,)
    return empty((rows,) + tail, x.dtype, x.device)


def release() -> None:
    POOL.release()


def stats() -> dict[str, int]:
    return POOL.stats()

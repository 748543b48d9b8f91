"""Timing helpers shared by the benchmark modes: medians after warm-up, the machine's
matmul rate (the physical limit the rows are compared with), and plain-text tables."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch


def sync(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], warmup: int = 2, repeats: int = 5,
            device: torch.device | str | None = None) -> list[float]:
    """Seconds per call of ``fn`` for ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def matmul_gflops(n: int = 4096, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  repeats: int = 3, best: bool = False) -> float:
    """Measured rate of one large square matmul (2 n^3 flops), GFLOP/s: the roofline.
    ``best``: the fastest of the repeats (on a shared machine the median is often a
    disturbed run) instead of the median."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    times = time_fn(lambda: a @ b, warmup=1, repeats=repeats, device=device)
    secs = min(times) if best else median(times)
    return 2 * n ** 3 / secs / 1e9


# ---- peak memory on the CPU ---------------------------------------------------------------
# torch keeps no allocator statistics for the CPU, so a case's peak is read from the kernel:
# run it in a fresh process (no heap left over from other cases), release the heap's free
# pages (malloc_trim), take the resident set as the baseline, reset the high-water mark
# (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0), run the step, and report
# VmHWM - baseline: every byte the step made resident at its peak, whoever allocated it.

def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def release_free_heap() -> None:
    """Return the C heap's free pages to the kernel (glibc ``malloc_trim``), after a gc,
    and moepar's CPU buffer pool with them: the step that follows must allocate (and is
    charged for) every buffer it uses, pooled or not."""
    import ctypes
    import gc

    from moepar.moe import cpu
    cpu.release()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Set this process's VmHWM to its current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmHWM") is not None
    except OSError:
        return False


def step_peak_bytes(step: Callable[[], object], warmup: bool = True) -> tuple[int, str]:
    """(bytes, method): the resident memory ``step`` adds at its peak over the current
    live data. ``warmup`` runs it once first (lazy initialisations), when the high-water
    mark can be reset; otherwise the increase of ru_maxrss over the current RSS."""
    can_reset = reset_peak_rss()
    if warmup and can_reset:
        step()
    release_free_heap()
    base = _status_kib("VmRSS")
    if can_reset and reset_peak_rss() and base is not None:
        step()
        return max(0, (_status_kib("VmHWM") - base) * 1024), "VmHWM - VmRSS baseline"
    import resource
    step()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux
    return max(0, (maxrss - (base or 0)) * 1024), "ru_maxrss - RSS baseline"


def run_in_fresh_process(fn: Callable, *args, timeout: float = 900.0):
    """``fn(*args)`` in a new spawned interpreter (fn must be a module-level function)."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    with ctx.Pool(1, maxtasksperchild=1) as pool:
        return pool.apply_async(fn, args).get(timeout)


def keep_freed_memory() -> bool:
    """glibc only: stop returning freed memory to the kernel (mmap threshold 1 GiB, trim
    threshold 2 GiB), so that a step's large buffers come back from the heap at the next
    step instead of page-faulting afresh. What jemalloc/tcmalloc or the MALLOC_*_ environment
    variables give a training process; the benchmarks' ``--malloc keep``. True if applied."""
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(-3, 1 << 30)) and bool(libc.mallopt(-1, (1 << 31) - 1))   # M_MMAP/M_TRIM
    except (OSError, AttributeError):
        return False


def grad_step(mod, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of ``mod`` on ``x`` (output gradient ``g``), the aux loss
    included: gradients to x and every trainable parameter. ``mod`` returns y or (y, aux);
    without the tuple its ``aux_loss`` attribute is the aux loss (moepar's layer), None for
    a layer without one (torchtitan's balances its load with an expert bias instead)."""
    params = [p for p in mod.parameters() if p.requires_grad]
    one = torch.ones((), device=x.device)   # the aux loss is an fp32 scalar

    def step():
        out = mod(x)
        y, aux = out if isinstance(out, tuple) else (out, mod.aux_loss)
        if aux is None:
            torch.autograd.grad(y, [x] + params, g)
        else:
            torch.autograd.grad([y, aux], [x] + params, [g, one])
    return step

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
                  repeats: int = 3) -> float:
    """Measured rate of one large square matmul (2 n^3 flops), GFLOP/s: the roofline."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    secs = median(time_fn(lambda: a @ b, warmup=1, repeats=repeats, device=device))
    return 2 * n ** 3 / secs / 1e9


def format_table(rows: list[dict], columns: Sequence[str] | None = None) -> str:
    """Fixed-width table; floats printed with 3 significant digits."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())

    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)

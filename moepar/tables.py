"""Plain-text tables, and human-readable bytes, times, counts and rates, for the command-line
reports (cost model, validation, benchmarks)."""
from __future__ import annotations

from typing import Sequence


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


def fmt_bytes(n: float) -> str:
    """Binary units: 64 MiB, 1.5 GiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def fmt_time(s: float) -> str:
    """Seconds as us / ms / s with 3 significant digits."""
    if s == 0:
        return "0"
    if abs(s) < 1e-3:
        return f"{s * 1e6:.3g} us"
    if abs(s) < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


def fmt_count(n: float) -> str:
    """Decimal units: 46.7 B, 12.9 G (parameters, FLOPs)."""
    n = float(n)
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.4g}"


def fmt_rate(bps: float) -> str:
    return f"{bps / 1e9:.3g} GB/s"

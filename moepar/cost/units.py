"""Human-readable bytes, times, counts and rates for the reports."""
from __future__ import annotations


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

"""Calibrated hardware profiles: measured time-vs-size curves, their fit, and the JSON file;
and ``get_hardware``, a machine by preset name or by profile path.

``python -m moepar calibrate`` (``moepar.cost.calibrate``) measures each (op, group size) over
a size sweep and keeps the table as a ``Curve`` (made monotone, interpolated between the
measured sizes) with a least-squares alpha-beta fit (``fit_alpha_beta``); ``save_profile``
and ``load_profile`` write and read the ``Hardware`` that carries the curves. The presets and
the pricing are ``moepar.cost.collectives``': this module imports it, never the reverse.
"""
from __future__ import annotations

import bisect
import dataclasses
import datetime
import functools
import json
import math
import os
from typing import Mapping, Sequence

from .collectives import Hardware, Link, bus_factor, check_op
from .presets import PRESETS

PROFILE_FORMAT = "moepar-profile/1"


@dataclasses.dataclass(frozen=True)
class Curve:
    """A measured time-vs-size curve for one (op, group size): the calibrated table.

    ``predict`` first makes the measured times non-decreasing in size (pool-adjacent-
    violators: a bigger message never takes less time, so a dip is noise), then
    interpolates linearly between neighbouring sizes (between two points the alpha-beta
    law is a straight line) and extrapolates with the nearest segment's slope.
    """

    op: str
    group_size: int
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    alpha: float          # fitted latency, s
    beta: float           # fitted s/byte (size convention); busbw = factor / beta

    def __post_init__(self) -> None:
        check_op(self.op)
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ValueError(f"curve {self.op}/{self.group_size}: need as many sizes as times (>0)")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"curve {self.op}/{self.group_size}: sizes must be strictly increasing")

    @property
    def busbw(self) -> float:
        """Fitted bus bandwidth, bytes/s."""
        return bus_factor(self.op, self.group_size) / self.beta if self.beta > 0 else math.inf

    def fit_time(self, nbytes: float) -> float:
        """The plain alpha-beta line."""
        return self.alpha + self.beta * nbytes

    @functools.cached_property
    def monotone(self) -> tuple[float, ...]:
        return tuple(isotonic(self.seconds))

    def predict(self, nbytes: float) -> float:
        xs, ys = self.sizes, self.monotone
        if len(xs) == 1:
            return max(self.fit_time(nbytes), 0.0)
        i = bisect.bisect_left(xs, nbytes)
        if i < len(xs) and xs[i] == nbytes:
            return ys[i]
        lo = min(max(i - 1, 0), len(xs) - 2)  # segment [lo, lo+1], the nearest one outside
        slope = (ys[lo + 1] - ys[lo]) / (xs[lo + 1] - xs[lo])
        if nbytes > xs[-1] and slope <= 0:
            slope = self.beta
        t = ys[lo] + slope * (nbytes - xs[lo])
        floor = max(min(self.alpha, ys[0]), 0.0) if nbytes < xs[0] else 0.0
        return max(t, floor, 1e-9)


def isotonic(ys: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit of ``ys`` (pool adjacent violators)."""
    blocks: list[list[float]] = []          # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least squares of ``t = alpha + beta * S`` on relative residuals (sizes span decades).

    A negative intercept is refitted through the origin; a negative slope is clipped to 0.
    """
    if len(sizes) != len(seconds) or not sizes:
        raise ValueError("fit needs as many sizes as times, at least one")
    if len(sizes) == 1:
        return 0.0, seconds[0] / sizes[0] if sizes[0] else 0.0
    w = [1.0 / t for t in seconds]
    # Weighted normal equations for [alpha, beta].
    a11 = sum(wi * wi for wi in w)
    a12 = sum(wi * wi * s for wi, s in zip(w, sizes))
    a22 = sum(wi * wi * s * s for wi, s in zip(w, sizes))
    b1 = sum(wi * wi * t for wi, t in zip(w, seconds))
    b2 = sum(wi * wi * s * t for wi, s, t in zip(w, sizes, seconds))
    det = a11 * a22 - a12 * a12
    alpha, beta = ((a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det) if det else (0.0, 0.0)
    if alpha < 0 or not det:
        alpha, beta = 0.0, b2 / a22
    return alpha, max(beta, 0.0)


def curves_to_dict(curves: Mapping[tuple[str, int], Curve]) -> list[dict]:
    return [dataclasses.asdict(c) for _, c in sorted(curves.items())]


def curves_from_dict(items: Sequence[dict]) -> dict[tuple[str, int], Curve]:
    out = {}
    for d in items:
        c = Curve(d["op"], int(d["group_size"]), tuple(int(s) for s in d["sizes"]),
                  tuple(float(t) for t in d["seconds"]), float(d["alpha"]), float(d["beta"]))
        out[(c.op, c.group_size)] = c
    return out


def _link_to_dict(link: Link) -> dict:
    return dataclasses.asdict(link)


def save_profile(hw: Hardware, path: str) -> None:
    """Write ``hw`` (typically a calibrated one) as JSON."""
    data = {
        "format": PROFILE_FORMAT, "name": hw.name, "description": hw.description,
        "gpus_per_node": hw.gpus_per_node, "flops": hw.flops, "memory_bytes": hw.memory_bytes,
        "base_latency": hw.base_latency, "sources": list(hw.sources),
        "nics_per_node": hw.nics_per_node, "nvls_algbw": hw.nvls_algbw, "memory_bandwidth": hw.memory_bandwidth,
        "intra": _link_to_dict(hw.intra), "inter": _link_to_dict(hw.inter),
        "meta": dict(hw.meta), "curves": curves_to_dict(hw.curves),
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def valid_hardware_names() -> str:
    return ", ".join(sorted(PRESETS)) + ", or the path of a JSON profile written by " \
        "`python -m moepar calibrate`"


def get_hardware(name: str | Hardware) -> Hardware:
    """A preset by name (case-insensitive) or a calibrated profile by path."""
    if isinstance(name, Hardware):
        return name
    key = str(name).strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if key.endswith(".json") or os.path.exists(name):
        return load_profile(name)
    raise ValueError(f"unknown hardware {name!r}; valid: {valid_hardware_names()}")


def load_profile(path: str) -> Hardware:
    """Read a JSON profile; errors name the file and what is wrong with it."""
    if not os.path.exists(path):
        raise ValueError(f"hardware profile {path!r} does not exist; valid hardware: "
                         f"{valid_hardware_names()}")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"hardware profile {path!r} is not valid JSON: {e}") from None
    if data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"hardware profile {path!r} has format {data.get('format')!r}, "
                         f"expected {PROFILE_FORMAT!r}")
    try:
        return Hardware(
            name=data["name"], description=data.get("description", ""),
            intra=Link(**data["intra"]), inter=Link(**data["inter"]),
            gpus_per_node=int(data["gpus_per_node"]), flops=float(data["flops"]),
            memory_bytes=float(data["memory_bytes"]), base_latency=float(data.get("base_latency", 0.0)),
            sources=tuple(data.get("sources", ())), curves=curves_from_dict(data.get("curves", [])),
            meta=data.get("meta", {}), nics_per_node=int(data.get("nics_per_node", 0)),
            nvls_algbw=float(data.get("nvls_algbw", 0.0)), memory_bandwidth=float(data.get("memory_bandwidth", 0.0)))
    except (KeyError, TypeError) as e:
        raise ValueError(f"hardware profile {path!r} is missing or has a bad field: {e}") from None


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine_description() -> str:
    """CPU model and core count (or GPU name): what the figures were measured on."""
    import platform

    import torch
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"

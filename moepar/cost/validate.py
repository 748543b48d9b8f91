"""Predicted against measured: real collectives (and, through row sources, real layers).

``run_validation`` runs every function in ``ROW_SOURCES`` on every rank; each takes a
``ValidationContext`` and returns ``Row``s (predicted and measured seconds of one thing).
This module's sources are ``collective_rows`` (the four ops at sizes calibration never
measured: geometric midpoints of its sweep) and ``ep_vs_tp_rows`` (the all-to-all of
T·K·D·b against the all-reduce of T·D·b across K, T, D: which is faster, as predicted and
as measured). A source for the MoE layer's dispatch is added with ``register_row_source``:

    def moe_dispatch_rows(ctx):
        ...build the layer on ctx.groups[n], time it with ctx.time(fn) or ctx.time_many(fns)...
        return [Row("moe-dispatch", case, "all_to_all", n, nbytes, predicted, measured)]
    register_row_source(moe_dispatch_rows)

Every source is a collective call: all ranks run it with the same arguments.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Sequence

import torch

from .calibrate import (CALIBRATED_OPS, DTYPES, Buffers, MiB, collective_fn, device, ensure_process_group,
                        load_average, make_groups, midpoints, op_group_sizes, size_sweep, time_interleaved)
from .collectives import P2P, Hardware, Placement
from .profiles import machine_description, utc_now

PICK_MARGIN = 0.15   # EP-vs-TP cases count for the pick accuracy when measured times differ more
ANCHOR_SIZES = (256 * 1024, 2 * MiB, 16 * MiB)   # calibrated sizes re-timed in every pass


@dataclasses.dataclass(frozen=True)
class Row:
    """One prediction against one measurement; ``role`` pairs EP/TP rows of one case."""

    source: str
    case: str
    op: str
    group_size: int
    nbytes: int
    predicted: float
    measured: float
    fit: float | None = None     # the plain alpha-beta line's prediction, for comparison
    role: str = ""
    drift: float = 1.0           # measured / calibrated on anchor points timed in the same rounds

    @property
    def rel_err(self) -> float:
        return (self.predicted - self.measured) / self.measured

    @property
    def drift_err(self) -> float:
        """Error of the prediction scaled by the machine's drift since calibration."""
        return (self.predicted * self.drift - self.measured) / self.measured

    @property
    def fit_err(self) -> float | None:
        return None if self.fit is None else (self.fit - self.measured) / self.measured


@dataclasses.dataclass
class ValidationContext:
    """What a row source needs: the profile, this rank's groups, timing settings."""

    hardware: Hardware
    groups: dict[int, object]
    repeats: int
    warmup: int
    dtype: torch.dtype
    device: torch.device
    sizes: list[int]
    quick: bool = False
    anchors: Sequence[int] = ANCHOR_SIZES
    drift: float = 1.0           # of the last measured pass

    @property
    def group_sizes(self) -> list[int]:
        return sorted(self.groups)

    def __post_init__(self) -> None:
        self.bufs = Buffers(self.dtype, self.device)

    def _anchor_items(self, keys: set[tuple[str, int]]) -> list[tuple[str, int, int]]:
        """Calibrated points (op, n, size) nearest to ``anchors``, for the given (op, n)."""
        out = []
        for op, n in sorted(keys):
            curve = self.hardware.curves.get((op, n))
            if curve is None:
                continue
            for a in self.anchors:
                out.append((op, n, min(curve.sizes, key=lambda s: abs(s - a))))
        return sorted(set(out))

    def time_many(self, fns: Sequence[Callable[[], object]],
                  anchor_keys: Sequence[tuple[str, int]] = ()) -> list[float]:
        """Median seconds per call of each ``fn`` (collective calls), averaged over ranks,
        in interleaved rounds as calibration does. With ``anchor_keys`` ((op, n) pairs),
        calibrated points of those are timed in the same rounds and ``self.drift`` is set
        to the median measured / calibrated ratio: how much faster or slower the machine
        runs now than during calibration (other load on a shared machine)."""
        anchors = self._anchor_items(set(anchor_keys))
        extra = [collective_fn(op, self.groups[n], n, s, self.bufs) for op, n, s in anchors]
        times = time_interleaved(list(fns) + extra, self.repeats, self.warmup, self.device)
        if anchors:
            ratios = [t / self.hardware.curves[(op, n)].predict(s)
                      for (op, n, s), t in zip(anchors, times[len(fns):])]
            self.drift = statistics.median(ratios)
        else:
            self.drift = 1.0
        return times[:len(fns)]

    def time(self, fn: Callable[[], object]) -> float:
        return self.time_many([fn])[0]

    def measure_many(self, items: Sequence[tuple[str, int, int]], anchored: bool = True) -> list[float]:
        """Measured seconds of each (op, group size, nbytes); anchors of the same (op, n)."""
        fns = [collective_fn(op, self.groups[n], n, s, self.bufs) for op, n, s in items]
        return self.time_many(fns, [(op, n) for op, n, _ in items] if anchored else ())

    def predict(self, op: str, n: int, nbytes: int) -> tuple[float, float | None]:
        """(curve-or-model prediction, plain alpha-beta fit) for a single-node group of n."""
        pl = Placement(n, n)
        curve = self.hardware.curve_for(op, pl)
        return self.hardware.collective_time(op, pl, nbytes), (curve.fit_time(nbytes) if curve else None)


def _aligned(nbytes: int, n: int, elem: int) -> int:
    unit = n * elem
    return max(unit, nbytes // unit * unit)


def _rows(ctx: ValidationContext, source: str, items: list[tuple[str, str, str, int, int]]) -> list[Row]:
    """Measure (case, role, op, n, nbytes) items in one interleaved pass; predict each."""
    measured = ctx.measure_many([(op, n, s) for _, _, op, n, s in items])
    rows = []
    for (case, role, op, n, s), m in zip(items, measured):
        pred, fit = ctx.predict(op, n, s)
        rows.append(Row(source, case, op, n, s, pred, m, fit, role, ctx.drift))
    return rows


def collective_rows(ctx: ValidationContext) -> list[Row]:
    """The collectives, and the point-to-point pair where the profile measured one."""
    elem = ctx.bufs.elem
    ops = [op for op in CALIBRATED_OPS if op != P2P or (P2P, 2) in ctx.hardware.curves]
    items = [(f"{op} n={n}", "", op, n, _aligned(s, n, elem))
             for op in ops for n in op_group_sizes(op, ctx.group_sizes) for s in ctx.sizes]
    return _rows(ctx, "collective", items)


def ep_vs_tp_cases(quick: bool = False, max_bytes: int = 64 * MiB, elem: int = 4) -> list[tuple[int, int, int]]:
    """(T, D, K) with T·K·D·elem <= max_bytes."""
    tokens, hidden, topk = ((64, 256), (128, 512), (1, 2, 8)) if quick else \
        ((256, 2048), (256, 1024, 4096), (1, 2, 4, 8))
    return [(t, d, k) for t in tokens for d in hidden for k in topk if t * k * d * elem <= max_bytes]


def ep_vs_tp_rows(ctx: ValidationContext) -> list[Row]:
    """One EP row (all-to-all of T·K·D·b) and one TP row (all-reduce of T·D·b) per case."""
    elem = ctx.bufs.elem
    items = []
    for n in ctx.group_sizes:
        for t, d, k in ep_vs_tp_cases(ctx.quick, elem=elem):
            case = f"n={n} T={t} D={d} K={k}"
            items.append((case, "EP", "all_to_all", n, _aligned(t * k * d * elem, n, elem)))
            items.append((case, "TP", "all_reduce", n, _aligned(t * d * elem, n, elem)))
    return _rows(ctx, "ep-vs-tp", items)


ROW_SOURCES: list[Callable[[ValidationContext], list[Row]]] = [collective_rows, ep_vs_tp_rows]


def register_row_source(fn: Callable[[ValidationContext], list[Row]]) -> None:
    """Add a source of rows (e.g. the MoE layer's dispatch) to ``python -m moepar validate``."""
    if fn not in ROW_SOURCES:
        ROW_SOURCES.append(fn)


@dataclasses.dataclass
class ValidationResult:
    rows: list[Row]
    meta: dict

    def median_error(self, op: str | None = None, source: str | None = None, fit: bool = False,
                     drift: bool = False) -> float | None:
        """Median |relative error| (of the curve prediction, or the plain alpha-beta ``fit``,
        or the curve prediction scaled by the pass's ``drift``)."""
        errs = [abs(r.fit_err if fit else r.drift_err if drift else r.rel_err) for r in self.rows
                if (op is None or r.op == op) and (source is None or r.source == source)
                and (not fit or r.fit is not None)]
        return statistics.median(errs) if errs else None

    def picks(self, margin: float = PICK_MARGIN) -> tuple[int, int, int]:
        """(right, counted, skipped): cases whose measured EP and TP times differ by more than
        ``margin`` (relative to the faster), and how often the prediction picks the faster."""
        pairs: dict[str, dict[str, Row]] = {}
        for r in self.rows:
            if r.role:
                pairs.setdefault(f"{r.source}/{r.case}", {})[r.role] = r
        right = counted = skipped = 0
        for p in pairs.values():
            if set(p) != {"EP", "TP"}:
                continue
            ep, tp = p["EP"], p["TP"]
            if abs(ep.measured - tp.measured) / min(ep.measured, tp.measured) <= margin:
                skipped += 1
                continue
            counted += 1
            right += (ep.predicted < tp.predicted) == (ep.measured < tp.measured)
        return right, counted, skipped

    def summary(self) -> dict:
        ops = sorted({r.op for r in self.rows})
        right, counted, skipped = self.picks()
        return {
            "median_rel_error": {op: self.median_error(op) for op in ops} | {"all": self.median_error()},
            "median_rel_error_alpha_beta": {op: self.median_error(op, fit=True) for op in ops},
            "median_rel_error_drift_corrected": {op: self.median_error(op, drift=True) for op in ops}
            | {"all": self.median_error(drift=True)},
            "drift": {src: sorted({round(r.drift, 3) for r in self.rows if r.source == src})
                      for src in sorted({r.source for r in self.rows})},
            "rows": len(self.rows),
            "pick_right": right, "pick_counted": counted, "pick_skipped_within_margin": skipped,
            "pick_accuracy": right / counted if counted else None, "pick_margin": PICK_MARGIN,
        }


def run_validation(hardware: Hardware, sources: Sequence[Callable] | None = None, repeats: int = 5,
                   warmup: int = 1, group_sizes: Sequence[int] | None = None, sizes: Sequence[int] | None = None,
                   dtype: str | None = None, quick: bool = False) -> ValidationResult:
    """Run every row source on every rank; every rank returns the same result."""
    rank, world = ensure_process_group("validate")
    meta = dict(hardware.meta)
    dtype = dtype or str(meta.get("dtype", "fp32"))
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; valid: {', '.join(DTYPES)}")
    if group_sizes is None:
        measured = sorted({n for (_, n) in hardware.curves}) or [2]
        group_sizes = [n for n in measured if n <= world and world % n == 0]
    if sizes is None:
        cal = list(meta.get("sizes") or size_sweep())
        sizes = midpoints(cal) if len(cal) > 1 else cal
    ctx = ValidationContext(hardware, make_groups(group_sizes), repeats, warmup, DTYPES[dtype], device(),
                            list(sizes), quick)
    rows: list[Row] = []
    load_before = load_average()
    for source in (sources if sources is not None else ROW_SOURCES):
        rows += source(ctx)
    return ValidationResult(rows, {"backend": torch.distributed.get_backend(), "world_size": world,
                                   "dtype": dtype, "date": utc_now(), "machine": machine_description(),
                                   "profile": hardware.name, "profile_date": meta.get("date"),
                                   "profile_load_average": meta.get("load_average"),
                                   "load_average": f"{load_before} -> {load_average()}", "repeats": repeats})


def format_validation(res: ValidationResult, table: Callable[[list[dict]], str] | None = None) -> str:
    """The rows (predicted vs measured, relative error) and the summary lines."""
    from ..tables import fmt_bytes, format_table
    table = table or format_table
    rows = [{"source": r.source, "case": r.case + (f" {r.role}" if r.role else ""), "op": r.op,
             "n": r.group_size, "size": fmt_bytes(r.nbytes), "predicted ms": f"{r.predicted * 1e3:.4g}",
             "measured ms": f"{r.measured * 1e3:.4g}", "error": f"{r.rel_err:+.1%}",
             "alpha-beta ms": "-" if r.fit is None else f"{r.fit * 1e3:.4g}",
             "a-b error": "-" if r.fit_err is None else f"{r.fit_err:+.1%}",
             "x drift error": f"{r.drift_err:+.1%}"} for r in res.rows]
    s = res.summary()
    m = res.meta
    lines = [f"validate: {m['backend']}, {m['world_size']} ranks, {m['dtype']}, {m['machine']}, {m['date']}, "
             f"profile {m['profile']} of {m['profile_date']}, median of {m['repeats']} repeats, mean over ranks; "
             f"load average {m['load_average']} (calibration: {m['profile_load_average']})", table(rows), ""]
    for op, e in s["median_rel_error"].items():
        ab = s["median_rel_error_alpha_beta"].get(op)
        dc = s["median_rel_error_drift_corrected"].get(op)
        n = sum(1 for r in res.rows if op == "all" or r.op == op)
        lines.append(f"median |relative error| {op:>14}: {e:6.1%} over {n} rows"
                     + (f" (plain alpha-beta fit: {ab:.1%})" if ab is not None else "")
                     + (f"; x drift: {dc:.1%}" if dc is not None else ""))
    drift = ", ".join(f"{src} x{'/'.join(map(str, d))}" for src, d in s["drift"].items())
    lines.append(f"machine drift since calibration (measured/calibrated on anchor sizes timed in the "
                 f"same rounds): {drift}")
    if s["pick_counted"] or s["pick_skipped_within_margin"]:
        acc = "n/a" if s["pick_accuracy"] is None else f"{s['pick_accuracy']:.1%}"
        lines.append(f"EP-vs-TP pick accuracy: {s['pick_right']}/{s['pick_counted']} = {acc} of the cases whose "
                     f"measured times differ by more than {s['pick_margin']:.0%} "
                     f"({s['pick_skipped_within_margin']} closer cases not counted)")
    return "\n".join(lines)


def validation_json(res: ValidationResult) -> str:
    import json
    rows = [dataclasses.asdict(r) | {"rel_err": r.rel_err} for r in res.rows]
    return json.dumps({"meta": res.meta, "summary": res.summary(), "rows": rows}, indent=1)

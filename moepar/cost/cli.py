"""``python -m moepar report | recommend | calibrate | validate``: argparse front ends.

Each ``*_main(argv)`` returns an exit code: 0 on success, 2 when the input is invalid
(the message, naming the valid values, goes to stderr), 1 when ``validate --check`` misses
its thresholds. ``report``, ``recommend`` and ``price`` never import torch (a laptop without
it can price a layout, and start-up stays quick): calibrate and validate, which measure,
import the torch-using modules inside their commands (tests/test_cost_cli_imports.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable

from .cli_args import (MODEL_FIELDS, _int_list, _positive_arg, add_hw_args, add_model_args,  # noqa: F401
                       add_pipeline_args, hardware_from_args, redundant_list, spec_from_args)
from .collectives import OPS
from .hardware import PRESETS, save_profile
from .model import CostLayout
from .schedules import default_vp
from .units import fmt_bytes, fmt_time


def _guard(fn: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser, argv) -> int:
    args = parser.parse_args(argv)
    try:
        return fn(args)
    except (ValueError, OSError) as e:   # OSError: a file that cannot be read or written
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


def check_output_path(path: str | None, flag: str) -> None:
    """Refuse, before any work, an output file whose folder does not exist."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path!r}: folder {folder!r} does not exist (create it first)")


def parse_size(text: str) -> int:
    """'64K', '64KiB', '1M', '65536' -> bytes (binary units)."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"size {text!r} is not a byte count >= 1 (e.g. 65536, 64K, 64M, 1GiB)")
    return int(value)


# ---- report ---------------------------------------------------------------------------

def _report(a: argparse.Namespace) -> int:
    from .pipeline import step_cost
    from .report import build_report, plot_png, render_markdown, render_text, to_json
    for path, flag in ((a.markdown, "--markdown"), (a.json, "--json"), (a.png, "--png")):
        check_output_path(path, flag)
    hw = hardware_from_args(a)
    vp = a.vp if a.vp is not None else default_vp(a.schedule)
    layout = CostLayout(a.gpus, hw.gpus_per_node, a.tp, a.ep, a.etp, a.sp, a.zero, a.pp, vp, a.schedule)
    spec = spec_from_args(a, layout.ep)
    for w in layout.warnings():
        print(f"warning: {w}", file=sys.stderr)
    if len(redundant_list(a)) > 1:
        raise ValueError(f"--redundant-experts {a.redundant_experts!r}: report prices one R (recommend takes a list)")
    cost = step_cost(spec, layout, hw, a.compute_efficiency, a.a2a, a.allreduce)
    base = (step_cost(spec.replace(redundant_experts=0), layout, hw, a.compute_efficiency, a.a2a, a.allreduce)
            if spec.redundant_experts else None)
    rep = build_report(cost, _int_list(a.compare_sizes) if a.compare_sizes else None, a.allreduce, base)
    print(render_text(rep))
    for path, text in ((a.markdown, render_markdown), (a.json, to_json)):
        if path:
            with open(path, "w") as f:
                f.write(text(rep))
            print(f"wrote {path}")
    if a.png:
        plot_png(rep, a.png)
        print(f"wrote {a.png}")
    return 0


def report_main(argv: list[str]) -> int:
    """Communication, FLOPs and memory report for one model on one layout."""
    p = argparse.ArgumentParser(prog="python -m moepar report", description=report_main.__doc__)
    add_model_args(p)
    add_hw_args(p)
    g = p.add_argument_group("layout")
    g.add_argument("--gpus", type=int, default=8)
    g.add_argument("--tp", type=int, default=1, help="tensor parallel size (dense layers)")
    g.add_argument("--ep", type=int, default=1, help="expert parallel size")
    g.add_argument("--etp", type=int, default=1, help="expert tensor parallel size")
    g.add_argument("--sp", action="store_true", help="sequence parallelism in the TP group")
    g.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    add_pipeline_args(g)
    o = p.add_argument_group("output")
    o.add_argument("--markdown", help="also write the report as Markdown here")
    o.add_argument("--json", help="also write the report's data as JSON here")
    o.add_argument("--png", help="also plot bytes/time per collective and EP vs TP here (matplotlib)")
    o.add_argument("--compare-sizes", help="group sizes of the EP-vs-TP table (default 2,4,... <= gpus)")
    return _guard(_report, p, argv)


# ---- recommend --------------------------------------------------------------------------

def _recommend(a: argparse.Namespace) -> int:
    from .compare import recommend
    from ..tables import format_table
    check_output_path(a.json, "--json")
    hw = hardware_from_args(a)
    spec = spec_from_args(a).replace(redundant_experts=0)
    redundant = redundant_list(a)
    zero = _int_list(a.zero)
    bad = [z for z in zero if z not in (0, 1, 2, 3)]
    if bad or not zero:
        raise ValueError(f"--zero {a.zero!r}: stages must be among 0, 1, 2, 3")
    if a.memory_gib is not None and not (0 < a.memory_gib < math.inf):
        raise ValueError(f"--memory-gib {a.memory_gib} must be a finite number > 0")
    if a.global_tokens is not None and a.global_tokens < 1:
        raise ValueError(f"--global-tokens {a.global_tokens} must be >= 1")
    if a.top < 1:
        raise ValueError(f"--top {a.top} must be >= 1")
    mem = a.memory_gib * 2 ** 30 if a.memory_gib is not None else None
    from .compare import find_layout, parse_find, pipeline_sizes
    vp = a.vp if a.vp is not None else default_vp(a.schedule)
    valid_pp = pipeline_sizes(spec, a.gpus, vp)
    pps = _int_list(a.pp) if a.pp else valid_pp
    bad = [p for p in pps if p not in valid_pp]
    if bad or not pps:
        raise ValueError(f"--pp {a.pp!r}: pipeline sizes must divide --gpus {a.gpus} with pp x vp <= "
                         f"layers={spec.layers} (vp={vp}); valid: {', '.join(map(str, valid_pp))}")
    find = parse_find(a.find) if a.find else None
    skipped: list = []
    cands = recommend(spec, a.gpus, hw, None, mem, a.global_tokens, a.compute_efficiency,
                      zero, a.cross_node_tp, a.a2a, a.allreduce, pps, a.schedule, vp, skipped, redundant)
    if not cands:
        raise ValueError(f"no layout of {a.gpus} GPUs divides the model (experts={spec.experts}, "
                         f"hidden={spec.hidden}, tokens={spec.tokens})")
    fit = [c for c in cands if c.fits]
    rows, data = [], []
    for i, c in enumerate((fit or cands)[: a.top], 1):
        lay, cost = c.cost.layout, c.cost
        data.append({"rank": i, "pp": lay.pp, "schedule": lay.schedule if lay.pp > 1 else None, "vp": lay.vp,
                     "bubble_s": cost.bubble_time,
                     "tp": lay.tp, "sp": lay.sp, "ep": lay.ep, "etp": lay.etp, "dp": lay.dp,
                     "edp": lay.edp, "zero": lay.zero, "micro_batches": cost.spec.micro_batches,
                     "tokens": cost.spec.tokens, "memory_gib": cost.memory.total / 2 ** 30, "fits": c.fits,
                     "comm_s": cost.comm_per_step, "compute_s": cost.compute_per_step,
                     "step_s": cost.step_time_overlapped, "step_no_overlap_s": cost.step_time,
                     "mfu": cost.mfu(True), "mfu_no_overlap": cost.mfu(),
                     "tokens_per_s_per_gpu": cost.tokens_per_second_per_gpu(True),
                     "redundant_experts": cost.spec.redundant_experts, "imbalance": cost.routes.max / cost.routes.mean})
        rows.append({"#": i, "pp": lay.pp, "tp": lay.tp, "sp": "on" if lay.sp else "off", "ep": lay.ep, "etp": lay.etp,
                     "dp": lay.dp, "edp": lay.edp, "zero": lay.zero,
                     "micro-batches": f"{cost.spec.micro_batches} x {cost.spec.tokens}",
                     "memory": fmt_bytes(cost.memory.total), "comm": fmt_time(cost.comm_per_step),
                     "compute": fmt_time(cost.compute_per_step), "bubble": fmt_time(cost.bubble_time),
                     "no overlap": fmt_time(cost.step_time),
                     "MFU": f"{cost.mfu(True):.1%}", "tokens/s/GPU": f"{cost.tokens_per_second_per_gpu(True):.4g}",
                     "step": fmt_time(cost.step_time_overlapped)})
        if any(redundant) or spec.expert_loads is not None:   # after "zero": R and the max/mean it reaches
            rows[-1] = {**{k: rows[-1][k] for k in list(rows[-1])[:9]}, "R": cost.spec.redundant_experts,
                        "max/mean": f"{cost.routes.max / cost.routes.mean:.3g}",
                        **{k: rows[-1][k] for k in list(rows[-1])[9:]}}
    mem_text = fmt_bytes(mem or hw.memory_bytes)
    total = fit[0].cost.tokens_per_step if fit else cands[0].cost.tokens_per_step
    print(f"{len(cands)} layouts of {a.gpus} GPUs on {hw.name}; {len(fit)} fit in {mem_text} per GPU; "
          f"about {total} tokens per step; ranked by predicted step time with ideal overlap (step; "
          f"'no overlap' is the upper bound), compute at {cands[0].cost.compute_efficiency:.0%} of peak:")
    if skipped:
        print(f"({len(skipped)} pipelined layouts left out: their micro-batches break the {a.schedule!r} schedule's "
              f"rule at this global batch)")
    if not fit:
        print("NONE FITS: the smallest by memory are listed; add GPUs, raise --zero or lower --tokens")
    print(format_table(rows))
    if find is not None:
        print()
        print(find_layout(cands, find, a.find, skipped))
    if any(redundant):
        from .replication_report import verdict
        print()
        print(verdict(cands, hw, a.compute_efficiency, a.a2a, a.allreduce))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


def recommend_main(argv: list[str]) -> int:
    """Rank the layouts of a GPU count that fit in memory by predicted step time."""
    p = argparse.ArgumentParser(prog="python -m moepar recommend", description=recommend_main.__doc__)
    add_model_args(p)
    add_hw_args(p)
    g = p.add_argument_group("search")
    g.add_argument("--gpus", type=int, required=True)
    g.add_argument("--memory-gib", type=float, help="memory per GPU (default: the hardware's)")
    g.add_argument("--global-tokens", type=int,
                   help="tokens per step (default 1048576, or tokens x micro-batches x gpus if larger)")
    g.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to consider (default 0,1,2,3)")
    g.add_argument("--cross-node-tp", action="store_true", help="also consider tp/etp > gpus per node")
    g.add_argument("--top", type=int, default=10)
    add_pipeline_args(g, search=True)
    g.add_argument("--find", metavar="FIELDS", help="also print where the best layout with these sizes ranks "
                                                    "and how its step differs from the first, e.g. "
                                                    "'pp=16,ep=64,zero=1' (fields: pp tp ep etp zero sp)")
    g.add_argument("--json", help="write the ranked rows as JSON here")
    return _guard(_recommend, p, argv)


# ---- price: one collective, nccl-tests style ---------------------------------------------

def _price(a: argparse.Namespace) -> int:
    from .collectives import Placement, bus_factor
    check_output_path(a.json, "--json")
    hw = hardware_from_args(a)
    _positive_arg("--gpus", a.gpus)
    size = parse_size(a.size)
    gpn = hw.gpus_per_node
    if a.op == "p2p" and a.gpus != 2:
        raise ValueError(f"--gpus {a.gpus}: p2p is a transfer between 2 GPUs (--gpus 2)")
    if a.gpus > gpn and a.gpus % gpn:
        raise ValueError(f"--gpus {a.gpus} is not a whole number of nodes of --gpus-per-node {gpn}")
    pl = Placement.contiguous(a.gpus, gpn)
    t = hw.collective_time(a.op, pl, size, a.algo)
    algo = hw.resolve_algo(a.op, pl, size, a.algo)
    algbw = size / t if t > 0 else math.inf
    busbw = algbw * bus_factor(a.op, a.gpus)
    out = {"op": a.op, "algo": algo, "size_bytes": size, "gpus": a.gpus, "gpus_per_node": gpn,
           "nodes": pl.nodes, "nics_per_node": hw.nics, "hardware": hw.name, "time_s": t,
           "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9}
    print(f"{a.op} ({algo}) of {fmt_bytes(size)} over {a.gpus} GPUs ({pl.nodes} node(s) x {pl.per_node}, "
          f"{hw.nics} NICs per node) on {hw.name}:")
    print(f"{'size (B)':>14} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    print(f"{size:>14} {t * 1e6:>12.2f} {algbw / 1e9:>13.2f} {busbw / 1e9:>13.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"wrote {a.json}")
    return 0


def price_main(argv: list[str]) -> int:
    """Predicted time, algbw and busbw of one collective, in nccl-tests' conventions (size:
    bytes per rank; busbw = algbw x 2(n-1)/n for all_reduce, (n-1)/n otherwise)."""
    p = argparse.ArgumentParser(prog="python -m moepar price", description=price_main.__doc__)
    p.add_argument("op", choices=(*OPS, "p2p"), help="a collective, or p2p: one tensor from one GPU to another "
                                                      "(a pipeline stage boundary; --gpus 2, --gpus-per-node 1 to "
                                                      "cross nodes)")
    p.add_argument("--size", default="1GiB", help="bytes per rank, nccl-tests' size (default 1GiB)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--algo", help="algorithm (default: all_reduce auto, all_to_all pairwise, else ring)")
    p.add_argument("--json", help="write time_s, algbw_GBps, busbw_GBps (and the inputs) here")
    g = p.add_argument_group("hardware")
    g.add_argument("--hardware", default="h100",
                   help=f"preset ({', '.join(sorted(PRESETS))}) or a calibrated JSON profile (default h100)")
    g.add_argument("--gpus-per-node", type=int, help="default: the hardware's")
    g.add_argument("--nics-per-node", type=int, help="default: the hardware's NICs per GPU x --gpus-per-node")
    return _guard(_price, p, argv)


# ---- calibrate / validate -------------------------------------------------------------------

def _calibrate(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..parallel import destroy_parallel
    from ..tables import format_table
    from .calibrate import bus_bandwidth_table, calibrate, pinned_to_core, size_sweep
    created = not (dist.is_available() and dist.is_initialized())
    sizes = size_sweep(parse_size(a.min_size), parse_size(a.max_size), a.factor)
    from .calibrate import CALIBRATED_OPS
    ops = [o.strip() for o in a.ops.split(",")] if a.ops else list(CALIBRATED_OPS)
    with pinned_to_core(not a.no_pin):
        hw = calibrate(sizes, _int_list(a.group_sizes) if a.group_sizes else None, ops, a.repeats, a.warmup,
                       a.dtype, log=print)
    if dist.get_rank() == 0:
        save_profile(hw, a.out)
        print(format_table(bus_bandwidth_table(hw)))
        print(f"matmul rate {hw.flops / 1e9:.3g} GFLOP/s per rank; fitted link {hw.intra.bandwidth / 1e9:.3g} GB/s, "
              f"{hw.intra.latency * 1e6:.3g} us/step; {hw.meta['seconds']} s on {hw.meta['machine']}")
        print(f"wrote {a.out}")
    if created:   # join every group's threads while the interpreter is intact (docs/fsdp.md)
        destroy_parallel()
    return 0


def calibrate_main(argv: list[str]) -> int:
    """Measure all-reduce, all-gather, reduce-scatter, all-to-all over a size sweep and
    group sizes, and the point-to-point send/recv of a pipeline stage boundary between rank
    pairs, on the current backend; fit and save a JSON profile. Run under torchrun."""
    p = argparse.ArgumentParser(prog="python -m moepar calibrate", description=calibrate_main.__doc__)
    p.add_argument("--out", default="profile.json")
    p.add_argument("--min-size", default="64K")
    p.add_argument("--max-size", default="64M")
    p.add_argument("--factor", type=float, default=2 ** 0.5, help="ratio between consecutive sizes (default sqrt 2)")
    p.add_argument("--group-sizes", help="default: 2,4,8 that divide the world")
    p.add_argument("--ops", help=f"default: {','.join(OPS)},p2p")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="fp32", help="fp32 bf16 fp16")
    p.add_argument("--no-pin", action="store_true", help="on CPU, do not pin rank r to core r %% cores")
    return _guard(_calibrate, p, argv)


def _validate(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..parallel import destroy_parallel
    from .hardware import load_profile
    from .report import markdown_table
    from .calibrate import pinned_to_core
    from .validate import format_validation, run_validation, validation_json
    from . import validate_moe  # noqa: F401  (registers the MoE dispatch rows)
    hw = load_profile(a.profile)
    created = not (dist.is_available() and dist.is_initialized())
    with pinned_to_core(not a.no_pin):
        res = run_validation(hw, repeats=a.repeats, warmup=a.warmup,
                             group_sizes=_int_list(a.group_sizes) if a.group_sizes else None, quick=a.quick)
    code = 0
    if dist.get_rank() == 0:
        print(format_validation(res))
        if a.json:
            with open(a.json, "w") as f:
                f.write(validation_json(res))
            print(f"wrote {a.json}")
        if a.markdown:
            with open(a.markdown, "w") as f:
                f.write(format_validation(res, table=markdown_table) + "\n")
            print(f"wrote {a.markdown}")
    if a.check:
        s = res.summary()
        basis = s["median_rel_error_drift_corrected" if a.check_drift_corrected else "median_rel_error"]
        errs = [basis.get(op) for op in ("all_reduce", "all_to_all")] + \
            ([basis["p2p"]] if basis.get("p2p") is not None else [])
        acc = s["pick_accuracy"]
        ok = all(e is not None and e <= a.max_median_error for e in errs) and (acc is None or acc >= a.min_pick_accuracy)
        code = 0 if ok else 1
    if created:   # join every group's threads while the interpreter is intact (docs/fsdp.md)
        destroy_parallel()
    return code


def validate_main(argv: list[str]) -> int:
    """Predicted vs measured time of real collectives and EP-vs-TP cases (and any registered
    row source), at sizes calibration did not measure. Run under torchrun after calibrate."""
    p = argparse.ArgumentParser(prog="python -m moepar validate", description=validate_main.__doc__)
    p.add_argument("--profile", default="profile.json", help="written by `python -m moepar calibrate`")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--group-sizes", help="default: those in the profile that divide the world")
    p.add_argument("--quick", action="store_true", help="fewer EP-vs-TP cases (smoke tests)")
    p.add_argument("--no-pin", action="store_true", help="on CPU, do not pin rank r to core r %% cores")
    p.add_argument("--json", help="write rows and summary as JSON here")
    p.add_argument("--markdown", help="write the table as Markdown here")
    p.add_argument("--check", action="store_true", help="exit 1 if the thresholds below are missed (median "
                                                         "error of all_reduce, all_to_all and, when measured, p2p)")
    p.add_argument("--max-median-error", type=float, default=0.20)
    p.add_argument("--min-pick-accuracy", type=float, default=0.90)
    p.add_argument("--check-drift-corrected", action="store_true",
                   help="--check the errors after scaling by the measured drift since calibration")
    return _guard(_validate, p, argv)

"""``python -m moepar calibrate | validate``: the front ends of the commands that measure.

Run under torchrun. Each imports torch and the measuring modules inside its command (so
``--help`` stays quick) and returns an exit code as ``moepar.cost.cli``'s: 0 on success, 2
when the input is invalid, 1 when ``validate --check`` misses its thresholds.
"""
from __future__ import annotations

import argparse

from .cli import _guard, _int_list, parse_size
from .collectives import OPS
from .profiles import save_profile


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


def _published(a: argparse.Namespace) -> int:
    """``validate --published``: torch-free, one process (the runs are priced, not measured)."""
    from .cli import check_output_path
    from .published_check import published_report, render_all
    check_output_path(a.markdown, "--markdown")
    rep = published_report(a.recommend)
    print(render_all(report=rep))
    if a.markdown:
        text = render_all(markdown=True, report=rep)
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
        print(f"wrote {a.markdown}")
    return 0


def _validate(a: argparse.Namespace) -> int:
    if a.published:
        return _published(a)
    import torch.distributed as dist

    from ..parallel import destroy_parallel
    from .profiles import load_profile
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
    row source), at sizes calibration did not measure. Run under torchrun after calibrate.
    With --published: the model against published training runs instead (no torchrun)."""
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
    p.add_argument("--published", action="store_true",
                   help="instead of measuring: price the published MoE training runs (moepar/cost/published.py) at "
                        "their layouts, predicted against published tokens/s per GPU (one process, no torch)")
    p.add_argument("--recommend", action="store_true",
                   help="with --published: also rank each published layout among the layouts recommend searches")
    return _guard(_validate, p, argv)

"""calibrate + validate end to end on gloo ranks (small sizes, few repeats: a smoke test
of the machinery, not of its accuracy), the JSON profile they produce, and the measured
vs predicted table fed with real recorded collectives."""
import os

import torch
import torch.distributed as dist

from moepar.cost.calibrate import calibrate, pinned_to_core
from moepar.cost.collectives import OPS
from moepar.cost.model import CostLayout, MoESpec
from moepar.cost.profiles import get_hardware, load_profile, save_profile
from moepar.cost.run_report import measured_vs_predicted
from moepar.cost.validate import (Row, ROW_SOURCES, collective_rows, ep_vs_tp_rows, format_validation,
                                  register_row_source, run_validation)
from moepar.parallel import comm

from ..helpers.multiproc import run_ranks

KiB = 1024


def _extra_rows(ctx):
    # a registered source (as the MoE layer's dispatch will be): timed through the context
    n = ctx.group_sizes[-1]
    t = ctx.time(lambda: comm.all_reduce_(torch.zeros(1024), ctx.groups[n]))
    return [Row("extra", "1024 floats", "all_reduce", n, 4096, *ctx.predict("all_reduce", n, 4096)[:1], t)]


def _calibrate_validate(path):
    hw = calibrate(sizes=[64 * KiB, 128 * KiB, 256 * KiB], repeats=2, warmup=1)
    if dist.get_rank() == 0:
        save_profile(hw, path)
    dist.barrier()
    loaded = load_profile(path)
    # The built-in sources by name: ROW_SOURCES is global, and a test that imported
    # moepar.cost.validate_moe earlier in these worker processes has added its source to it.
    res = run_validation(loaded, sources=[collective_rows, ep_vs_tp_rows, _extra_rows], repeats=2, quick=True,
                         sizes=[96 * KiB, 192 * KiB])
    return hw.meta["group_sizes"], res.summary(), len(res.rows), format_validation(res), \
        sorted({r.source for r in res.rows})


def test_calibrate_then_validate_on_4_gloo_ranks(tmp_path):
    path = str(tmp_path / "profile.json")
    results = run_ranks(_calibrate_validate, 4, path)
    group_sizes, summary, n_rows, text, sources = results[0]
    assert group_sizes == [2, 4]
    # every rank agrees (the measurements are reduced over ranks)
    assert all(r[1] == summary for r in results)
    hw = load_profile(path)
    assert hw.meta["backend"] == "gloo" and hw.meta["world_size"] == 4 and hw.calibrated
    # the collectives at both group sizes, the point-to-point pair (a stage boundary) at 2
    assert set(hw.curves) == {(op, n) for op in OPS for n in (2, 4)} | {("p2p", 2)}
    for c in hw.curves.values():
        assert c.sizes == (64 * KiB, 128 * KiB, 256 * KiB)
        assert all(0 < t < 10 for t in c.seconds) and c.alpha >= 0 and c.busbw > 0
        assert min(c.monotone) > 0 and list(c.monotone) == sorted(c.monotone)
    assert 0 < hw.intra.bandwidth < 1e12 and hw.flops > 0 and hw.memory_bytes > 0
    # 4 ops x 2 group sizes x 2 sizes, p2p x 2 sizes, plus 2 quick EP-vs-TP cases x 2 group sizes x 2 rows ...
    assert sources == ["collective", "ep-vs-tp", "extra"]
    assert n_rows == 4 * 2 * 2 + 2 + 2 * 12 * 2 + 1
    assert set(summary["median_rel_error"]) == {"all", "p2p", *OPS}
    assert all(e >= 0 for e in summary["median_rel_error"].values())
    counted, skipped = summary["pick_counted"], summary["pick_skipped_within_margin"]
    assert counted + skipped == 2 * 12 and 0 <= summary["pick_right"] <= counted
    assert "median |relative error|     all_reduce" in text and "EP-vs-TP pick accuracy" in text
    assert "median |relative error|            p2p" in text
    # the profile drives a report like any preset
    assert get_hardware(path).collective_time("all_reduce", hw_placement(2), 128 * KiB) > 0


def hw_placement(n):
    from moepar.cost.collectives import Placement
    return Placement(n, n)


def _record_layer_like_traffic():
    group = dist.group.WORLD
    x = torch.randn(64, 32, requires_grad=True)
    with comm.track() as stats:
        y = comm.all_to_all(x, group)                       # dispatch (+ its backward)
        z = comm.all_to_all(y * 2, group)                   # combine (+ its backward)
        z.sum().backward()
    return stats.events


def test_measured_vs_predicted_with_recorded_events():
    events = run_ranks(_record_layer_like_traffic, 2)[0]
    assert sum(1 for e in events if e.op == "all_to_all") == 4
    spec = MoESpec(hidden=32, ffn=64, experts=2, topk=1, tokens=64, dtype="fp32")
    text = measured_vs_predicted(spec, CostLayout(2, 2, ep=2), get_hardware("h100"), events)
    lines = text.splitlines()
    assert "measured vs predicted" in lines[0]
    a2a = [ln for ln in lines if ln.strip().startswith("all_to_all")]
    # forward: 2 measured; the model expects dispatch + combine = 2 (the counts travel in an
    # all-gather); backward: 2 and 2
    assert len(a2a) == 2
    bwd, fwd = (ln.split() for ln in a2a)                    # rows sorted by (op, n, phase)
    assert fwd[:5] == ["all_to_all", "2", "fwd", "2", "2"]
    assert bwd[:5] == ["all_to_all", "2", "bwd", "2", "2"]
    assert "16 KiB" in a2a[1]                               # 2 calls x 64 x 32 x 4 bytes
    assert lines[-1].startswith("total: measured")


def test_pinning_restores_the_affinity():
    if not hasattr(os, "sched_getaffinity"):
        return
    before = os.sched_getaffinity(0)
    with pinned_to_core(True):
        inside = os.sched_getaffinity(0)
    assert len(inside) == 1 or torch.cuda.is_available()
    assert os.sched_getaffinity(0) == before


def test_register_row_source_is_idempotent():
    n = len(ROW_SOURCES)
    register_row_source(_extra_rows)
    register_row_source(_extra_rows)
    try:
        assert len(ROW_SOURCES) == n + 1
    finally:
        ROW_SOURCES.remove(_extra_rows)

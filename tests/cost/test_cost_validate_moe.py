"""The MoE dispatch rows of `python -m moepar validate` on 4 gloo ranks."""

import pytest

from moepar.cost.calibrate import calibrate, row_pass_seconds
from moepar.cost.profiles import get_hardware
from moepar.cost.validate import run_validation
from moepar.cost.validate_moe import QUICK_CASES, moe_dispatch_rows

from ..helpers.multiproc import run_ranks


def _dispatch_rows():
    hw = calibrate(sizes=[16 * 1024, 64 * 1024, 256 * 1024], ops=["all_to_all"], repeats=2)
    res = run_validation(hw, sources=[moe_dispatch_rows], repeats=2, quick=True)
    comm_only = [ctx_free_prediction(hw, r) for r in res.rows]
    return [(r.case, r.op, r.group_size, r.nbytes, r.predicted, r.measured) for r in res.rows], \
        res.summary()["median_rel_error"].get("moe_dispatch"), hw.meta["row_passes"], comm_only


def ctx_free_prediction(hw, row):
    """The communication-only prediction of a dispatch row (the counts all-gather + 2 token
    all-to-alls)."""
    from moepar.cost.collectives import Placement
    from moepar.moe.traffic import message_bytes
    n, E = row.group_size, 2 * row.group_size
    pl = Placement(n, n)
    return hw.collective_time("all_gather", pl, message_bytes(E, n, n)) + 2 * hw.collective_time("all_to_all", pl,
                                                                                                  row.nbytes)


def test_moe_dispatch_rows():
    results = run_ranks(_dispatch_rows, 4)
    rows, median, passes, comm_only = results[0]
    assert len(rows) == 2 * len(QUICK_CASES)  # group sizes 2 and 4
    for case, op, n, nbytes, pred, meas in rows:
        assert op == "moe_dispatch" and n in (2, 4) and pred > 0 and meas > 0
    T, D = QUICK_CASES[0]
    assert rows[0][3] == T * 2 * D * 4  # R·D·b of one token all-to-all, fp32
    assert median is not None and median >= 0
    assert all(r[0] == rows for r in results)  # every rank reports the same rows
    # the local passes: calibrated (a positive rate) and added to each row's prediction
    assert passes["bytes_per_s"] > 0 and passes["latency"] >= 0 and len(passes["sizes"]) == len(passes["seconds"])
    for (case, op, n, nbytes, pred, meas), comm in zip(rows, comm_only):
        extra = passes["latency"] + nbytes / passes["bytes_per_s"]
        assert pred == pytest.approx(comm + extra, rel=1e-9) and extra > 0


def test_row_pass_seconds_is_the_calibrated_line():
    hw = get_hardware("h100")
    assert row_pass_seconds(hw, 1 << 20) == 0.0          # presets carry no measurement
    cal = hw.replace(meta={"row_passes": {"latency": 1e-5, "bytes_per_s": 2e9}})
    assert row_pass_seconds(cal, 4e9) == pytest.approx(1e-5 + 2.0)
    assert row_pass_seconds(cal, 0) == 0.0

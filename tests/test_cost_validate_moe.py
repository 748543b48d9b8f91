"""The MoE dispatch rows of `python -m moepar validate` on 4 gloo ranks."""

from moepar.cost.calibrate import calibrate
from moepar.cost.validate import run_validation
from moepar.cost.validate_moe import QUICK_CASES, moe_dispatch_rows

from .multiproc import run_ranks


def _dispatch_rows():
    hw = calibrate(sizes=[16 * 1024, 64 * 1024, 256 * 1024], ops=["all_to_all"], repeats=2)
    res = run_validation(hw, sources=[moe_dispatch_rows], repeats=2, quick=True)
    return [(r.case, r.op, r.group_size, r.nbytes, r.predicted, r.measured) for r in res.rows], \
        res.summary()["median_rel_error"].get("moe_dispatch")


def test_moe_dispatch_rows():
    results = run_ranks(_dispatch_rows, 4)
    rows, median = results[0]
    assert len(rows) == 2 * len(QUICK_CASES)  # group sizes 2 and 4
    for case, op, n, nbytes, pred, meas in rows:
        assert op == "moe_dispatch" and n in (2, 4) and pred > 0 and meas > 0
    T, D = QUICK_CASES[0]
    assert rows[0][3] == T * 2 * D * 4  # R·D·b of one token all-to-all, fp32
    assert median is not None and median >= 0
    assert all(r[0] == rows for r in results)  # every rank reports the same rows

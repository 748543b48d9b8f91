"""The example's end-of-run report: for every op (and group size, phase) the calls and bytes
the run recorded equal the cost model's, on 4 gloo ranks and six layouts, one of them with
the peer-wait barriers (which must not count as collectives), one with pipeline stages (the
point-to-point sends and receives too), one with redundant experts rebalanced every step (the
copies' weights and gradients, and the rebalance's all-reduce)."""
import dataclasses

import pytest

from examples import train_gpt_moe
from moepar.cost import run_report

from ..helpers.multiproc import run_ranks
from ..project.test_example import TINY


def _report_rows(argv):
    """Train, and return the rows rank 0's end-of-run report compared (None elsewhere)."""
    seen = []
    original = run_report.compare_run

    def spy(*a, **kw):
        seen.append(original(*a, **kw))
        return seen[-1]
    run_report.compare_run = spy
    try:
        train_gpt_moe.train(train_gpt_moe.parse_args(argv))
    finally:
        run_report.compare_run = original
    return [dataclasses.asdict(r) for r in seen[0]] if seen else None


@pytest.mark.parametrize("layout", [["--tp", "2", "--ep", "2"],
                                    ["--tp", "2", "--ep", "1", "--moe-every", "2", "--z-loss-coeff", "0"],
                                    ["--tp", "1", "--ep", "4", "--moe-every", "2", "--time-peer-wait"],
                                    ["--tp", "2", "--ep", "2", "--dispatch-dtype", "fp8"],
                                    ["--tp", "1", "--ep", "2", "--pp", "2", "--microbatches", "2"],
                                    ["--tp", "1", "--ep", "4", "--redundant-experts", "4", "--rebalance-every", "1"]])
def test_every_op_matches_the_model(tmp_path, layout):
    argv = TINY + ["--steps", "2", "--hardware", "h100", "--out", str(tmp_path), *layout]
    rows = run_ranks(_report_rows, 4, argv)[0]
    assert rows, "rank 0 printed no cost report"
    ops = {r["op"] for r in rows}
    assert "all_reduce" in ops and (layout[3] == "1" or "all_to_all" in ops)
    if "--pp" in layout:   # stage 0's activations out, their gradients in, counted like the rest
        assert {("send", "fwd"), ("recv", "bwd")} <= {(r["op"], r["phase"]) for r in rows}, rows
    for r in rows:
        assert (r["calls"], r["nbytes"]) == (r["model_calls"], r["model_bytes"]), r
        assert r["model_seconds"] > 0
        # --time-peer-wait: the barriers are timed apart, and are not counted as collectives.
        assert (r["wait_seconds"] > 0) == ("--time-peer-wait" in layout), r


def test_rebalance_collectives_follow_the_planning_spread():
    """One all-reduce of the routes per rebalance; a second of the plans once the stage's
    replicated slots reach SPREAD_SLOTS (the layers are then planned across the ranks)."""
    from moepar.moe.traffic import SPREAD_SLOTS, rebalance_collectives
    assert rebalance_collectives(4, 8, 4, 1) == []
    assert rebalance_collectives(4, 8, 4, 2) == [4 * 8 * 8]
    assert SPREAD_SLOTS == 1024
    assert rebalance_collectives(58, 256, 64, 64) == [58 * 256 * 8, 58 * (1 + 2 * 320) * 8]

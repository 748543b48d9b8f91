"""``python -m moepar report | recommend | calibrate | validate``: smoke runs, outputs, and
the messages for bad input."""
import json

import pytest

from moepar.__main__ import main
from moepar.cost import cli, cli_measure
from moepar.cost.pipeline import step_cost
from moepar.cost.model import CostLayout, MoESpec
from moepar.cost.profiles import get_hardware
from moepar.cost.report import build_report, render_markdown

ISSUE_EXAMPLE = ["--hidden", "4096", "--ffn", "14336", "--experts", "8", "--topk", "2", "--tokens", "8192",
                 "--gpus", "64", "--gpus-per-node", "8", "--tp", "2", "--ep", "8", "--hardware", "h100"]


def test_report_of_the_issue_example_prints_every_section(capsys, tmp_path):
    md, js, png = tmp_path / "r.md", tmp_path / "r.json", tmp_path / "r.png"
    assert main(["report", *ISSUE_EXAMPLE, "--markdown", str(md), "--json", str(js), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    for text in ("Collectives per layer and micro-batch", "MoE dispatch", "attention output",
                 "EP vs TP for this FFN", "params per rank", "DeepSpeed", "tp=2 dp=32 | ep=8 etp=1 edp=8"):
        assert text in out
    data = json.loads(js.read_text())
    assert data["layout"]["dp"] == 32 and len(data["ep_vs_tp"]["rows"]) == 6       # n = 2 .. 64
    dispatch = [c for c in data["layer_collectives"] if c["name"] == "MoE dispatch"][0]
    assert dispatch["bytes"] == 8192 // 2 * 2 * 4096 * 2 and dispatch["group_size"] == 8
    assert md.read_text().startswith("# moepar communication cost report")
    assert "| phase | collective |" in md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_mixtral_on_8_h100_prints_per_rank_params_and_flops(capsys):
    assert cli.report_main(["--model", "mixtral-8x7b", "--tokens", "4096", "--gpus", "8", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    # hand numbers of test_cost_model: 1.606 G dense + 5.637 G expert = 7.243 G per rank;
    # 46.7 G total, 12.88 G active; 76.49 GFLOP per token; 313.3 TFLOP per rank per micro-batch
    assert "1.606 G / 5.637 G / 7.243 G" in out
    assert "46.7 G / 12.88 G" in out
    assert "76.49 G" in out and "313.3 T / 313.3 T" in out


def test_bad_input_messages(capsys):
    assert cli.report_main([*ISSUE_EXAMPLE[:-1], "tpu"]) == 2
    err = capsys.readouterr().err
    assert "unknown hardware 'tpu'" in err and "h100" in err and "a100" in err and "h100-pcie" in err
    assert cli.report_main(["--model", "mixtral-8x7b", "--gpus", "24", "--ep", "3"]) == 2
    assert "experts=8 is not divisible by ep=3 (valid ep: 1, 2, 4, 8)" in capsys.readouterr().err
    assert cli.report_main(["--model", "mixtral-8x7b", "--gpus", "8", "--tp", "3"]) == 2
    assert "valid tp: 1, 2, 4, 8" in capsys.readouterr().err
    assert cli.report_main(["--hidden", "64", "--gpus", "8"]) == 2
    assert "missing --ffn, --experts, --topk" in capsys.readouterr().err


def test_tp_across_nodes_warns_but_reports(capsys):
    args = ["--hidden", "4096", "--ffn", "8192", "--experts", "8", "--topk", "2", "--tokens", "1024",
            "--gpus", "32", "--tp", "16", "--ep", "8"]
    assert cli.report_main(args) == 0
    cap = capsys.readouterr()
    assert "warning: tp=16 > gpus_per_node=8" in cap.err
    assert "WARNING: tp=16 > gpus_per_node=8" in cap.out and "2 nodes" in cap.out


def test_routing_counts_set_the_imbalance(capsys, tmp_path):
    counts = tmp_path / "counts.txt"
    counts.write_text("10\n30\n20\n20\n")
    args = ["--hidden", "64", "--ffn", "128", "--experts", "4", "--topk", "1", "--tokens", "64",
            "--gpus", "4", "--ep", "4", "--routing-counts", str(counts)]
    assert cli.report_main(args) == 0
    out = capsys.readouterr().out
    assert "imbalance=1.5" in out and "64 / 96" in out          # mean 64 routes, most loaded 96


def test_recommend_ranks_fitting_layouts(capsys):
    args = ["--model", "mixtral-8x7b", "--tokens", "4096", "--gpus", "16", "--hardware", "h100", "--top", "5"]
    assert cli.recommend_main(args) == 0
    out = capsys.readouterr().out
    assert "ranked by predicted step time" in out
    lines = [ln for ln in out.splitlines()[3:] if ln.strip()[:1].isdigit()]
    assert len(lines) == 5
    steps = []
    for ln in lines:
        value, unit = ln.split()[-2:]
        steps.append(float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit])
    assert steps == sorted(steps)
    assert cli.recommend_main(["--model", "mixtral-8x7b", "--gpus", "2", "--memory-gib", "1"]) == 0
    assert "NONE FITS" in capsys.readouterr().out


def test_calibrate_and_validate_explain_how_to_launch(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli_measure.calibrate_main(["--out", str(tmp_path / "p.json")]) == 2
    assert "torchrun --nproc_per_node=4 -m moepar calibrate" in capsys.readouterr().err
    assert cli_measure.validate_main(["--profile", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a byte count"):
        cli.parse_size("lots")
    assert cli.parse_size("64K") == 65536 and cli.parse_size("64MiB") == 64 * 2 ** 20


def test_markdown_of_a_tiny_model_one_gpu():
    spec = MoESpec(hidden=8, ffn=8, experts=2, topk=1, tokens=1)
    rep = build_report(step_cost(spec, CostLayout(1, 8), get_hardware("a100")))
    assert rep["layer_collectives"] == [] and rep["time"]["comm_per_step"] == 0
    assert "## Summary" in render_markdown(rep)


MIXTRAL16 = ["--model", "mixtral-8x7b", "--tokens", "4096", "--gpus", "16"]


@pytest.mark.parametrize("args, needle", [
    (["report", *MIXTRAL16, "--ep", "8", "--imbalance", "inf"], "--imbalance inf must be a finite number >= 1"),
    (["report", *MIXTRAL16, "--ep", "8", "--routing-counts", "no/such/counts.txt"],
     "--routing-counts 'no/such/counts.txt' is neither"),
    (["report", *MIXTRAL16, "--ep", "8", "--routing-counts", "1,2,3,4"],
     "--routing-counts has 4 counts; the model has experts=8"),
    (["report", *MIXTRAL16, "--ep", "8", "--json", "no/such/folder/r.json"], "--json 'no/such/folder/r.json': folder"),
    (["report", *MIXTRAL16, "--ep", "8", "--gpus-per-node", "0"], "--gpus-per-node=0 must be >= 1"),
    (["recommend", *MIXTRAL16, "--memory-gib", "0"], "--memory-gib 0.0 must be a finite number > 0"),
    (["recommend", *MIXTRAL16, "--global-tokens", "0"], "--global-tokens 0 must be >= 1"),
    (["recommend", *MIXTRAL16, "--top", "-1"], "--top -1 must be >= 1"),
    (["recommend", *MIXTRAL16, "--zero", "0,5"], "--zero '0,5': stages must be among 0, 1, 2, 3"),
    (["recommend", *MIXTRAL16, "--json", "no/such/folder/r.json"], "--json 'no/such/folder/r.json': folder"),
    (["price", "all_reduce", "--size", "lots"], "size 'lots' is not a byte count"),
    (["price", "all_reduce", "--gpus", "12", "--gpus-per-node", "8"], "--gpus 12 is not a whole number of nodes"),
    (["price", "all_reduce", "--gpus", "16", "--algo", "nvls"], "algo='nvls' needs one node"),
])
def test_every_bad_value_exits_2_with_one_line(capsys, args, needle):
    assert main(args) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], cap.err
    assert "Traceback" not in cap.err


def test_price_prints_nccl_tests_figures_and_json(capsys, tmp_path):
    out = tmp_path / "p.json"
    assert main(["price", "all_reduce", "--size", "1GiB", "--gpus", "16", "--gpus-per-node", "8",
                 "--hardware", "h100", "--json", str(out)]) == 0
    assert "busbw (GB/s)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["time_s"] > 0 and data["nodes"] == 2 and data["size_bytes"] == 2 ** 30
    assert data["algbw_GBps"] == pytest.approx(2 ** 30 / data["time_s"] / 1e9)
    assert data["busbw_GBps"] == pytest.approx(data["algbw_GBps"] * 2 * 15 / 16)
    # published: 8 x 46-48 GB/s per NIC on two DGX H100 nodes (nccl-tests #290)
    assert data["busbw_GBps"] == pytest.approx(376, rel=0.2)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert main(["price", op, "--size", "64M", "--gpus", "8", "--json", str(out)]) == 0
        d = json.loads(out.read_text())
        assert d["busbw_GBps"] == pytest.approx(d["algbw_GBps"] * 7 / 8)
    assert main(["price", "all_reduce", "--gpus", "8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["busbw_GBps"] == pytest.approx(476, rel=0.2)   # nccl-tests #290


def test_recommend_json_writes_numbers(tmp_path, capsys):
    out = tmp_path / "rec.json"
    assert main(["recommend", *MIXTRAL16, "--top", "3", "--zero", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ideal overlap" in text and "no overlap" in text and "MFU" in text
    rows = json.loads(out.read_text())
    assert len(rows) == 3
    for r in rows:
        for key in ("tp", "ep", "etp", "dp", "zero", "micro_batches"):
            assert isinstance(r[key], int)
        for key in ("step_s", "step_no_overlap_s", "memory_gib", "mfu"):
            assert isinstance(r[key], float)
        assert r["step_s"] <= r["step_no_overlap_s"]
    # ranked by the step to 3 significant digits (what the table prints; then less memory first)
    shown = [float(f"{r['step_s']:.3g}") for r in rows]
    assert shown == sorted(shown)


def test_report_prints_both_bounds_and_the_capped_crossover(capsys, tmp_path):
    js = tmp_path / "r.json"
    assert main(["report", *MIXTRAL16, "--tp", "2", "--ep", "8", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "ideal overlap" in out and "MFU" in out and "tokens/s per GPU" in out
    assert "any K <= 8" in out and "1.5e+03" not in out
    data = json.loads(js.read_text())
    assert data["time"]["step_overlapped"] < data["time"]["step"]
    assert data["time"]["compute_efficiency"] == pytest.approx(794.5 / 989)   # H100's measured BF16 GEMM rate
    assert sum(data["time"]["terms"].values()) == pytest.approx(data["time"]["step_overlapped"])
    row8 = [r for r in data["ep_vs_tp"]["rows"] if r["group_size"] == 8][0]
    assert row8["ep_faster_for_every_topk"] and row8["k_star"] is None
    assert row8["tp_bytes"] == 8 * row8["ep_bytes"] / 2        # n·t·D·b against t·K·D·b, K = 2

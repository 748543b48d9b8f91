"""The published training runs: the data's sanity, docs/cost.md's table equal to
``validate --published``'s output, and where recommend ranks a published layout."""
import os
import re

import pytest

from moepar.__main__ import main
from moepar.cost.architectures import MODELS
from moepar.cost.presets import PRESETS
from moepar.cost.published import LATER_RUNS, RUNS, SOURCES
from moepar.cost.published_check import check_all, published_rank, rank_rows, render_all, run_setup, summary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START, END = "<!-- validate --published: start -->", "<!-- validate --published: end -->"


def _docs_block() -> str:
    text = open(os.path.join(ROOT, "docs", "cost.md")).read()
    return text[text.index(START) + len(START):text.index(END)].strip()


@pytest.mark.parametrize("run", RUNS + LATER_RUNS, ids=lambda r: f"{r['model']}-{r['hardware']}-{r['precision']}")
def test_every_run_names_its_sources_and_prices_at_its_layout(run):
    assert run["source"] in SOURCES and run["settings"]["source"] in SOURCES
    assert run["model"] in MODELS and run["hardware"] in PRESETS
    spec, layout, hw = run_setup(run)
    dp = run["gpus"] // (run["tp"] * run["pp"])
    assert spec.micro_batches * run["micro_batch"] * dp == run["global_batch"]     # the batch as published
    assert spec.tokens == run["micro_batch"] * run["seq_len"] and layout.ep == run["ep"] and layout.zero == 1


def test_the_published_figures_as_their_sources_give_them():
    ds = [r for r in RUNS if r["source"] == "deepseek-v3-report"][0]
    assert ds["tokens_per_s_per_gpu"] == round(14.8e12 / (2.664e6 * 3600))          # 2.664M GPU-hours, 14.8T tokens
    assert (ds["gpus"], ds["pp"], ds["ep"], ds["global_batch"]) == (2048, 16, 64, 15360)
    assert len(RUNS) == 18 and sum(r["source"] == "megatron-bridge-25.11" for r in RUNS) == 17
    # the page's GA column disagrees with GBS / (MBS x DP) on two rows (module doc of published.py)
    odd = [(r["model"], r["hardware"]) for r in RUNS if r["published_ga"] is not None
           and r["published_ga"] != r["global_batch"] // (r["micro_batch"] * r["gpus"] // (r["tp"] * r["pp"]))]
    assert odd == [("qwen3-235b-a22b", "gb300-nvl72"), ("gpt-oss-120b", "h100")]


def test_docs_table_is_the_commands_output():
    assert _docs_block() == render_all(markdown=True), \
        "docs/cost.md's published-runs table is stale: paste `python -m moepar validate --published --markdown F`"


def test_validate_published_prints_the_table(capsys, tmp_path):
    md = tmp_path / "pub.md"
    assert main(["validate", "--published", "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "Megatron-Bridge 25.11 and the DeepSeek-V3 report" in out and "ratio" in out
    assert md.read_text().strip() == render_all(markdown=True)


def test_summary_counts_what_the_rows_say():
    checked = check_all(RUNS)
    s = summary(checked)
    errs = sorted(abs(c.ratio - 1) for c in checked)
    assert s["max_abs_error"] == errs[-1] and s["within_25"] == sum(e <= 0.25 for e in errs)
    assert s["fit"] == sum(c.cost.fits for c in checked)


def test_recommend_ranks_of_the_small_runs_are_the_docs():
    small = [c for c in check_all(RUNS) if c.run["gpus"] <= 16]
    rows = rank_rows(small)
    docs = open(os.path.join(ROOT, "docs", "cost.md")).read()
    for r in rows:
        line = "| " + " | ".join(str(v) for v in r.values()) + " |"
        assert line in docs, line
    rank, n, best, mine = published_rank(small[0].run)
    assert 1 <= rank <= n and mine.layout.ep == small[0].run["ep"]

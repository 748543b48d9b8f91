"""The cost model against published training runs: every run of ``moepar.cost.published``
priced at its published layout, predicted against published tokens/s per GPU, and whether
the layout fits in memory with the recomputation the run used.

``python -m moepar validate --published`` prints the table (``--markdown`` the one
docs/cost.md holds; a test keeps the two equal). How a run becomes a spec and a layout:
tokens per micro-batch = micro batch x sequence length; DP = GPUs / (TP x PP x CP); micro-batches
per step = global batch / (micro batch x DP); sequence parallelism with TP > 1 (Megatron's
rule for MoE with TP); the distributed optimizer (ZeRO-1); expert TP 1; the schedule
``interleaved`` where VP > 1, else ``1f1b`` (DeepSeek's DualPipe as ``dualpipev``); the
predicted figure is the ideal-overlap bound (``StepCost.step_time_overlapped``).
"""
from __future__ import annotations

import dataclasses
import statistics

from ..tables import fmt_bytes, format_table
from .architectures import MODELS
from .collectives import Hardware
from .model import CostLayout, MoESpec
from .pipeline import step_cost
from .presets import PRESETS
from .published import LATER_RUNS, RUNS, SOURCES
from .step import StepCost


def run_setup(run: dict) -> tuple[MoESpec, CostLayout, Hardware]:
    """The spec, layout and hardware of a published run (module doc)."""
    hw = PRESETS[run["hardware"]]
    if run["gpus_per_node"] != hw.gpus_per_node:
        hw = hw.with_gpus_per_node(run["gpus_per_node"])
    tp, pp, cp, mbs = run["tp"], run["pp"], run["cp"], run["micro_batch"]
    if cp != 1:
        raise ValueError(f"run {label(run)}: context parallelism cp={cp} is not modelled")
    dp = run["gpus"] // (tp * pp)
    m, rest = divmod(run["global_batch"], mbs * dp)
    if rest or m < 1:
        raise ValueError(f"run {label(run)}: global batch {run['global_batch']} is not a multiple of micro batch "
                         f"{mbs} x DP {dp}")
    st = run["settings"]
    spec = MoESpec(**MODELS[run["model"]], tokens=mbs * run["seq_len"], seq_len=run["seq_len"], dtype=run["dtype"],
                   micro_batches=m, recompute=st["recompute"], recompute_modules=tuple(st["recompute_modules"]),
                   train_mtp=st["mtp"], max_nodes_per_token=st.get("max_nodes_per_token"))
    schedule = st.get("schedule") or ("interleaved" if run["vp"] > 1 else "1f1b")
    layout = CostLayout(run["gpus"], hw.gpus_per_node, tp, run["ep"], 1, tp > 1, 1, pp,
                        run["vp"] if pp > 1 else 1, schedule, st["a2a_overlap"])
    return spec, layout, hw


def label(run: dict) -> str:
    return f"{run['model']} {run['gpus']}x {run['hardware']} {run['precision']}"


@dataclasses.dataclass(frozen=True)
class Checked:
    run: dict
    cost: StepCost

    @property
    def predicted(self) -> float:
        return self.cost.tokens_per_second_per_gpu(True)

    @property
    def ratio(self) -> float:
        return self.predicted / self.run["tokens_per_s_per_gpu"]


def check_all(runs=RUNS) -> list[Checked]:
    out = []
    for run in runs:
        spec, layout, hw = run_setup(run)
        out.append(Checked(run, step_cost(spec, layout, hw)))
    return out


def dominant(cost: StepCost, n: int = 2) -> str:
    terms = cost.terms()
    total = sum(terms.values())
    top = sorted(terms.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v / total:.0%}" for k, v in top)


def rows(checked: list[Checked]) -> list[dict]:
    out = []
    for c in checked:
        r, lay, s = c.run, c.cost.layout, c.cost.spec
        layout = (f"TP{r['tp']} PP{r['pp']}" + (f" VP{r['vp']}" if r["pp"] > 1 and r["vp"] > 1 else "")
                  + f" EP{r['ep']}, {s.micro_batches} x {s.tokens}"
                  + (f", {lay.schedule}" if lay.schedule == "dualpipev" else ""))
        st = r["settings"]
        rec = st["recompute"] if st["recompute"] != "selective" else "+".join(st["recompute_modules"])
        extras = [x for x, on in (("a2a overlap", st["a2a_overlap"]), ("MTP", st["mtp"]),
                                  (f"<= {st.get('max_nodes_per_token')} nodes", st.get("max_nodes_per_token")))
                  if on]
        out.append({"run": f"{r['model']} {r['system']} {r['precision']}", "GPUs": r["gpus"], "layout": layout,
                    "recompute": rec + (f"; {', '.join(extras)}" if extras else ""),
                    "published": f"{r['tokens_per_s_per_gpu']:,}", "predicted": f"{c.predicted:,.0f}",
                    "ratio": f"{c.ratio:.2f}", "memory": fmt_bytes(c.cost.memory.total),
                    "fits": "yes" if c.cost.fits else "NO", "dominant terms": dominant(c.cost)})
    return out


def summary(checked: list[Checked]) -> dict:
    errs = [abs(c.ratio - 1) for c in checked]
    return {"rows": len(checked), "median_abs_error": statistics.median(errs), "max_abs_error": max(errs),
            "within_25": sum(e <= 0.25 for e in errs), "within_15": sum(e <= 0.15 for e in errs),
            "fit": sum(c.cost.fits for c in checked)}


def summary_line(s: dict) -> str:
    return (f"{s['rows']} runs: median |predicted/published - 1| = {s['median_abs_error']:.1%}, largest "
            f"{s['max_abs_error']:.1%}; {s['within_15']} within 15%, {s['within_25']} within 25%; "
            f"{s['fit']} of {s['rows']} published layouts fit in memory")


_RIGHT = ("GPUs", "published", "predicted", "ratio", "memory", "rank", "of", "top 10% within")


def _table(table: list[dict], markdown: bool) -> str:
    if not markdown:
        return format_table(table)
    cols = list(table[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" if c in _RIGHT else "---" for c in cols) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in table])


def render(checked: list[Checked], markdown: bool = False) -> str:
    return "\n".join([_table(rows(checked), markdown), "", summary_line(summary(checked))])


def published_report(recommend: bool = False) -> dict:
    """Everything ``validate --published`` prints, priced once: the runs the acceptance is
    judged on (Megatron-Bridge 25.11 and the DeepSeek-V3 report), the same page's newest rows,
    and with ``recommend`` where each published layout ranks among recommend's."""
    first = check_all(RUNS)
    return {"first": first, "later": check_all(LATER_RUNS), "ranks": rank_rows(first) if recommend else None}


def render_all(markdown: bool = False, recommend: bool = False, report: dict | None = None) -> str:
    rep = report or published_report(recommend)
    head = "### " if markdown else "== "
    out = [f"{head}Megatron-Bridge 25.11 and the DeepSeek-V3 report", "", render(rep["first"], markdown), "",
           f"{head}Megatron-Bridge 26.08 (the page's version of 2026-08-11)", "", render(rep["later"], markdown), "",
           "sources: " + "; ".join(f"{k}: {t}, {u} ({d})" for k, (t, u, d) in SOURCES.items())]
    if rep["ranks"] is not None:
        out += ["", f"{head}recommend against practice", "", _table(rep["ranks"], markdown)]
    return "\n".join(out)


def published_rank(run: dict, top: int = 1) -> tuple[int, int, list, StepCost]:
    """Where the published layout ranks among the layouts ``recommend`` searches for the run's
    GPUs, hardware, model, global batch, micro-batch size, schedule (and vp), ZeRO-1 and
    all-to-all overlap: (rank, candidates, the first ``top``, the published layout's cost)."""
    from .search import pipeline_sizes, recommend
    spec, layout, hw = run_setup(run)
    vp = layout.vp if layout.pp > 1 else (2 if layout.schedule in ("interleaved", "zb", "zbv", "dualpipev") else 1)
    sched = layout.schedule if layout.pp > 1 else "1f1b"
    pps = [p for p in pipeline_sizes(spec, layout.gpus, vp if sched != "1f1b" else 1)]
    cands = recommend(spec.replace(micro_batches=1), layout.gpus, hw,
                      global_tokens=run["global_batch"] * run["seq_len"], zero_stages=(1,), pp_sizes=pps,
                      schedule=sched, vp=vp if sched != "1f1b" else 1, a2a_overlap=layout.a2a_overlap)
    want = (layout.pp, layout.tp, layout.ep, layout.etp, layout.sp)
    rank = next((i for i, c in enumerate(cands, 1) if (c.cost.layout.pp, c.cost.layout.tp, c.cost.layout.ep,
                                                          c.cost.layout.etp, c.cost.layout.sp) == want), 0)
    return rank, len(cands), cands[:top], cands[rank - 1].cost if rank else None


def rank_rows(checked: list[Checked]) -> list[dict]:
    out = []
    for c in checked:
        rank, n, best, mine = published_rank(c.run)
        b = best[0].cost
        out.append({"run": f"{c.run['model']} {c.run['system']} {c.run['precision']}", "rank": rank or "-", "of": n,
                    "top 10% within": "yes" if rank and rank <= max(1, round(0.1 * n)) else "no",
                    "first pick": f"pp{b.layout.pp} tp{b.layout.tp} ep{b.layout.ep} etp{b.layout.etp}",
                    "first / published step": f"{b.step_time_overlapped / mine.step_time_overlapped:.2f}"
                    if mine else "-"})
    return out

"""The layout search of ``recommend``: every layout of a GPU count priced at one global batch,
ranked by predicted step time (those that fit in memory first), and where a given layout ranks
(``--find``).
"""
from __future__ import annotations

import dataclasses
import math

from .. import checks
from ..tables import fmt_bytes, fmt_time, format_table
from .step import StepCost
from .pipeline import step_cost
from .collectives import Hardware
from .model import CostLayout, MoESpec, divisors
from .schedules import check_pipeline


@dataclasses.dataclass(frozen=True)
class Candidate:
    cost: StepCost
    fits: bool


def pipeline_sizes(spec: MoESpec, gpus: int, vp: int = 1) -> list[int]:
    """pp dividing ``gpus`` with a block for each of the pp·vp chunks."""
    return [pp for pp in divisors(gpus) if pp * vp <= spec.layers]


def candidate_layouts(spec: MoESpec, gpus: int, gpus_per_node: int, zero_stages=(0, 1, 2, 3),
                      cross_node_tp: bool = False, pp_sizes=(1,), schedule: str = "1f1b",
                      vp: int = 1, a2a_overlap: bool = False) -> list[CostLayout]:
    """Layouts of ``gpus`` whose sizes divide the model; TP and expert-TP stay inside a
    node unless ``cross_node_tp``; ``pp_sizes`` pipeline sizes (``schedule`` with ``vp``
    stages per rank where pp > 1)."""
    out = []
    for pp in pp_sizes:
        stage = gpus // pp
        if gpus % pp:
            continue
        for tp, ep, etp, sp, zero in _stage_layouts(spec, stage, gpus_per_node, zero_stages, cross_node_tp):
            out.append(CostLayout(gpus, gpus_per_node, tp, ep, etp, sp, zero, pp, vp if pp > 1 else 1,
                                  schedule if pp > 1 else "1f1b", a2a_overlap))
    return out


def _stage_layouts(spec: MoESpec, gpus: int, gpus_per_node: int, zero_stages, cross_node_tp: bool):
    out = []
    for tp in divisors(gpus):
        if (tp > gpus_per_node and not cross_node_tp) or spec.hidden % tp or spec.tokens % tp:
            continue
        if spec.heads and (spec.heads % tp or (spec.kv_heads or spec.heads) % tp):
            continue
        if spec.shared_experts and spec.fs % tp:
            continue
        for sp in ((False, True) if tp > 1 else (False,)):
            for ep in divisors(spec.experts):
                if gpus % ep:
                    continue
                for etp in divisors(gpus // ep):
                    if spec.ffn % etp or (etp > gpus_per_node and not cross_node_tp):
                        continue
                    for zero in zero_stages:
                        out.append((tp, ep, etp, sp, zero))
    return out


# A million-token global batch (256 sequences of 4096): smaller than published MoE
# pre-training batches (DeepSeek-V3: 3,072-15,360 sequences of 4K), large enough that the
# per-step gradient reduction does not dwarf the per-layer collectives as a batch of one
# micro-batch per GPU would.
DEFAULT_GLOBAL_TOKENS = 2 ** 20


def _rank_time(t: float) -> float:
    """Step times equal to 3 significant digits (what the table prints) rank as equal, so
    that the layout with less memory comes first (e.g. ZeRO 1/2 against ZeRO 0, which move
    about the same bytes)."""
    return float(f"{t:.3g}")


def recommend(spec: MoESpec, gpus: int, hw: Hardware, gpus_per_node: int | None = None,
              memory_bytes: float | None = None, global_tokens: int | None = None,
              compute_efficiency: float | None = None, zero_stages=(0, 1, 2, 3),
              cross_node_tp: bool = False, a2a_algo: str = "pairwise", ar_algo: str = "auto",
              pp_sizes=(1,), schedule: str = "1f1b", vp: int = 1,
              skipped: list | None = None, redundant=(0,), a2a_overlap: bool = False) -> list[Candidate]:
    """Every layout of ``gpus`` ranked by predicted step time with ideal overlap (both
    bounds are on each candidate's ``cost``), those that fit in ``memory_bytes`` first. The
    global batch is fixed at ``global_tokens`` (default ``DEFAULT_GLOBAL_TOKENS`` or
    ``spec.tokens x spec.micro_batches x gpus`` if larger): a layout with dp replicas runs
    global / (tokens x dp) micro-batches of ``spec.tokens`` tokens (dp per pipeline stage).
    Pipelined layouts (``pp_sizes``, run by ``schedule``) whose micro-batch count breaks the
    schedule's rule (e.g. 1F1B: at least pp) are left out; ``skipped`` (a list) receives them
    as (layout, micro-batches, tokens, reason). ``redundant``: the redundant-expert counts R
    to price on each layout, those that fit its ep (R % ep == 0, R <= E x (ep - 1); R = 0
    always), each a candidate of its own."""
    checks.positive_ints(gpus=gpus, gpus_per_node=gpus_per_node, global_tokens=global_tokens)
    if memory_bytes is not None and not (0 < memory_bytes < math.inf):
        raise ValueError(f"memory_bytes={memory_bytes} must be a finite number > 0")
    gpn = gpus_per_node or hw.gpus_per_node
    mem = memory_bytes or hw.memory_bytes
    hw = (hw if gpn == hw.gpus_per_node else hw.with_gpus_per_node(gpn)).replace(memory_bytes=mem)
    total = global_tokens or max(DEFAULT_GLOBAL_TOKENS, spec.tokens * spec.micro_batches * gpus)
    out = []
    for layout in candidate_layouts(spec, gpus, gpn, zero_stages, cross_node_tp, pp_sizes, schedule, vp, a2a_overlap):
        per_replica = total / layout.dp
        t = min(spec.tokens, max(layout.tp, int(per_replica) // layout.tp * layout.tp))
        s = spec.replace(tokens=t, micro_batches=max(1, math.ceil(per_replica / t)))
        if layout.pp > 1:
            try:
                check_pipeline(layout.pp, layout.vp, layout.schedule, s.micro_batches, s.layers)
            except ValueError as e:
                if skipped is not None:
                    skipped.append((layout, s.micro_batches, s.tokens, str(e)))
                continue
        E, ep = s.experts, layout.ep
        for R in sorted({0, *redundant}):
            if R and (R % ep or R > E * (ep - 1)):
                continue
            cost = step_cost(s.replace(redundant_experts=R), layout, hw, compute_efficiency, a2a_algo, ar_algo)
            out.append(Candidate(cost, cost.fits))
    # Fitting layouts by overlapped step time (equal times: less memory first), then the
    # rest by memory.
    out.sort(key=lambda c: (not c.fits, _rank_time(c.cost.step_time_overlapped) if c.fits else c.cost.memory.total,
                            c.cost.memory.total, _rank_time(c.cost.step_time)))
    return out


# ---- where a given layout ranks ------------------------------------------------------------

FIND_FIELDS = ("pp", "tp", "ep", "etp", "zero", "sp")


def parse_find(text: str) -> dict:
    out = {}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        k, _, v = item.partition("=")
        if k not in FIND_FIELDS or not v.strip().lstrip("-").isdigit():
            raise ValueError(f"--find {text!r}: {item!r} is not FIELD=INTEGER with FIELD one of "
                             f"{', '.join(FIND_FIELDS)} (sp=0|1)")
        out[k] = int(v)
    return out


def find_layout(cands, fields: dict, text: str, skipped=()) -> str:
    """Where the best candidate with ``fields`` ranks, and its step beside the first's (or
    why no such layout was ranked: ``skipped`` from ``recommend``)."""
    def sizes(lay):
        return {"pp": lay.pp, "tp": lay.tp, "ep": lay.ep, "etp": lay.etp, "zero": lay.zero, "sp": int(lay.sp)}
    hits = [(i, c) for i, c in enumerate(cands, 1) if all(sizes(c.cost.layout)[k] == v for k, v in fields.items())]
    if not hits:
        why = [(lay, m, t, reason) for lay, m, t, reason in skipped
               if all(sizes(lay)[k] == v for k, v in fields.items())]
        if why:
            lay, m, t, reason = why[0]
            return (f"--find {text}: not ranked: with the global batch fixed, {lay.describe()} runs {m} "
                    f"micro-batch(es) of {t} tokens per replica, and {reason}")
        return f"--find {text}: no candidate layout has these sizes"
    i, c = hits[0]
    best = cands[0]
    rows = []
    for label, cand in (("#1", best), (f"#{i} ({text})", c)):
        k = cand.cost
        rows.append({"layout": label, "describe": k.layout.describe(), "micro-batches": f"{k.spec.micro_batches} x "
                     f"{k.spec.tokens}", "compute": fmt_time(k.compute_per_step), "comm": fmt_time(k.comm_per_step),
                     "bubble": fmt_time(k.bubble_time), "hidden": fmt_time(k.step_time - k.step_time_overlapped),
                     "step": fmt_time(k.step_time_overlapped), "memory": fmt_bytes(k.memory.total),
                     "fits": "yes" if cand.fits else "NO"})
    fit = sum(1 for x in cands if x.fits)
    where = (f"ranks #{i} of {len(cands)} ({fit} fit)" if c.fits
             else f"does not fit in memory ({fmt_bytes(c.cost.memory.total)} per GPU); by memory it is #{i} of "
                  f"{len(cands)}")
    return f"--find {text}: the best such layout {where}:\n" + format_table(rows)

"""Reports: the numbers of a ``StepCost`` as a terminal table, Markdown, JSON and a PNG, with
expert parallelism against tensor slicing for the same FFN and its crossovers.

``build_report`` gathers everything as plain data (what ``--json`` writes); the renderers
only format it.

EP against TP (``ep_vs_tp``): both sides process the same global batch: n GPUs holding ``t``
tokens each (the layer table's T/tp, so EP rows are the layer table's and ``recommend``'s
(T/tp)·K, balanced). What is counted per rank, per MoE layer, per training step (b bytes per
element):
  EP over n: 4 all-to-alls of t·K·D·b (dispatch and combine, forward and backward; the
      tiny counts exchange is left out); each sends (n-1)/n of its buffer.
  TP over n: the group's n·t tokens are replicated on its ranks; 4 all-reduces of n·t·D·b
      (2 forward: attention-style row-parallel output and the FFN's; 2 backward, Megatron's
      f/g); each sends 2(n-1)/n of it.
So EP sends 4(n-1)/n·t·K·D·b and TP 8(n-1)·t·D·b: EP / TP = K / (2n) in bytes; on a pure
bandwidth link EP is faster for K < 2n, and the crossover is capped at E (K cannot exceed
it). Latency and which links each uses once the group spans nodes move it.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence

from ..tables import fmt_bytes, fmt_count, fmt_rate, fmt_time, format_table
from .step import StepCost
from .pipeline import step_cost
from .collectives import Hardware, Link, Placement, sent_bytes
from .model import CostLayout, MoESpec
from .routes import layout_imbalance


# ---- EP against TP for the same FFN --------------------------------------------------------

EP_A2A_PER_STEP = 4
TP_AR_PER_STEP = 4


@dataclasses.dataclass(frozen=True)
class Comparison:
    """EP vs TP for one (t, D, K, n) at equal global batch: bytes, bytes sent, times (per step)."""

    tokens: int              # t, tokens per GPU
    hidden: int
    topk: int
    group_size: int
    ep_bytes: float          # per all-to-all, size convention: t·K·D·b
    tp_bytes: float          # per all-reduce: n·t·D·b
    ep_sent: float           # 4 x (n-1)/n x ep_bytes
    tp_sent: float           # 4 x 2(n-1)/n x tp_bytes
    ep_time: float
    tp_time: float

    @property
    def ratio(self) -> float:
        """EP time / TP time (< 1: expert parallelism is faster)."""
        return self.ep_time / self.tp_time if self.tp_time else math.inf

    @property
    def winner(self) -> str:
        return "EP" if self.ep_time < self.tp_time else "TP"


def ep_vs_tp(hw: Hardware, hidden: int, tokens: float, topk: float, group_size: int,
             gpus_per_node: int | None = None, dtype_bytes: int = 2, a2a_algo: str = "pairwise",
             ar_algo: str = "auto") -> Comparison:
    """Price EP's 4 all-to-alls against TP's 4 all-reduces on one group of ``group_size``
    GPUs holding ``tokens`` tokens each (equal global batch)."""
    for name, v in (("hidden", hidden), ("tokens", tokens), ("group_size", group_size)):
        if not v >= 1:
            raise ValueError(f"{name}={v} must be >= 1")
    pl = Placement.contiguous(group_size, gpus_per_node or hw.gpus_per_node)
    ep_b = tokens * topk * hidden * dtype_bytes
    tp_b = group_size * tokens * hidden * dtype_bytes
    ar = hw.resolve_algo("all_reduce", pl, tp_b, ar_algo)
    return Comparison(tokens, hidden, topk, group_size, ep_b, tp_b,
                      EP_A2A_PER_STEP * sent_bytes("all_to_all", pl, ep_b, a2a_algo),
                      TP_AR_PER_STEP * sent_bytes("all_reduce", pl, tp_b, ar),
                      EP_A2A_PER_STEP * hw.collective_time("all_to_all", pl, ep_b, a2a_algo),
                      TP_AR_PER_STEP * hw.collective_time("all_reduce", pl, tp_b, ar_algo))


def crossover_topk(hw: Hardware, hidden: int, tokens: float, group_size: int, experts: int | None = None,
                   **kw) -> float:
    """K* with EP time = TP time: EP is faster for K < K* (0: never; inf: for every K up to
    ``experts``, the most a token can pick; 4096 when not given)."""
    def diff(k):
        c = ep_vs_tp(hw, hidden, tokens, k, group_size, **kw)
        return c.ep_time - c.tp_time
    lo, hi = 1e-6, float(experts or 4096)
    if diff(lo) >= 0:
        return 0.0
    if diff(hi) < 0:
        return math.inf
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if diff(mid) < 0 else (lo, mid)
    return math.sqrt(lo * hi)


def scale_bandwidth(hw: Hardware, factor: float) -> Hardware:
    """The same machine with both links ``factor`` x faster (measured curves dropped)."""
    def s(link: Link) -> Link:
        return dataclasses.replace(link, bandwidth=link.bandwidth * factor)
    return hw.replace(intra=s(hw.intra), inter=s(hw.inter), curves={}, nvls_algbw=hw.nvls_algbw * factor)


def sweep(hw: Hardware, param: str, values, hidden: int, tokens: float, topk: float, group_size: int,
          **kw) -> tuple[list[Comparison], list[str]]:
    """EP vs TP along one of tokens | hidden | topk | group_size | bandwidth (a factor on both
    links); returns the rows and, where the winner flips, the crossover located by bisection
    (group size, being discrete, is reported between neighbours)."""
    base = dict(hidden=hidden, tokens=tokens, topk=topk, group_size=group_size)
    if param not in (*base, "bandwidth"):
        raise ValueError(f"param={param!r} is not sweepable; valid: tokens, hidden, topk, group_size, bandwidth")

    def at(v):
        if param == "bandwidth":
            return ep_vs_tp(scale_bandwidth(hw, v), **base, **kw)
        return ep_vs_tp(hw, **{**base, param: v}, **kw)

    rows = [at(v) for v in values]
    notes = []
    for (v0, r0), (v1, r1) in zip(zip(values, rows), zip(values[1:], rows[1:])):
        if r0.winner == r1.winner:
            continue
        if param == "group_size":
            notes.append(f"{param}: {r0.winner} at {v0}, {r1.winner} at {v1}")
            continue
        lo, hi = float(v0), float(v1)
        for _ in range(40):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if at(mid).winner == r0.winner else (lo, mid)
        notes.append(f"{param} crossover at {lo:.4g}: {r0.winner} below, {r1.winner} above")
    label = "link bandwidth factor" if param == "bandwidth" else param
    notes = [n.replace(f"{param} ", f"{label} ", 1) for n in notes]
    if not notes and rows:
        notes.append(f"{rows[0].winner} faster for every {label} in {values[0]:.4g}..{values[-1]:.4g}")
    return rows, notes


# ---- the report ----------------------------------------------------------------------------

DEEPSPEED_NOTE = (
    "DeepSpeed's flops profiler reports 'params of model = params per GPU x mp_size' and "
    "'fwd flops of model = fwd flops per GPU x mp_size'. Under expert parallelism a rank holds "
    "E/ep experts, so params x mp_size misses the other experts (the right total is dense x tp + "
    "experts x ep x etp), and a rank's expert FLOPs are its work on routes received from other "
    "data-parallel replicas: scaling one rank by the model-parallel size is exact only for "
    "balanced, dropless, unpadded routing. Under moepar.deepspeed's engine (experts tagged as "
    "DeepSpeed's own) DeepSpeed 0.19.8 prints non-expert params x mp_size + expert params x ep "
    "instead: right for the experts, but a tensor-parallel-replicated parameter (norms, the "
    "router) counts tp times. Here model FLOPs count routes (T x K per token, "
    "6 x N_active) and per-rank FLOPs count the rows the rank's experts actually process.")


def _group_sizes(gpus: int) -> list[int]:
    out, n = [], 2
    while n <= gpus:
        out.append(n)
        n *= 2
    return out or [1]


def build_report(cost: StepCost, compare_sizes: Sequence[int] | None = None, ar_algo: str = "auto",
                 baseline: StepCost | None = None) -> dict:
    """Everything the renderers print, as JSON-able data (seconds, bytes, counts);
    ``ar_algo`` is the all-reduce algorithm of the EP-vs-TP table (as ``--allreduce``);
    ``baseline``: the same layout without replication, for a spec with redundant experts."""
    s, lay, hw, p, f, m, r = (cost.spec, cost.layout, cost.hardware, cost.params, cost.flops,
                              cost.memory, cost.routes)
    L, mb = s.layers, s.micro_batches

    def nodes(c):   # a stage boundary spans the two ranks' nodes, a group its placement's
        return (2 if "(network)" in c.name else 1) if c.op in ("send", "recv") else lay.placement(c.group).nodes

    def calls(cs):
        return [{"name": c.name, "phase": c.phase, "op": c.op, "algo": c.algo, "group": c.group,
                 "group_size": c.group_size, "nodes": nodes(c), "bytes": c.nbytes,
                 "formula": c.formula, "sent_bytes": c.sent, "count": c.count, "seconds": c.seconds,
                 "per": c.per} for c in cs]

    sizes = list(compare_sizes or _group_sizes(lay.gpus))
    # the EP-vs-TP table prices plain all-to-alls (a node-limited one is the model's routing, not an algorithm)
    a2a = [c.algo for c in cost.layer if c.op == "all_to_all" and c.algo in ("pairwise", "hierarchical")]
    kw = dict(gpus_per_node=lay.gpus_per_node, dtype_bytes=s.b, a2a_algo=a2a[0] if a2a else "pairwise",
              ar_algo=ar_algo)
    t_gpu = s.tokens // lay.tp          # the layer table's T/tp tokens per GPU: rows (T/tp)·K
    comparison = []
    for n in sizes:
        c = ep_vs_tp(hw, s.hidden, t_gpu, s.topk, n, **kw)
        k_star = crossover_topk(hw, s.hidden, t_gpu, n, s.experts, **kw)
        comparison.append({"group_size": n, "ep_bytes": c.ep_bytes, "tp_bytes": c.tp_bytes,
                           "ep_sent": c.ep_sent, "tp_sent": c.tp_sent, "ep_seconds": c.ep_time,
                           "tp_seconds": c.tp_time, "ratio": c.ratio, "winner": c.winner,
                           "k_star": None if k_star == math.inf else k_star,
                           "ep_faster_for_every_topk": k_star == math.inf})
    n_ref = lay.ep if lay.ep > 1 else max(lay.tp, 2)
    crossovers = []
    for param, values in (("tokens", [2 ** i for i in range(4, 17)]), ("hidden", [2 ** i for i in range(8, 15)]),
                          ("bandwidth", [2.0 ** i for i in range(-6, 5)])):
        crossovers += sweep(hw, param, values, s.hidden, t_gpu, s.topk, n_ref, **kw)[1]
    crossovers += sweep(hw, "group_size", sizes, s.hidden, t_gpu, s.topk, n_ref, **kw)[1]
    by_phase = {ph: sum(c.total_seconds for c in cost.layer if c.phase == ph) for ph in ("fwd", "bwd")}
    replication = None
    if baseline is not None:   # redundant experts, priced beside R = 0
        from . import replication_report
        replication = replication_report.summary(cost, baseline)
    return {
        "model": {k: v for k, v in vars(s).items()},
        "layout": {**vars(lay), "dp": lay.dp, "edp": lay.edp, "nodes": lay.nodes, "describe": lay.describe()},
        "hardware": {"name": hw.name, "description": hw.description, "intra": vars(hw.intra),
                     "inter": vars(hw.inter), "gpus_per_node": hw.gpus_per_node, "flops": hw.flops,
                     "memory_bytes": hw.memory_bytes, "calibrated": hw.calibrated, "sources": list(hw.sources),
                     "meta": dict(hw.meta)},
        "warnings": lay.warnings() + ([f"profile measured on one node; {lay.nodes} nodes use its link "
                                       f"model for the inter-node link"] if hw.calibrated and lay.nodes > 1 else []),
        "params": {"per_layer": {"attention": p.attention, "router": p.router, "norms": p.norms,
                                 "expert": p.expert, "shared": p.shared},
                   "embeddings": p.embeddings, "total": p.total, "active": p.active,
                   "rank_dense": p.dense_rank, "rank_expert": p.expert_rank, "rank": p.rank,
                   "deepspeed_style_total": p.rank * lay.tp},
        "routes": {"local_tokens": r.local_tokens, "mean": r.mean, "max": r.max, "capacity": r.capacity,
                   "imbalance": layout_imbalance(s, lay)},
        "replication": replication,
        "flops": {"per_token": f.per_token, "model_per_microbatch": f.model, "rank_mean": f.rank_mean,
                  "rank_max": f.rank_max, "rank_expert_max": f.rank_expert_max,
                  "deepspeed_style_model": f.deepspeed_style, "rank_per_step": f.per_step_rank_max},
        "memory": {"weights": m.weights, "grads": m.grads, "optimizer": m.optimizer,
                   "activations": m.activations, "total": m.total, "capacity": hw.memory_bytes, "fits": cost.fits},
        "layer_collectives": calls(cost.layer), "step_collectives": calls(cost.step),
        "p2p": calls(cost.p2p), "pipeline": _pipeline_data(cost),
        "time": {"layer_fwd": by_phase["fwd"], "layer_bwd": by_phase["bwd"], "layer": cost.comm_per_layer,
                 "comm_per_step": cost.comm_per_step, "compute_per_step": cost.compute_per_step,
                 "step": cost.step_time, "step_overlapped": cost.step_time_overlapped,
                 "grad_reduction": cost.grad_reduction, "hidden_grad_reduction": cost.hidden_grad_reduction,
                 "hidden_shared_experts": cost.hidden_shared_experts, "hidden_a2a": cost.hidden_a2a,
                 "weight_gathers": cost.weight_gathers, "hidden_weight_gathers": cost.hidden_weight_gathers,
                 "optimizer": cost.optimizer_time, "terms": cost.terms(),
                 "compute": None if cost.compute is None else dataclasses.asdict(cost.compute),
                 "bubble": cost.bubble_time, "p2p_per_step": cost.p2p_per_microbatch * mb,
                 "hidden_p2p": cost.hidden_p2p, "microbatch": cost.microbatch_time,
                 "compute_efficiency": cost.compute_efficiency, "layers": L, "micro_batches": mb,
                 "tokens_per_step": cost.tokens_per_step,
                 "mfu": cost.mfu(), "mfu_overlapped": cost.mfu(True),
                 "tokens_per_s_per_gpu": cost.tokens_per_second_per_gpu(),
                 "tokens_per_s_per_gpu_overlapped": cost.tokens_per_second_per_gpu(True)},
        "ep_vs_tp": {"tokens": t_gpu, "hidden": s.hidden, "topk": s.topk, "experts": s.experts, "rows": comparison,
                     "crossovers": crossovers, "reference_group_size": n_ref,
                     "counted": "same global batch, t = T/tp tokens per GPU: EP 4 all-to-alls of t·K·D·b; "
                                "TP 4 all-reduces of n·t·D·b, per layer per step"},
        "notes": [DEEPSPEED_NOTE],
    }


def _pipeline_data(cost: StepCost) -> dict | None:
    info = cost.pipeline
    if info is None:
        return None
    return {"schedule": info.schedule, "pp": info.pp, "vp": info.vp, "micro_batches": info.micro_batches,
            "bubble_units": info.bubble_units, "bubble_fraction": info.bubble_fraction,
            "model_layers": info.model_layers, "critical_stage": info.critical_stage, "memory_stage": info.memory_stage,
            "stages": [vars(s) for s in info.stages]}


def _pipeline_rows(rep: dict) -> list[tuple[str, list[dict]]]:
    pipe = rep["pipeline"]
    if pipe is None:
        return []
    rows = [{"stage": s["stage"], "blocks (MoE)": f"{s['layers']} ({s['moe_layers']})",
             "ends": "+".join(e for e, on in (("embedding", s["first"]), ("head+loss", s["last"])) if on) or "-",
             "activations kept (micro-batches)": f"{s['in_flight']:.3g}", "t_mb": fmt_time(s["microbatch_time"]),
             "memory": fmt_bytes(s["memory"]), "sends+recvs per micro-batch": s["p2p_calls"],
             "": " ".join(w for w, on in (("slowest", s["stage"] == pipe["critical_stage"]),
                                          ("most memory", s["stage"] == pipe["memory_stage"])) if on)}
            for s in pipe["stages"]]
    title = (f"Pipeline stages ({pipe['schedule']}, pp={pipe['pp']}, vp={pipe['vp']}, m={pipe['micro_batches']}: "
             f"bubble {pipe['bubble_units']:.4g} x t_mb = {pipe['bubble_fraction']:.1%} of the step; "
             f"the figures above are the slowest stage's, memory the largest stage's)")
    return [(title, rows)]


def _tables(rep: dict) -> list[tuple[str, list[dict]]]:
    """(title, rows of display strings) for the text and Markdown renderers."""
    P, F, M, T, R = rep["params"], rep["flops"], rep["memory"], rep["time"], rep["routes"]
    lay = rep["layout"]
    summary = [
        {"quantity": "params per rank (dense / expert / total)",
         "value": f"{fmt_count(P['rank_dense'])} / {fmt_count(P['rank_expert'])} / {fmt_count(P['rank'])}"},
        {"quantity": "params of model (total / active per token)",
         "value": f"{fmt_count(P['total'])} / {fmt_count(P['active'])}"},
        {"quantity": "DeepSpeed-style params (per GPU x mp_size) [wrong under EP]",
         "value": fmt_count(P["deepspeed_style_total"])},
        {"quantity": "routes per rank per micro-batch (mean / most loaded)",
         "value": f"{R['mean']:.6g} / {R['max']:.6g}" + (f", capacity {R['capacity']}" if R["capacity"] else "")},
        {"quantity": "train FLOPs per token (6·N_active)", "value": fmt_count(F["per_token"])},
        {"quantity": "FLOPs per micro-batch: rank mean / most loaded / model",
         "value": f"{fmt_count(F['rank_mean'])} / {fmt_count(F['rank_max'])} / {fmt_count(F['model_per_microbatch'])}"},
        {"quantity": "DeepSpeed-style model FLOPs (most loaded rank x mp_size x dp)",
         "value": fmt_count(F["deepspeed_style_model"])},
        {"quantity": f"memory per rank, ZeRO-{lay['zero']} (weights / grads / optimizer / activations)",
         "value": " / ".join(fmt_bytes(M[k]) for k in ("weights", "grads", "optimizer", "activations"))},
        {"quantity": "memory per rank total / GPU memory",
         "value": f"{fmt_bytes(M['total'])} / {fmt_bytes(M['capacity'])} ({'fits' if M['fits'] else 'DOES NOT FIT'})"},
        {"quantity": "communication per layer (fwd / bwd)",
         "value": f"{fmt_time(T['layer_fwd'])} / {fmt_time(T['layer_bwd'])}"},
        {"quantity": f"per step: comm / compute (large GEMMs at {T['compute_efficiency']:.0%} of peak) / total, "
                     f"no overlap",
         "value": f"{fmt_time(T['comm_per_step'])} / {fmt_time(T['compute_per_step'])} / {fmt_time(T['step'])}"},
        *([{"quantity": "pipeline: bubble / stage-boundary transfers per step (p2p hidden with overlap)",
            "value": f"{fmt_time(T['bubble'])} / {fmt_time(T['p2p_per_step'])} ({fmt_time(T['hidden_p2p'])})"}]
          if rep["pipeline"] else []),
        {"quantity": "per step, ideal overlap (dp gradients and weights behind compute, all-to-all behind shared "
                     "experts or, with --a2a-overlap, another micro-batch)",
         "value": f"{fmt_time(T['step_overlapped'])} (hides {fmt_time(T['hidden_grad_reduction'])} of "
                  f"{fmt_time(T['grad_reduction'])} gradient reduction, {fmt_time(T['hidden_weight_gathers'])} of "
                  f"{fmt_time(T['weight_gathers'])} weight gathers, "
                  f"{fmt_time(T['hidden_shared_experts'] + T['hidden_a2a'])} of all-to-all)"},
        {"quantity": f"MFU, no overlap / ideal overlap ({fmt_count(T['tokens_per_step'])} tokens per step)",
         "value": f"{T['mfu']:.1%} / {T['mfu_overlapped']:.1%}"},
        {"quantity": "tokens/s per GPU, no overlap / ideal overlap",
         "value": f"{T['tokens_per_s_per_gpu']:.4g} / {T['tokens_per_s_per_gpu_overlapped']:.4g}"},
    ]

    def call_rows(cs):
        return [{"phase": c["phase"], "collective": c["name"], "op": f"{c['op']} ({c['algo']})",
                 "group": f"{c['group']} n={c['group_size']}" + (f" {c['nodes']} nodes" if c["nodes"] > 1 else ""),
                 "bytes/rank": fmt_bytes(c["bytes"]), "= formula": c["formula"], "sent/rank": fmt_bytes(c["sent_bytes"]),
                 "x": c["count"], "time": fmt_time(c["seconds"] * c["count"])} for c in cs]

    cmp_rows = [{"n": c["group_size"], "EP a2a bytes": fmt_bytes(c["ep_bytes"]), "TP AR bytes": fmt_bytes(c["tp_bytes"]),
                 "EP sent": fmt_bytes(c["ep_sent"]), "TP sent": fmt_bytes(c["tp_sent"]),
                 "EP time": fmt_time(c["ep_seconds"]), "TP time": fmt_time(c["tp_seconds"]),
                 "EP/TP": f"{c['ratio']:.3g}", "faster": c["winner"],
                 "EP faster for K <": (f"any K <= {rep['ep_vs_tp']['experts']}" if c["ep_faster_for_every_topk"]
                                       else f"{c['k_star']:.3g}")} for c in rep["ep_vs_tp"]["rows"]]
    total = sum(T["terms"].values()) or 1.0
    terms = [{"term": k, "per step": fmt_time(v), "share": f"{v / total:.1%}"}
             for k, v in sorted(T["terms"].items(), key=lambda kv: -kv[1]) if v > 0]
    return [("Summary", summary),
            ("What the step is made of (ideal overlap; largest first)", terms),
            ("Collectives per layer and micro-batch (most loaded rank)", call_rows(rep["layer_collectives"])),
            ("Collectives per step (data parallel)", call_rows(rep["step_collectives"])),
            *([("Point-to-point per micro-batch (pipeline stage boundaries of the slowest stage)",
                call_rows(rep["p2p"]))] if rep["p2p"] else []),
            *_pipeline_rows(rep),
            (f"EP vs TP for this FFN (t={rep['ep_vs_tp']['tokens']} per GPU, D={rep['ep_vs_tp']['hidden']}, "
             f"K={rep['ep_vs_tp']['topk']}; {rep['ep_vs_tp']['counted']})", cmp_rows)]


def _header(rep: dict) -> list[str]:
    m, hw = rep["model"], rep["hardware"]
    lines = [f"model: D={m['hidden']} F={m['ffn']} E={m['experts']} K={m['topk']} T={m['tokens']} "
             f"{m['dtype']} layers={rep['pipeline']['model_layers'] if rep['pipeline'] else m['layers']} "
             + ("dropless" if m["capacity_factor"] is None else f"capacity factor {m['capacity_factor']}")
             + (f" shared experts={m['shared_experts']}" if m["shared_experts"] else "")
             + (f" imbalance={rep['routes']['imbalance']:.3g}" if rep["routes"]["imbalance"] != 1 else "")
             + (f" redundant experts={m['redundant_experts']}" if m["redundant_experts"] else ""),
             f"layout: {rep['layout']['describe']}",
             f"hardware: {hw['name']}: {hw['description']}; intra {fmt_rate(hw['intra']['bandwidth'])} "
             f"({hw['intra']['name']}), inter {fmt_rate(hw['inter']['bandwidth'])} ({hw['inter']['name']}), "
             f"{hw['flops'] / 1e12:.4g} TFLOP/s" + (" [calibrated]" if hw["calibrated"] else "")]
    return lines + [f"WARNING: {w}" for w in rep["warnings"]]


def render_text(rep: dict) -> str:
    out = _header(rep)
    for title, rows in _tables(rep):
        out += ["", f"== {title} ==", format_table(rows) if rows else "(none)"]
    if rep.get("replication"):
        from . import replication_report
        out += [""] + replication_report.render_summary(rep["replication"])
    if rep["ep_vs_tp"]["crossovers"]:
        out += ["", f"crossovers (group of {rep['ep_vs_tp']['reference_group_size']}): "
                + "; ".join(rep["ep_vs_tp"]["crossovers"])]
    out += ["", "note: " + rep["notes"][0]]
    return "\n".join(out)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(none)"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def render_markdown(rep: dict) -> str:
    out = ["# moepar communication cost report", ""] + [f"- {line}" for line in _header(rep)]
    for title, rows in _tables(rep):
        out += ["", f"## {title}", "", markdown_table(rows)]
    if rep.get("replication"):
        from . import replication_report
        title = replication_report.render_summary(rep["replication"])[0].strip("= ")
        out += ["", f"## {title}", "", markdown_table(replication_report.summary_rows(rep["replication"]))]
    if rep["ep_vs_tp"]["crossovers"]:
        out += ["", "Crossovers: " + "; ".join(rep["ep_vs_tp"]["crossovers"]) + "."]
    out += ["", "> " + rep["notes"][0], ""]
    return "\n".join(out)


def to_json(rep: dict) -> str:
    return json.dumps(rep, indent=1, default=str)


def plot_png(rep: dict, path: str) -> None:
    """Bytes and time per collective, and EP vs TP across group sizes (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--png needs matplotlib: pip install 'moepar[plot]'") from None
    calls = rep["layer_collectives"]
    fig, (ax1, ax3) = plt.subplots(1, 2, figsize=(14, 5))
    labels = [f"{c['phase']} {c['name']}" for c in calls]
    x = range(len(calls))
    ax1.bar([i - 0.2 for i in x], [c["bytes"] * c["count"] / 2 ** 20 for c in calls], 0.4, label="MiB per rank")
    ax1.set_ylabel("MiB per rank (size convention)")
    ax2 = ax1.twinx()
    ax2.bar([i + 0.2 for i in x], [c["seconds"] * c["count"] * 1e3 for c in calls], 0.4, color="tab:orange",
            label="predicted ms")
    ax2.set_ylabel("predicted ms")
    ax1.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    handles = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax1.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=8)
    ax1.set_title("collectives per layer and micro-batch")
    rows = rep["ep_vs_tp"]["rows"]
    ns = [r["group_size"] for r in rows]
    ax3.plot(ns, [r["ep_seconds"] * 1e3 for r in rows], "o-", label="EP: 4 all-to-alls of t·K·D·b")
    ax3.plot(ns, [r["tp_seconds"] * 1e3 for r in rows], "s-", label="TP: 4 all-reduces of n·t·D·b")
    ax3.set_xscale("log", base=2)
    ax3.set_xlabel("group size")
    ax3.set_ylabel("ms per layer per step")
    ax3.set_title(f"EP vs TP (t={rep['ep_vs_tp']['tokens']}, D={rep['ep_vs_tp']['hidden']}, K={rep['ep_vs_tp']['topk']})")
    ax3.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_for(spec: MoESpec, layout: CostLayout, hardware: Hardware, **kw) -> str:
    """Convenience: the terminal report of ``spec`` on ``layout``."""
    return render_text(build_report(step_cost(spec, layout, hardware, **kw)))

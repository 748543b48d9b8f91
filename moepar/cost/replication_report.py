"""What replication buys and costs, for ``report`` (one layout) and ``recommend`` (against the
receive cap, expert-TP and a larger EP group). Torch-free; arithmetic in ``replication.py``."""
from __future__ import annotations

from ..tables import fmt_bytes, fmt_time, format_table
from .accounting import calls_per_step
from .step import StepCost
from .pipeline import step_cost
from .model import wire_bytes
from .routes import layout_imbalance
from .replication import expert_slice_params, receive_cap_drops, replica_plan

REPLICA_CALLS = ("MoE replica weights", "MoE replica grads")


def _replica_seconds(cost: StepCost, name: str) -> float:
    return sum(c.seconds * calls_per_step(c, cost.spec) for c in cost.layer if c.name == name)


def figures(cost: StepCost) -> dict:
    """One priced layout's replication figures (X = 0 included: no replica traffic)."""
    s, lay = cost.spec, cost.layout
    plan = replica_plan(s, lay) if (s.redundant_experts or s.expert_loads is not None) else None
    per_layer = {c.name: c for c in cost.layer if c.name in REPLICA_CALLS}
    w = per_layer.get("MoE replica weights")
    return {"redundant_experts": s.redundant_experts, "imbalance": layout_imbalance(s, lay),
            "imbalance_unreplicated": plan.imbalance_unreplicated if plan else s.imbalance,
            "received_rows_max": cost.routes.max, "received_rows_mean": cost.routes.mean,
            "copies_sent_max": max(plan.sent) if plan and s.redundant_experts else 0,
            "copies_received_max": max(plan.received) if plan and s.redundant_experts else 0,
            "expert_slice_bytes": expert_slice_params(s, lay.etp) * wire_bytes(s).param,
            "replica_bytes_per_layer": w.nbytes if w else 0.0,
            "replica_weights_seconds_per_step": _replica_seconds(cost, "MoE replica weights"),
            "replica_grads_seconds_per_step": _replica_seconds(cost, "MoE replica grads"),
            "replica_memory": cost.memory.replica_weights + cost.memory.replica_grads,
            "compute_per_step": cost.compute_per_step, "comm_per_step": cost.comm_per_step,
            "step": cost.step_time, "step_overlapped": cost.step_time_overlapped,
            "memory": cost.memory.total, "fits": cost.fits}


def summary(cost: StepCost, baseline: StepCost) -> dict:
    """``report``'s replication section: this layout with its X and with X = 0."""
    return {"with": figures(cost), "without": figures(baseline)}


def rows(named: list[tuple[str, str, dict, float | None]]) -> list[dict]:
    """Display rows: (option, layout, figures, dropped fraction or None)."""
    out = []
    for option, layout, f, drops in named:
        out.append({"option": option, "layout": layout, "X": f["redundant_experts"],
                    "max/mean": f"{f['imbalance']:.3g}", "rows max": f"{f['received_rows_max']:.6g}",
                    "replica a2a/step (fwd+bwd)": fmt_time(f["replica_weights_seconds_per_step"]
                                                           + f["replica_grads_seconds_per_step"]),
                    "replica memory": fmt_bytes(f["replica_memory"]),
                    "dropped": "-" if drops is None else f"{drops:.1%}", "compute": fmt_time(f["compute_per_step"]),
                    "comm": fmt_time(f["comm_per_step"]), "memory": fmt_bytes(f["memory"]),
                    "fits": "yes" if f["fits"] else "NO", "step": fmt_time(f["step_overlapped"])})
    return out


def render_summary(rep: dict) -> list[str]:
    """Text lines of ``report``'s replication section."""
    a = rep["with"]
    head = (f"== Expert replication: X={a['redundant_experts']} (one expert slice {fmt_bytes(a['expert_slice_bytes'])};"
            f" busiest EP rank sends {a['copies_sent_max']} and receives {a['copies_received_max']} copies per layer "
            f"and micro-batch; replica all-to-all {fmt_bytes(a['replica_bytes_per_layer'])} forward + the same "
            f"backward) ==")
    return [head, format_table(summary_rows(rep))]


def summary_rows(rep: dict) -> list[dict]:
    return rows([("with replication", "this layout", rep["with"], None),
                 ("without (X=0)", "this layout", rep["without"], None)])


def _short(lay) -> str:
    return f"tp={lay.tp} ep={lay.ep} etp={lay.etp} zero={lay.zero}" + (f" pp={lay.pp}" if lay.pp > 1 else "")


def verdict(cands, hw, compute_efficiency=None, a2a_algo: str = "pairwise", ar_algo: str = "auto") -> str:
    """``recommend``'s comparison: the best fitting layout with replication against the same
    layout without it, the same layout with the receive cap at the max/mean replication
    reaches (``receive_capacity_factor``: same rows, routes dropped), the best expert-TP
    layout and the best layout with a larger EP group (both without replication)."""
    fit = [c for c in cands if c.fits]
    rep = [c for c in fit if c.cost.spec.redundant_experts]
    flat = [c for c in fit if not c.cost.spec.redundant_experts]
    if not rep:
        return "replication: no layout with redundant experts fits (or X divides no ep); nothing to compare"
    best = rep[0].cost
    rank = {id(c.cost): i for i, c in enumerate(fit, 1)}
    lay, spec = best.layout, best.spec
    # (where it ranks, what it is, its figures, routes dropped or None)
    named = [(f"#{rank[id(best)]}", "replication", best.layout, figures(best), None)]
    same = [c.cost for c in cands if c.cost.layout == lay and not c.cost.spec.redundant_experts]
    if same:
        named.append((f"#{rank[id(same[0])]}" if id(same[0]) in rank else "(does not fit)", "same layout, X=0",
                      lay, figures(same[0]), None))
    f, cap = layout_imbalance(spec, lay), None
    plain = spec.replace(redundant_experts=0)
    imb0 = layout_imbalance(plain, lay)
    if imb0 > f:   # the receive guard at the factor that gives replication's received rows
        capped = step_cost(plain.replace(expert_loads=None, imbalance=min(imb0, f)), lay, hw, compute_efficiency,
                           a2a_algo, ar_algo)
        loads = spec.expert_loads or (1.0,) * spec.experts
        cap = ("", f"receive cap f={f:.3g}, X=0", lay, figures(capped), receive_cap_drops(loads, lay.ep, f))
        named.append(cap)
    listed = [best, *same[:1]]
    for label, keep in (("best expert-TP, X=0", lambda c: c.cost.layout.etp > 1),
                        (f"best ep>{lay.ep}, X=0", lambda c: c.cost.layout.ep > lay.ep),
                        ("best X=0", lambda c: True)):
        hit = next((c.cost for c in flat if keep(c)), None)
        if hit is not None and all(hit is not x for x in listed):
            listed.append(hit)
            named.append((f"#{rank[id(hit)]}", label, hit.layout, figures(hit), None))
    t = best.step_time_overlapped
    others = [(f"{label} ({_short(where)}) at {fmt_time(fig['step_overlapped'])}", fig["step_overlapped"])
              for _, label, where, fig, drops in named[1:] if drops is None]
    beaten = [o for o, s in others if s > t]
    lost = [o for o, s in others if s <= t]
    line = (f"replication X={spec.redundant_experts} on {_short(lay)}: step {fmt_time(t)}, max/mean "
            f"{f:.3g} (X=0: {imb0:.3g}); " + (f"beats {', '.join(beaten)}" if beaten else "beats nothing here")
            + (f"; does not beat {', '.join(lost)}" if lost else ""))
    if cap is not None:
        line += (f"; the receive cap reaches the same rows in {fmt_time(cap[3]['step_overlapped'])} by dropping "
                 f"{cap[4]:.1%} of the routes")
    table = rows([(f"{tag} {label}".strip(), _short(where), fig, drops) for tag, label, where, fig, drops in named])
    return "replication against the alternatives (ranked by step with ideal overlap):\n" + \
        format_table(table) + "\n" + line

"""A training run's own report: every collective it recorded beside the model's count.

``moepar.parallel.comm.track()`` records each collective (op, group size, bytes, seconds,
forward/backward); the cost model lists the same collectives for ``steps`` steps of the
run's ``MoESpec`` on its ``CostLayout`` (``layer_calls`` + ``step_calls``). Both are
grouped by (op, group size, phase); "step" collectives (gradients, norms, loss) are issued
outside autograd and so count as forward.

Bytes that depend on the routing: a rank sends its own routes (dropless: (T/tp)·K rows,
known) and receives what the router sent it, which only the run knows. ``received_rows``
is that measurement: the rows this rank's experts were given, summed over the run's MoE
layer calls; it sets the bytes of the combine all-to-all (forward) and of the dispatch
gradient all-to-all (backward), both of which send back the rows received. Everything else
is the model's own arithmetic.

With expert replication (``spec.redundant_experts`` R > 0) every MoE layer's forward issues
one all-to-all of the remote copies' weights and its backward one of their gradients, each
sending ``replica_sent(placement, ep_rank)`` expert slices from this rank
(``moepar.cost.replication``; a layer's ``moe.placement``). ``replica_copies`` is what the run
counted: those copies summed over every MoE layer forward of the tracked steps (with
``moepar.rebalance`` the placement, and so the count, changes between steps); the replica rows'
bytes are then exact, forward and backward alike. Without it they are the model's busiest rank's.

With pipeline stages (``layout.pp > 1``) a rank reports its own stage (``pipeline_stage``):
the blocks it holds (the runtime splits them evenly over the stages), its stage's groups, and
its point-to-point sends and receives (op "send"/"recv", group size pp; activations forward,
their gradients backward), counted like every collective.

``measured_vs_predicted`` is the shorter table: the recorded calls by (op, group size, phase),
each beside the time the model predicts for the same bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from ..tables import fmt_bytes, fmt_time, format_table
from .accounting import calls_per_step
from .pipeline import step_cost
from .collectives import Hardware, Placement
from .model import CostLayout, MoESpec, wire_bytes
from .routes import dedup_fraction
from .pipeline import check_stages, stage_cost
from .replication import expert_slice_params
from ..moe.traffic import rebalance_collectives

RECEIVED = ("MoE combine", "MoE dispatch grad")   # calls whose send buffer is the rows received
REPLICA = ("MoE replica weights", "MoE replica grads")   # each: the copies this rank sends


@dataclasses.dataclass
class RunRow:
    op: str
    group_size: int
    phase: str
    calls: int = 0
    nbytes: float = 0.0
    seconds: float = 0.0
    wait_seconds: float = 0.0   # before the calls, waiting for peers (comm.peer_wait_timing)
    model_calls: int = 0
    model_bytes: float = 0.0
    model_seconds: float = 0.0


def compare_run(spec: MoESpec, layout: CostLayout, hardware: Hardware, events: Iterable, steps: int,
                received_rows: int | None = None, pipeline_stage: int = 0,
                replica_copies: int | None = None, rebalances: int = 0,
                replica_returned: int | None = None) -> list[RunRow]:
    """Rows of (op, group size, phase): the run's calls, bytes and seconds beside the model's
    for ``steps`` steps. The spec is priced as routed (``imbalance`` is ignored: the send side
    is the rank's own routes, the receive side ``received_rows``); with pipeline stages, as
    the blocks and boundaries of ``pipeline_stage``, this rank's stage. ``replica_copies``:
    expert slices this rank sent in the replica all-to-alls, summed over the run's MoE layer
    forwards (``replica_copies_per_forward`` per forward); ``replica_returned``: the copies
    whose gradients it sent back, i.e. the remote copies its slots held (default: as many).
    ``rebalances``: ``moepar.rebalance`` calls in these steps, each one all-reduce of the
    stage's MoE layers' routes per expert ([layers, E] int64) over the stage's ranks, and a
    second of the plans where their planning is spread (``traffic.rebalance_collectives``)."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if not (isinstance(pipeline_stage, int) and 0 <= pipeline_stage < layout.pp):
        raise ValueError(f"pipeline_stage={pipeline_stage!r} must be a stage index in 0..{layout.pp - 1} "
                         f"(pp={layout.pp})")
    if replica_copies is not None and (not spec.redundant_experts or replica_copies < 0):
        raise ValueError(f"replica_copies={replica_copies!r} needs spec.redundant_experts > 0 "
                         f"(got {spec.redundant_experts}) and a count >= 0")
    spec = spec.replace(imbalance=1.0, expert_loads=None)
    rows: dict[tuple, RunRow] = {}

    def row(op, n, phase):
        return rows.setdefault((op, n, phase), RunRow(op, n, phase))

    for e in events:
        r = row(e.op, e.group_size, "bwd" if e.backward else "fwd")
        r.calls += 1
        r.nbytes += e.nbytes
        r.seconds += e.seconds
        r.wait_seconds += e.wait_seconds
    if layout.pp > 1:
        check_stages(spec, layout, even=True)
        cost = stage_cost(spec, layout, hardware, pipeline_stage)
        spec = cost.spec   # the stage's blocks: per-layer calls count over them
    else:
        cost = step_cost(spec, layout, hardware)
    exact_rows = received_rows is not None and dedup_fraction(spec, layout) is None and layout.etp == 1
    for c in cost.layer + cost.step + list(cost.p2p):
        k = calls_per_step(c, spec) * steps
        r = row(c.op, c.group_size, "fwd" if c.phase == "step" else c.phase)
        r.model_calls += k
        if replica_copies is not None and c.name in REPLICA:
            copies = replica_copies if c.phase == "fwd" or replica_returned is None else replica_returned
            nbytes = copies * expert_slice_params(spec, layout.etp) * wire_bytes(spec).param
            r.model_bytes += nbytes
            # all of it to peers: the time of an all-to-all whose (n-1)/n share it is
            wire = nbytes / max(k, 1) * c.group_size / (c.group_size - 1)
            r.model_seconds += k * hardware.collective_time(c.op, layout.placement(c.group), wire, c.algo)
        elif exact_rows and c.name in RECEIVED:
            nbytes = received_rows * spec.hidden * spec.b
            r.model_bytes += nbytes
            r.model_seconds += k * hardware.collective_time(c.op, layout.placement(c.group), nbytes / k, c.algo)
        else:
            r.model_bytes += k * c.nbytes
            r.model_seconds += k * c.seconds
    n = layout.size("world")
    if rebalances:
        r = row("all_reduce", n, "fwd")
        for nbytes in rebalance_collectives(spec.moe_layers, spec.experts, spec.redundant_experts, n):
            r.model_calls += rebalances
            r.model_bytes += rebalances * nbytes
            r.model_seconds += rebalances * hardware.collective_time("all_reduce", layout.placement("world"), nbytes)
    return sorted(rows.values(), key=lambda r: (r.op, r.group_size, r.phase))


def render_run(rows: list[RunRow], hardware: Hardware, layout: CostLayout, steps: int) -> str:
    """The rows as a table, and the totals measured and predicted side by side."""
    table = [{"op": r.op, "n": r.group_size, "phase": r.phase, "calls": r.calls, "model calls": r.model_calls,
              "bytes": fmt_bytes(r.nbytes), "model bytes": fmt_bytes(r.model_bytes),
              "same": "yes" if (r.calls, r.nbytes) == (r.model_calls, r.model_bytes) else "NO",
              "measured": fmt_time(r.seconds), "predicted": fmt_time(r.model_seconds),
              "pred/meas": f"{r.model_seconds / r.seconds:.3g}" if r.seconds > 0 else "-"} for r in rows]
    tot = {k: sum(getattr(r, k) for r in rows) for k in ("calls", "nbytes", "seconds", "wait_seconds",
                                                         "model_calls", "model_bytes", "model_seconds")}
    waited = tot["wait_seconds"] > 0
    if waited:  # measured with comm.peer_wait_timing(): "measured" is the transfer alone
        for t, r in zip(table, rows):
            t["peer wait"] = fmt_time(r.wait_seconds)
    head = (f"communication of {steps} step(s), this run (rank 0) vs the cost model ({hardware.name}; "
            f"{layout.describe()}):")
    totals = [{"": "measured", "calls": tot["calls"], "bytes": fmt_bytes(tot["nbytes"]), "time": fmt_time(tot["seconds"])},
              {"": "predicted", "calls": tot["model_calls"], "bytes": fmt_bytes(tot["model_bytes"]),
               "time": fmt_time(tot["model_seconds"])}]
    if waited:
        totals.insert(1, {"": "waiting for peers (before the calls)", "calls": tot["calls"], "bytes": "-",
                          "time": fmt_time(tot["wait_seconds"])})
    same = all((r.calls, r.nbytes) == (r.model_calls, r.model_bytes) for r in rows)
    verdict = ("every op: calls and bytes as the model counts them" if same
               else "MISMATCH: the rows marked NO differ from the model")
    return "\n".join([head, format_table(table) if table else "(no collectives recorded)", "",
                      "totals:", format_table(totals), verdict])


# ---- measured vs predicted ---------------------------------------------------------------

def _placement_for(layout: CostLayout, n: int) -> Placement:
    for kind in ("ep", "tp", "etp", "dp", "edp"):
        if layout.size(kind) == n:
            return layout.placement(kind)
    return Placement.contiguous(n, layout.gpus_per_node)


def measured_vs_predicted(spec: MoESpec, layout: CostLayout, hardware: Hardware, events: Iterable,
                          steps: int = 1) -> str:
    """A table of the recorded ``CommEvent``s (op, group_size, nbytes, seconds, backward)
    aggregated by (op, group size, phase), each beside the time the model predicts for the
    same calls and bytes, and the calls/bytes the model expects for ``steps`` steps of
    ``spec`` on ``layout`` (attention collectives included, so a model with no TP attention
    issues fewer than expected)."""
    agg: dict[tuple, dict] = {}
    for e in events:
        key = (e.op, e.group_size, "bwd" if e.backward else "fwd")
        row = agg.setdefault(key, {"calls": 0, "bytes": 0.0, "measured": 0.0, "predicted": 0.0,
                                   "model_calls": 0, "model_bytes": 0.0})
        row["calls"] += 1
        row["bytes"] += e.nbytes
        row["measured"] += e.seconds
        if e.op in ("send", "recv"):   # a stage boundary: priced as the worst link it may cross
            pl = Placement(2, 1) if layout.stage_size >= layout.gpus_per_node else Placement(2, 2)
            row["predicted"] += hardware.collective_time("p2p", pl, e.nbytes)
        else:
            row["predicted"] += hardware.collective_time(e.op, _placement_for(layout, e.group_size), e.nbytes)
    if layout.pp > 1:   # rank 0's stage (the first)
        cost = stage_cost(spec, layout, hardware, 0)
        spec = cost.spec
    else:
        cost = step_cost(spec, layout, hardware)
    for c in cost.layer + cost.step + list(cost.p2p):
        k = calls_per_step(c, spec) * steps
        phase = c.phase if c.phase != "step" else "fwd"   # issued after backward, outside autograd
        row = agg.setdefault((c.op, c.group_size, phase), {"calls": 0, "bytes": 0.0, "measured": 0.0,
                                                           "predicted": 0.0, "model_calls": 0, "model_bytes": 0.0})
        row["model_calls"] += k
        row["model_bytes"] += k * c.nbytes
    rows = []
    for (op, n, phase), r in sorted(agg.items()):
        rows.append({"op": op, "n": n, "phase": phase, "calls": r["calls"], "model calls": r["model_calls"],
                     "bytes": fmt_bytes(r["bytes"]), "model bytes": fmt_bytes(r["model_bytes"]),
                     "measured": fmt_time(r["measured"]) if r["calls"] else "-",
                     "predicted": fmt_time(r["predicted"]) if r["calls"] else "-",
                     "pred/meas": f"{r['predicted'] / r['measured']:.3g}" if r["measured"] > 0 else "-"})
    meas = sum(r["measured"] for r in agg.values())
    pred = sum(r["predicted"] for r in agg.values())
    head = (f"communication, measured vs predicted ({hardware.name}; predicted at the recorded bytes; "
            f"model calls for {steps} step(s) of {layout.describe()}):")
    tail = f"total: measured {fmt_time(meas)}, predicted {fmt_time(pred)}"
    return "\n".join([head, format_table(rows) if rows else "(no collectives recorded)", tail])

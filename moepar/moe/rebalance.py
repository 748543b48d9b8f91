"""``moepar.rebalance(model)``: re-place every replicated MoE layer's experts from the load
measured since the last call (``moepar.moe.replicas``; docs/routing.md).

Called at a step boundary (after ``optimizer.step()``), on every rank of the model alike.
It issues one all-reduce of every layer's measured routes ([layers, E] int64) over the
ranks that hold these layers (the pipeline stage's group), reads it once, plans each
layer's slot map with ``plan_placement`` (the same on every rank: a pure function of the
same numbers) and uses it from the next forward on. No parameter and no optimizer state
moves: the experts' owners never change (the copies are rebuilt each forward), so the
optimizer needs no call here.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from .. import checks
from ..parallel import comm
from .layer import MoE
from .placement import Placement, check_placement_args, plan_placement
from .replicas import OWNER_SLACK


@dataclasses.dataclass(frozen=True)
class Rebalanced:
    """One layer's re-placement: the measured routes per expert, the most-loaded EP rank's
    expected rows over the mean with the previous slot map and with the new one, and how many
    of the new map's slots are copies away from their owner (weights moved each forward)."""

    layer: str
    loads: tuple[float, ...]
    before: float
    after: float
    remote_slots: int


def rebalance(model: nn.Module, *, ranks_per_node: int | None = None,
              owner_slack: float = OWNER_SLACK, decay: float = 0.0) -> list[Rebalanced]:
    """Re-place every MoE layer of ``model`` built with ``redundant_experts > 0`` from the
    routes its router produced in training forwards since the last call (or since it was
    built), summed over the stage's ranks; the counts start again from zero. A layer that
    saw no route keeps its slot map. ``ranks_per_node``: EP ranks per node (copies then
    prefer their node; ``plan_placement``); ``owner_slack``: how much more load on the
    most-loaded rank a plan keeping every expert on its owner may carry and still be chosen
    (it moves fewer weights each forward; ``plan_placement``); ``decay`` in [0, 1): the plan
    is made from ``decay`` x the load it was last made from + the routes counted since (0:
    those routes alone; e.g. 0.8 with a rebalance every step: a moving average over about
    five steps, which follows drifting routing with less of one batch's noise). ValueError,
    on every rank before any collective, when ``model`` holds no such layer or an option is
    out of range."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"rebalance needs a torch.nn.Module, got {type(model).__name__}")
    check_placement_args([0.0], 1, 0, 1, ranks_per_node)
    checks.finite("owner_slack", owner_slack, at_least=0)
    if not (checks.is_number(decay) and 0 <= decay < 1):
        raise ValueError(f"decay={decay!r} must be a number in [0, 1) (the weight of the previous load)")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE) and m.replicas is not None]
    if not layers:
        raise ValueError(f"rebalance: the model ({type(model).__name__}) holds no moepar.MoE layer with "
                         f"redundant_experts > 0; build the layers with MoE(..., redundant_experts=R)")
    device = layers[0][1].router.weight.device
    loads = torch.stack([m.replicas.loads_E.to(device) if m.replicas.loads_E is not None
                         else torch.zeros(m.num_experts, dtype=torch.int64, device=device) for _, m in layers])
    state = layers[0][1].state
    group = state.stage_group if dist.is_available() and dist.is_initialized() else None
    if group is not None and comm.group_size(group) > 1:
        comm.all_reduce_(loads, group)
    host = loads.tolist()   # the one host read
    out = []
    for (name, m), counts in zip(layers, host):
        rep = m.replicas
        old = rep.placement
        if decay and rep.planned_loads is not None:
            counts = [decay * a + b for a, b in zip(rep.planned_loads, counts)]
        if sum(counts) > 0:
            rep.planned_loads = list(counts)
            rep.set_placement(plan_placement(counts, m.num_experts, rep.redundant_experts, rep.ep_size,
                                             ranks_per_node=ranks_per_node, owner_slack=owner_slack))
        rep.loads_E = None
        out.append(Rebalanced(name or "(model)", tuple(counts), expected_overload(old, counts),
                              expected_overload(rep.placement, counts), remote_slots(rep.placement)))
    return out


def expected_overload(placement: Placement, loads) -> float:
    """The most-loaded EP rank's expected rows over the mean when ``loads`` are split as
    ``placement`` plans (1.0 when there is no load)."""
    per_rank = [0.0] * placement.ep_size
    for g, copies in enumerate(placement.copies):
        total = sum(c.share for c in copies)
        for i, c in enumerate(copies):
            share = c.share / total if total > 0 else float(i == 0)
            per_rank[c.rank] += loads[g] * share
    mean = sum(per_rank) / placement.ep_size
    return max(per_rank) / mean if mean > 0 else 1.0


def remote_slots(placement: Placement) -> int:
    """Slots of the EP group holding a copy away from the expert's owner (rank g // (E/ep))."""
    L = placement.num_experts // placement.ep_size
    return sum(1 for r, held in enumerate(placement.slots) for g in held if g // L != r)


def placement_state(model: nn.Module) -> dict:
    """{layer name: (slot map, routes counted since the last rebalance as a list or None, the
    load the map was planned from or None)}
    for every replicated MoE layer: plain picklable values to keep beside a checkpoint (which
    stores the logical experts alone), so that a resumed run places and rebalances as the
    uninterrupted one. One host read per layer."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, MoE) and m.replicas is not None:
            loads = m.replicas.loads_E
            out[name] = (m.placement, None if loads is None else loads.tolist(), m.replicas.planned_loads)
    return out


def load_placement_state(model: nn.Module, saved: dict | None) -> None:
    """Put back what ``placement_state`` returned (layers it does not name keep theirs)."""
    for name, m in model.named_modules():
        if saved and name in saved and isinstance(m, MoE) and m.replicas is not None:
            placement, loads, planned = saved[name]
            m.replicas.set_placement(placement)
            m.replicas.planned_loads = planned
            m.replicas.loads_E = None if loads is None else torch.tensor(loads, device=m.router.weight.device)

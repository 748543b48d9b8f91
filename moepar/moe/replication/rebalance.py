"""``moepar.rebalance(model)``: re-place every replicated MoE layer's experts from the load
measured since the last call (``moepar.moe.replication.replicas``; docs/routing.md).

Called at a step boundary (after ``optimizer.step()``), on every rank of the model alike.
It issues one all-reduce of every layer's measured routes ([layers, E] int64) over the
ranks that hold these layers (the pipeline stage's group) and reads it once. Each rank of
the group then plans its share of the layers with ``plan_placement`` (planned layer j on
the group's rank j mod n), and a second all-reduce ([layers, 1 + 2 x (E + X)] float64,
every row filled by one rank, zeros elsewhere, so the sum is exact) hands every rank every
plan, bit for bit; a stage with fewer than SPREAD_SLOTS expert slots in all plans every
layer on every rank instead (no second collective). The slot maps are used from the next
forward on. No parameter and no optimizer state moves: the experts' owners never change
(the copies are rebuilt each forward), so the optimizer needs no call here.

Legend (docs/moe.md): E logical experts, X redundant expert slots in all.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from ... import checks
from ...parallel import comm
from ..layer import MoE
from .placement import Placement, check_placement_args, placement_from_values, placement_values, plan_placement
from .replicas import OWNER_SLACK


from ..traffic import SPREAD_SLOTS, rebalance_collectives  # noqa: F401 (the threshold, re-exported)


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
    five steps, which follows drifting routing with less of one batch's noise). The stage's
    ranks share the planning and exchange the plans in a second all-reduce (module
    docstring); every rank ends with the same slot maps. ValueError, on every rank before
    any collective, when ``model`` holds no such layer or an option is out of range."""
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
    host = loads.tolist()   # the one host read of the counts
    planned = []   # (layer index, the load to plan from), the same list on every rank
    for i, ((_, m), counts) in enumerate(zip(layers, host)):
        rep = m.replicas
        if decay and rep.planned_loads is not None:
            host[i] = counts = [decay * a + b for a, b in zip(rep.planned_loads, counts)]
        if sum(counts) > 0:
            planned.append((i, counts))
    plans = _plan_shared(layers, planned, group, device, ranks_per_node, owner_slack)
    out = []
    for i, ((name, m), counts) in enumerate(zip(layers, host)):
        rep = m.replicas
        old = rep.placement
        if i in plans:
            rep.planned_loads = list(counts)
            rep.set_placement(plans[i])
        rep.loads_E = None
        out.append(Rebalanced(name or "(model)", tuple(counts), expected_overload(old, counts),
                              expected_overload(rep.placement, counts), remote_slots(rep.placement)))
    return out


def _plan_shared(layers, planned, group, device, ranks_per_node, owner_slack) -> dict[int, Placement]:
    """{layer index: Placement} for every layer of ``planned``, the same on every rank. With
    SPREAD_SLOTS or more expert slots over the stage's layers (and more than one rank), each
    layer is planned once in the group (planned layer j on the group's rank j mod n) and one
    all-reduce sums the plans into every rank; a rank whose planning raises still joins it,
    its rows marked failed, so that every rank raises together instead of the others
    waiting. Below that, every rank plans every layer (a pure function of the same numbers)."""
    size, me = comm.group_size(group), comm.group_rank(group)
    widths = [2 * m.replicas.ep_size * m.replicas.slots_per_rank for _, m in layers]
    if size == 1 or sum(widths) // 2 < SPREAD_SLOTS:
        size, me = 1, 0
    rows = [[0.0] * (1 + max(widths)) for _ in layers]   # a status column, then the plan's values
    failure = None
    for j, (i, counts) in enumerate(planned):
        if j % size == me and failure is None:
            rep = layers[i][1].replicas
            try:
                plan = plan_placement(counts, rep.num_experts, rep.redundant_experts, rep.ep_size,
                                      ranks_per_node=ranks_per_node, owner_slack=owner_slack)
                rows[i][0] = 1.0
                rows[i][1:1 + widths[i]] = placement_values(plan)
            except Exception as exc:   # re-raised after the collective, which the others are in
                failure, rows[i][0] = exc, -1.0
    if size > 1:
        # [replicated layers, 1 + 2 x (E + X)] float64, one rank's numbers per planned row and
        # zeros from the others, so the sum is that rank's plan, exact
        table = torch.tensor(rows, dtype=torch.float64, device=device)
        comm.all_reduce_(table, group)
        rows = table.tolist()
    if failure is not None:
        raise failure
    plans = {}
    for j, (i, counts) in enumerate(planned):
        rep = layers[i][1].replicas
        if rows[i][0] != 1.0:   # exactly one rank planned it, and that one did not fail
            raise RuntimeError(f"rebalance: planning layer {layers[i][0] or '(model)'!r} failed on rank "
                               f"{j % size} of the stage group (its own error says why)")
        plans[i] = placement_from_values(counts, rep.num_experts, rep.redundant_experts, rep.ep_size,
                                         rows[i][1:1 + widths[i]])
    return plans


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


def named_moe_layers(model: nn.Module):
    """(name, layer) of every moepar MoE layer of ``model``, under the name it has in the
    whole model: a rank holding several pipeline stages (``StageChunks``) names its layers
    without the chunk prefix, as it names their parameters."""
    from ...parallel.pipeline import StageChunks
    for part in (model.chunks if isinstance(model, StageChunks) else [model]):
        for name, m in part.named_modules():
            if isinstance(m, MoE):
                yield name, m


def placement_plain(placement: Placement) -> dict:
    """A slot map as plain values (numbers and lists, ``placement_values``' form), what a
    checkpoint may hold."""
    return {"num_experts": placement.num_experts, "redundant_experts": placement.redundant_experts,
            "ep_size": placement.ep_size, "loads": list(placement.loads), "values": placement_values(placement)}


def placement_of(value, where: str) -> Placement:
    """The slot map ``placement_plain`` gave (or a Placement itself, as earlier versions kept
    it), rebuilt and checked by ``placement_from_values``: ValueError naming ``where``."""
    try:
        if isinstance(value, Placement):
            value = placement_plain(value)
        return placement_from_values(list(value["loads"]), int(value["num_experts"]), int(value["redundant_experts"]),
                                     int(value["ep_size"]), list(value["values"]))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"{where}: not a slot map ({type(e).__name__}: {e})") from None


def placement_state(model: nn.Module) -> dict:
    """{layer name: (slot map, routes counted on this rank since the last rebalance as a list
    or None, the load the map was planned from or None)} for every replicated MoE layer of
    ``model``, in plain values (the slot map as ``placement_plain`` writes it), so that it
    may travel in a checkpoint's ``extra``. ``moepar.checkpoint.save`` keeps the same state
    by itself (slot maps per layer, counted routes per rank), so a resumed run places and
    rebalances as the uninterrupted one. One host read per layer."""
    out = {}
    for name, m in named_moe_layers(model):
        if m.replicas is not None:
            loads = m.replicas.loads_E
            out[name] = (placement_plain(m.placement), None if loads is None else loads.tolist(),
                         None if m.replicas.planned_loads is None else list(m.replicas.planned_loads))
    return out


def load_placement_state(model: nn.Module, saved: dict | None) -> None:
    """Put back what ``placement_state`` returned (also its earlier form, with Placement
    objects); layers it does not name keep theirs. A layer saved at another ``ep_size`` or
    ``redundant_experts`` is re-planned (``plan_placement``) from the load its map was planned
    from, or for uniform load if it was never rebalanced. Every layer is checked before any
    changes: a ValueError naming the layer (another expert count, a malformed entry) leaves
    the model as it was."""
    for m, placement, loads, planned in prepare_placements(model, saved):
        apply_placement(m, placement, loads, planned)


def prepare_placements(model: nn.Module, saved: dict | None) -> list:
    """``load_placement_state``'s checks and re-plans, changing nothing: [(layer, slot map,
    counted routes or None, planned load or None)] to hand to ``apply_placement``."""
    out = []
    for name, m in named_moe_layers(model):
        entry = None if not saved else saved.get(name)
        if entry is None or m.replicas is None:
            continue
        where = f"the placement state of layer {name!r}"
        if isinstance(entry, dict):
            entry = (entry.get("placement"), entry.get("loads"), entry.get("planned"))
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise ValueError(f"{where}: expected (slot map, counted routes, planned load), got {entry!r:.80}")
        placement, loads, planned = placement_of(entry[0], where), entry[1], entry[2]
        rep = m.replicas
        if placement.num_experts != rep.num_experts:
            raise ValueError(f"{where}: a slot map of E={placement.num_experts} experts, but the layer has "
                             f"E={rep.num_experts}: the state of another model")
        for what, v in (("counted routes", loads), ("planned load", planned)):
            if v is not None:
                check_placement_args(v, rep.num_experts, 0, 1)   # E finite numbers >= 0
                if what == "counted routes" and any(float(x) != int(x) for x in v):
                    raise ValueError(f"{where}: counted routes {list(v)[:4]}... must be whole numbers")
        if (placement.redundant_experts, placement.ep_size) != (rep.redundant_experts, rep.ep_size):
            # Saved at another layout: the plan rebalance would make from the same load.
            placement = plan_placement(planned if planned is not None else [1.0] * rep.num_experts,
                                       rep.num_experts, rep.redundant_experts, rep.ep_size, owner_slack=OWNER_SLACK)
        out.append((m, placement, None if loads is None else [int(x) for x in loads],
                    None if planned is None else list(planned)))
    return out


def apply_placement(m: MoE, placement: Placement, loads: list | None, planned: list | None) -> None:
    """Use ``placement`` in layer ``m`` from its next forward, with ``loads`` as the routes
    counted since the last rebalance and ``planned`` as the load the map was made from."""
    m.replicas.set_placement(placement)
    m.replicas.planned_loads = planned
    m.replicas.loads_E = None if loads is None else torch.tensor(loads, dtype=torch.int64,
                                                                 device=m.router.weight.device)

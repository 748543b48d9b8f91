"""Pricing expert replication (``MoE(..., redundant_experts=X)``): the plan, its traffic, memory.

Torch-free. The layer gives each EP group E + X expert slots, (E + X)/ep per rank,
laid out by ``moepar.moe.replication.placement.plan_placement`` from per-expert loads. Ownership never
moves: expert e's parameters stay on its home EP rank e // (E/ep); a slot holding e on another
rank is a remote copy. What that costs and buys, per MoE layer and micro-batch:

  * received rows: the most-loaded EP rank receives (T/tp)·K·max_over_mean rows, with
    max_over_mean the plan's (``Placement.max_over_mean``; X = 0: the contiguous layout's);
  * one all-to-all forward of the remote copies' weights and one backward of their gradients
    (same bytes): a rank sends ``replica_sent`` copies (its home experts' copies elsewhere)
    and receives its remote slots, each ``expert_slice_params`` x the parameter bytes; the
    collective ends with its busiest rank, so the model prices every rank as that one:
    max over ranks of max(copies sent, copies received). Nothing goes to the rank itself (a
    copy on its home rank is a view), so the time is that of an all-to-all whose (n-1)/n
    share is those bytes;
  * memory: the remote copies' weights, kept from the forward to the backward in every MoE
    layer (per micro-batch in flight), plus one layer's gradient buffers in the backward.

Loads: ``MoESpec.expert_loads`` (measured routing counts, or ``zipf_loads``); without them the
loads are uniform. ``MoESpec.imbalance`` (max/mean routes per EP rank at X = 0) cannot be
combined with either: it does not say which experts are hot.

Legend (docs/moe.md): E experts, L = E/ep home experts per EP rank, X redundant expert slots in
all, T tokens, K routes per token, D hidden, F expert FFN hidden (``Fl = F/etp`` one slice).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

from ..moe.replication.placement import Placement, check_placement_args, plan_placement, zipf_loads

__all__ = ["ReplicaPlan", "replica_plan", "replica_sent", "replica_received", "replica_copies_per_forward",
           "expert_slice_params", "receive_cap_drops", "zipf_loads"]


def replica_sent(placement: Placement, ep_rank: int) -> int:
    """Copies of EP rank ``ep_rank``'s home experts (e // (E/ep) == ep_rank) that other EP
    ranks hold: what it sends in the replica all-to-all, per forward (and gets back as
    gradients). 0 for X = 0 (every expert on its home rank only)."""
    L = placement.num_experts // placement.ep_size
    return sum(1 for r, held in enumerate(placement.slots) if r != ep_rank
               for e in held if e // L == ep_rank)


def replica_received(placement: Placement, ep_rank: int) -> int:
    """Slots of EP rank ``ep_rank`` that hold another rank's expert (remote copies it receives)."""
    L = placement.num_experts // placement.ep_size
    return sum(1 for e in placement.slots[ep_rank] if e // L != ep_rank)


def replica_copies_per_forward(placements: Sequence[Placement | None], ep_rank: int,
                               received: bool = False) -> int:
    """Copies one forward of every MoE layer makes this rank send (None: a layer without
    replication): the sum of ``replica_sent`` over the layers' placements; ``received``: the
    copies it receives instead (``replica_received``: whose gradients it sends back)."""
    count = replica_received if received else replica_sent
    return sum(count(p, ep_rank) for p in placements if p is not None)


def expert_slice_params(spec, etp: int) -> int:
    """Parameters of one expert's slice on an expert-TP rank: w1 (and w3 if gated) column-
    sliced, w2 row-sliced (F/etp each), their biases likewise, w2's bias (D) on every rank."""
    Fl = spec.ffn // etp
    up = 2 if spec.gated else 1
    return spec.mats * spec.hidden * Fl + ((up * Fl + spec.hidden) if spec.expert_bias else 0)


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    """The plan of one MoE layer on one layout: ``placement`` (X = 0: the contiguous layout),
    the most-loaded rank's load over the mean with it (``imbalance``) and without replication
    (``imbalance_unreplicated``), copies each EP rank sends and receives."""

    placement: Placement
    imbalance: float
    imbalance_unreplicated: float
    sent: tuple[int, ...]
    received: tuple[int, ...]

    @property
    def busiest_copies(self) -> int:
        """Copies the busiest EP rank sends or receives: what bounds the replica all-to-all."""
        return max(max(self.sent), max(self.received))


@functools.lru_cache(maxsize=256)
def _plan(loads: tuple[float, ...], E: int, X: int, ep: int, ranks_per_node: int | None) -> ReplicaPlan:
    p = plan_placement(loads, E, X, ep, ranks_per_node=ranks_per_node)
    flat = plan_placement(loads, E, 0, ep) if X else p
    return ReplicaPlan(p, p.max_over_mean(), flat.max_over_mean(),
                       tuple(replica_sent(p, r) for r in range(ep)), tuple(replica_received(p, r) for r in range(ep)))


def replica_plan(spec, layout) -> ReplicaPlan:
    """The plan for ``spec.redundant_experts`` on ``layout.ep`` from ``spec.expert_loads``
    (uniform when None), with the EP ranks per node of ``layout``'s real rank order. Raises
    ``plan_placement``'s ValueError (naming the value and the rule) when X does not fit ep."""
    E, X, ep = spec.experts, spec.redundant_experts, layout.ep
    loads = tuple(spec.expert_loads) if spec.expert_loads is not None else (1.0,) * E
    check_placement_args(loads, E, X, ep)
    per_node = layout.placement("ep").per_node if ep > 1 else ep
    return _plan(loads, E, X, ep, per_node if per_node < ep else None)


def receive_cap_drops(loads: Sequence[float], ep: int, factor: float) -> float:
    """Fraction of the EP group's routes the receive guard (``receive_capacity_factor`` f)
    drops at X = 0, expected from per-expert ``loads``: every rank over cap = f x mean keeps
    the cap (``moepar.moe.exchange.guard``; its ceil is below one route here)."""
    E = len(loads)
    per = [math.fsum(loads[r * (E // ep):(r + 1) * (E // ep)]) for r in range(ep)]
    total = math.fsum(per)
    if total <= 0:
        return 0.0
    cap = factor * total / ep
    return math.fsum(max(0.0, x - cap) for x in per) / total

"""Rows per rank: what a rank dispatches and its experts process per micro-batch, the
imbalance over EP ranks, and the dedup fraction the layer's "auto" rule picks.

Legend as ``moepar.cost.model``: T tokens per micro-batch per TP group, K top-k, E experts,
R rows (routes) one rank sends per micro-batch and, balanced, its experts process.
"""
from __future__ import annotations

import dataclasses
import math

from ..moe.exchange.dedup_policy import DEDUP_MAX_FRACTION   # the layer's "auto" threshold, priced as it decides
from .model import CostLayout, MoESpec


@dataclasses.dataclass(frozen=True)
class Routes:
    """Rows per rank per micro-batch: what it dispatches/receives (mean and most loaded)."""

    local_tokens: int        # T/tp: the TP ranks split the replicated tokens
    mean: float
    max: float
    capacity: int | None     # C rows per expert per sender, capacity mode only


def layout_imbalance(spec: MoESpec, layout: CostLayout) -> float:
    """max/mean routes per EP rank on ``layout``: ``spec.imbalance``, or with per-expert loads
    or redundant experts the placement plan's (``moepar.cost.replication``)."""
    if spec.expert_loads is None and not spec.redundant_experts:
        return spec.imbalance
    from .replication import replica_plan
    return replica_plan(spec, layout).imbalance


def routes_per_rank(spec: MoESpec, layout: CostLayout) -> Routes:
    t_local = spec.tokens // layout.tp
    routes = t_local * spec.topk
    imbalance = layout_imbalance(spec, layout)
    if spec.dropless:
        return Routes(t_local, float(routes), routes * imbalance, None)
    cap = max(math.ceil(routes / spec.experts * spec.capacity_factor), spec.min_capacity)
    full = spec.experts * cap   # a receiver gets at most C per local expert from each of ep senders
    if spec.pad_to_capacity:
        return Routes(t_local, float(full), float(full), cap)
    return Routes(t_local, float(min(routes, full)), float(min(routes * imbalance, full)), cap)


def dedup_fraction(spec: MoESpec, layout: CostLayout) -> float | None:
    """Dispatch rows with dedup / routes under uniform top-k routing: the expected number of
    distinct EP ranks a token's K experts live on, ep·(1 - C(E-L, K)/C(E, K)), over K (L = E/ep).
    None where the layer sends one row per route: ep = 1, expert TP, K = 1, padded capacity,
    ``dedup="off"``, or "auto" above DEDUP_MAX_FRACTION (as the layer decides)."""
    E, K, ep = spec.experts, spec.topk, layout.ep
    if ep == 1 or layout.etp > 1 or K < 2 or spec.pad_to_capacity or spec.dedup == "off":
        return None
    L = E // ep
    f = ep * (1.0 - math.comb(E - L, K) / math.comb(E, K)) / K
    return f if spec.dedup == "on" or f <= DEDUP_MAX_FRACTION else None


def imbalance_from_counts(tokens_per_expert, ep: int) -> float:
    """max/mean tokens over EP ranks from measured per-expert counts (experts contiguous)."""
    counts = [float(c) for c in tokens_per_expert]
    if not counts or len(counts) % ep:
        raise ValueError(f"{len(counts)} expert counts are not divisible by ep={ep}")
    per = len(counts) // ep
    loads = [sum(counts[i * per:(i + 1) * per]) for i in range(ep)]
    mean = sum(loads) / ep
    if mean <= 0:
        raise ValueError("routing counts sum to 0: no tokens were routed")
    return max(loads) / mean



def node_limited_fraction(spec: MoESpec, layout: CostLayout) -> float | None:
    """With ``max_nodes_per_token`` M: the share of a rank's dispatched bytes that crosses the
    network, when each token goes once to each node its experts lie on. Uniform routing over
    the experts of M nodes (E_M = M·L of them, L = E/g per node of the EP group's g) puts a
    token on u = M·(1 - C(E_M - L, K)/C(E_M, K)) nodes on average, (g-1)/g of them remote: u·(g-1)/g
    rows of the token's K cross the network. None without the option or inside one node."""
    M = spec.max_nodes_per_token
    pl = layout.placement("ep")
    g = pl.nodes
    if M is None or g == 1:
        return None
    M = min(M, g)
    L, K = spec.experts // g, spec.topk
    pool = M * L
    u = M * (1.0 - math.comb(pool - L, K) / math.comb(pool, K)) if K <= pool else float(M)
    return u * (g - 1) / g / K

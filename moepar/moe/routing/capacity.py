"""Capacity drops, the router's option (``capacity_factor``, ``eval_capacity_factor`` or
``expert_capacity`` in ``RouterConfig``): which routes beyond an expert's slots are dropped,
their weights zeroed and the kept routes counted. Dropless routing (the default) never
comes here.

Legend: T tokens, K routes per token, E experts, N = T*K routes.
"""
from __future__ import annotations

from typing import Optional

import torch


def drop_beyond_capacity(cfg, ids_TK: torch.Tensor, w_TK: torch.Tensor, bad_T: torch.Tensor, capacity: int,
                         replayed_TK: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dropped_TK, weights_TK with the dropped routes at 0, kept routes per expert [E]) for a
    ``RouterConfig`` ``cfg`` with this rank's ``capacity`` slots per expert. ``replayed_TK``:
    the forward's drops, given to a recompute."""
    T, E = ids_TK.shape[0], cfg.num_experts
    if replayed_TK is not None:
        dropped_TK = replayed_TK
    elif cfg.expert_capacity is not None and cfg.seq_len is not None:
        # Per-sequence slots (Switch Transformers' expert_capacity): sequence b's routes to
        # expert e rank in their own bin b*E + e, [T, K] ids in [0, B*E).
        seq_T = torch.arange(T, device=ids_TK.device) // cfg.seq_len
        bins_TK = ids_TK + (seq_T * E)[:, None]
        dropped_TK = capacity_drops(bins_TK, w_TK, bad_T, cfg.expert_capacity, cfg.drop_policy,
                                    E * cfg.sequences(T))
    else:
        dropped_TK = capacity_drops(ids_TK, w_TK, bad_T, capacity, cfg.drop_policy, E)
    # Dropped routes weigh 0, except a non-finite token's, which stay NaN.
    w_TK = torch.where(dropped_TK & ~bad_T[:, None], torch.zeros_like(w_TK), w_TK)
    kept_E = torch.zeros(E, dtype=torch.int64, device=ids_TK.device).scatter_add_(
        0, ids_TK.reshape(-1), (~dropped_TK).reshape(-1).long())
    return dropped_TK, w_TK, kept_E


def capacity_drops(expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor, bad_T: torch.Tensor,
                   capacity: int, policy: str, num_experts: int) -> torch.Tensor:
    """[T, K] bool: routes beyond ``capacity`` per expert. Routes are ranked per expert by
    weight ("probs") or by arrival ("position"); arrival order is slot-major (every
    token's first choice, in token order, before any second choice), which also breaks
    ties for "probs". Routes of non-finite tokens rank last so they never displace others."""
    T, K = expert_ids_TK.shape
    N = T * K
    ids_N = expert_ids_TK.t().reshape(-1)
    bad_N = bad_T.repeat(K)
    if policy == "probs":
        w_N = weights_TK.detach().t().reshape(-1)
        w_N = torch.where(bad_N, torch.full_like(w_N, float("-inf")), w_N)
        order_N = torch.sort(w_N, descending=True, stable=True).indices
    else:
        order_N = torch.sort(bad_N.to(torch.int32), stable=True).indices
    # Group the priority order by expert (stable), then rank within each expert.
    by_expert = torch.sort(ids_N[order_N], stable=True)
    route_N = order_N[by_expert.indices]
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device).scatter_add_(
        0, ids_N, torch.ones_like(ids_N))
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank_N = torch.arange(N, device=ids_N.device) - start_E[by_expert.values]
    keep_N = torch.empty(N, dtype=torch.bool, device=ids_N.device).scatter_(0, route_N, rank_N < capacity)
    return ~keep_N.view(K, T).t()

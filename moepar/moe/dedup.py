"""Dedup dispatch: one row per (token, destination EP rank) instead of one per route.

Legend: T tokens, K routes per token, L local experts per rank, P EP ranks, S rows sent,
R rows received. A token whose K routes go to fewer than K ranks is sent once to each
(DeepEP's layout); a side message per row carries the token's weights and local expert ids
at that rank. The dispatcher (``Dispatcher._dispatch_dedup``) moves the rows; this module
holds the pure tensor work on either side and the group's decision.
"""
from __future__ import annotations

import torch

from moepar_kernels.permute import inverse_row_map, permute

# Dedup (one row per token and destination rank) in "auto" mode: when the EP group's rows
# with dedup are at most this fraction of its routes. The break-even measured on the 2-core
# CPU with gloo (docs/benchmarks.md); not measured on NCCL, where moving bytes costs more
# against the local passes and the break-even is likely higher (dedup="on" forces it).
DEDUP_MAX_FRACTION = 0.3


def dedup_rows(expert_ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None, L: int, P: int) -> torch.Tensor:
    """Rows per EP rank with dedup: the tokens with at least one kept route to the rank
    ([P] int64 on the ids' device; a [T, P] mask, cheap next to the rows). Out-of-range ids
    (the counts exchange raises on them) count nowhere."""
    T = expert_ids_TK.shape[0]
    ids = expert_ids_TK.long()
    kept = (ids >= 0) & (ids < L * P)
    if dropped_TK is not None:
        kept &= ~dropped_TK
    hit = torch.zeros(T, P + 1, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, torch.where(kept, torch.div(ids, L, rounding_mode="floor"), P), True)
    return hit[:, :P].sum(0)


def _dedup_plan(expert_ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None, L: int, P: int):
    """(dest_TK, drop_TK): each route's EP rank, and the routes that send no row of their
    own (dropped, or an earlier kept route of the token goes to the same rank: each token's
    first route per rank, a [T, P] scatter-min of k). Ids are in range here."""
    T, K = expert_ids_TK.shape
    dest = torch.div(expert_ids_TK.long(), L, rounding_mode="floor")
    k_TK = torch.arange(K, device=dest.device).expand(T, K)
    bins = dest if dropped_TK is None else dest.masked_fill(dropped_TK, P)   # dropped: a spare bin
    first = torch.full((T, P + 1), K, dtype=torch.int64, device=dest.device)
    first.scatter_reduce_(1, bins, k_TK, reduce="amin")
    drop = first.gather(1, bins) != k_TK
    if dropped_TK is not None:
        drop |= dropped_TK
    return dest, drop


def dedup_send(x_TD, expert_ids_TK, dropped_TK, weights_TK, L: int, P: int, num_rows: int | None = None):
    """The sender's half of the dedup dispatch: (x_SD, row_map_TK, side_S). x_SD holds one
    row per (token, destination rank), rank-major; row_map_TK maps each route to its row (-1
    for the routes that share an earlier route's row, or are dropped). side_S [S, 2K] fp32:
    for the row of (token t, rank p), slot j holds route j's weight and local expert id where
    route j also goes to rank p, else 0 and -1 (differentiable w.r.t. the weights).
    ``num_rows``: S when known (from the counts exchange): no host read."""
    dest_TK, drop_TK = _dedup_plan(expert_ids_TK, dropped_TK, L, P)
    K = dest_TK.shape[1]
    x_SD, _, row_map_TK = permute(x_TD, dest_TK, drop_TK, P, num_rows=num_rows)
    route_S = inverse_row_map(row_map_TK, x_SD.shape[0])    # each row's (first) route t*K + k
    tok_S = torch.div(route_S, K, rounding_mode="floor")
    mine_SK = dest_TK.index_select(0, tok_S) == dest_TK.reshape(-1).index_select(0, route_S)[:, None]
    if dropped_TK is not None:
        mine_SK &= ~dropped_TK.index_select(0, tok_S)
    ids_SK = torch.where(mine_SK, (expert_ids_TK.long() % L).index_select(0, tok_S), -1)
    w_SK = torch.where(mine_SK, weights_TK.index_select(0, tok_S), 0)
    return x_SD, row_map_TK, torch.cat([w_SK.float(), ids_SK.float()], 1)


def dedup_expand(x_RD: torch.Tensor, side_RK2: torch.Tensor, L: int, num_rows: int | None = None):
    """The receiver's half: the received rows expanded into the local experts' rows,
    expert-major (x_local, row_map_RK, weights_RK); ``combine`` sums each received row's
    expert outputs with unpermute(y, row_map_RK, weights_RK). ``num_rows``: the local
    experts' rows when known (from the counts exchange): no host read."""
    K = side_RK2.shape[1] // 2
    ids_RK = side_RK2[:, K:].detach().long()
    x_local, _, row_map_RK = permute(x_RD, ids_RK.clamp(min=0), ids_RK < 0, L, num_rows=num_rows)
    return x_local, row_map_RK, side_RK2[:, :K]


def group_dedups(votes_P: torch.Tensor, rows_P: torch.Tensor, routes_P: torch.Tensor) -> bool:
    """The EP group's decision from every rank's vote (0 off, 1 auto, 2 forced), rows with
    dedup and routes, the same on every rank: off if any rank votes off, on if all force it,
    else on when the group's rows are at most DEDUP_MAX_FRACTION of its routes."""
    if int(votes_P.min()) == 0:
        return False
    if int(votes_P.min()) == 2:
        return True
    return int(rows_P.sum()) <= DEDUP_MAX_FRACTION * int(routes_P.sum())

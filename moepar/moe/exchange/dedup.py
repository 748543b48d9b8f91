"""Dedup dispatch: one row per (token, destination EP rank) instead of one per route.

Legend (docs/moe.md): T tokens, K routes per token, L local experts per rank, P EP ranks,
R rows sent, M rows received. Each token whose K routes go to fewer than K ranks is sent once to each
(DeepEP's layout); a side message per row carries the token's weights and local expert ids
at that rank. ``DedupRows`` is the exchange form (``rows.py`` has the others and the
steps they share); below it, the pure tensor work on either side and the group's decision.
"""
from __future__ import annotations

import dataclasses

import torch

from moepar_kernels.permute import inverse_row_map, permute, unpermute

from ...parallel import comm
from .rows import Call, During, Meta, Plan, Routes, combine_rows, run_during, start_rows, tokens_back

# The "auto" threshold lives in a torch-free module so the cost model can read it; re-exported.
from .dedup_policy import DEDUP_MAX_FRACTION



@dataclasses.dataclass(frozen=True, kw_only=True)
class DedupMeta(Meta):
    row_map_TK: torch.Tensor             # [T, K] route -> sent row; -1: shares an earlier route's row
    send: tuple[int, ...]
    recv: tuple[int, ...]
    row_map_MK: torch.Tensor             # [M, K] received row's routes -> x_local rows
    weights_MK: torch.Tensor             # [M, K] their weights (in the graph)
    token_sizes: tuple[int, ...] | None


class DedupRows:
    """One row per (token, destination rank), not per route (``dedup.py``). The sender
    sends each token once to every rank that holds any of its experts, with a side message
    per row ([rows, 2K] fp32: the weights and local expert ids of the token's routes to that
    rank); the receiver expands the rows into its experts' rows (expert-major: no regroup)
    and, in ``combine``, sums each row's expert outputs with its weights before the return
    all-to-all; the sender then sums a token's returned rows. The weights' gradients flow
    back through the side message's reverse all-to-all."""

    def dispatch(self, call: Call, routes: Routes, plan: Plan, during: During = None, trusted: bool = False):
        r, P, L = routes, call.topo.ep, call.L
        x_RD, row_map_TK, side_R2K = dedup_send(r.x_TD, r.expert_ids_TK, r.dropped_TK, r.weights_TK, L, P,
                                                num_rows=sum(plan.send))
        group = call.topo.ep_group
        x_recv, pending_x = start_rows(call, x_RD, plan.recv, plan.send)
        side_M2K, pending_side = comm.all_to_all_start(side_R2K, group, plan.recv, plan.send, stats=call.stats)
        extra = run_during(during, plan.tp_tokens)
        x_recv, side_M2K = comm.wait_for(x_recv, pending_x), comm.wait_for(side_M2K, pending_side)
        counts = tuple(plan.counts_SL.sum(0).tolist())
        x_local, row_map_MK, w_MK = dedup_expand(x_recv, side_M2K, L, num_rows=sum(counts))
        return x_local, DedupMeta(form="dedup", num_tokens=r.x_TD.shape[0], counts=counts,
                                  counts_dev=plan.counts_SL_dev.sum(0), load=plan.load, tp_tokens=plan.tp_tokens,
                                  row_map_TK=row_map_TK, send=plan.send, recv=plan.recv, row_map_MK=row_map_MK,
                                  weights_MK=w_MK, token_sizes=r.token_sizes), extra

    def combine(self, call: Call, y: torch.Tensor, meta: DedupMeta) -> torch.Tensor:
        y = unpermute(y, meta.row_map_MK, meta.weights_MK, meta.row_map_MK.shape[0], checked=True)
        y = combine_rows(call, y, meta.send, meta.recv)
        # The weights were applied on the receiver: the sender sums a token's rows with weight 1.
        y = unpermute(y, meta.row_map_TK, None, meta.row_map_TK.shape[0], checked=True)
        return tokens_back(call, y, meta.token_sizes)

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
    """The sender's half of the dedup dispatch: (x_RD, row_map_TK, side_R). x_RD holds one
    row per (token, destination rank), rank-major; row_map_TK maps each route to its row (-1
    for the routes that share an earlier route's row, or are dropped). side_R [R, 2K] fp32:
    for the row of (token t, rank p), slot j holds route j's weight and local expert id where
    route j also goes to rank p, else 0 and -1 (differentiable w.r.t. the weights).
    ``num_rows``: S when known (from the counts exchange): no host read."""
    dest_TK, drop_TK = _dedup_plan(expert_ids_TK, dropped_TK, L, P)
    K = dest_TK.shape[1]
    x_RD, _, row_map_TK = permute(x_TD, dest_TK, drop_TK, P, num_rows=num_rows)
    route_R = inverse_row_map(row_map_TK, x_RD.shape[0])    # each row's (first) route t*K + k
    tok_R = torch.div(route_R, K, rounding_mode="floor")
    mine_RK = dest_TK.index_select(0, tok_R) == dest_TK.reshape(-1).index_select(0, route_R)[:, None]
    if dropped_TK is not None:
        mine_RK &= ~dropped_TK.index_select(0, tok_R)
    ids_RK = torch.where(mine_RK, (expert_ids_TK.long() % L).index_select(0, tok_R), -1)
    w_RK = torch.where(mine_RK, weights_TK.index_select(0, tok_R), 0)
    return x_RD, row_map_TK, torch.cat([w_RK.float(), ids_RK.float()], 1)


def dedup_expand(x_MD: torch.Tensor, side_MK2: torch.Tensor, L: int, num_rows: int | None = None):
    """The receiver's half: the received rows expanded into the local experts' rows,
    expert-major (x_local, row_map_MK, weights_MK); ``combine`` sums each received row's
    expert outputs with unpermute(y, row_map_MK, weights_MK). ``num_rows``: the local
    experts' rows when known (from the counts exchange): no host read."""
    K = side_MK2.shape[1] // 2
    ids_MK = side_MK2[:, K:].detach().long()
    x_local, _, row_map_MK = permute(x_MD, ids_MK.clamp(min=0), ids_MK < 0, L, num_rows=num_rows)
    return x_local, row_map_MK, side_MK2[:, :K]


def group_dedups(votes_P: torch.Tensor, rows_P: torch.Tensor, routes_P: torch.Tensor) -> bool:
    """The EP group's decision from every rank's vote (0 off, 1 auto, 2 forced), rows with
    dedup and routes, the same on every rank: off if any rank votes off, on if all force it,
    else on when the group's rows are at most DEDUP_MAX_FRACTION of its routes."""
    if int(votes_P.min()) == 0:
        return False
    if int(votes_P.min()) == 2:
        return True
    return int(rows_P.sum()) <= DEDUP_MAX_FRACTION * int(routes_P.sum())

"""What ``permute`` and ``unpermute`` settle before any kernel runs: their argument checks
(host-side, no data read; the MoE dispatcher runs them alone, before its first collective,
so that a rank with bad arguments raises together with its peers) and where each route
lands in the permuted buffer (plain torch, on the ids' device, shared by the kernel and the
reference paths, and by callers that need the row map alone: the FP8 permute, the dedup
exchange).

Legend: T tokens, E experts, K routes per token (top-k), N rows of the permuted buffer (kept
routes, or E*C when padded to a capacity C), R = T*K routes.

Layout. Route (t, k) has the flat index r = t*K + k. Kept routes are stably sorted by
expert, so rows are expert-major and, inside an expert, in token order (then k order).
``row_map_TK[t, k]`` is the row of route (t, k), -1 where it was dropped; ``route_N[n]``
is its inverse, the route of row n or -1 for a padding row. The computation is a histogram,
one stable sort of R narrow integer keys and a prefix sum: work and memory linear in R (up
to the sort), never a [T, E, C] mask, and no host read when the caller passes the row count
(``num_rows``): the MoE dispatcher knows it from its counts exchange.
"""
from __future__ import annotations

from typing import Optional

import torch


def route_index(expert_ids_TK: torch.Tensor, dropped_TK: Optional[torch.Tensor], num_experts: int,
                capacity: Optional[int], num_rows: Optional[int], need_counts: bool = True
                ) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(counts_E int64, row_map_TK int64, route_N int64), all on the ids' device.

    ``num_rows`` given (the caller knows the kept routes, dropless, or E*C with a capacity):
    nothing is read back to the host, so on CUDA nothing waits; the caller vouches that the
    ids lie in [0, E) and that no expert exceeds the capacity. None: one host read of the
    histogram counts the kept routes and checks both. ``need_counts=False`` (dropless with
    ``num_rows``, the caller has the counts): no histogram, counts_E None."""
    T, K = expert_ids_TK.shape
    R, E = T * K, num_experts
    dev = expert_ids_TK.device
    ids_R = expert_ids_TK.reshape(R).to(torch.int64)
    # Sort key: the expert, E for dropped routes (they sort last), E+1 for invalid ids (only
    # looked for without num_rows: with it the caller vouched, and four ops are saved).
    key_R = ids_R if dropped_TK is None else ids_R.masked_fill(dropped_TK.reshape(R), E)
    if num_rows is None:
        bad_R = (ids_R < 0) | (ids_R >= E)
        key_R = key_R.masked_fill(bad_R, E + 1)
    skip = not need_counts and capacity is None and num_rows is not None
    # [E + 2]: kept per expert, dropped, bad. scatter_add, not bincount: bincount reads the
    # input's max back to the host on CUDA.
    hist = None if skip else torch.zeros(E + 2, dtype=torch.int64, device=dev).scatter_add_(
        0, key_R, torch.ones_like(key_R))
    counts_E = None if skip else hist[:E]
    if num_rows is None:
        h = hist.cpu()
        if int(h[E + 1]):
            bad = ids_R.cpu()[bad_R.cpu()]
            raise ValueError(f"expert id {int(bad[0])} out of range: ids must lie in [0, num_experts={E}) "
                             f"({int(h[E + 1])} of {R} routes are out of range)")
        if capacity is not None and bool((h[:E] > capacity).any()):
            e = int(torch.nonzero(h[:E] > capacity)[0])
            raise ValueError(f"expert {e} has {int(h[e])} kept routes but capacity={capacity}: "
                             f"drop the routes beyond capacity first (the router does)")
        num_rows = int(h[:E].sum()) if capacity is None else E * capacity
    # Routes, expert-major, token order inside. Narrow keys sort faster (radix passes).
    narrow = torch.int16 if E + 2 <= torch.iinfo(torch.int16).max else torch.int32
    order_R = torch.sort(key_R.to(narrow), stable=True).indices
    if capacity is None and dropped_TK is None and num_rows == R:
        # every route has a row: its map is the sort's inverse, written whole (no -1 fill)
        row_map_R = torch.empty_like(order_R).index_copy_(0, order_R, torch.arange(R, device=dev))
        return counts_E, row_map_R.view(T, K), order_R
    row_map_R = torch.full((R,), -1, dtype=torch.int64, device=dev)
    if capacity is not None:
        route_N = _capacity_slots(key_R, order_R, hist, row_map_R, E, capacity)
        return counts_E, row_map_R.view(T, K), route_N
    route_N = order_R[:num_rows]
    row_map_R.index_copy_(0, route_N, torch.arange(num_rows, device=dev))
    return counts_E, row_map_R.view(T, K), route_N


def _capacity_slots(key_R, order_R, hist, row_map_R, E: int, capacity: int) -> torch.Tensor:
    """Padded capacity mode: the route at sorted position i of expert e goes to slot
    e*C + (i - start_e); the dropped and bad routes to private slots past the E*C rows (their
    count is not known here). Fills ``row_map_R``; returns route_N [E*C]."""
    R, dev = key_R.shape[0], key_R.device
    start = torch.cumsum(hist, 0) - hist
    key_sorted = key_R.index_select(0, order_R)
    pos = torch.arange(R, device=dev)
    kept = key_sorted < E
    slot = torch.where(kept, key_sorted * capacity + pos - start.index_select(0, key_sorted), E * capacity + pos)
    route_N = torch.full((E * capacity + R,), -1, dtype=torch.int64, device=dev).index_copy_(0, slot, order_R)
    row_map_R.index_copy_(0, order_R, torch.where(kept, slot, -1))
    return route_N[:E * capacity]


def inverse_row_map(row_map_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """route_N: the route of each row, -1 for rows no route maps to. No host sync, no
    duplicate scatter indices (dropped routes land in private slots past num_rows)."""
    R = row_map_TK.numel()
    dev = row_map_TK.device
    flat = row_map_TK.reshape(R)
    slot = torch.where(flat >= 0, flat, num_rows + torch.arange(R, device=dev))
    inv = torch.full((num_rows + R,), -1, dtype=torch.int64, device=dev)
    inv.scatter_(0, slot, torch.arange(R, device=dev))
    return inv[:num_rows]

def check_permute_args(x_TD, expert_ids_TK, dropped_TK, num_experts, capacity, num_rows=None) -> None:
    if not isinstance(x_TD, torch.Tensor) or x_TD.dim() != 2:
        raise ValueError(f"x_TD must be a 2-D [T, D] tensor, got shape {tuple(getattr(x_TD, 'shape', ()))}")
    if expert_ids_TK.dim() != 2 or expert_ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"expert_ids_TK must be [T={x_TD.shape[0]}, K], got shape {tuple(expert_ids_TK.shape)}")
    if expert_ids_TK.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"expert_ids_TK must be int64 or int32, got {expert_ids_TK.dtype}")
    if expert_ids_TK.shape[1] < 1:
        raise ValueError("expert_ids_TK must have K >= 1 routes per token")
    if expert_ids_TK.device != x_TD.device:
        raise ValueError(f"expert_ids_TK is on {expert_ids_TK.device} but x_TD is on {x_TD.device}")
    if dropped_TK is not None:
        if dropped_TK.dtype != torch.bool:
            raise ValueError(f"dropped_TK must be a bool tensor, got {dropped_TK.dtype}")
        if dropped_TK.shape != expert_ids_TK.shape:
            raise ValueError(f"dropped_TK has shape {tuple(dropped_TK.shape)} but expert_ids_TK has "
                             f"{tuple(expert_ids_TK.shape)}; they must match")
        if dropped_TK.device != x_TD.device:
            raise ValueError(f"dropped_TK is on {dropped_TK.device} but x_TD is on {x_TD.device}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive integer")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity={capacity!r} must be None or an integer >= 0")
    if num_rows is not None:
        R = expert_ids_TK.shape[0] * expert_ids_TK.shape[1]
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
            raise ValueError(f"num_rows={num_rows!r} must be None or an integer >= 0")
        if capacity is not None and num_rows != num_experts * capacity:
            raise ValueError(f"num_rows={num_rows} but capacity={capacity} gives num_experts x capacity = "
                             f"{num_experts * capacity} rows")
        if capacity is None and num_rows > R:
            raise ValueError(f"num_rows={num_rows} is more than the {R} routes of expert_ids_TK")


def check_unpermute_args(y_ND, row_map_TK, weights_TK, num_tokens) -> None:
    if not isinstance(y_ND, torch.Tensor) or y_ND.dim() != 2:
        raise ValueError(f"y_ND must be a 2-D [N, D] tensor, got shape {tuple(getattr(y_ND, 'shape', ()))}")
    if row_map_TK.dim() != 2 or row_map_TK.dtype != torch.int64:
        raise ValueError(f"row_map_TK must be a 2-D int64 [T, K] tensor (from permute), got "
                         f"{row_map_TK.dtype} of shape {tuple(row_map_TK.shape)}")
    if row_map_TK.shape[0] != num_tokens:
        raise ValueError(f"num_tokens={num_tokens} but row_map_TK has {row_map_TK.shape[0]} rows; they must match")
    if row_map_TK.device != y_ND.device:
        raise ValueError(f"row_map_TK is on {row_map_TK.device} but y_ND is on {y_ND.device}")
    if weights_TK is not None:
        if weights_TK.shape != row_map_TK.shape:
            raise ValueError(f"weights_TK has shape {tuple(weights_TK.shape)} but row_map_TK has "
                             f"{tuple(row_map_TK.shape)}; they must match")
        if not weights_TK.is_floating_point():
            raise ValueError(f"weights_TK must be floating point (fp32), got {weights_TK.dtype}")
        if weights_TK.device != y_ND.device:
            raise ValueError(f"weights_TK is on {weights_TK.device} but y_ND is on {y_ND.device}")

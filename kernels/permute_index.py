"""Where each route lands in the permuted buffer: the index computation of ``permute`` and
``unpermute`` (plain torch, on the ids' device, shared by the kernel and the reference paths,
and by callers that need the row map alone: the FP8 permute, the dedup exchange).

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
                 capacity: Optional[int], num_rows: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts_E int64, row_map_TK int64, route_N int64), all on the ids' device.

    ``num_rows`` given (the caller knows the kept routes, dropless, or E*C with a capacity):
    nothing is read back to the host, so on CUDA nothing waits; the caller vouches that the
    ids lie in [0, E) and that no expert exceeds the capacity. None: one host read of the
    histogram counts the kept routes and checks both."""
    T, K = expert_ids_TK.shape
    R, E = T * K, num_experts
    dev = expert_ids_TK.device
    ids_R = expert_ids_TK.reshape(R).to(torch.int64)
    bad_R = (ids_R < 0) | (ids_R >= E)
    # Sort key: the expert, E for dropped routes (they sort last), E+1 for invalid ids.
    key_R = ids_R if dropped_TK is None else ids_R.masked_fill(dropped_TK.reshape(R), E)
    key_R = key_R.masked_fill(bad_R, E + 1)
    # [E + 2]: kept per expert, dropped, bad. scatter_add, not bincount: bincount reads the
    # input's max back to the host on CUDA.
    hist = torch.zeros(E + 2, dtype=torch.int64, device=dev).scatter_add_(0, key_R, torch.ones_like(key_R))
    counts_E = hist[:E]
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
    row_map_R = torch.full((R,), -1, dtype=torch.int64, device=dev)
    if capacity is None:
        route_N = order_R[:num_rows]
        row_map_R.index_copy_(0, route_N, torch.arange(num_rows, device=dev))
        return counts_E, row_map_R.view(T, K), route_N
    # Route at sorted position i of expert e goes to slot e*C + (i - start_e); the dropped
    # and bad routes to private slots past the E*C rows (their count is not known here).
    start = torch.cumsum(hist, 0) - hist
    key_sorted = key_R.index_select(0, order_R)
    pos = torch.arange(R, device=dev)
    kept = key_sorted < E
    slot = torch.where(kept, key_sorted * capacity + pos - start.index_select(0, key_sorted), E * capacity + pos)
    route_N = torch.full((E * capacity + R,), -1, dtype=torch.int64, device=dev).index_copy_(0, slot, order_R)
    row_map_R.index_copy_(0, order_R, torch.where(kept, slot, -1))
    return counts_E, row_map_R.view(T, K), route_N[:E * capacity]


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

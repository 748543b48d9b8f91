"""Padded capacity mode's exchange form (``MoE(..., capacity_factor=f, pad_to_capacity=True)``).

Legend (docs/moe.md): T tokens, D hidden, E experts, L = E/P local experts, P EP ranks,
S = etp*P source blocks, C slots per expert. The steps it shares with the dropless forms
(``start_rows``, ``gather_etp``, ``return_rows``, the regroup) are in ``rows.py``.
"""
from __future__ import annotations

import dataclasses

import torch

from moepar_kernels.permute import permute, unpermute

from ...parallel import comm, regions
from .rows import (Call, During, Meta, PermuteRows, gather_etp, regroup_index, return_rows, run_during,
                       start_rows)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PaddedMeta(Meta):
    row_map_TK: torch.Tensor             # [T, K] slot of each route, -1 dropped
    weights_TK: torch.Tensor
    capacity: int                        # C: slots per expert (a multiple of tp)
    etp_sizes: tuple[int, ...] | None
    regroup: tuple[torch.Tensor, torch.Tensor] | None


class PaddedRows:
    """Capacity slots: every expert gets C slots (the router's capacity rounded up to a
    multiple of tp), empty slots zero, so every split is equal and known on every rank
    without any exchange (no host read: a CUDA graph can capture it). The TP ranks split
    each expert's slots ([E, C/tp, D] each) instead of the tokens. Every rank of the block
    must route the same number of tokens (equal capacities), as Megatron-Core's and
    DeepSpeed's padded all-to-alls assume."""

    def dispatch(self, call: Call, x_TD, expert_ids_TK, dropped_TK, weights_TK, capacity: int,
                 during: During = None):
        topo, E, L, P, D = call.topo, call.num_experts, call.L, call.topo.ep, x_TD.shape[1]
        C = -(-capacity // topo.tp) * topo.tp
        x_ND, _, row_map_TK = permute(x_TD, expert_ids_TK, dropped_TK, E, capacity=C, num_rows=E * C)
        if topo.tp > 1:
            x_ND = regions.scatter_to_region(x_ND.view(E, C, D), topo.tp_group, 1, stats=call.stats).reshape(-1, D)
        slots = C // topo.tp
        split = (L * slots,) * P
        x_recv, pending = start_rows(call, x_ND, split, split)
        extra = run_during(during, None)
        etp_sizes = (P * L * slots,) * topo.etp if topo.etp > 1 else None
        x_recv = gather_etp(call, comm.wait_for(x_recv, pending), etp_sizes)
        S = topo.etp * P
        regroup = None
        if S > 1 and L > 1:
            regroup = regroup_index(torch.full((S, L), slots, dtype=torch.int64, device=x_recv.device),
                                    x_recv.shape[0])
            x_recv = PermuteRows.apply(x_recv, *regroup)
        counts_dev = torch.full((L,), S * slots, dtype=torch.int64, device=x_recv.device)
        return x_recv, PaddedMeta(form="padded", num_tokens=x_TD.shape[0], counts=(S * slots,) * L,
                                  counts_dev=counts_dev, load=None, tp_tokens=None, row_map_TK=row_map_TK,
                                  weights_TK=weights_TK, capacity=C, etp_sizes=etp_sizes, regroup=regroup), extra

    def combine(self, call: Call, y: torch.Tensor, meta: PaddedMeta) -> torch.Tensor:
        if meta.regroup is not None:
            idx, inv = meta.regroup
            y = PermuteRows.apply(y, inv, idx)
        split = (call.L * (meta.capacity // call.topo.tp),) * call.topo.ep
        y = return_rows(call, y, meta.etp_sizes, split, split)
        if call.topo.tp > 1:   # gather every expert's slot slices back: [E, C, D]
            y = regions.gather_from_region(y.view(call.num_experts, -1, y.shape[-1]), call.topo.tp_group, 1,
                                           stats=call.stats).reshape(-1, y.shape[-1])
        return unpermute(y, meta.row_map_TK, meta.weights_TK, meta.num_tokens, checked=True)

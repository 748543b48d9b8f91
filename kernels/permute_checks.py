"""Argument checks of ``permute``/``unpermute`` (host-side, no data read), kept apart so that
callers that must validate before a collective (the MoE dispatcher) can run them alone."""
from __future__ import annotations

import torch


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

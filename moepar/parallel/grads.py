"""Data-parallel gradient reduction for models mixing dense and expert parameters.

Rules (objective = mean over data-parallel replicas of each replica's loss):
- dense parameter: sum over the dp group, divide by dp. A dense parameter marked
  ``sequence_parallel=True`` (replicated over TP but fed only this rank's tokens) is first
  summed over the TP group.
- expert parameter (``moepar_expert=True``): its gradient already holds the contributions
  of every token routed to it from the whole EP group, so it is summed over the
  expert-data-parallel group (the other copies of the same expert slice) and divided by
  dp, not edp. An expert parameter replicated across expert-TP ranks
  (``moepar_expert_partition_dim is None``, e.g. the output bias, applied on ETP rank 0
  only) is first summed over the ETP group.
A ``None`` gradient counts as zeros, so every rank issues the same collectives.
With pipeline stages each rank holds its stage's parameters only and every group above lies
inside one stage, so the reductions are per stage; the gradient norm adds the stages' sums
over the pipeline group. No parameter is shared between stages (the example's head is not
tied to its embedding): a tied pair would need its gradients summed across the two stages.
Gradients are flattened into one buffer per (group, dtype) to keep the call count low.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from . import comm
from .groups import ParallelState, get_parallel_state


def is_expert_param(p: torch.Tensor) -> bool:
    return bool(getattr(p, "moepar_expert", False))


def expert_param_names(model: nn.Module) -> list[str]:
    """Names of expert parameters: give them to DDP's ignore list and reduce them here."""
    return [n for n, p in model.named_parameters() if is_expert_param(p)]


def _reduce(params: list[torch.Tensor], group, scale: float, stats: comm.CommStats | None) -> None:
    if not params:
        return
    if comm.group_size(group) == 1 and scale == 1.0:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        by_dtype[p.grad.dtype].append(p)
    for plist in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in plist])
        comm.all_reduce_(flat, group, stats=stats)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for p in plist:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def allreduce_gradients(model: nn.Module, state: ParallelState | None = None, op: str = "mean",
                        which: str = "all", stats: comm.CommStats | None = None) -> None:
    """Reduce ``model``'s gradients: dense over dp, experts over edp (see module doc).

    ``op``: "mean" (divide by dp: the gradient of the mean of the replicas' losses) or
    "sum". ``which``: "all", "dense" or "expert" (e.g. "expert" when DDP handles the
    dense parameters).
    """
    if op not in ("mean", "sum"):
        raise ValueError(f"op={op!r} must be 'mean' or 'sum'")
    if which not in ("all", "dense", "expert"):
        raise ValueError(f"which={which!r} must be 'all', 'dense' or 'expert'")
    state = state if state is not None else get_parallel_state()
    params = [p for p in model.parameters() if p.requires_grad]
    if any(hasattr(p, "moepar_fsdp_kind") for p in params):
        raise ValueError(f"model {type(model).__name__} is sharded with moepar.fully_shard: its backward "
                         f"pass already reduced the gradients; do not call allreduce_gradients on it")
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    scale = 1.0 / state.dp_size if op == "mean" else 1.0
    experts = [p for p in params if is_expert_param(p)]
    dense = [p for p in params if not is_expert_param(p)]
    if which in ("all", "expert"):
        _reduce([p for p in experts if getattr(p, "moepar_expert_partition_dim", 0) is None],
                state.etp_group, 1.0, stats)
        _reduce(experts, state.edp_group, scale, stats)
    if which in ("all", "dense"):
        _reduce([p for p in dense if getattr(p, "sequence_parallel", False)], state.tp_group, 1.0, stats)
        _reduce(dense, state.dp_group, scale, stats)


def _param_device(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def grad_norm(model: nn.Module, state: ParallelState | None = None,
              stats: comm.CommStats | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients of the whole (unsharded) model, the same on every
    rank (call after ``allreduce_gradients``), a 0-dim fp32 tensor on the parameters'
    device: the sums and their all-reduces stay there (NCCL takes no CPU tensor; nothing is
    read to the host). Each distinct parameter slice counts once: dense TP-sliced params
    summed over TP, replicated ones counted on TP rank 0; expert slices summed over the EP
    and ETP groups, ETP-replicated ones counted on ETP rank 0; the stages' sums over the
    pipeline group (each stage holds its own layers)."""
    state = state if state is not None else get_parallel_state()
    if any(hasattr(p, "moepar_fsdp_kind") for p in model.parameters()):
        return _sharded_grad_norm(model, state, stats)
    dev = _param_device(model)
    dense_sq = torch.zeros((), dtype=torch.float64, device=dev)
    expert_sq = torch.zeros((), dtype=torch.float64, device=dev)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if is_expert_param(p):
            if getattr(p, "moepar_expert_partition_dim", 0) is not None or state.etp_rank == 0:
                expert_sq += sq
        elif getattr(p, "tensor_model_parallel", False) or state.tp_rank == 0:
            dense_sq += sq
    comm.all_reduce_(dense_sq, state.tp_group, stats=stats)
    comm.all_reduce_(expert_sq, state.ep_group, stats=stats)
    comm.all_reduce_(expert_sq, state.etp_group, stats=stats)
    total = dense_sq + expert_sq
    comm.all_reduce_(total, state.pp_group, stats=stats)   # 8 bytes over the pipeline stages
    return total.sqrt().float()


def _sharded_grad_norm(model: nn.Module, state: ParallelState, stats: comm.CommStats | None) -> torch.Tensor:
    """grad_norm of a moepar.fully_shard model: each rank's gradient shards are distinct
    within their FSDP group (and each pipeline stage holds its own layers), so one sum over
    the world counts every element once, except a
    replicated (not TP-sliced) dense parameter, whose TP ranks hold the same shards: counted on
    TP rank 0. One 8-byte all-reduce over the world, on the parameters' device."""
    sq = torch.zeros((), dtype=torch.float64, device=_param_device(model))
    for p in model.parameters():
        if p.grad is None:
            continue
        if p.moepar_fsdp_kind == "dense" and not getattr(p, "tensor_model_parallel", False) and state.tp_rank:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        sq += g.detach().double().pow(2).sum().to(sq.device)
    if state.world_size > 1:
        comm.all_reduce_(sq, torch.distributed.group.WORLD, stats=stats)
    return sq.sqrt().float()


def clip_grad_norm_(model: nn.Module, max_norm: float, state: ParallelState | None = None,
                    stats: comm.CommStats | None = None) -> torch.Tensor:
    """Scale all gradients so the global norm is at most ``max_norm``; returns the norm.
    The scale min(1, max_norm / (norm + 1e-6)) is applied on the device, as
    ``torch.nn.utils.clip_grad_norm_`` does: no host read."""
    total = grad_norm(model, state, stats)
    scale = (max_norm / (total.double() + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        if p.grad is not None:   # a sharded (DTensor) gradient: scale its local shard in place
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            g.mul_(scale.to(device=g.device, dtype=g.dtype))
    return total

"""Where each checkpoint entry lives: the device meshes that mirror a layout and the
DTensor wrapping that gives every local slice its global shape and offsets (the package
docstring, ``moepar.checkpoint``, describes the meshes)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.groups import ParallelState


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def meshes(state: ParallelState):
    """(dense, expert) meshes of the layout, kept in the state (destroy_parallel frees them)."""
    from torch.distributed.device_mesh import init_device_mesh
    lay = state.layout
    key = ("checkpoint", id(dist.group.WORLD))
    if key not in state.meshes:
        device = _device_type()
        if lay.pp == 1:
            dense = init_device_mesh(device, (lay.dp, lay.tp), mesh_dim_names=("dp", "tp"))
            expert = init_device_mesh(device, (lay.edp, lay.ep, lay.etp), mesh_dim_names=("edp", "ep", "etp"))
        else:   # every rank builds both whole-world meshes, then keeps its stage's slice
            dense = init_device_mesh(device, (lay.pp, lay.dp, lay.tp), mesh_dim_names=("pp", "dp", "tp"))
            expert = init_device_mesh(device, (lay.pp, lay.edp, lay.ep, lay.etp),
                                      mesh_dim_names=("pp", "edp", "ep", "etp"))
            dense, expert = dense["dp", "tp"], expert["edp", "ep", "etp"]
        state.meshes[key] = (dense, expert)
    return state.meshes[key]


_FSDP_KINDS = ("dense", "sp", "expert", "expert_rep")


def _fsdp_mesh(kind: str, state: ParallelState):
    """The mesh of a fully-sharded parameter kind (module docstring), built once per state."""
    from torch.distributed.device_mesh import DeviceMesh
    key = ("checkpoint-fsdp", kind, id(dist.group.WORLD))
    if key not in state.meshes:
        lay = state.layout
        # With pipeline stages every rank builds every kind's mesh, in one order (a stage may
        # lack a kind), over the world with a leading "pp" dimension, and keeps its stage's.
        for k in (_FSDP_KINDS if lay.pp > 1 else (kind,)):
            ranks = torch.arange(lay.world_size).view(lay.pp, lay.stage_size)
            by_expert = ranks.view(lay.pp, lay.edp, lay.ep, lay.etp).permute(0, 2, 1, 3)
            grid, names = {"dense": (ranks.view(lay.pp, lay.dp, lay.tp).transpose(1, 2), ("tp", "dp")),
                           "sp": (ranks, ("world",)),
                           "expert": (by_expert, ("ep", "edp", "etp")),
                           "expert_rep": (by_expert.reshape(lay.pp, lay.ep, -1), ("ep", "edp_etp"))}[k]
            if lay.pp == 1:
                mesh = DeviceMesh(_device_type(), grid[0].contiguous(), mesh_dim_names=names)
            else:
                mesh = DeviceMesh(_device_type(), grid.contiguous(), mesh_dim_names=("pp",) + names)[names]
            state.meshes[("checkpoint-fsdp", k, id(dist.group.WORLD))] = mesh
    return state.meshes[key]


def _wrap_fsdp(t, like, state: ParallelState):
    """A fully-sharded parameter's (or its optimizer state's) local shard as a DTensor of the
    moepar-global shape on its kind's mesh."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    kind, shape = like.moepar_fsdp_kind, list(like.shape)  # like.shape: this rank's TP/EP slice
    if kind == "dense":
        tp_sliced = getattr(like, "tensor_model_parallel", False) and state.tp_size > 1
        if tp_sliced:
            shape[like.partition_dim] *= state.tp_size
        placements = [Shard(like.partition_dim) if tp_sliced else Replicate(), Shard(0)]
    elif kind == "sp":
        placements = [Shard(0)]
    elif kind == "expert":
        pdim = getattr(like, "moepar_expert_partition_dim", None)
        shape[0] *= state.ep_size
        if pdim is not None:
            shape[pdim] *= state.etp_size
        placements = [Shard(0), Shard(0), Replicate() if pdim is None else Shard(pdim)]
    else:  # expert_rep
        shape[0] *= state.ep_size
        placements = [Shard(0), Shard(0)]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t.to_local(), _fsdp_mesh(kind, state), placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)


def wrap(t: torch.Tensor, like: torch.Tensor, state: ParallelState):
    """``t`` (shaped like parameter ``like``) as a DTensor with the parameter's placement,
    or ``t`` itself when the parameter is replicated or the world has one rank."""
    if not distributed():
        return t
    from torch.distributed.tensor import DTensor, Replicate, Shard
    if hasattr(like, "moepar_fsdp_kind"):
        return _wrap_fsdp(t, like, state)
    dense_mesh, expert_mesh = meshes(state)
    if getattr(like, "moepar_expert", False):
        pdim = getattr(like, "moepar_expert_partition_dim", None)
        placements = [Replicate(), Shard(0), Replicate() if pdim is None else Shard(pdim)]
        return DTensor.from_local(t, expert_mesh, placements, run_check=False)
    if getattr(like, "tensor_model_parallel", False):
        return DTensor.from_local(t, dense_mesh, [Replicate(), Shard(like.partition_dim)], run_check=False)
    return t


def sharded(p: torch.Tensor, state: ParallelState) -> bool:
    """Whether parameter ``p`` is saved as slices (TP, EP, expert TP or FSDP), so that a
    tensor of another shape belonging to it (an optimizer's factored statistics) differs
    from rank to rank and cannot be one replicated entry."""
    return distributed() and (hasattr(p, "moepar_fsdp_kind") or getattr(p, "moepar_expert", False)
                              or getattr(p, "tensor_model_parallel", False))


def prepare(model: nn.Module, state: ParallelState) -> None:
    """Register a fully-sharded model's sharded parameters and, with pipeline stages (which
    hold different parameters, so would make the meshes lazily in different orders), make
    every mesh now, in one order on every rank: before anything that may fail on one rank."""
    reshard(model)
    if distributed() and state.layout.pp > 1:
        meshes(state)
        if any(hasattr(p, "moepar_fsdp_kind") for p in model.parameters()):
            _fsdp_mesh("dense", state)


def reshard(model: nn.Module) -> None:
    """Register a fully-sharded model's sharded parameters (after a forward outside training,
    FSDP leaves the root's gathered ones in place); a no-op for other models."""
    if not any(hasattr(p, "moepar_fsdp_kind") or hasattr(p, "device_mesh") for p in model.parameters()) and \
            not any(type(m).__name__.startswith("FSDP") for m in model.modules()):
        return
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def layout_name(state: ParallelState) -> str:
    """The layout in an entry's name: per-rank entries (RNG streams, counters) belong to a
    rank of one layout, and a load under another layout finds none of them."""
    lay = state.layout
    return f"world{lay.world_size}.tp{lay.tp}.ep{lay.ep}.etp{lay.etp}" + (f".pp{lay.pp}" if lay.pp > 1 else "")

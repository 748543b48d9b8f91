"""Reshardable checkpoints through ``torch.distributed.checkpoint`` (DCP).

Every parameter is saved under its module path with its *global* shape: a rank's local
tensor is wrapped as a DTensor on a device mesh that mirrors the layout, and DCP writes
each shard with its global offsets. Loading builds the same wrapping for the current
layout, so DCP reads exactly the slices each rank now owns. Hence a model saved at
(tp=1, ep=4) loads at (tp=2, ep=2, etp=2) or in a single process.

Meshes (row-major over global ranks, matching ``moepar.parallel.groups``):
  dense  (dp, tp):      TP-sliced params -> [Replicate, Shard(partition_dim)]
  expert (edp, ep, etp): expert params [L, ...] -> [Replicate, Shard(0), Shard(etp dim) | Replicate]
so an expert tensor's dim 0 is the *global* expert index whatever the layout.
Replicated params and buffers are plain tensors (DCP keeps one copy).

A model sharded with ``moepar.fully_shard`` (FSDP2) has DTensor parameters sharded on dim 0
of this rank's TP/EP slice over their FSDP group (``moepar_fsdp_kind``, see
moepar/parallel/fsdp.py). They are saved with the same global shapes, on meshes whose dim
order says "the TP/EP slice first, then FSDP's chunk of it":
  dense      (tp, dp):          [Shard(partition_dim) | Replicate, Shard(0)]
  sp         (world,):          [Shard(0)]
  expert     (ep, edp, etp):    [Shard(0), Shard(0), Shard(etp dim) | Replicate]
  expert_rep (ep, edp x etp):   [Shard(0), Shard(0)]
so a fully-sharded checkpoint loads into any layout, sharded or not, and back.

``save_checkpoint``/``latest_checkpoint`` add crash safety: each save goes to a temporary
directory that rank 0 renames to ``step_<n>`` only after every rank finished writing, so
a run killed mid-save leaves the previous checkpoint intact.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .parallel.groups import ParallelState, get_parallel_state

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _meshes(state: ParallelState):
    """(dense, expert) meshes of the layout, kept in the state (destroy_parallel frees them)."""
    from torch.distributed.device_mesh import init_device_mesh
    lay = state.layout
    key = ("checkpoint", id(dist.group.WORLD))
    if key not in state.meshes:
        device = _device_type()
        dense = init_device_mesh(device, (lay.dp, lay.tp), mesh_dim_names=("dp", "tp"))
        expert = init_device_mesh(device, (lay.edp, lay.ep, lay.etp), mesh_dim_names=("edp", "ep", "etp"))
        state.meshes[key] = (dense, expert)
    return state.meshes[key]


def _fsdp_mesh(kind: str, state: ParallelState):
    """The mesh of a fully-sharded parameter kind (module docstring), built once per state."""
    from torch.distributed.device_mesh import DeviceMesh
    key = ("checkpoint-fsdp", kind, id(dist.group.WORLD))
    if key not in state.meshes:
        lay = state.layout
        ranks = torch.arange(lay.world_size)
        grid = {"dense": (ranks.view(lay.dp, lay.tp).T, ("tp", "dp")),
                "sp": (ranks, ("world",)),
                "expert": (ranks.view(lay.edp, lay.ep, lay.etp).permute(1, 0, 2), ("ep", "edp", "etp")),
                "expert_rep": (ranks.view(lay.edp, lay.ep, lay.etp).permute(1, 0, 2).reshape(lay.ep, -1),
                               ("ep", "edp_etp"))}[kind]
        state.meshes[key] = DeviceMesh(_device_type(), grid[0].contiguous(), mesh_dim_names=grid[1])
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


def _wrap(t: torch.Tensor, like: torch.Tensor, state: ParallelState):
    """``t`` (shaped like parameter ``like``) as a DTensor with the parameter's placement,
    or ``t`` itself when the parameter is replicated or the world has one rank."""
    if not _distributed():
        return t
    from torch.distributed.tensor import DTensor, Replicate, Shard
    if hasattr(like, "moepar_fsdp_kind"):
        return _wrap_fsdp(t, like, state)
    dense_mesh, expert_mesh = _meshes(state)
    if getattr(like, "moepar_expert", False):
        pdim = getattr(like, "moepar_expert_partition_dim", None)
        placements = [Replicate(), Shard(0), Replicate() if pdim is None else Shard(pdim)]
        return DTensor.from_local(t, expert_mesh, placements, run_check=False)
    if getattr(like, "tensor_model_parallel", False):
        return DTensor.from_local(t, dense_mesh, [Replicate(), Shard(like.partition_dim)], run_check=False)
    return t


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: ParallelState,
                create_optimizer_state: bool) -> dict:
    sd: dict = {}
    _reshard(model)
    params = dict(model.named_parameters())
    for name, p in params.items():
        sd[f"model.{name}"] = _wrap(p.data, p, state)
    for name, b in model.named_buffers():
        sd[f"model.{name}"] = b
    if optimizer is not None:
        names = {id(p): n for n, p in params.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state[p]
                if create_optimizer_state and not st:
                    _init_optimizer_state(optimizer, p)
                for key, value in st.items():
                    full = f"optim.{names[id(p)]}.{key}"
                    if torch.is_tensor(value) and value.shape == p.shape:
                        sd[full] = _wrap(value, p, state)
                    else:
                        sd[full] = value
        sd["optim.param_groups"] = _pack([{k: v for k, v in g.items() if k != "params"}
                                          for g in optimizer.param_groups])
    return sd


def _reshard(model: nn.Module) -> None:
    """Register a fully-sharded model's sharded parameters (after a forward outside training,
    FSDP leaves the root's gathered ones in place); a no-op for other models."""
    if not any(hasattr(p, "moepar_fsdp_kind") or hasattr(p, "device_mesh") for p in model.parameters()) and \
            not any(type(m).__name__.startswith("FSDP") for m in model.modules()):
        return
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _pack(value) -> bytes:
    """Opaque bytes: DCP would otherwise flatten nested dicts and lists into many keys."""
    return pickle.dumps(value)


def _unpack(blob):
    return pickle.loads(blob) if isinstance(blob, bytes) else blob


def _init_optimizer_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> None:
    """Adam-family state so that loading has tensors to fill (Adam creates it lazily)."""
    st = optimizer.state[p]
    st["step"] = torch.zeros((), dtype=torch.float32)
    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None, state: ParallelState | None = None) -> None:
    """Write ``model`` (and ``optimizer``, ``extra`` picklable values) to directory ``path``."""
    state = state if state is not None else get_parallel_state()
    sd = _state_dict(model, optimizer, state, create_optimizer_state=False)
    for key, value in (extra or {}).items():
        sd[f"extra.{key}"] = _pack(value)
    dcp.save(sd, checkpoint_id=path, no_dist=not _distributed())


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra_keys: tuple[str, ...] = (), state: ParallelState | None = None) -> dict:
    """Load ``path`` into ``model`` (and ``optimizer``) for the current layout; returns the
    requested ``extra`` values."""
    state = state if state is not None else get_parallel_state()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {path!r}")
    sd = _state_dict(model, optimizer, state, create_optimizer_state=True)
    for key in extra_keys:
        sd[f"extra.{key}"] = b""
    dcp.load(sd, checkpoint_id=path, no_dist=not _distributed())
    # Plain tensors were filled in place; DTensors wrap the parameters' own storage.
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, _unpack(sd["optim.param_groups"])):
            group.update(saved)
        names = dict(model.named_parameters())
        for key, value in sd.items():
            if key.startswith("optim.") and key != "optim.param_groups" and not torch.is_tensor(value) \
                    and not hasattr(value, "to_local"):
                pname, skey = key[len("optim."):].rsplit(".", 1)
                optimizer.state[names[pname]][skey] = value
    return {key: _unpack(sd[f"extra.{key}"]) for key in extra_keys}


_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(root: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None, state: ParallelState | None = None) -> str:
    """Save to ``root/step_<step>`` atomically (temp dir + rename after all ranks wrote)."""
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp_step_{step}")
    rank = dist.get_rank() if _distributed() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    if _distributed():
        dist.barrier()
    save(tmp, model, optimizer, dict(extra or {}, step=step), state)
    if _distributed():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    if _distributed():
        dist.barrier()
    return final


def latest_checkpoint(root: str) -> str | None:
    """The newest complete ``root/step_<n>`` directory, or None."""
    if not os.path.isdir(root):
        return None
    steps = [(int(m.group(1)), d) for d in os.listdir(root) if (m := _STEP_DIR.match(d))
             and os.path.exists(os.path.join(root, d, ".metadata"))]
    return os.path.join(root, max(steps)[1]) if steps else None

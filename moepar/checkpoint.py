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

Pipeline stages: each rank holds its stage's parameters, under the names they have in the
whole model (``moepar.parallel.pipeline``), and every mesh above is the one of its stage
(a leading "pp" mesh dimension, sliced off), so DCP writes each parameter once, from the
stage that holds it, with the same global shape at any pp: the checkpoint is layout-free.

``save_checkpoint``/``latest_checkpoint`` add crash safety: each save goes to a temporary
directory that rank 0 renames to ``step_<n>`` only after every rank finished writing, so
a run killed mid-save leaves the previous checkpoint intact.
"""
from __future__ import annotations

import math
import os
import pickle
import random
import re
import shutil
import sys
import warnings

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
    if _distributed() and state.layout.pp > 1:
        # Stages hold different parameters: every rank makes every mesh now, in one order.
        _meshes(state)
        if any(hasattr(p, "moepar_fsdp_kind") for p in model.parameters()):
            _fsdp_mesh("dense", state)
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


def _rng_key(state: ParallelState) -> str:
    """This rank's RNG entry. The layout is in the name: RNG streams belong to a rank of one
    layout, and a load under another layout finds no entry (and keeps its own streams)."""
    return f"rng.{_layout_name(state)}.rank{state.rank}"


def _layout_name(state: ParallelState) -> str:
    lay = state.layout
    return f"world{lay.world_size}.tp{lay.tp}.ep{lay.ep}.etp{lay.etp}" + (f".pp{lay.pp}" if lay.pp > 1 else "")


def _rng_streams(state: ParallelState) -> dict:
    """Every RNG stream this rank draws from: torch's CPU generator (the router's noise,
    dropout), the CUDA device's, the model-parallel tracker's (``fork_model_parallel_rng``),
    Python's ``random`` and NumPy's global generator if NumPy is loaded."""
    streams = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        streams["cuda"] = torch.cuda.get_rng_state()
    if state.rng is not None:
        streams["tracker"] = (state.rng._cpu, state.rng._cuda)
    if "numpy" in sys.modules:
        streams["numpy"] = sys.modules["numpy"].random.get_state()
    return streams


def _set_rng_streams(streams: dict, state: ParallelState) -> None:
    torch.set_rng_state(streams["torch"])
    random.setstate(streams["python"])
    if "cuda" in streams and torch.cuda.is_available():
        torch.cuda.set_rng_state(streams["cuda"])
    if "tracker" in streams:
        if state.rng is None:
            from .parallel.groups import RNGTracker
            state.rng = RNGTracker(state.model_parallel_seed)
        state.rng._cpu, state.rng._cuda = streams["tracker"]
    if "numpy" in streams:
        import numpy
        numpy.random.set_state(streams["numpy"])


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None, state: ParallelState | None = None, rng: bool = True) -> None:
    """Write ``model`` (and ``optimizer``, ``extra`` picklable values) to directory ``path``;
    ``rng``: also every rank's RNG streams (``load(..., rng=True)`` restores them)."""
    state = state if state is not None else get_parallel_state()
    sd = _state_dict(model, optimizer, state, create_optimizer_state=False)
    for key, value in (extra or {}).items():
        sd[f"extra.{key}"] = _pack(value)
    if rng:
        sd[_rng_key(state)] = _pack(_rng_streams(state))
    dcp.save(sd, checkpoint_id=path, no_dist=not _distributed())


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model, raised before anything is loaded;
    the message names the file (or entry) and what is wrong with it."""


def _check(path: str, sd: dict, state: ParallelState) -> None:
    """Raise CheckpointError unless every entry ``sd`` asks for is in ``path`` with the
    same global shape, fully covered by the saved shards, and every shard file is there
    whole. Reads only the metadata and file sizes (every rank the same: all raise alike)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta_file = os.path.join(path, ".metadata")
    if not os.path.isfile(meta_file):
        raise CheckpointError(f"{meta_file}: missing, so {path} is not a complete checkpoint "
                              f"(a save that never finished, or not a checkpoint directory)")
    try:
        md = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{meta_file}: unreadable ({type(e).__name__}: {e}); truncated, "
                              f"or not written by torch.distributed.checkpoint") from e
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise CheckpointError(f"{shard}: missing shard (the metadata lists it, with {size} bytes)")
        if os.path.getsize(shard) < size:
            raise CheckpointError(f"{shard}: truncated shard, {os.path.getsize(shard)} bytes where "
                                  f"the metadata needs {size}")
    saved = md.state_dict_metadata
    here = _layout_name(state)
    there = next((k[len("rng."):].rsplit(".rank", 1)[0] for k in saved if k.startswith("rng.")), "an unknown layout")
    extras = [k[len("extra."):] for k in sd if k.startswith("extra.") and k not in saved]
    if extras:
        raise CheckpointError(f"{path} has no extra value {extras} (saved keys: "
                              f"{sorted(k[len('extra.'):] for k in saved if k.startswith('extra.'))})")
    missing = [k for k in sd if k not in saved and not k.startswith("rng.")]
    held = _model_keys_of_every_stage(sd, state)
    foreign = [k for k in saved if k.startswith("model.") and k not in held]
    if missing or foreign:
        what = (f"has no entry for {len(missing)} of this model's, e.g. {missing[:3]}" if missing else
                f"has {len(foreign)} parameters this model lacks, e.g. {foreign[:3]}")
        raise CheckpointError(f"{path} {what}: a checkpoint of another model"
                              + (" (or one saved without optimizer state)" if missing and all(
                                  k.startswith("optim.") for k in missing) else ""))
    for key, value in sd.items():
        if not (torch.is_tensor(value) or hasattr(value, "to_local")):
            continue
        entry = saved[key]
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{path}: {key} is saved as an object, this model has a tensor there")
        if tuple(entry.size) != tuple(value.shape):
            raise CheckpointError(f"{path}: {key} has global shape {list(entry.size)} in the checkpoint "
                                  f"(saved at {there}) but {list(value.shape)} in this model (at {here}): "
                                  f"a checkpoint of another model configuration")
        covered = sum(math.prod(c.sizes) for c in entry.chunks)
        if covered != math.prod(entry.size):
            raise CheckpointError(f"{path}: the shards of {key} (saved at {there}) hold {covered} of its "
                                  f"{math.prod(entry.size)} elements, so it cannot be resharded into this "
                                  f"layout ({here})")


def _model_keys_of_every_stage(sd: dict, state: ParallelState) -> set:
    """The model entries of the whole model: this rank's, and with pipeline stages every
    stage's (gathered over the pipeline group)."""
    mine = {k for k in sd if k.startswith("model.")}
    if state.layout.pp == 1 or state.pp_group is None:
        return mine
    every: list = [None] * state.pp_size
    dist.all_gather_object(every, sorted(mine), group=state.pp_group)
    return set().union(*map(set, every))


def _check_everywhere(path: str, sd: dict, state: ParallelState) -> None:
    """``_check`` on every rank; with pipeline stages (each rank checks its stage's entries)
    one rank's error is raised on every rank, so that none goes on into DCP's collectives."""
    if state.layout.pp == 1 or not _distributed():
        _check(path, sd, state)
        return
    try:
        _check(path, sd, state)
        mine = None
    except CheckpointError as e:
        mine = str(e)
    errors: list = [None] * state.world_size
    dist.all_gather_object(errors, mine)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra_keys: tuple[str, ...] = (), state: ParallelState | None = None, rng: bool = False) -> dict:
    """Load ``path`` into ``model`` (and ``optimizer``) for the current layout; returns the
    requested ``extra`` values. ``rng=True``: also restore this rank's RNG streams, when the
    checkpoint has them for this layout (else a warning: the run continues exactly only in
    the layout it was saved in)."""
    state = state if state is not None else get_parallel_state()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {path!r}")
    sd = _state_dict(model, optimizer, state, create_optimizer_state=True)
    for key in extra_keys:
        sd[f"extra.{key}"] = b""
    _check_everywhere(path, sd, state)
    rng_key = _rng_key(state) if rng else None
    if rng_key is not None:
        if rng_key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
            sd[rng_key] = b""
        else:
            warnings.warn(f"{path}: no RNG streams saved for this layout and rank ({rng_key}); "
                          f"the RNG streams are left as they are", stacklevel=2)
            rng_key = None
    dcp.load(sd, checkpoint_id=path, no_dist=not _distributed())
    if rng_key is not None:
        _set_rng_streams(_unpack(sd[rng_key]), state)
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
                    extra: dict | None = None, state: ParallelState | None = None, rng: bool = True) -> str:
    """Save to ``root/step_<step>`` atomically (temp dir + rename after all ranks wrote)."""
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp_step_{step}")
    rank = dist.get_rank() if _distributed() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    if _distributed():
        dist.barrier()
    save(tmp, model, optimizer, dict(extra or {}, step=step), state, rng)
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

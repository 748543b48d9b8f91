"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for models mixing dense and expert parameters.

``fully_shard`` reproduces ``allreduce_gradients``' objective (the mean over data-parallel
replicas of each replica's loss) with sharded parameters, gradients and optimizer state.
Each parameter is sharded on dim 0 over the group whose ranks hold the *same* tensor and
whose gradient contributions must be summed; every group then divides by dp:

  kind        parameter                                   FSDP group       divide by
  dense       dense, TP-sliced or replicated              dp               dp
  sp          dense, sequence_parallel=True (tp > 1)      stage (tp x dp)  dp
  expert      moepar_expert, sliced over expert-TP        edp              dp (not edp)
  expert_rep  moepar_expert, replicated over expert-TP    edp x etp        dp

(an SP parameter's gradient is summed over TP and dp, so sharding it over tp x dp does both
sums in one reduce-scatter; likewise edp x etp for the expert-TP-replicated output bias.)
A dense TP-sliced parameter is sharded within its TP slice: the dp group holds one slice.
With pipeline stages every group lies inside one stage (a stage's model holds only its own
layers; "stage" is the world when pp = 1), so each stage shards its own parameters.

Units (one all-gather and one reduce-scatter each): every child of every ``nn.ModuleList``
(the transformer blocks), then the root; parameters of several kinds share a unit through
per-parameter meshes. The gradient reduce-scatter bytes per unit and rank are
``(n - 1) / n x 4 x numel`` (fp32) over each kind's group of n ranks, the forward and backward
all-gathers the same again, against ``2 (n - 1) / n x 4 x numel`` for ``allreduce_gradients``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .groups import ParallelState, get_parallel_state

# Options moepar passes through to torch's fully_shard; the meshes are moepar's to choose.
PASSED_THROUGH = ("reshard_after_forward", "mp_policy", "offload_policy")
# Markers that moepar's other functions (gradient norm, checkpoint) read from a parameter,
# copied onto the sharded parameters that replace the originals.
MARKERS = ("moepar_expert", "moepar_expert_partition_dim", "tensor_model_parallel", "partition_dim",
           "sequence_parallel")


@torch.no_grad()
def copy_local(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p.copy_(value)``, where ``value`` is the whole tensor ``p`` stands for on this rank;
    for a DTensor (a parameter FSDP2 sharded) only this rank's shard of ``value`` is copied.
    The initialisers' write (``reset_parameters``), so that a model built on the meta device,
    sharded, then ``to_empty``'d takes the same values as one built whole."""
    to_local = getattr(p, "to_local", None)
    if to_local is None:
        p.copy_(value)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = to_local()
    if local.numel():
        part = value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        local.copy_(part.reshape(local.shape))


def param_kind(p: torch.Tensor, state: ParallelState) -> str:
    """Which FSDP group shards ``p`` (see the module table)."""
    if getattr(p, "moepar_expert", False):
        if getattr(p, "moepar_expert_partition_dim", 0) is None and state.etp_size > 1:
            return "expert_rep"
        return "expert"
    if getattr(p, "sequence_parallel", False) and state.tp_size > 1:
        return "sp"
    return "dense"


def _check(model: nn.Module, state: ParallelState, fsdp_kwargs: dict) -> None:
    """Every rank runs the same checks on the same model, before any collective."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} must be a torch.nn.Module")
    bad = sorted(set(fsdp_kwargs) - set(PASSED_THROUGH))
    if bad:
        raise ValueError(f"fully_shard got {bad}: moepar chooses the meshes and placements itself; "
                         f"the options passed through to torch's fully_shard are {list(PASSED_THROUGH)}")
    if not any(getattr(p, "moepar_expert", False) for p in model.parameters()):
        raise ValueError(f"model {type(model).__name__} has no MoE layer (no parameter is marked "
                         f"moepar_expert): moepar.fully_shard shards expert and dense parameters over "
                         f"different groups; for a dense model use torch.distributed.fsdp.fully_shard")
    if any(hasattr(p, "device_mesh") for p in model.parameters()):
        raise ValueError(f"model {type(model).__name__} already has DTensor parameters "
                         f"(fully_shard applied twice?)")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("fully_shard needs torch.distributed to be initialised (torchrun, "
                         "init_process_group, then moepar.init_parallel); a single process has "
                         "nothing to shard")
    if dist.get_world_size() != state.world_size:
        raise ValueError(f"the parallel state has world_size={state.world_size} but torch.distributed "
                         f"has {dist.get_world_size()} ranks: call moepar.init_parallel first")


def _group_of(ranks_lists: list[list[int]], rank: int, cache_key, state: ParallelState):
    """This rank's group among ``ranks_lists``, created once per state (every rank creates
    every group, in the same order) and kept in ``state.meshes`` so destroy_parallel frees it."""
    if cache_key not in state.meshes:
        mine = None
        for ranks in ranks_lists:
            g = dist.new_group(ranks, timeout=state.timeout)
            if rank in ranks:
                mine = g
        state.meshes[cache_key] = mine
    return state.meshes[cache_key]


def _mesh_infos(state: ParallelState, device_type: str) -> dict[str, object]:
    """{kind: FSDP mesh info}, one 1-D mesh per group of the module table."""
    # The per-parameter mesh result type of torch's fully_shard (its docstring documents it
    # for MoE) is not exported from torch.distributed.fsdp in torch 2.13.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    key = ("fsdp", device_type)
    if key in state.meshes:
        return state.meshes[key]
    lay, rank = state.layout, state.rank
    singles = [[r] for r in range(lay.world_size)]
    # The ranks of one stage with the same EP index (every stage's groups, in stage order).
    edp_etp = [sorted(r for r in range(lay.world_size) if lay.coords(r)["ep"] == e and lay.coords(r)["pp"] == s)
               for s in range(lay.pp) for e in range(lay.ep)]
    groups = {
        "dense": state.dp_group or _group_of(singles, rank, "single", state),
        "sp": state.stage_group or _group_of(singles, rank, "single", state),
        "expert": state.edp_group or _group_of(singles, rank, "single", state),
        "expert_rep": (_group_of(edp_etp, rank, "edp_etp", state) if len(edp_etp[0]) > 1
                       else _group_of(singles, rank, "single", state)),
    }
    infos = {kind: FSDPMeshInfo(DeviceMesh.from_group(g, device_type), shard_mesh_dim=0)
             for kind, g in groups.items()}
    state.meshes[key] = infos
    return infos


def _units(model: nn.Module) -> list[nn.Module]:
    """Every child of every ModuleList or ModuleDict, deepest first, then the root (fully_shard
    goes bottom-up)."""
    found: list[nn.Module] = []
    for module in model.modules():
        # ModuleDict: a pipeline stage's blocks, keyed by their index in the whole model
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            children = module.values() if isinstance(module, nn.ModuleDict) else module
            found.extend(c for c in children if any(True for _ in c.parameters()))
    depth = {id(m): len(n.split(".")) for n, m in model.named_modules()}
    found.sort(key=lambda m: -depth[id(m)])
    return found + [model]


def fully_shard(model: nn.Module, state: ParallelState | None = None, **fsdp_kwargs) -> nn.Module:
    """Apply torch's FSDP2 ``fully_shard`` to a model with moepar MoE layers, in place.

    Dense parameters are sharded over the data-parallel group, expert parameters over the
    expert-data-parallel group, with every gradient divided by dp (the same objective as
    ``allreduce_gradients``; see the module docstring for TP-sliced and sequence-parallel
    parameters). ``fsdp_kwargs``: ``reshard_after_forward``, ``mp_policy`` and
    ``offload_policy``, passed to every ``fully_shard`` call. After it, do not call
    ``allreduce_gradients``: the backward pass reduces the gradients; ``clip_grad_norm_``
    and ``moepar.checkpoint`` work on the sharded model. Returns ``model``.

    Raises ``ValueError`` on every rank, before any collective, for a model without MoE
    layers, an option moepar sets itself, or no process group.
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.tensor import Shard

    state = state if state is not None else get_parallel_state()
    _check(model, state, fsdp_kwargs)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    infos = _mesh_infos(state, device_type)
    markers = {name: {m: getattr(p, m) for m in MARKERS if hasattr(p, m)}
               for name, p in model.named_parameters()}
    kinds = {id(p): param_kind(p, state) for p in model.parameters()}
    kind_by_name = {name: kinds[id(p)] for name, p in model.named_parameters()}

    def placement(p: nn.Parameter):
        return ShardPlacementResult(placement=Shard(0), mesh_info=infos[kinds[id(p)]])

    # gloo has no AVG or PREMUL_SUM reduction: sum, then divide (FSDP's post-divide).
    gloo = dist.get_backend() == "gloo"
    for unit in _units(model):
        torch_fully_shard(unit, mesh=infos["dense"].mesh, shard_placement_fn=placement, **fsdp_kwargs)
        # One divide factor (dp) for every group of the unit. torch 2.13 sets the divide
        # factor and the force-sum switch per unit only; a group of one rank must not force
        # the sum (its copy path would divide twice), so both are set per parameter group.
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            group.gradient_divide_factor = float(state.dp_size)
            group.force_sum_reduction_for_comms = gloo and group.mesh_info.shard_mesh_size > 1
    for name, p in model.named_parameters():
        for m, value in markers[name].items():
            setattr(p, m, value)
        p.moepar_fsdp_kind = kind_by_name[name]
    return model

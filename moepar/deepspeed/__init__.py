"""moepar inside DeepSpeed's engine (the optional extra: ``pip install moepar[deepspeed]``).

``moepar.deepspeed.initialize(...)`` is ``deepspeed.initialize`` for a model holding moepar
layers: the same arguments, the same return ``(engine, optimizer, dataloader, lr_scheduler)``,
moepar's ``ParallelState`` as the ``mpu``. It hands moepar's experts to DeepSpeed the way
DeepSpeed's own MoE recipe hands it its experts, so that the engine trains exactly as
``moepar.allreduce_gradients`` does (docs/deepspeed.md):

- every expert parameter (``moepar_expert``) is tagged as DeepSpeed tags its own
  (``allreduce=False``, ``group_name``) and as distinct on every rank (``model_parallel``),
  and its group name is registered in DeepSpeed's group registry with moepar's
  expert-parallel and expert-data-parallel (edp) groups;
- the optimizer's parameter groups are split, experts into groups of their own
  (``moe=True``), as DeepSpeed's ZeRO requires;
- the engine is told that it holds MoE layers (DeepSpeed recognises only its own layer
  class), and uses moepar's exact global gradient norm where it would average per-rank norms
  (ZeRO-0's clipping); its checkpoints keep each rank's experts (DeepSpeed's keep one
  data-parallel rank's copy of every parameter).

DeepSpeed then broadcasts each expert over its edp group only, sums its gradient there and
divides by dp (moepar's rule), and ZeRO-1/2 partition it over its edp group. Plain
``deepspeed.initialize(..., mpu=state)`` refuses a layout with model or expert parallelism
(``ParallelState.get_sequence_data_parallel_group``), naming this function.

What is refused, each with a ``ValueError`` on every rank before any collective: ZeRO-3
with expert parameters (DeepSpeed partitions experts at stage 3 only for its AutoEP layers;
``moepar.fully_shard`` shards them), bf16 or fp16 without ZeRO (that optimizer's gradient
norm leaves the experts out), pipeline stages, expert tensor parallelism,
sequence-parallel parameters, DeepSpeed's own MoE layers in the same model, its hybrid
engine, elastic and universal checkpoints.

DeepSpeed is imported only when one of these functions runs: ``import moepar`` and
``import moepar.deepspeed`` never import it (the absolute ``import deepspeed`` below finds
the real package, not this module). Tested with DeepSpeed 0.19.8; the engine subclass
(``moepar.deepspeed.engine``) overrides some of its engine's methods
(``_configure_distributed_model``, ``clip_fp32_gradients``, ``save_checkpoint``,
``_save_moe_checkpoint``, ``_load_checkpoint``, ``load_module_state_dict``), hence the
extra's ``<0.20`` bound.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moepar.parallel.grads import is_expert_param
from moepar.parallel.groups import ParallelState, get_parallel_state

TESTED_VERSION = "0.19.8"


def group_name(state: ParallelState) -> str:
    """The name moepar's expert groups carry in DeepSpeed's registry and on the parameters
    (``group_name``). DeepSpeed parses ``ep_size_<n>`` to find its largest expert group when
    it saves and loads checkpoints, so the name keeps that form."""
    return f"ep_size_{state.ep_size}"


def plain_engine_error(state: ParallelState, mpu: bool = True) -> str | None:
    """Why DeepSpeed's engine, given ``state`` as its mpu (``mpu=False``: given none), would
    train a moepar model wrong (None when it would not: pure data parallelism). Read by
    ``ParallelState`` when DeepSpeed asks it for the group it reduces and partitions every
    parameter over, and by ``MoE.set_deepspeed_parallelism`` when an engine is built
    around the layer without ``moepar.deepspeed.initialize``."""
    lay = state.layout
    if (lay.tp, lay.ep, lay.etp, lay.pp) == (1, 1, 1, 1):
        return None
    why = []
    if lay.ep > 1 or lay.etp > 1:
        why.append(f"each rank holds other experts (ep={lay.ep}, etp={lay.etp}): DeepSpeed would broadcast "
                   f"them from data-parallel rank 0 and average their gradients over the {lay.dp} data-parallel "
                   f"ranks, where moepar sums them over their {lay.edp} expert-data-parallel ranks")
    if lay.tp > 1:
        why.append(f"tensor-parallel ranks (tp={lay.tp}) split each MoE layer's routes, so an expert's gradient "
                   f"is summed over tp x dp ranks, and the gradient norm must count every rank's experts")
    if lay.pp > 1:
        why.append(f"pipeline stages (pp={lay.pp}) hold different layers")
    call = "deepspeed.initialize(mpu=moepar's ParallelState)" if mpu else "deepspeed.initialize without moepar's mpu"
    return (call + " with layout " + describe(lay) + ": "
            + "; ".join(why) + ". Training would silently diverge from moepar.allreduce_gradients. Use "
            "moepar.deepspeed.initialize(model=..., optimizer=..., config=..., mpu=state) instead: it takes "
            "deepspeed.initialize's arguments and returns its engine, with moepar's experts handed to DeepSpeed "
            "as its own MoE experts (docs/deepspeed.md).")


def ranks_of(state: ParallelState, kind: str) -> list[int]:
    """The global ranks of this rank's ``kind`` group ("dp", "ep", "edp", ...)."""
    return next(g for g in state.layout.all_groups()[kind] if state.rank in g)


def describe(lay) -> str:
    return f"tp={lay.tp} ep={lay.ep} etp={lay.etp} pp={lay.pp} (dp={lay.dp}, edp={lay.edp})"


class DeepSpeedMPU:
    """moepar's ``ParallelState`` as DeepSpeed's ``mpu`` object: the same ranks and sizes,
    and a process group for every group, a one-rank group where moepar has ``None``
    (DeepSpeed reads a group of ``None`` as the whole world, moepar as this rank alone)."""

    def __init__(self, state: ParallelState, alone):
        self.state, self._alone = state, alone

    def _group(self, kind: str):
        return self.state.group(kind) if self.state.size(kind) > 1 else self._alone

    def get_model_parallel_rank(self) -> int: return self.state.tp_rank
    def get_model_parallel_world_size(self) -> int: return self.state.tp_size
    def get_model_parallel_group(self): return self._group("tp")
    def get_data_parallel_rank(self) -> int: return self.state.dp_rank
    def get_data_parallel_world_size(self) -> int: return self.state.dp_size
    def get_data_parallel_group(self): return self._group("dp")
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return ranks_of(self.state, "dp")

    def get_pipeline_model_parallel_world_size(self) -> int: return 1
    def get_pipeline_model_parallel_rank(self) -> int: return 0


def _import_deepspeed():
    try:
        import deepspeed   # the real package (absolute import), imported on first use only
    except ImportError as e:
        raise ImportError(f"moepar.deepspeed needs DeepSpeed (tested with {TESTED_VERSION}): "
                          f"pip install 'moepar[deepspeed]' ({e})") from e
    return deepspeed


def _config_dict(deepspeed, config, config_params, args) -> dict:
    """The DeepSpeed config as a dict, read as deepspeed.initialize reads it (a dict, or a
    JSON/HJSON path, from ``config``, ``config_params`` or ``args.deepspeed_config``)."""
    if config is None:
        config = config_params
    if config is None and getattr(args, "deepspeed_config", None) is not None:
        config = args.deepspeed_config
    if config is None:
        raise ValueError("moepar.deepspeed.initialize: no DeepSpeed config (pass config=dict or a JSON path)")
    if isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    return load_ds_config(config)


def check(model: nn.Module, state: ParallelState, config: dict) -> None:
    """Raise ``ValueError`` (the same on every rank, before any collective) when DeepSpeed's
    engine cannot train ``model`` at ``state``'s layout as moepar's own path does."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} must be a torch.nn.Module")
    if type(model).__module__.startswith("deepspeed."):
        raise ValueError(f"model is DeepSpeed's {type(model).__name__}: pass the bare nn.Module holding moepar's "
                         f"layers (DeepSpeed's pipeline modules and engines are not supported)")
    lay = state.layout
    if lay.pp > 1:
        raise ValueError(f"pipeline_parallel_size={lay.pp}: moepar.deepspeed runs one pipeline stage per engine; "
                         f"use moepar.Pipeline with moepar.allreduce_gradients (docs/pipeline.md)")
    if lay.etp > 1:
        raise ValueError(f"expert_tensor_parallel_size={lay.etp}: DeepSpeed reduces and partitions an expert over one "
                         f"group, but moepar's expert-TP-replicated biases need a sum over expert-TP first; use etp=1 "
                         f"or moepar.allreduce_gradients / moepar.fully_shard")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != lay.world_size:
        raise ValueError(f"the parallel state was made for {lay.world_size} ranks but torch.distributed has {world}: "
                         f"call moepar.init_parallel after init_process_group")
    names = {n for n, p in model.named_parameters() if is_expert_param(p)}
    sp = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False) and lay.tp > 1]
    if sp:
        raise ValueError(f"parameter {sp[0]!r} is sequence_parallel=True at tp={lay.tp}: its gradient must be summed "
                         f"over the TP group before DeepSpeed's data-parallel reduction, which DeepSpeed's engine "
                         f"does not do; train without sequence parallelism under DeepSpeed")
    for mod_name, m in model.named_modules():
        if type(m).__module__.startswith("deepspeed.moe"):
            raise ValueError(f"module {mod_name!r} is DeepSpeed's own {type(m).__name__}: mixing it with moepar's "
                             f"layers in one engine is not supported (their expert groups differ)")
    if not names:
        return
    zero = config.get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0))
    if stage == 3:
        raise ValueError(f"zero_optimization.stage=3 with {len(names)} moepar expert parameters (e.g. "
                         f"{sorted(names)[0]!r}): DeepSpeed's ZeRO-3 partitions expert parameters only for its AutoEP "
                         f"layers (it refuses its own MoE layer at stage 3 too). Use stage 1 or 2 (optimizer state "
                         f"and gradients sharded, experts over their expert-data-parallel group), or "
                         f"moepar.fully_shard for sharded parameters (docs/fsdp.md)")
    low = [k for k in ("bf16", "bfloat16", "fp16") if (config.get(k, {}) or {}).get("enabled")]
    if low and stage == 0:
        raise ValueError(f"{low[0]}.enabled=true at zero_optimization.stage=0: without ZeRO DeepSpeed steps mixed "
                         f"precision through its unfused optimizer, whose gradient norm leaves expert gradients out; "
                         f"use stage 1 or 2 with {low[0]} (tested exact against moepar's own {low[0]} path)")
    if zero.get("elastic_checkpoint"):
        raise ValueError("zero_optimization.elastic_checkpoint=true: DeepSpeed's elastic merge of expert partitions "
                         "assumes its own expert layout (experts within the ranks of one tensor-parallel rank), "
                         "not moepar's; leave it false")
    if (config.get("checkpoint", {}) or {}).get("load_universal"):
        raise ValueError("checkpoint.load_universal=true: DeepSpeed's universal checkpoints find experts by its own "
                         "layers' names; save and load moepar models with engine checkpoints or moepar.checkpoint")
    if (config.get("hybrid_engine", {}) or {}).get("enabled"):
        raise ValueError("hybrid_engine.enabled=true: DeepSpeed's hybrid engine swaps in its own inference "
                         "containers, which do not know moepar's layers")


def tag_expert_parameters(model: nn.Module, state: ParallelState | None = None) -> list[nn.Parameter]:
    """Tag ``model``'s moepar expert parameters as DeepSpeed tags its own experts, and
    return them: ``allreduce=False`` (not reduced over data parallelism), ``group_name``
    (their expert group in DeepSpeed's registry), ``model_parallel=True`` (each rank's slice
    is distinct: DeepSpeed's ZeRO gradient norm then counts every rank's partition, and its
    sums over the data- and model-parallel groups cover the world once)."""
    state = state if state is not None else get_parallel_state()
    name = group_name(state)
    experts = [p for p in model.parameters() if is_expert_param(p)]
    for p in experts:
        p.allreduce, p.group_name, p.model_parallel = False, name, True
    return experts


def param_groups(params_or_groups, state: ParallelState | None = None) -> list[dict]:
    """Optimizer parameter groups with moepar's expert parameters in groups of their own
    (``moe=True``, ``name`` their DeepSpeed group name), each with the hyperparameters of the
    group it came from; what DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``
    makes for its own experts. Takes parameters or parameter groups (dicts); groups already
    marked ``moe`` are kept. Empty groups are dropped."""
    state = state if state is not None else get_parallel_state()
    name = group_name(state)
    items = list(params_or_groups)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    dense_out, expert_out = [], []
    for i, g in enumerate(groups):
        params = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        if g.get("moe"):
            bad = [p for p in params if not is_expert_param(p)]
            if bad or g.get("name") != name:
                raise ValueError(f"parameter group {i} is marked moe=True but holds {len(bad)} non-expert "
                                 f"parameters or is named {g.get('name')!r}, not {name!r}")
            expert_out.append(g)
            continue
        dense = [p for p in params if not is_expert_param(p)]
        experts = [p for p in params if is_expert_param(p)]
        if dense:
            dense_out.append({**g, "params": dense, "name": g.get("name", f"dense_{i}")})
        if experts:
            expert_out.append({**g, "params": experts, "name": name, "moe": True})
    return dense_out + expert_out


def _split_optimizer(optimizer, model_parameters, lr_scheduler, state: ParallelState):
    """The optimizer (and parameters) to hand DeepSpeed, expert parameters in groups of their own."""
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = param_groups(optimizer.param_groups, state)
        moved = [[id(p) for p in g["params"]] for g in groups] != [[id(p) for p in g["params"]]
                                                                   for g in optimizer.param_groups]
        if moved and isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ValueError("the optimizer's parameter groups mix expert and dense parameters and an lr_scheduler "
                             "instance was built on them: splitting the groups now would leave the expert groups "
                             "unscheduled. Build the optimizer on moepar.deepspeed.param_groups(model.parameters()) "
                             "first, or pass lr_scheduler as a callable of the optimizer")
        optimizer.param_groups[:] = groups   # in place: the optimizer's state is keyed by parameter
        return optimizer, model_parameters
    return optimizer, param_groups(model_parameters, state)


def _one_rank_groups(state: ParallelState):
    """This rank's one-rank process group (every rank creates every one, in order), kept in
    ``state.meshes`` so that ``destroy_parallel`` forgets it with the layout's groups."""
    key = ("deepspeed", "alone")
    if key not in state.meshes:
        alone = None
        for r in range(state.world_size):
            g = dist.new_group([r], timeout=state.timeout) if state.timeout is not None else dist.new_group([r])
            if r == state.rank:
                alone = g
        state.meshes[key] = alone
    return state.meshes[key]


def _register_groups(state: ParallelState, alone) -> None:
    """moepar's EP and edp groups in DeepSpeed's registry under ``group_name(state)``. The
    registry is a process-wide table of DeepSpeed's (kept across worlds): entries of earlier
    worlds are dropped, since their groups are gone."""
    from deepspeed.utils import groups as ds_groups
    name = group_name(state)
    for table in (ds_groups._EXPERT_PARALLEL_GROUP, ds_groups._EXPERT_DATA_PARALLEL_GROUP,
                  ds_groups._EXPERT_PARALLEL_GROUP_RANKS, ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        table.clear()
    for kind, groups_, ranks_ in (("ep", ds_groups._EXPERT_PARALLEL_GROUP, ds_groups._EXPERT_PARALLEL_GROUP_RANKS),
                                  ("edp", ds_groups._EXPERT_DATA_PARALLEL_GROUP,
                                   ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS)):
        groups_[name] = state.group(kind) if state.size(kind) > 1 else alone
        ranks_[name] = ranks_of(state, kind)


@contextlib.contextmanager
def _building_moepar_engine(deepspeed):
    """``deepspeed.initialize`` constructs ``deepspeed.DeepSpeedEngine`` by that module-level
    name; for the length of the call the name is moepar's subclass (initialize is a
    once-per-job setup step, not called from several threads at once)."""
    saved = deepspeed.DeepSpeedEngine
    deepspeed.DeepSpeedEngine = engine_class()
    try:
        yield
    finally:
        deepspeed.DeepSpeedEngine = saved


def initialize(args: Any = None, model: nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, mpu: ParallelState | None = None, config=None,
               config_params=None, **kwargs):
    """``deepspeed.initialize`` for a model with moepar layers; returns ``(engine, optimizer,
    training_dataloader, lr_scheduler)`` as it does.

    ``mpu``: moepar's ``ParallelState`` (default: the last ``moepar.init_parallel``); the
    other arguments (``distributed_port``, ``dist_init_required``, ``collate_fn``, ...) go
    to ``deepspeed.initialize`` unchanged. Expert parameters are tagged and registered as
    DeepSpeed's own experts (module docstring), and the optimizer's parameter groups are
    split in place, experts into groups of their own (``param_groups``). Every check runs on
    every rank before any collective and raises ``ValueError`` (``check``).
    """
    if model is None:
        raise ValueError("moepar.deepspeed.initialize requires a model")
    if mpu is not None and not isinstance(mpu, ParallelState):
        raise ValueError(f"mpu={type(mpu).__name__}: moepar.deepspeed.initialize takes moepar's ParallelState "
                         f"(moepar.init_parallel's return) as the mpu")
    state = mpu if mpu is not None else get_parallel_state()
    deepspeed = _import_deepspeed()
    cfg = _config_dict(deepspeed, config, config_params, args)
    check(model, state, cfg)
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer, model_parameters = _split_optimizer(optimizer, list(model_parameters), lr_scheduler, state)
    from deepspeed.accelerator import get_accelerator
    # deepspeed.initialize's own first step, taken here so that the groups below can be made.
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               **{k: kwargs[k] for k in ("distributed_port", "dist_init_required") if k in kwargs})
    alone = _one_rank_groups(state)
    _register_groups(state, alone)
    tag_expert_parameters(model, state)
    with _building_moepar_engine(deepspeed):
        out = deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                   training_data=training_data, lr_scheduler=lr_scheduler,
                                   mpu=DeepSpeedMPU(state, alone), config=cfg, **kwargs)
    if not isinstance(out[0], engine_class()):
        raise RuntimeError(f"deepspeed {deepspeed.__version__} did not build its engine through "
                           f"deepspeed.DeepSpeedEngine; moepar.deepspeed is tested with {TESTED_VERSION}")
    return out


_ENGINE_CLASS = None


def engine_class():
    """DeepSpeed's engine, with moepar's experts counted as its MoE layers' (built on first use)."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        _import_deepspeed()
        from moepar.deepspeed.engine import MoeparEngine
        _ENGINE_CLASS = MoeparEngine
    return _ENGINE_CLASS

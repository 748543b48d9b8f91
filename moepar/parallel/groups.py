"""Process-group layout for tensor, data, expert and pipeline parallelism ("MoE parallel folding").

Dense layers see the world as ``tp x dp`` with consecutive ranks forming a TP group:
``rank = dp_rank * tp + tp_rank``. Expert layers fold the same ranks into
``etp x ep x edp``, expert-TP fastest, then expert-parallel:
``rank = edp_rank * (ep * etp) + ep_rank * etp + etp_rank`` (Megatron-Core's MoE parallel
folding: the expert layout is independent of the dense one, only both must tile the world).

One MoE layer's collectives (TP, EP, ETP) stay inside its *MoE block*: the closure of those
groups, ``lcm(tp, ep*etp)`` consecutive ranks (group "moe"). Its counts exchange is an
all-gather over the block, so a bad input on any rank of the block raises on all of them,
and nothing in a layer's forward reaches wider (data-parallel replicas, pipeline stages).

Pipeline stages are outermost (Megatron's order): with ``pp`` stages, stage s holds the
consecutive ranks ``s * stage_size ...``, and every group above lies inside one stage; the
pipeline groups ("pp") join the ranks at the same place of every stage, and the "stage"
group (created only when pp > 1) holds one stage's ranks, the span of a global-batch
statistic that the world covers when there is one stage.

Everything above ``ParallelState`` is pure rank arithmetic, testable without processes.
``init_parallel`` creates the ``torch.distributed`` groups for this rank. In moepar a group
of ``None`` means "this rank alone" (never "the world", unlike torch's own default), so a
single process without ``torch.distributed`` is a valid world of one everywhere.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import functools
import gc
import sys
from typing import Iterator

import torch
import torch.distributed as dist

from .faults import DEFAULT_TIMEOUT, as_timeout
# The rank arithmetic lives in a torch-free module (the cost model uses it); re-exported here.
from .layout import Layout, MoeRows, check_positive as _check_positive  # noqa: F401

if dist.is_available():
    # Imported here, before any process group exists, on purpose. torch.distributed.nn.functional
    # binds ``group=group.WORLD`` as default arguments when it is imported; imported after
    # init_process_group (torch._dynamo pulls it in at moepar's first custom-op call), those
    # defaults pin the world group until interpreter shutdown, and its gloo worker thread then
    # drops a tensor while the interpreter finalizes: std::terminate, SIGABRT, in a job that
    # finished (pytorch/pytorch#190489 and #117762, CPython gh-87135).
    import torch.distributed.nn  # noqa: F401

# Megatron's offset between the data-parallel and the model-parallel seed.
MODEL_PARALLEL_SEED_OFFSET = 2718


class RNGTracker:
    """A second RNG stream (the model-parallel one) swapped in by ``fork()``.

    Megatron keeps a CUDA RNG state per region; here the same idea covers the CPU default
    generator and, when present, the current CUDA device, so dropout inside TP regions
    differs across TP ranks while dropout outside them matches.
    """

    def __init__(self, seed: int):
        self.seed = seed
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        torch.manual_seed(seed)
        self._cpu = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state() if saved_cuda is not None else None
        torch.set_rng_state(saved_cpu)
        if saved_cuda is not None:
            torch.cuda.set_rng_state(saved_cuda)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if self._cuda is not None else None
        torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state(self._cuda)
        try:
            yield
        finally:
            self._cpu = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if self._cuda is not None:
                self._cuda = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved_cuda)


@dataclasses.dataclass(frozen=True)
class MoeTopology:
    """This rank's groups as one MoE layer's forward uses them (``ParallelState.moe_topology``).

    ``block``: the MoE block group (None: this rank alone); ``rows``: where its EP and TP
    peers sit among the block's rows; ``tp_group``: the TP group whose ranks hold the same
    tokens and split them (None under sequence parallelism, where each holds its own)."""

    block: object | None
    block_size: int
    rows: MoeRows
    ep_group: object | None
    ep: int
    ep_rank: int
    etp_group: object | None
    etp: int
    etp_rank: int
    tp_group: object | None
    tp: int

    @classmethod
    def of_ep_group(cls, ep_group) -> "MoeTopology":
        """An EP group alone (no TP, no expert TP): the block is the EP group."""
        P = 1 if ep_group is None else dist.get_world_size(ep_group)
        me = 0 if ep_group is None else dist.get_rank(ep_group)
        return cls(ep_group, P, MoeRows(me, 0, tuple(range(P)), (me,)), ep_group, P, me, None, 1, 0, None, 1)

    def global_rank(self, row: int) -> int:
        """The global rank of block row ``row`` (for messages)."""
        if self.block is None:
            return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return dist.get_global_rank(self.block, row)


@dataclasses.dataclass
class ParallelState:
    """This rank's view of the layout: groups (``None`` = alone), ranks, sizes, seeds.

    Also answers DeepSpeed's ``mpu`` and Megatron's ``parallel_state`` method names, so it
    can be passed where those libraries expect an ``mpu`` object.
    """

    layout: Layout
    rank: int = 0
    groups: dict[str, object | None] = dataclasses.field(default_factory=dict)
    seed: int = 1234
    rng: RNGTracker | None = None
    # Device meshes (checkpoint, FSDP) and derived groups built on demand over this layout:
    # kept here, not in module globals, so that destroy_parallel() can drop them with the groups.
    meshes: dict[object, object] = dataclasses.field(default_factory=dict)
    # The groups' timeout (init_parallel's), for the groups created later on this layout.
    timeout: object = None
    # Model chunks per pipeline rank for the interleaved and V-shaped schedules (1: one).
    virtual_pipeline_size: int = 1

    @classmethod
    def single(cls, seed: int = 1234) -> "ParallelState":
        return cls(Layout(1), 0, {k: None for k in ("tp", "dp", "etp", "ep", "edp", "moe", "pp")}, seed)

    @property
    def stage_group(self):
        """The ranks of this rank's pipeline stage: the world when pp = 1 (None alone)."""
        if self.layout.pp > 1:
            return self.groups.get("stage")
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    # sizes and ranks
    def size(self, kind: str) -> int:
        return {"tp": self.layout.tp, "dp": self.layout.dp, "etp": self.layout.etp,
                "ep": self.layout.ep, "edp": self.layout.edp, "moe": self.layout.moe,
                "pp": self.layout.pp, "world": self.layout.world_size}[kind]

    def rank_in(self, kind: str) -> int:
        return self.rank if kind == "world" else self.layout.coords(self.rank)[kind]

    def group(self, kind: str):
        return self.groups.get(kind)

    tp_size = property(lambda self: self.layout.tp)
    dp_size = property(lambda self: self.layout.dp)
    ep_size = property(lambda self: self.layout.ep)
    etp_size = property(lambda self: self.layout.etp)
    edp_size = property(lambda self: self.layout.edp)
    world_size = property(lambda self: self.layout.world_size)
    tp_rank = property(lambda self: self.rank_in("tp"))
    dp_rank = property(lambda self: self.rank_in("dp"))
    ep_rank = property(lambda self: self.rank_in("ep"))
    etp_rank = property(lambda self: self.rank_in("etp"))
    edp_rank = property(lambda self: self.rank_in("edp"))
    tp_group = property(lambda self: self.group("tp"))
    dp_group = property(lambda self: self.group("dp"))
    ep_group = property(lambda self: self.group("ep"))
    etp_group = property(lambda self: self.group("etp"))
    edp_group = property(lambda self: self.group("edp"))
    moe_size = property(lambda self: self.layout.moe)
    moe_group = property(lambda self: self.group("moe"))
    pp_size = property(lambda self: self.layout.pp)
    pp_rank = property(lambda self: self.rank_in("pp"))
    pp_group = property(lambda self: self.group("pp"))

    @property
    def moe_rows(self) -> MoeRows:
        """This rank's EP, ETP and TP peers as rows of its MoE block (``Layout.moe_rows``)."""
        return self.layout.moe_rows(self.rank)

    # A state's layout and groups do not change until destroy_parallel forgets the groups
    # (and these with them), so the MoE layers' view of them is computed once, on first use
    # (kept in the instance's dict by hand: functools.cached_property takes a lock on
    # Python 3.11, which torch.compile cannot trace through on a fresh layer's first call).
    @property
    def moe_topology(self) -> "MoeTopology":
        """What an MoE layer's forward needs of this rank's groups (TP ranks share tokens)."""
        topo = self.__dict__.get("_moe_topology")
        if topo is None:
            topo = self.__dict__["_moe_topology"] = MoeTopology(
                self.moe_group, self.moe_size, self.moe_rows, self.ep_group, self.ep_size, self.ep_rank,
                self.etp_group, self.etp_size, self.etp_rank, self.tp_group,
                self.tp_size if self.tp_group is not None else 1)
        return topo

    @property
    def moe_topology_sp(self) -> "MoeTopology":
        """``moe_topology`` under sequence parallelism: each TP rank's tokens are its own."""
        topo = self.__dict__.get("_moe_topology_sp")
        if topo is None:
            topo = self.__dict__["_moe_topology_sp"] = dataclasses.replace(self.moe_topology, tp_group=None, tp=1)
        return topo

    @property
    def model_parallel_seed(self) -> int:
        return self.seed + MODEL_PARALLEL_SEED_OFFSET + self.tp_rank

    @property
    def data_parallel_seed(self) -> int:
        return self.seed

    @contextlib.contextmanager
    def fork_model_parallel_rng(self) -> Iterator[None]:
        """Use the model-parallel RNG stream inside the block (dropout in TP regions)."""
        if self.rng is None:
            self.rng = RNGTracker(self.model_parallel_seed)
        with self.rng.fork():
            yield

    # DeepSpeed mpu names (model parallel = tensor parallel here; the pipeline has its own).
    def get_model_parallel_rank(self) -> int: return self.tp_rank
    def get_model_parallel_world_size(self) -> int: return self.tp_size
    def get_model_parallel_group(self): return self.tp_group
    def get_data_parallel_rank(self) -> int: return self.dp_rank
    def get_data_parallel_world_size(self) -> int: return self.dp_size
    def get_data_parallel_group(self): return self.dp_group

    def get_sequence_data_parallel_group(self):
        """The group DeepSpeed's engine reduces, broadcasts and partitions every parameter
        over (it asks its mpu for it while it builds the engine, before any collective).
        That is right for this state only under pure data parallelism: with model or expert
        parallelism moepar's experts live on other groups, so the engine would train a
        moepar model silently wrong, and this raises a ``ValueError`` naming
        ``moepar.deepspeed.initialize``, which hands the layout to DeepSpeed correctly."""
        from ..deepspeed import plain_engine_error   # no DeepSpeed import: the message only
        error = plain_engine_error(self)
        if error is not None:
            raise ValueError(error)
        return self.dp_group
    # Megatron parallel_state names.
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    def get_pipeline_model_parallel_rank(self) -> int: return self.pp_rank
    def get_pipeline_model_parallel_world_size(self) -> int: return self.pp_size
    def get_pipeline_model_parallel_group(self): return self.pp_group
    def get_virtual_pipeline_model_parallel_world_size(self) -> int: return self.virtual_pipeline_size

    def is_pipeline_first_stage(self) -> bool:
        """Whether this rank is first in its pipeline group (it holds the first stage, the
        embedding)."""
        return self.pp_rank == 0

    def is_pipeline_last_stage(self) -> bool:
        """Whether this rank is last in its pipeline group (Megatron's meaning: it holds the
        last stage, the head and the loss, with one stage per rank or the interleaved loop
        placement). With the V-shaped schedules (zbv, dualpipev) the last stage is on rank 0
        instead: ``moepar.Pipeline.has_last`` says where a rank's stages are."""
        return self.pp_rank == self.pp_size - 1
    def get_expert_model_parallel_rank(self) -> int: return self.ep_rank
    def get_expert_model_parallel_world_size(self) -> int: return self.ep_size
    def get_expert_model_parallel_group(self): return self.ep_group
    def get_expert_tensor_parallel_rank(self) -> int: return self.etp_rank
    def get_expert_tensor_parallel_world_size(self) -> int: return self.etp_size
    def get_expert_tensor_parallel_group(self): return self.etp_group
    def get_expert_data_parallel_rank(self) -> int: return self.edp_rank
    def get_expert_data_parallel_world_size(self) -> int: return self.edp_size
    def get_expert_data_parallel_group(self): return self.edp_group

    def describe(self) -> str:
        return (f"initializing model parallel with size {self.tp_size}: global rank {self.rank}, "
                f"tp rank {self.tp_rank}, ep rank {self.ep_rank}, dp rank {self.dp_rank}, "
                + (f"pipeline stage {self.pp_rank} of {self.pp_size}, " if self.pp_size > 1 else "") +
                f"model parallel seed {self.model_parallel_seed}, "
                f"data parallel seed {self.data_parallel_seed}")


_STATE: ParallelState | None = None


def world() -> tuple[int, int]:
    """(rank, world_size) of torch.distributed, or (0, 1) when it is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_parallel(tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
                  expert_tensor_parallel_size: int | None = None, seed: int = 1234,
                  verbose: bool = False,
                  timeout: datetime.timedelta | float | None = DEFAULT_TIMEOUT,
                  pipeline_parallel_size: int = 1, virtual_pipeline_size: int = 1) -> ParallelState:
    """Create this rank's tp/dp/ep/etp/edp/pp groups and seed the RNGs the Megatron way.

    Call after ``torch.distributed.init_process_group`` (every rank, same arguments), or
    with no process group at all for a world of one. ``expert_tensor_parallel_size=None``
    means 1: each expert whole on one rank, as in DeepSpeed-MoE (Megatron defaults it to
    the dense TP size; pass it explicitly for that). Raises ``ValueError`` on every rank,
    before creating any group, when the sizes do not tile the world.

    ``pipeline_parallel_size=p`` cuts the world into p stages of consecutive ranks (the
    pipeline outermost; every other group lies inside one stage);
    ``virtual_pipeline_size=v``: model chunks per rank for the interleaved and V-shaped
    schedules (``moepar.parallel.pipeline``), kept in the state for the stage builders.

    ``timeout`` (a timedelta, or seconds; default ``moepar.parallel.faults.DEFAULT_TIMEOUT``,
    10 minutes): how long a collective on these groups waits for a peer before it fails, with
    a ``CollectiveError`` naming the op and the group (a peer died or stalled). The world
    group's timeout is ``init_process_group(timeout=...)``'s (or ``init_distributed``'s).
    """
    global _STATE
    timeout = as_timeout(timeout)
    etp = 1 if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    pp = pipeline_parallel_size
    _check_positive(tensor_parallel_size=tensor_parallel_size,
                    expert_parallel_size=expert_parallel_size, expert_tensor_parallel_size=etp,
                    pipeline_parallel_size=pp, virtual_pipeline_size=virtual_pipeline_size)
    rank, world_size = world()
    if world_size == 1 and max(tensor_parallel_size, expert_parallel_size, etp, pp) > 1 and not (
            dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size}, expert_parallel_size={expert_parallel_size}, "
            f"expert_tensor_parallel_size={etp}, pipeline_parallel_size={pp} need torch.distributed "
            f"to be initialised "
            f"(launch with torchrun and call torch.distributed.init_process_group first); "
            f"without it the world has 1 rank and every size must be 1")
    layout = Layout(world_size, tensor_parallel_size, expert_parallel_size, etp, pp)
    groups: dict[str, object | None] = {}
    # The MoE block reuses a group of the same ranks where there is one (most layouts: the EP
    # or the TP group); the other kinds keep groups of their own (FSDP2 wants one mesh per group).
    made: dict[tuple[int, ...], object] = {}
    for kind, rank_lists in layout.all_groups().items():
        groups[kind] = None
        if len(rank_lists[0]) == 1:
            continue  # size-1 groups are never created: every collective on them is a no-op
        for ranks in rank_lists:  # every rank creates every group, in the same order
            key = tuple(ranks)
            if kind != "moe" or key not in made:
                made[key] = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[kind] = made[key]
    if pp > 1:   # one stage's ranks: the span of global-batch statistics inside a stage
        n = layout.stage_size
        for s in range(pp):
            ranks = list(range(s * n, (s + 1) * n))
            g = made.get(tuple(ranks)) or (dist.new_group(ranks, timeout=timeout) if n > 1 else None)
            if rank in ranks:
                groups["stage"] = g
    state = ParallelState(layout, rank, groups, seed, timeout=timeout,
                          virtual_pipeline_size=virtual_pipeline_size)
    torch.manual_seed(state.data_parallel_seed)
    state.rng = RNGTracker(state.model_parallel_seed)
    if verbose:
        print(state.describe(), flush=True)
    _STATE = state
    _unpin_default_groups()
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(_drop_references)
        _ATEXIT_REGISTERED = True
    return state


def get_parallel_state() -> ParallelState:
    """The state from the last ``init_parallel``, or a world of one if none was made."""
    return _STATE if _STATE is not None else ParallelState.single()


def group_kind(group) -> str | None:
    """The kinds of the parallel state that ``group`` serves, for messages: "tp", "ep/moe"
    (the MoE block reuses the EP or the TP group), "world", or None when it is none of them."""
    kinds = [k for k, g in get_parallel_state().groups.items() if g is not None and g is group]
    if not kinds and group is not None and dist.is_available() and group is dist.group.WORLD:
        kinds = ["world"]
    return "/".join(kinds) or None


def reset_parallel_state() -> None:
    """Forget the last ``init_parallel`` (groups are left to torch.distributed)."""
    global _STATE
    _STATE = None


_ATEXIT_REGISTERED = False


def _unpin_default_groups() -> None:
    """Replace every ProcessGroup bound as a default argument in torch.distributed's modules
    with ``None`` (torch's "the world" there), so that no function default keeps a group alive.

    Only matters when torch.distributed.nn was imported after init_process_group (by the user,
    before importing moepar); see the import at the top of this module.
    """
    if not dist.is_available():
        return
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for fn in list(vars(module).values()):
            if not callable(fn) or getattr(fn, "__module__", None) != name:
                continue
            defaults = getattr(fn, "__defaults__", None)
            if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
            kwdefaults = getattr(fn, "__kwdefaults__", None)
            if kwdefaults and any(isinstance(d, dist.ProcessGroup) for d in kwdefaults.values()):
                fn.__kwdefaults__ = {k: None if isinstance(d, dist.ProcessGroup) else d
                                     for k, d in kwdefaults.items()}


def _drop_references() -> None:
    """Forget every group and mesh moepar holds, in place (modules that kept the state object
    see ``None`` groups afterwards), then collect. Registered with atexit by init_parallel, so
    that even a script that never calls destroy_parallel() lets go of its groups while the
    interpreter is still intact."""
    global _STATE
    state, _STATE = _STATE, None
    if state is not None:
        state.groups.clear()
        state.meshes.clear()
        for cached in ("_moe_topology", "_moe_topology_sp"):   # they hold the groups too
            state.__dict__.pop(cached, None)
    _unpin_default_groups()
    gc.collect()


def destroy_parallel() -> None:
    """End the parallel job cleanly: barrier, drop moepar's groups and meshes, destroy every
    process group, empty DTensor's plan caches (they would outlive the groups) and collect,
    so that every group's worker threads are joined while the interpreter is intact. Call it
    once at the end of a script, on every rank, instead of (not after)
    ``torch.distributed.destroy_process_group()``. Without torch.distributed it only forgets
    the parallel state. A later ``init_parallel`` needs a new process group.
    """
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        dist.barrier()  # no rank tears its groups down while a peer still sends to it
    _drop_references()
    if initialized:
        dist.destroy_process_group()
        _forget_dtensor_plans()
    gc.collect()


def _forget_dtensor_plans() -> None:
    """Empty DTensor's sharding-propagation caches after the world is gone. They key on
    DeviceMesh, which compares equal by ranks and shape, not by process group: in a later
    world an output spec cached in this one would carry a mesh whose group was destroyed
    (group names restart at 0 in a new world, so it could even name a different group).
    torch 2.13 has no public API for this; both caches are skipped if torch renames them."""
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    dtensor = sys.modules.get("torch.distributed.tensor")
    dispatcher = getattr(getattr(dtensor, "DTensor", None), "_op_dispatcher", None)
    cached = getattr(getattr(dispatcher, "sharding_propagator", None), "propagate_op_sharding", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()

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
Replicated params and persistent buffers are plain tensors (DCP keeps one copy);
non-persistent buffers are not state (torch's ``state_dict`` leaves them out too), except the
MoE counters a resume needs, which are saved per rank (``ranks``).

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

Entries that are not one tensor: optimizer state and param groups (``optim``), each rank's
RNG streams and counters and each stage's slot maps (``ranks``), the caller's ``extra``
values. All of them are plain data, and a load reads nothing through a pickle that could
run code (``safe``; docs/faults.md, "What a checkpoint may contain").

Every check a load makes (the files, the shapes, every entry decoded) runs on each rank
without a collective; then one all-gather tells every rank every rank's verdict, and either
all raise (the first failing rank's error) or all go on into DCP's collectives together.

``save_checkpoint``/``latest_checkpoint`` add crash safety: each save goes to a temporary
directory that rank 0 renames to ``step_<n>`` only after every rank finished writing, so
a run killed mid-save (SIGKILL at any point: scripts/fault_soak.py --kill-in save) leaves
the previous checkpoint the newest complete one.
"""
from __future__ import annotations

import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..parallel.groups import ParallelState, get_parallel_state
from . import layout, ranks
from .entries import model_entries, optim_entries
from .reading import LoadPlan
from .safe import CheckpointError, SafeLoadPlanner, pack

__all__ = ["save", "load", "save_checkpoint", "latest_checkpoint", "CheckpointError"]


def _agree(error: BaseException | None, state: ParallelState, payload=None, what: str = "load") -> list:
    """Every rank's (verdict, payload), by one all-gather over the world: raises on every
    rank when any rank failed (its own error where it failed, the first failing rank's
    elsewhere), so that no rank goes on alone into DCP's collectives."""
    if not layout.distributed():
        if error is not None:
            raise error
        return [payload]
    mine = None if error is None else (type(error).__name__, str(error))
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, (mine, payload))
    failed = [(r, e) for r, (e, _) in enumerate(got) if e is not None]
    if failed:
        if error is not None:
            raise error
        r, (kind, msg) = failed[0]
        cls = FileNotFoundError if kind == "FileNotFoundError" else CheckpointError
        raise cls(f"rank {r} of {len(got)} refused this {what} ({kind}): {msg}")
    return [p for _, p in got]


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None, state: ParallelState | None = None, rng: bool = True) -> None:
    """Write ``model`` (and ``optimizer``, and ``extra``: {name: plain value}) to directory
    ``path``; ``rng``: also every rank's RNG streams (``load(..., rng=True)`` restores them).
    Every MoE layer's per-rank counters and every replicated layer's slot map are saved too.

    ``extra`` values, optimizer state and param-group settings must be plain data: tensors,
    numbers, strings, bools, None and lists, tuples and dicts of them (what loads without
    running code). Anything else is a CheckpointError naming the key and the type, raised on
    every rank before anything is written. ``extra`` is one value for the whole job: give
    every rank the same (DCP writes one rank's)."""
    state = state if state is not None else get_parallel_state()
    layout.prepare(model, state)
    sd, error = None, None
    try:
        sd, _ = model_entries(model, state)
        if optimizer is not None:
            sd.update(optim_entries(model, optimizer, state))
        for key, value in (extra or {}).items():
            if not isinstance(key, str):
                raise CheckpointError(f"extra key {key!r} is a {type(key).__name__}: extra's keys are strings")
            sd[f"extra.{key}"] = pack(value, f"extra[{key!r}]")
        if rng:
            sd[ranks.rng_key(state)] = pack(ranks.rng_streams(state), "this rank's RNG streams")
        counted = ranks.counters(model)
        if counted:
            sd[ranks.local_key(state)] = pack(counted, "this rank's MoE counters")
        sd.update({k: pack(v, k) for k, v in ranks.replica_entries(model).items()})
    except Exception as e:   # agreed below: a rank that raised alone would leave its peers in DCP
        error = e
    _agree(error, state, what="save")
    dcp.save(sd, checkpoint_id=path, no_dist=not layout.distributed())


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra_keys: tuple[str, ...] = (), state: ParallelState | None = None, rng: bool = False,
         trust_pickles: bool = False) -> dict:
    """Load ``path`` into ``model`` (and ``optimizer``) for the current layout; returns the
    requested ``extra`` values. ``rng=True``: also restore this rank's RNG streams, when the
    checkpoint has them for this layout (else a warning: the run continues exactly only in
    the layout it was saved in). Every MoE layer's counters (same layout) and every
    replicated layer's slot map (re-planned from its saved load at another ep or number of
    copies) come back too.

    Nothing in the checkpoint runs code: ``.metadata`` admits only the classes DCP's metadata
    is made of, every other entry is read as plain data. A checkpoint written by moepar
    before that format holds pickles; those of plain values, tensors and slot maps load as
    they are, anything else is refused unless ``trust_pickles=True`` (only for a checkpoint
    whose origin you trust: it then runs what the pickle names).

    Every check (files, shapes, entries) runs before anything is loaded; CheckpointError
    (FileNotFoundError for a missing directory) on every rank when any rank's fails."""
    state = state if state is not None else get_parallel_state()
    layout.prepare(model, state)
    plan = LoadPlan(path, model, optimizer, state, trust_pickles)
    error = None
    try:
        plan.prepare(extra_keys, rng)
    except Exception as e:   # agreed below: a rank that raised alone would leave its peers in DCP
        error = e
    try:
        # With pipeline stages a saved parameter is foreign only if no stage holds it: each
        # stage's first rank sends which of the saved parameters it holds, as bits.
        pp, first_of_stage = state.layout.pp, state.rank % state.layout.stage_size == 0
        held = plan.held_bits() if pp > 1 and first_of_stage and error is None else None
        stages = [h for h in _agree(error, state, held) if h is not None]
        if pp > 1:
            _refuse_foreign(path, plan.saved_model_keys(), stages)
    except BaseException:
        plan.undo()
        raise
    if plan.sd or layout.distributed():   # every rank enters DCP's collectives, even with nothing to read
        dcp.load(plan.sd, storage_reader=plan.reader, planner=SafeLoadPlanner(), no_dist=not layout.distributed())
    return plan.apply()


def _refuse_foreign(path: str, saved: list[str], stages: list[tuple[int, int]]) -> None:
    """CheckpointError when a saved parameter is held by no stage, or when the stages read
    different checkpoints: decided from the gathered bits alone, so on every rank alike."""
    counts = sorted({n for n, _ in stages})
    if len(counts) > 1:
        raise CheckpointError(f"{path}: the pipeline stages read different checkpoints there "
                              f"({counts} parameters)")
    anywhere = 0
    for _, bits in stages:
        anywhere |= bits
    nowhere = [i for i in range(counts[0] if counts else 0) if not anywhere >> i & 1]
    if nowhere:
        names = [saved[i] if len(saved) == counts[0] else f"#{i}" for i in nowhere[:3]]
        raise CheckpointError(f"{path} has {len(nowhere)} parameters no pipeline stage of this model "
                              f"holds, e.g. {names}: a checkpoint of another model")


_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(root: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None, state: ParallelState | None = None, rng: bool = True) -> str:
    """Save to ``root/step_<step>`` atomically: every rank writes into ``root/.tmp_step_<step>``,
    which rank 0 renames to ``step_<step>`` after all finished (an older ``step_<step>`` is
    first renamed away whole), so that a directory named ``step_<n>`` is always complete."""
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp_step_{step}")
    rank = dist.get_rank() if layout.distributed() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    if layout.distributed():
        dist.barrier()
    save(tmp, model, optimizer, dict(extra or {}, step=step), state, rng)
    if layout.distributed():
        dist.barrier()
    if rank == 0:
        old = os.path.join(root, f".old_step_{step}")
        if os.path.exists(final):   # a kill between the two renames leaves no step_<step>, never half of one
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    if layout.distributed():
        dist.barrier()
    return final


def latest_checkpoint(root: str) -> str | None:
    """The newest complete ``root/step_<n>`` directory, or None."""
    if not os.path.isdir(root):
        return None
    steps = [(int(m.group(1)), d) for d in os.listdir(root) if (m := _STEP_DIR.match(d))
             and os.path.exists(os.path.join(root, d, ".metadata"))]
    return os.path.join(root, max(steps)[1]) if steps else None

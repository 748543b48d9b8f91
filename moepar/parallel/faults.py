"""Failing fast and restarting cleanly: process-group timeouts, errors that name the failed
collective, and a rendezvous that survives ``torchrun --max-restarts``.

* ``DEFAULT_TIMEOUT`` (10 minutes): how long a collective may wait for a peer before it
  fails. torch's own default is 30 minutes (gloo; NCCL's watchdog uses the same value), long
  enough to waste half an hour of a job whose peer died. A training step's collectives
  finish in seconds, so minutes still leave room for a slow checkpoint or a first-step
  compile while bounding the damage. ``init_parallel(timeout=...)`` applies it to every group
  it creates; ``init_distributed(timeout=...)`` to the world group.
* ``CollectiveError``: raised by ``moepar.parallel.comm`` when a collective fails, naming the
  op, the phase (forward/backward), the group (tp, ep, ...: the caller names it, from the
  parallel state's ``group_kind``) and its global ranks.
* ``init_distributed``: joins the launcher's world with a store prefix per restart attempt.
  Under torchrun the workers share the agent's TCPStore, which lives across restarts (same
  MASTER_PORT every attempt) and still holds the previous attempt's keys: gloo's rendezvous
  then reads a dead worker's address (connectFullMesh: "timed out connecting") or a stale
  counter (a hang). Keys under ``moepar/attempt<TORCHELASTIC_RESTART_COUNT>/`` are new in
  every attempt.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from .. import checks

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def as_timeout(value: datetime.timedelta | float | int | None) -> datetime.timedelta:
    """``value`` (a timedelta, or seconds) as a positive timedelta; ``None`` = ``DEFAULT_TIMEOUT``."""
    if value is None:
        return DEFAULT_TIMEOUT
    if not isinstance(value, datetime.timedelta):
        if not checks.is_number(value):
            raise ValueError(f"timeout={value!r} must be a datetime.timedelta or a number of seconds")
        value = datetime.timedelta(seconds=value)
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout={value} must be positive")
    return value


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, or stalled past the group's timeout. Names the op,
    the phase, the group and its global ranks; the backend's own error is ``__cause__``.
    Built only on failure, so the hot path pays nothing for it (no extra collective, no sync)."""

    def __init__(self, message: str, op: str, phase: str, ranks: list[int], kind: str | None):
        super().__init__(message)
        self.op, self.phase, self.ranks, self.kind = op, phase, ranks, kind

    @classmethod
    def of(cls, error: BaseException, op: str, group, kind: str | None, backward: bool,
           t0: float) -> "CollectiveError":
        """The error for ``op`` failing on ``group``, whose kind (``groups.group_kind``:
        "tp", "ep/moe", "world", or None) names it in the message."""
        phase = "backward" if backward else "forward"
        try:
            ranks = dist.get_process_group_ranks(group)
        except Exception:   # the group may be unusable by now; the message must still come
            ranks = []
        where = f"the {kind} group" if kind else "a group"
        return cls(f"moepar {op} ({phase}) over {where} (global ranks {ranks}) failed on rank "
                   f"{dist.get_rank()} after {time.perf_counter() - t0:.1f}s (a peer in the group died or "
                   f"stalled past the group's timeout, or the call was invalid). Backend error: {error}",
                   op, phase, ranks, kind)


def restart_attempt() -> int:
    """Which attempt of an elastic job this is (torchrun's TORCHELASTIC_RESTART_COUNT; 0
    outside torchrun). Read once, at initialisation."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_distributed(backend: str | None = None,
                     timeout: datetime.timedelta | float | None = DEFAULT_TIMEOUT) -> bool:
    """Join the world a launcher (torchrun) describes in its environment (``env://``), as
    ``torch.distributed.init_process_group(backend, timeout=timeout)`` does, but with the
    rendezvous keys under a prefix of their own per restart attempt (module docstring), so
    that ``torchrun --max-restarts=N`` restarts work. Returns False, creating nothing, when
    the launcher describes a world of one (no WORLD_SIZE, or 1) and True when a process group
    exists afterwards (also when one existed before: then nothing is changed).

    ``backend``: default NCCL when CUDA is available, else gloo. ``timeout``: the world
    group's collective timeout (``init_parallel``'s covers the groups it creates). On NCCL,
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` is set unless already set (torchrun sets it too):
    a collective past its timeout then ends the process instead of leaving it hung.
    """
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    timeout = as_timeout(timeout)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "nccl" in backend:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"moepar/attempt{restart_attempt()}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return True

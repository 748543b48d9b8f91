"""What a session saw: host reads, host->device copies, collectives, Triton launches, violations.

A ``Recorder`` is what ``fake_cuda.session()`` yields. Every event carries the phase it
happened in (``with rec.phase("forward"):``; "other" outside any phase) and a short stack:
the first few frames outside torch, triton and tests/helpers/fake_cuda, so that a count in a table
can be traced to the line of moepar that pays it.

Categories (``Event.category``):

* ``host_read``: the host waits for a device value (``.item()``, ``int(t)``, ``bool(t)``,
  ``.cpu()``/``.tolist()``/``copy_`` into a CPU tensor, a size-less ``nonzero``,
  ``masked_select``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``,
  ``bincount``, ``unique``, ``equal``, ``event.synchronize()``, ``torch.cuda.synchronize()``,
  a ``barrier`` ...). ``Event.kind`` names which.
* ``blocking_h2d``: host data copied to the device from pageable memory or without
  ``non_blocking=True`` (``torch.tensor(list, device="cuda")``, ``x.new_tensor``, ``.cuda()``).
* ``async_h2d`` / ``async_d2h``: a ``non_blocking=True`` copy from / into pinned memory.

Collectives are ``Collective`` records; violations (what a real GPU run would crash on) are
strings in ``rec.violations``, raised as ``RuntimeError`` at the op in strict mode.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))


def _skip_dirs() -> tuple[str, ...]:
    dirs = [_HERE + os.sep]
    for name in ("torch", "triton"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(mod.__file__)) + os.sep)
    dirs.append(os.path.dirname(contextlib.__file__) + os.sep + "contextlib.py")
    return tuple(dirs)


_SKIP: tuple[str, ...] | None = None


def _short(path: str) -> str:
    parts = path.replace(os.sep, "/").split("/")
    return "/".join(parts[-3:]) if len(parts) > 3 else path


def short_stack(depth: int = 4) -> tuple[str, ...]:
    """Up to ``depth`` frames ("dir/file.py:line in fn"), innermost first, outside torch,
    triton and this package; ("<autograd engine>",) when there is none (a backward formula
    run by the engine's device thread)."""
    global _SKIP
    if _SKIP is None:
        _SKIP = _skip_dirs()
    out = []
    f = sys._getframe(1)
    while f is not None and len(out) < depth:
        fn = os.path.abspath(f.f_code.co_filename)
        if not fn.startswith(_SKIP) and not fn.startswith("<"):
            out.append(f"{_short(fn)}:{f.f_lineno} in {f.f_code.co_name}")
        f = f.f_back
    return tuple(out) or ("<autograd engine>",)


@dataclass(frozen=True)
class Event:
    category: str          # host_read | blocking_h2d | async_h2d | async_d2h
    kind: str              # item, d2h, nonzero, bool_index, event_sync, ...
    op: str                # the aten op or Python API that paid it
    phase: str
    stack: tuple[str, ...]
    nbytes: int = 0

    @property
    def where(self) -> str:
        return self.stack[0]

    def __str__(self) -> str:
        return f"{self.kind} ({self.op}) at {self.where} [{self.phase}]"


@dataclass(frozen=True)
class Collective:
    op: str                # all_reduce, all_to_all_single, ...
    ranks: tuple[int, ...] # global ranks of the group, sorted
    nbytes: int            # bytes of this rank's input (what it sends)
    phase: str
    async_op: bool
    stack: tuple[str, ...] = field(default=(), compare=False)


class Recorder:
    """Events of one session; ``phase()`` labels them. Safe to use from the autograd
    engine's device thread (backward runs there): one lock, one current phase."""

    CATEGORIES = ("host_read", "blocking_h2d", "async_h2d", "async_d2h")

    def __init__(self, strict: bool = True):
        self.strict = strict
        self.events: list[Event] = []
        self.collective_records: list[Collective] = []
        self.triton_launches: list[tuple[str, str]] = []   # (kernel name, phase)
        self.device_op_records: list[tuple[str, str]] = []  # (aten op issued on the device, phase)
        self.violations: list[str] = []
        self.current_phase = "other"
        self._lock = threading.Lock()
        self._suspended = 0
        # Host waits on the fake device that Python-level patches saw; the shim counts all of
        # them (sync_counter), and the difference is recorded at each phase's end.
        self.attributed_syncs = 0
        self.sync_counter = None
        self._sync_base = 0

    def start_sync_count(self, counter) -> None:
        self.sync_counter, self._sync_base = counter, counter()

    def reconcile_syncs(self) -> None:
        """Record the host waits the shim saw but no patched Python call did (e.g.
        ``torch.accelerator.current_stream().synchronize()`` on an unpatched object)."""
        if self.sync_counter is None:
            return
        seen = self.sync_counter() - self._sync_base
        for _ in range(seen - self.attributed_syncs):
            self.add("host_read", "sync", "device guard synchronize (no patched Python call)")
        self.attributed_syncs = max(seen, self.attributed_syncs)

    # ---- phases ------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        """Label everything recorded inside the block with ``name`` (nesting restores)."""
        self.reconcile_syncs()
        old, self.current_phase = self.current_phase, name
        try:
            yield self
        finally:
            self.reconcile_syncs()
            self.current_phase = old

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside the block (test setup/teardown reads that are not the
        code under test's)."""
        self._suspended += 1
        try:
            yield self
        finally:
            self._suspended -= 1

    @property
    def recording(self) -> bool:
        return self._suspended == 0

    # ---- recording (called by the dispatch mode and the patches) -----------------------
    def add(self, category: str, kind: str, op: str, nbytes: int = 0) -> None:
        if not self.recording:
            return
        ev = Event(category, kind, op, self.current_phase, short_stack(), nbytes)
        with self._lock:
            self.events.append(ev)

    def add_collective(self, op: str, ranks, nbytes: int, async_op: bool) -> None:
        if not self.recording:
            return
        rec = Collective(op, tuple(sorted(ranks)), int(nbytes), self.current_phase, bool(async_op),
                         short_stack())
        with self._lock:
            self.collective_records.append(rec)

    def add_device_op(self, name: str) -> None:
        """An aten op that a GPU would run as a kernel or a copy (views and allocations are
        not): what the host pays to issue, op by op."""
        if self.recording:
            with self._lock:
                self.device_op_records.append((name, self.current_phase))

    def add_launch(self, name: str) -> None:
        if self.recording:
            with self._lock:
                self.triton_launches.append((name, self.current_phase))

    def violation(self, message: str) -> None:
        """A real GPU run would fail here: record it (with where), and raise in strict mode."""
        if not self.recording:
            return
        msg = f"{message} (at {short_stack()[0]}, phase {self.current_phase})"
        with self._lock:
            self.violations.append(msg)
        if self.strict:
            raise RuntimeError(f"fake_cuda: {msg}")

    # ---- queries -----------------------------------------------------------------------
    def _select(self, category: str, phase: str | None) -> list[Event]:
        return [e for e in self.events if e.category == category and (phase is None or e.phase == phase)]

    def host_reads(self, phase: str | None = None) -> list[Event]:
        return self._select("host_read", phase)

    def blocking_h2d(self, phase: str | None = None) -> list[Event]:
        return self._select("blocking_h2d", phase)

    def async_h2d(self, phase: str | None = None) -> list[Event]:
        return self._select("async_h2d", phase)

    def async_d2h(self, phase: str | None = None) -> list[Event]:
        return self._select("async_d2h", phase)

    def collectives(self, phase: str | None = None) -> list[Collective]:
        return [c for c in self.collective_records if phase is None or c.phase == phase]

    def launches(self, phase: str | None = None) -> list[str]:
        return [n for n, p in self.triton_launches if phase is None or p == phase]

    def device_ops(self, phase: str | None = None) -> list[str]:
        """The aten ops issued on the device in ``phase`` (Triton launches apart: ``launches``)."""
        return [n for n, p in self.device_op_records if phase is None or p == phase]

    def phases(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in ([e.phase for e in self.events] + [c.phase for c in self.collective_records]
                  + [p for _, p in self.triton_launches]):
            seen.setdefault(p, None)
        return list(seen)

    def summary(self) -> dict[str, dict[str, int]]:
        """{phase: {"host_reads", "blocking_h2d", "async_h2d", "async_d2h", "collectives",
        "triton_launches"}: counts}, plus "violations" under the phase "all"."""
        out: dict[str, dict[str, int]] = {}
        for p in self.phases():
            out[p] = {"host_reads": len(self.host_reads(p)), "blocking_h2d": len(self.blocking_h2d(p)),
                      "async_h2d": len(self.async_h2d(p)), "async_d2h": len(self.async_d2h(p)),
                      "collectives": len(self.collectives(p)), "triton_launches": len(self.launches(p))}
        out["all"] = {"host_reads": len(self.host_reads()), "blocking_h2d": len(self.blocking_h2d()),
                      "async_h2d": len(self.async_h2d()), "async_d2h": len(self.async_d2h()),
                      "collectives": len(self.collectives()), "triton_launches": len(self.launches()),
                      "violations": len(self.violations)}
        return out

    def report(self, phase: str | None = None) -> str:
        """Human-readable list of every event (for assertion messages)."""
        lines = [f"{e.category}: {e}" for e in self.events if phase is None or e.phase == phase]
        lines += [f"violation: {v}" for v in self.violations]
        return "\n".join(lines) or "(nothing recorded)"

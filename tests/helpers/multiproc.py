"""Run a function on N gloo ranks from inside pytest.

``run_ranks(fn, world_size, *args)`` calls ``fn(*args)`` on every rank of a world of
``world_size`` processes (gloo, CPU, one thread each) and returns the per-rank results.
Workers are kept between calls (importing torch costs seconds a process on 2 cores), but
each call runs in a world of its own: the worker joins a new process group before ``fn`` and
ends it with ``moepar.destroy_parallel()`` after, so no group (and no gloo thread) outlives
the call. ``fn`` and its arguments must be picklable: define ``fn`` at module level.

A rank that raises fails the call with that rank's traceback; a call that outlives its
``timeout`` (a hang in a collective) kills the workers and fails with the ranks that never
answered, instead of freezing the suite; a rank that dies fails the call at once with its
exit code.

Rendezvous goes through a ``FileStore`` in a fresh temporary directory, one file per call
(no free-port race between picking a port and binding it). Workers import moepar before any
``init_process_group``; their exit codes are checked when a pool closes:
``run_ranks(..., fresh=True)`` runs in new processes and fails the test whose ranks do not
exit 0, and shared pools are checked when replaced and at the end of the session (conftest).

``run_ranks(..., fake_cuda=True)`` runs on workers started with the fake-CUDA shim in
``LD_PRELOAD`` (tests/helpers/fake_cuda: "cuda" tensors on a CPU-only machine, which needs the shim
loaded before torch), a pool of their own keyed by ``(world_size, fake_cuda)``.
"""
from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

DEFAULT_TIMEOUT = float(os.environ.get("MOEPAR_TEST_TIMEOUT", "180"))


def _worker(rank: int, world_size: int, store_dir: str, inbox, outbox, fake_cuda: bool = False) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    if fake_cuda:
        from .fake_cuda import available as _shim_loaded
        if not _shim_loaded():
            outbox.put((rank, False, "fake_cuda: the shim is not loaded in this worker (LD_PRELOAD="
                        f"{os.environ.get('LD_PRELOAD', '')!r})"))
            return

    # Before any process group exists, as a user's script does: moepar's import is what keeps
    # torch.distributed.nn from pinning the world group (tests/parallel/test_teardown.py).
    import moepar

    torch.set_num_threads(1)
    calls = 0
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        # Each call gets its own world, destroyed after it: every gloo group keeps its own
        # threads polling, and a worker that kept every call's groups would take the cores
        # from the tests that follow.
        try:
            store = dist.FileStore(os.path.join(store_dir, f"world{calls}"), world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT))
            del store
        except BaseException:
            outbox.put((rank, False, "init_process_group failed:\n" + traceback.format_exc()))
            return
        calls += 1
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            # The peers may be stuck in a collective: no barrier, the pool is closed.
            outbox.put((rank, False, traceback.format_exc()))
            return
        try:
            moepar.destroy_parallel()
        except BaseException:
            outbox.put((rank, False, "destroy_parallel failed:\n" + traceback.format_exc()))
            return
        outbox.put((rank, True, result))


class RankFailure(AssertionError):
    pass


class _Pool:
    def __init__(self, world_size: int, fake_cuda: bool = False):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tmpdir = tempfile.mkdtemp(prefix="moepar-store-")
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, self.tmpdir, self.inboxes[r], self.outbox,
                                                        fake_cuda),
                                  daemon=True, name=f"moepar-rank{r}") for r in range(world_size)]
        # The shim must be loaded before torch: LD_PRELOAD only while these processes start.
        saved = os.environ.get("LD_PRELOAD")
        if fake_cuda:
            from .fake_cuda import build
            os.environ["LD_PRELOAD"] = build.preload_env()["LD_PRELOAD"]
        try:
            for p in self.procs:
                p.start()
        finally:
            if fake_cuda:
                if saved is None:
                    os.environ.pop("LD_PRELOAD", None)
                else:
                    os.environ["LD_PRELOAD"] = saved

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for box in self.inboxes:
            box.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            # After a failure the other ranks may wait forever in a collective: give them
            # a short grace period, then kill.
            left = deadline - time.monotonic()
            if errors:
                left = min(left, 10.0)
            try:
                # Short waits, so that a rank that died (signal, abort) fails the call at once.
                rank, ok, payload = self.outbox.get(timeout=min(max(left, 0.01), 1.0))
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self.procs)
                        if not p.is_alive() and r not in results and r not in errors}
                if dead or left <= 0:
                    self.close()
                    missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
                    msg = (f"ranks {sorted(dead)} died during {fn.__name__} (exit codes {dead})" if dead else
                           f"ranks {missing} did not finish {fn.__name__} within {timeout:.0f}s (hang?)")
                    raise RankFailure(_format(msg, errors)) from None
                continue
            (results if ok else errors)[rank] = payload
        if errors:
            # A failed call can leave ranks out of step in their collectives: start afresh.
            self.close()
            raise RankFailure(_format(f"{fn.__name__} failed on ranks {sorted(errors)}", errors))
        return [results[r] for r in range(self.world_size)]

    def ask_to_stop(self) -> None:
        for box in self.inboxes:
            try:
                box.put(None)
            except Exception:
                pass

    def close(self, grace: float = 2.0) -> dict[int, int | None]:
        """Stop the workers; returns {rank: exit code} of those that did not exit 0."""
        self.ask_to_stop()
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
        bad = {}
        for r, p in enumerate(self.procs):
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
                bad[r] = None  # never exited by itself
            elif p.exitcode != 0:
                bad[r] = p.exitcode
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        return bad


def _format(headline: str, errors: dict[int, str]) -> str:
    parts = [headline]
    for rank in sorted(errors):
        parts.append(f"--- rank {rank} traceback ---\n{errors[rank]}")
    return "\n".join(parts)


_POOLS: dict[tuple[int, bool], _Pool] = {}
# Abnormal exits of shared pools' workers, reported by check_exits() (conftest, session end).
_ABNORMAL: list[str] = []


def _exit_message(world_size: int, bad: dict[int, int | None]) -> str:
    codes = ", ".join(f"rank {r}: {'killed (never exited)' if c is None else f'exit code {c}'}"
                      for r, c in sorted(bad.items()))
    return f"gloo workers of a {world_size}-rank pool exited abnormally ({codes})"


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, fresh: bool = False,
              fake_cuda: bool = False, **kwargs) -> list[Any]:
    """``[fn(*args, **kwargs) on rank r for r in range(world_size)]`` on gloo workers.

    ``fresh=True``: in new processes that end after the call; fails (RankFailure) when any
    of them does not exit 0 (e.g. an abort in teardown) even though ``fn`` succeeded.
    ``fake_cuda=True``: on workers started with the fake-CUDA shim preloaded (tests/helpers/fake_cuda).
    """
    if fresh:
        pool = _Pool(world_size, fake_cuda)
        try:
            results = pool.run(fn, args, kwargs, timeout)
        finally:
            bad = pool.close(grace=60.0)
        if bad:
            raise RankFailure(_exit_message(world_size, bad))
        return results
    key = (world_size, bool(fake_cuda))
    pool = _POOLS.get(key)
    if pool is None or not pool.alive():
        if pool is not None:
            bad = pool.close()
            if bad:
                _ABNORMAL.append(_exit_message(world_size, bad))
        pool = _POOLS[key] = _Pool(world_size, fake_cuda)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except RankFailure:
        _POOLS.pop(key, None)
        raise


def close_pools() -> list[str]:
    """Stop the shared pools; returns (and clears) the abnormal exits seen so far."""
    for pool in _POOLS.values():   # every pool winds down at once, then each is waited for
        pool.ask_to_stop()
    for (world_size, _), pool in _POOLS.items():
        bad = pool.close(grace=60.0)
        if bad:
            _ABNORMAL.append(_exit_message(world_size, bad))
    _POOLS.clear()
    found = list(_ABNORMAL)
    _ABNORMAL.clear()
    return found


def check_exits() -> None:
    """Close the shared pools and raise RankFailure if any worker exited abnormally."""
    found = close_pools()
    if found:
        raise RankFailure("\n".join(found))


atexit.register(close_pools)

"""Run a function on N gloo ranks from inside pytest.

``run_ranks(fn, world_size, *args)`` calls ``fn(*args)`` on every rank of a world of
``world_size`` processes (gloo, CPU, one thread each) and returns the per-rank results.
Workers are kept between calls (importing torch costs ~2 s a process on the CI's 2 cores),
so ``fn`` must leave no state behind but process groups; moepar's parallel state is reset
after every call. ``fn`` and its arguments must be picklable: define ``fn`` at module level.

A rank that raises fails the call with that rank's traceback; a call that outlives its
``timeout`` (a hang in a collective) kills the workers and fails with the ranks that never
answered, instead of freezing the suite.
"""
from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

DEFAULT_TIMEOUT = float(os.environ.get("MOEPAR_TEST_TIMEOUT", "180"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, inbox, outbox) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT))
    except BaseException:
        outbox.put((rank, False, "init_process_group failed:\n" + traceback.format_exc()))
        return
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
        finally:
            try:
                from moepar.parallel import groups
                groups.reset_parallel_state()
            except ImportError:
                pass
    dist.destroy_process_group()


class RankFailure(AssertionError):
    pass


class _Pool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        port = free_port()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.inboxes[r], self.outbox),
                                  daemon=True, name=f"moepar-rank{r}") for r in range(world_size)]
        for p in self.procs:
            p.start()

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
                rank, ok, payload = self.outbox.get(timeout=max(left, 0.01))
            except queue.Empty:
                self.close()
                missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
                msg = f"ranks {missing} did not finish {fn.__name__} within {timeout:.0f}s (hang?)"
                raise RankFailure(_format(msg, errors)) from None
            (results if ok else errors)[rank] = payload
        if errors:
            # A failed call can leave ranks out of step in their collectives: start afresh.
            self.close()
            raise RankFailure(_format(f"{fn.__name__} failed on ranks {sorted(errors)}", errors))
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for box in self.inboxes:
            try:
                box.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)


def _format(headline: str, errors: dict[int, str]) -> str:
    parts = [headline]
    for rank in sorted(errors):
        parts.append(f"--- rank {rank} traceback ---\n{errors[rank]}")
    return "\n".join(parts)


_POOLS: dict[int, _Pool] = {}


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list[Any]:
    """``[fn(*args, **kwargs) on rank r for r in range(world_size)]`` on gloo workers."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except RankFailure:
        _POOLS.pop(world_size, None)
        raise


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(close_pools)

"""Measure the real collectives on the current backend and fit a hardware profile.

Run on every rank (``torchrun --nproc_per_node=4 -m moepar calibrate --out profile.json``):
for each op, group size n (consecutive ranks, all groups of that size busy at once, as
EP/TP groups are in training) and size S, time the collective through
``moepar.parallel.comm`` (the calls the layer makes). Every (op, n, S) is timed once per
round, rounds repeat (``time_interleaved``), each sample is the mean of back-to-back calls
after a world barrier; the estimate is the median over rounds, averaged over ranks.
Per (op, n) the table of (S, t) is kept as a measured curve, and a latency alpha and
bandwidth (busbw = factor / beta) are fitted by least squares on relative residuals. A
single link (median busbw, median latency per step) is fitted too, to price group sizes
that were not measured.

Point-to-point ("p2p", group size 2): what a pipeline stage boundary moves, one tensor each
way between ranks 2i and 2i + 1 (every pair at once; in 1F1B's steady state a rank sends its
activation while it receives a gradient), as nccl-tests' sendrecv times it and as torch's
pipeline schedules issue it (``dist.batch_isend_irecv`` of ``P2POp``s). Each rank waits for
its own receive, so every rank times the transfer (a send alone can return before its
receiver has the data). The curve prices the model's send/recv rows inside a node.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import statistics
import time
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..parallel import comm
from ..tables import fmt_bytes
from .collectives import OPS, P2P, Hardware, Link, bus_factor
from .profiles import Curve, fit_alpha_beta, machine_description, utc_now

KiB, MiB = 1024, 1024 ** 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def size_sweep(lo: int = 64 * KiB, hi: int = 64 * MiB, factor: float = 2 ** 0.5,
               align: int = 4096) -> list[int]:
    """Sizes lo, lo·factor, ... <= hi (bytes), rounded to ``align``."""
    if lo < 1 or hi < lo or factor <= 1:
        raise ValueError(f"size sweep needs 1 <= min={lo} <= max={hi} and factor={factor} > 1")
    out, s = [], float(lo)
    while s <= hi * (1 + 1e-9):
        out.append(max(align, int(round(s / align)) * align) if s >= align else int(round(s)))
        s *= factor
    return sorted(set(out))


def midpoints(sizes: Sequence[int], align: int = 4096) -> list[int]:
    """Geometric midpoints of consecutive sizes, rounded to ``align`` bytes: fresh sizes for
    validation that calibration never measured."""
    return [max(align, int(round((a * b) ** 0.5 / align)) * align) for a, b in zip(sizes, sizes[1:])]


def launch_hint(command: str) -> str:
    return (f"run it on every rank under torchrun, e.g. `torchrun --nproc_per_node=4 -m moepar "
            f"{command} ...` (gloo on CPU, NCCL on CUDA)")


def ensure_process_group(command: str = "calibrate") -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment if nobody did; (rank, world)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ValueError(f"`{command}` needs torch.distributed with at least 2 ranks: {launch_hint(command)}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def pinned_to_core(enable: bool = True) -> Iterator[None]:
    """On CPU, pin this rank to core ``local_rank % cores`` for the block (then restore).

    With more ranks than cores, which ranks share a core decides how fast a group is, and
    the scheduler decides that anew on every launch: unpinned, the same collective differs
    by tens of percent between two runs. Pinning makes calibrate and validate see the same
    placement (as benchmarks bind GPUs and NUMA nodes)."""
    if not enable or not hasattr(os, "sched_setaffinity") or torch.cuda.is_available():
        yield
        return
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    os.sched_setaffinity(0, {cores[local % len(cores)]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_groups(group_sizes: Sequence[int]) -> dict[int, object]:
    """For each n: split the world into consecutive groups of n (every rank creates every
    group, in the same order) and return this rank's group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for n in group_sizes:
        if n < 2 or world % n:
            raise ValueError(f"group size {n} must be >= 2 and divide the world of {world} ranks; "
                             f"valid: {', '.join(str(d) for d in range(2, world + 1) if world % d == 0)}")
        for start in range(0, world, n):
            g = dist.new_group(list(range(start, start + n)))
            if start <= rank < start + n:
                out[n] = g
    return out


class Buffers:
    """One zero-filled input buffer per rank, sliced for every size: calibration of many
    sizes holds one largest tensor, not one per size. Zeros keep in-place all-reduces
    finite however often they run."""

    def __init__(self, dtype: torch.dtype, dev: torch.device):
        self.dtype, self.device = dtype, dev
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.buf = torch.zeros(0, dtype=dtype, device=dev)
        self.out = torch.zeros(0, dtype=dtype, device=dev)

    def view(self, numel: int) -> torch.Tensor:
        if self.buf.numel() < numel:
            self.buf = torch.zeros(numel, dtype=self.dtype, device=self.device)
        return self.buf[:numel]

    def out_view(self, numel: int) -> torch.Tensor:
        """A second buffer, for what a point-to-point exchange receives."""
        if self.out.numel() < numel:
            self.out = torch.zeros(numel, dtype=self.dtype, device=self.device)
        return self.out[:numel]


def p2p_fn(nbytes: int, bufs: Buffers) -> Callable[[], object]:
    """One tensor of ``nbytes`` each way between ranks 2i and 2i + 1 (module docstring), as a
    pipeline schedule sends a stage's output and receives a gradient (``batch_isend_irecv``)."""
    rank, numel = dist.get_rank(), max(1, nbytes // bufs.elem)
    x, y = bufs.view(numel), bufs.out_view(numel)
    ops = [dist.P2POp(dist.isend, x, rank ^ 1), dist.P2POp(dist.irecv, y, rank ^ 1)]
    if rank % 2:
        ops.reverse()   # the pair posts matching orders

    def fn():
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return fn


def collective_fn(op: str, group, n: int, nbytes: int, bufs: Buffers) -> Callable[[], object]:
    """A closure issuing one ``op`` of ``nbytes`` (nccl-tests size) through moepar's comm
    (``p2p``: a pair's send and receive, ``p2p_fn``)."""
    if op == P2P:
        return p2p_fn(nbytes, bufs)
    numel = max(n, nbytes // bufs.elem // n * n)
    if op == "all_reduce":
        x = bufs.view(numel)
        return lambda: comm.all_reduce_(x, group)
    if op == "all_gather":
        x = bufs.view(numel // n)
        return lambda: comm.all_gather_rows(x, group)
    if op == "reduce_scatter":
        x = bufs.view(numel)
        return lambda: comm.reduce_scatter_rows(x, group)
    if op == "all_to_all":
        x = bufs.view(numel)
        return lambda: comm.all_to_all_rows(x, group, None, None)
    raise ValueError(f"op={op!r} is not a known collective; valid: {', '.join(CALIBRATED_OPS)}")


CALIBRATED_OPS = (*OPS, P2P)   # what calibrate measures by default


def op_group_sizes(op: str, group_sizes: Sequence[int]) -> list[int]:
    """The group sizes an op is measured at: a point-to-point pair is 2 ranks."""
    return [n for n in group_sizes if n == 2] if op == P2P else list(group_sizes)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed_batch(fn: Callable[[], object], calls: int, dev: torch.device) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(dev)
    return (time.perf_counter() - t0) / calls


def time_interleaved(fns: Sequence[Callable[[], object]], repeats: int, warmup: int, dev: torch.device,
                     target: float = 0.05, max_calls: int = 64) -> list[float]:
    """Median seconds per call of each ``fn``, averaged over ranks (collective calls: every
    rank passes the same list). Each repeat is a round over all ``fns``, so load that comes and
    goes (other processes on the machine) spreads over every item instead of spoiling a
    run of neighbouring sizes; each sample is the mean of back-to-back calls lasting about
    ``target`` seconds (as nccl-tests averages its iterations), after a world barrier."""
    for _ in range(warmup):       # whole untimed rounds: the first pass over fresh sizes is slower
        for fn in fns:
            fn()
    first = [_timed_batch(fn, 1, dev) for fn in fns]
    first = slowest(first, dev)   # every rank must choose the same number of calls
    calls = [min(max_calls, max(1, int(target / max(t, 1e-6)))) for t in first]
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            samples[i].append(_timed_batch(fn, calls[i], dev))
    return rank_mean([statistics.median(s) for s in samples], dev)


def time_local(fn: Callable[[], object], repeats: int, warmup: int, dev: torch.device) -> float:
    """This rank's median seconds per call; a world barrier before each timed call."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    return statistics.median(_timed_batch(fn, 1, dev) for _ in range(repeats))


def rank_mean(values: Sequence[float], dev: torch.device) -> list[float]:
    """Element-wise mean over all ranks: the ranks of one collective finish together, up to
    the skew with which they left the barrier; the mean is the steadier estimate."""
    t = torch.tensor(list(values), dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).cpu().tolist()


def slowest(values: Sequence[float], dev: torch.device) -> list[float]:
    """Element-wise maximum over all ranks (every rank passes the same-length list)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def flop_rate(dev: torch.device, n: int = 1024) -> float:
    """Slowest rank's matmul FLOP/s, every rank computing at once (as in training)."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=dev)
    secs = time_local(lambda: a @ a, 3, 1, dev)
    t = torch.tensor([2 * n ** 3 / secs], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def load_average() -> str:
    """The 1/5/15-minute load averages: on a shared machine they explain run-to-run drift."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def memory_per_rank(dev: torch.device) -> float:
    if dev.type == "cuda":
        return float(torch.cuda.get_device_properties(dev).total_memory)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / local


def fit_link(curves: dict[tuple[str, int], Curve], name: str) -> Link:
    """One link for unmeasured group sizes: median busbw, median latency per ring step."""
    coll = [c for c in curves.values() if c.op != P2P]   # the collectives' ring steps
    bws = [c.busbw for c in coll if c.beta > 0]
    lats = [c.alpha / ((2 if c.op == "all_reduce" else 1) * (c.group_size - 1)) for c in coll]
    return Link(name, statistics.median(bws) if bws else 1e9, statistics.median(lats) if lats else 0.0,
                "fitted by `python -m moepar calibrate`")


def calibrate(sizes: Sequence[int] | None = None, group_sizes: Sequence[int] | None = None,
              ops: Sequence[str] = CALIBRATED_OPS, repeats: int = 5, warmup: int = 1, dtype: str = "fp32",
              log: Callable[[str], None] | None = None) -> Hardware:
    """Measure and fit on every rank; every rank returns the same ``Hardware``."""
    rank, world = ensure_process_group()
    if world < 2:
        raise ValueError(f"calibrate needs at least 2 ranks, the world has {world}: {launch_hint('calibrate')}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; valid: {', '.join(DTYPES)}")
    for op in ops:
        if op not in CALIBRATED_OPS:
            raise ValueError(f"op={op!r} is not a known collective; valid: {', '.join(CALIBRATED_OPS)}")
    sizes = sorted(set(sizes or size_sweep()))
    group_sizes = list(group_sizes or [n for n in (2, 4, 8) if n <= world and world % n == 0])
    dev, tdtype = device(), DTYPES[dtype]
    groups = make_groups(group_sizes)
    bufs = Buffers(tdtype, dev)
    t_start = time.perf_counter()
    keys = [(op, n, s) for op in ops for n in op_group_sizes(op, group_sizes) for s in sizes]
    secs = time_interleaved([collective_fn(op, groups[n], n, s, bufs) for op, n, s in keys],
                            repeats, warmup, dev)
    table = dict(zip(keys, secs))
    curves: dict[tuple[str, int], Curve] = {}
    for op in ops:
        for n in op_group_sizes(op, group_sizes):
            ts = [table[(op, n, s)] for s in sizes]
            alpha, beta = fit_alpha_beta(sizes, ts)
            c = curves[(op, n)] = Curve(op, n, tuple(sizes), tuple(ts), alpha, beta)
            if log and rank == 0:
                log(f"{op:>14} n={n}: alpha {alpha * 1e6:8.1f} us, busbw {c.busbw / 1e9:7.3f} GB/s "
                    f"({len(sizes)} sizes)")
    rate = flop_rate(dev)
    row_passes = calibrate_row_passes([s for s in sizes if s <= 16 * MiB][::2] or sizes[:1], repeats, warmup,
                                      tdtype, dev)
    if log and rank == 0:
        log(f"local row passes (permute, regroup and back, unpermute): {row_passes['latency'] * 1e6:.1f} us + "
            f"{row_passes['bytes_per_s'] / 1e9:.3g} GB/s of routed rows")
    backend = dist.get_backend()
    link = fit_link(curves, f"{backend} measured")
    gpn = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    meta = {"backend": backend, "world_size": world, "dtype": dtype, "date": utc_now(),
            "load_average": load_average(),
            "machine": machine_description(), "torch": torch.__version__, "repeats": repeats,
            "group_sizes": group_sizes, "sizes": sizes, "seconds": round(time.perf_counter() - t_start, 1),
            "row_passes": row_passes,
            "note": ("measured on one node: the inter-node link is set equal to the intra-node one"
                     if gpn >= world else "groups larger than a node were measured but only "
                     "single-node curves price collectives; the link fit mixes both")}
    return Hardware(f"{backend}-{world}ranks", f"calibrated {backend}, {world} ranks on {meta['machine']}",
                    link, link, gpn, rate, memory_per_rank(dev), 0.0,
                    (f"measured {meta['date']} by `python -m moepar calibrate`",), curves, meta)


ROW_PASS_D, ROW_PASS_K, ROW_PASS_E = 256, 2, 4


def row_pass_fn(nbytes: int, dtype: torch.dtype, dev: torch.device) -> Callable[[], object]:
    """The dispatcher's local passes over ``nbytes`` of routed rows (N = T·K rows of D), as a
    dispatch + combine with L = 2 local experts per rank runs them, without communication:
    the expert-major permute (gather), the regroup of the received (source, local expert)
    blocks to expert-major (``exchange.regroup_index`` and a gather), its inverse after the
    experts, and the weighted unpermute (scatter-combine); uniform random top-K routing."""
    from moepar_kernels.permute import permute, unpermute

    from ..moe.exchange.rows import regroup_index
    elem = torch.empty((), dtype=dtype).element_size()
    T = max(1, nbytes // (ROW_PASS_K * ROW_PASS_D * elem))
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, ROW_PASS_D, generator=gen).to(dtype=dtype, device=dev)
    ids = torch.rand(T, ROW_PASS_E, generator=gen).argsort(-1)[:, :ROW_PASS_K].to(dev)
    w = torch.full((T, ROW_PASS_K), 1.0 / ROW_PASS_K, device=dev)
    # The permuted rows stand for the received ones: 2 senders x 2 local experts.
    counts_SL = torch.bincount(ids.reshape(-1), minlength=ROW_PASS_E).view(2, ROW_PASS_E // 2)

    def fn():
        x_ND, _, row_map = permute(x, ids, None, ROW_PASS_E)
        idx, inv = regroup_index(counts_SL, x_ND.shape[0])
        y_ND = x_ND.index_select(0, idx).index_select(0, inv)
        return unpermute(y_ND, row_map, w, T)
    return fn


def calibrate_row_passes(sizes: Sequence[int], repeats: int, warmup: int, dtype: torch.dtype,
                         dev: torch.device) -> dict:
    """Seconds of the local passes of one dispatch + combine (``row_pass_fn``) against the
    rows' bytes, every rank at once (as in a dispatch); a line ``latency + bytes /
    bytes_per_s`` fitted as the collectives are."""
    secs = time_interleaved([row_pass_fn(s, dtype, dev) for s in sizes], repeats, warmup, dev)
    alpha, beta = fit_alpha_beta(sizes, secs)
    return {"what": "moepar_kernels permute, regroup (2 senders x 2 local experts) and back, weighted "
                    "unpermute of N = T·K rows (K=2), all ranks at once",
            "latency": alpha, "bytes_per_s": 1.0 / beta if beta > 0 else float("inf"),
            "sizes": list(sizes), "seconds": secs}


def row_pass_seconds(hw: Hardware, nbytes: float) -> float:
    """The calibrated time of the local passes (permute + unpermute) over ``nbytes`` of
    routed rows; 0 for a profile without the measurement (presets, older profiles)."""
    rp = hw.meta.get("row_passes")
    if not rp or nbytes <= 0:
        return 0.0
    return float(rp["latency"]) + nbytes / float(rp["bytes_per_s"])


def bus_bandwidth_table(hw: Hardware) -> list[dict]:
    """Rows of the fitted curves for printing: op, n, alpha, busbw, and the largest size's busbw."""
    rows = []
    for (op, n), c in sorted(hw.curves.items()):
        big, t = c.sizes[-1], c.seconds[-1]
        rows.append({"op": op, "n": n, "alpha us": c.alpha * 1e6, "fit busbw GB/s": c.busbw / 1e9,
                     "largest size": fmt_bytes(big), "busbw there GB/s": big * bus_factor(op, n) / t / 1e9})
    return rows

"""Count how many 4-rank torchrun MoE jobs exit 0 (a finished job must exit cleanly).

    python scripts/exit_soak.py --runs 100                      # every layout, both variants
    python scripts/exit_soak.py --runs 20 --layouts 1x2 --variants plain

Each run is ``torchrun --standalone --nproc_per_node 4`` of this same file in ``--job`` mode:
a user's script that imports moepar, joins a gloo world, runs one MoE forward and backward
at the given tp x ep layout, reduces the gradients, prints its result and ends, either with
``moepar.destroy_parallel()`` ("destroy") or with only ``torch.distributed.destroy_process_group()``
("plain", what a user writes without knowing moepar's teardown). "late" is "plain" in a
script that imports ``torch.distributed.nn`` after ``init_process_group`` (as ``torch._dynamo``
does at a first ``torch.compile``), the import that pins the world group; "bare"
is that script without the MoE step: the late import, ``init_parallel``, one all-reduce. A run counts as clean when
torchrun exits 0; the script prints, per layout and variant, the clean count and the exit
codes and first abort line of the others.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def job(tp: int, ep: int, variant: str) -> None:
    """The user's script (one rank of the torchrun job)."""
    import torch
    import torch.distributed as dist

    import moepar

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if variant in ("late", "bare"):
        import torch.distributed.nn  # noqa: F401  (binds group.WORLD as default arguments)
    state = moepar.init_parallel(tp, ep, verbose=False)
    if variant == "bare":
        t = torch.ones(4)
        dist.all_reduce(t)
        if dist.get_rank() == 0:
            print(f"loss {float(t[0]):.6f}", flush=True)
        dist.destroy_process_group()
        return
    inp = moepar.ColumnParallelLinear(16, 16, gather_output=True, init_seed=1, state=state)
    moe = moepar.MoE(16, 4, ep, k=2, ffn_hidden=32, state=state, init_seed=2)
    torch.manual_seed(state.dp_rank)
    x = torch.randn(6, 16)
    loss = moe(inp(x)).square().mean() + moepar.aux_loss(moe)
    loss.backward()
    moepar.allreduce_gradients(moe, state)
    moepar.allreduce_gradients(inp, state)
    if dist.get_rank() == 0:
        print(f"loss {float(loss):.6f}", flush=True)
    if variant == "destroy":
        moepar.destroy_parallel()
    else:
        dist.destroy_process_group()


def run_once(tp: int, ep: int, variant: str, timeout: float) -> tuple[int, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           os.path.abspath(__file__), "--job", f"{tp}x{ep}", "--variant", variant]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "timeout"
    text = p.stdout + p.stderr
    first = next((line for line in text.splitlines() if "terminate called" in line or "Signal" in line
                  or "exitcode" in line), "")
    if p.returncode == 0 and "loss " not in p.stdout:
        return 1, "exit 0 but no result printed"
    return p.returncode, first.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100, help="runs per layout and variant")
    ap.add_argument("--layouts", default="1x2,1x4,2x2", help="comma-separated TPxEP at 4 ranks")
    ap.add_argument("--variants", default="destroy,plain",
                    help="comma-separated: destroy (destroy_parallel), plain, late, bare (see above)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="destroy", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        tp, ep = (int(v) for v in args.job.split("x"))
        job(tp, ep, args.variant)
        return 0
    layouts = [tuple(int(v) for v in s.split("x")) for s in args.layouts.split(",")]
    variants = args.variants.split(",")
    for v in variants:
        if v not in ("destroy", "plain", "late", "bare"):
            raise SystemExit(f"error: variant {v!r} must be 'destroy', 'plain', 'late' or 'bare'")
    for tp, ep in layouts:
        for variant in variants:
            clean, bad, t0 = 0, [], time.time()
            for i in range(args.runs):
                rc, why = run_once(tp, ep, variant, args.timeout)
                if rc == 0:
                    clean += 1
                else:
                    bad.append((i, rc, why))
                    print(f"  tp{tp}·ep{ep} {variant} run {i}: exit {rc}: {why}", flush=True)
            print(f"tp{tp}·ep{ep} {variant}: {clean}/{args.runs} exit 0 ({time.time() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Random sweep: the distributed MoE layer against the single-process layer.

``python -m tests.sweep [--seconds 600] [--seed 0] [--world 4]`` (from the repository root)
draws layouts (tp, ep, etp), token-exchange forms (tests/test_moe_distributed.py's
``_PATHS``), router and expert options, capacities, token counts (5, 0, 3, 7 per replica or
6 each), dtypes (fp32, float64, bf16), hidden sizes and sequence parallelism, runs each case
on ``--world`` gloo processes, and compares outputs, input gradients, every weight gradient
and the dropped-route counts with the single-process layer on the same replicas. It prints
each failing case with its error and ends with the counts; exit status 1 if any failed.

Tolerances: fp32 2e-5; float64 1e-6 (the router and the dedup side message compute in fp32
by design); bf16 loose (5e-2 relative on outputs). Not drawn, since the reference would
differ by design: capacity with sequence parallelism (capacity is per TP rank's slice, as in
Megatron-Core), ``aux_loss_scope="global"``, and an explicit ``gemm_path="grouped_mm"`` off
fp32 or with expert TP (it refuses float64 and rows under 16 bytes, with a clear error). Run it after changing the
dispatcher, the router or the layouts; 2026-12-01 sweeps found two bugs (padded capacity
with a rank of no tokens; shared experts under SP with unequal slices).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
import traceback

import torch

from .multiproc import run_ranks
from .test_moe_distributed import _PATHS, _compare_dispatch_path

LAYOUTS = [(1, 2, 1), (1, 4, 1), (2, 2, 1), (2, 2, 2), (1, 2, 2), (2, 1, 1), (1, 1, 1)]


def draw(rng: random.Random) -> dict:
    """One random case."""
    tp, ep, etp = rng.choice(LAYOUTS)
    E = rng.choice([e for e in (4, 8, 16) if e % ep == 0])
    k = rng.choice([1, 2, 3, 4])
    mode = rng.choice(list(_PATHS))
    if mode == "dedup":
        k = max(k, 2)
    dtype = rng.choice(["float32", "float32", "float64", "bfloat16"])
    # grouped_mm refuses float64 and rows narrower than 16 bytes (the layer says so): fp32, no expert TP
    grouped = ["grouped_mm"] if etp == 1 and dtype == "float32" else []
    score = rng.choice(["softmax", "softmax_after_topk", "sigmoid"]) if k > 1 else rng.choice(["softmax", "sigmoid"])
    layer = dict(k=k, num_experts=E, score_func=score, num_shared_experts=rng.choice([0, 1]),
                 activation=rng.choice(["gelu", "swiglu", "relu"]), bias=rng.choice([False, True]),
                 normalize_weights=rng.choice([None, True, False]), scaling_factor=rng.choice([1.0, 2.5]),
                 expert_bias=rng.choice([False, True]), checkpoint_experts=rng.choice([False, True]),
                 gemm_path=rng.choice(["auto", "loop", "bmm"] + grouped),
                 aux_loss=rng.choice([None, "switch"]), z_loss_coeff=rng.choice([0.0, 1e-3]))
    if E >= 8 and rng.random() < 0.3:
        layer.update(num_groups=4, topk_groups=2)
    sp = tp > 1 and rng.random() < 0.3
    if not sp and rng.random() < 0.4:
        layer.update(capacity_factor=rng.choice([0.5, 1.0, 2.0]), min_capacity=rng.choice([0, 1, 2]),
                     pad_to_capacity=rng.choice([False, True]), drop_policy=rng.choice(["probs", "position"]))
    return dict(layout=(tp, ep, etp), mode=mode, layer=layer, uneven=rng.choice([False, True]), sp=sp,
                dtype=dtype, hidden=rng.choice([8, 24]))


def run_case(case: dict) -> list[dict]:
    """On every rank: ``_compare``'s results for the case, the exchange forced into its form."""
    tp, ep, etp = case["layout"]
    out = _compare_dispatch_path(case["mode"], tp, ep, etp, [case["layer"]], case["uneven"], None, True,
                                 getattr(torch, case["dtype"]), case["hidden"], case["sp"])
    return out[-1]


def check(case: dict, per_rank: list) -> None:
    """Raises AssertionError naming the rank and the figures where a tolerance is missed."""
    for rank, (r,) in enumerate(per_rank):
        dy, dx, dg, n = r["y"], r["dx"], max(r["grads"].values(), default=0.0), r["tokens"]
        if case["dtype"] == "bfloat16":
            ok = dy <= 0.05 * max(1.0, r["y_scale"]) and dx <= 0.1 and dg <= 0.25
        else:
            tol = 2e-5 if case["dtype"] == "float32" else 1e-6
            ok = dy <= tol and dx <= tol and dg <= tol
        assert ok, f"rank {rank} ({n} tokens): max |dy| {dy:.3g}, |dx| {dx:.3g}, |d grad| {dg:.3g}"
        assert r["weights"] == 0.0, f"rank {rank}: the layers' weights differ"
        assert r["ref_dropped"] is None or r["dropped"] == r["ref_dropped"], \
            f"rank {rank}: dropped {r['dropped']} vs {r['ref_dropped']}"


def sweep(seconds: float, seed: int, world: int, cases: int | None = None, out=sys.stdout) -> tuple[int, int]:
    rng = random.Random(seed)
    ok = bad = 0
    t_end = time.time() + seconds
    while time.time() < t_end and (cases is None or ok + bad < cases):
        case = draw(rng)
        tp, ep, etp = case["layout"]
        if world % tp or world % (ep * etp):   # not a layout of this world
            continue
        try:
            check(case, run_ranks(run_case, world, case))
            ok += 1
        except Exception as e:   # report the case and go on
            bad += 1
            print("FAIL", case, "".join(traceback.format_exception_only(type(e), e))[-1500:], file=out, flush=True)
    print(f"sweep: {ok} cases passed, {bad} failed (seed {seed}, world {world})", file=out, flush=True)
    return ok, bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    args = p.parse_args(argv)
    _, bad = sweep(args.seconds, args.seed, args.world, args.cases)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

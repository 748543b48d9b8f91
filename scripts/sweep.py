"""Random sweep: the distributed MoE layer against the single-process layer.

``python scripts/sweep.py [--seconds 600] [--seed 0] [--world 4] [--cases N]`` (from the
repository root) draws cases (tests/helpers/sweep_cases.py: layouts (tp, ep, etp), the token
exchange form each must take, router and expert options, capacities, the receive guard,
nonzero expert biases, token counts 5, 0, 3, 7 per replica or 6 each, fp32, float64 and
bf16, hidden sizes, sequence parallelism), runs each on ``--world`` gloo processes, and
checks that the exchange took the drawn form and that outputs, input gradients, every
weight gradient and the dropped-route counts match the single-process layer on the same
replicas within tests/helpers/tolerances.py's tolerance of the case's dtype. It prints each failing
case with its error and ends with the counts; exit status 1 if any failed. Run it after
changing the dispatcher, the router or the layouts; 2026-12-01 sweeps found two bugs
(padded capacity with a rank of no tokens; shared experts under SP with unequal slices).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback

# The cases and the comparison are the tests' helpers (package ``tests``): run from anywhere,
# import them from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.multiproc import run_ranks  # noqa: E402
from tests.helpers.sweep_cases import check, draw, run_case  # noqa: E402


def sweep(seconds: float, seed: int, world: int, cases: int | None = None, out=sys.stdout) -> tuple[int, int]:
    """Run random cases for ``seconds`` (or ``cases`` of them); (passed, failed)."""
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
    p = argparse.ArgumentParser(prog="python scripts/sweep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    args = p.parse_args(argv)
    _, bad = sweep(args.seconds, args.seed, args.world, args.cases)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

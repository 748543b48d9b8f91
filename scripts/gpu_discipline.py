"""What the MoE layer's forward and backward would pay on a GPU, measured on the CPU.

Runs ``moepar.MoE`` layers (hidden 8, ffn 12, fp32, 4 experts, top-2, 6 tokens a rank,
built by tests/helpers/moe_ref.py; ``--dtype bfloat16 --ffn 16`` reaches the grouped_mm path an
sm90 GPU takes) on gloo processes started with the fake-CUDA shim (tests/helpers/fake_cuda): the
input and the parameters are "cuda" tensors holding CPU data, collectives behave like
NCCL's. For each layout it prints a markdown table: host reads (each one drains the CUDA
stream) and blocking host->device copies per forward and per backward, the rank groups of
the forward's collectives (flagged when one spans the whole world while the layer's own
TP x EP x ETP block is smaller), and whether a strict run (which fails where a GPU would:
a CPU tensor handed to NCCL, a CPU tensor next to CUDA ones) gets through. Counts are the
maximum over ranks ("a-b" where ranks differ); "(async)" marks a collective issued with
async_op=True. Then each counted event of rank 0, with its line.

    TRITON_INTERPRET=1 .venv/bin/python scripts/gpu_discipline.py [--out table.md]
    # another checkout's moepar (e.g. a worktree of an older commit), this repo's tests/:
    TRITON_INTERPRET=1 .venv/bin/python scripts/gpu_discipline.py --moepar-path ../wt/path

``--moepar-path DIR``: a directory holding ``moepar`` and ``moepar_kernels`` (put first on
sys.path in this process and in the workers); the instrument (tests/helpers/fake_cuda) and the
layer builder (tests/helpers/moe_ref.py) always come from this repository. The workers are
spawned by tests.helpers.multiproc.run_ranks(fake_cuda=True), so the script is run directly (not
under torchrun); it needs g++ and torch's headers to compile the shim once (cached).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, world size, tp, ep, etp, layer options)
CASES = [
    ("ep2", 2, 1, 2, 1, {}),
    ("tp2", 2, 2, 1, 1, {}),
    ("ep2 + shared experts", 2, 1, 2, 1, {"num_shared_experts": 1}),
    ("ep2 padded (capacity 2.0)", 2, 1, 2, 1, {"capacity_factor": 2.0, "pad_to_capacity": True}),
    ("ep2 dedup=on", 2, 1, 2, 1, {"dedup": "on"}),
    ("ep1 tp1 (world of one)", 1, 1, 1, 1, {}),
    ("ep1 tp1 capacity 1.0 (drops)", 1, 1, 1, 1, {"capacity_factor": 1.0}),
    ("ep2 capacity 1.0 (drops)", 2, 1, 2, 1, {"capacity_factor": 1.0}),
    ("tp2·ep2", 4, 2, 2, 1, {}),
    ("tp2·ep2 sequence parallel", 4, 2, 2, 1, {"sequence_parallel": True}),
    ("ep4", 4, 1, 4, 1, {}),
    ("ep2·etp2", 4, 1, 2, 2, {}),
    ("tp2·ep2 + shared experts", 4, 2, 2, 1, {"num_shared_experts": 1}),
    ("ep2, 2 redundant experts", 2, 1, 2, 1, {"redundant_experts": 2}),
    ("ep4, 4 redundant experts (E 8)", 4, 1, 4, 1, {"redundant_experts": 4, "num_experts": 8}),
]
GRAD_CASES = [("grad_norm", "tp2·ep2"), ("clip_grad_norm_", "tp2·ep2")]
TOKENS = 6


def _setup_path(moepar_path: str | None) -> None:
    for p in (ROOT, moepar_path):
        if p and p in sys.path:
            sys.path.remove(p)
    sys.path.insert(0, ROOT)
    if moepar_path:
        sys.path.insert(0, os.path.abspath(moepar_path))


def _block(world: int, group_lists: list[list[int]], rank: int = 0) -> set[int]:
    """Ranks that share ``rank``'s layer work: the connected component of ``rank`` over every
    rank's TP, EP and ETP groups (as moepar's ParallelState made them; its TP x EP x ETP
    block)."""
    parent = list(range(world))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a
    for ranks in group_lists:
        for r in ranks[1:]:
            parent[find(r)] = find(ranks[0])
    return {r for r in range(world) if find(r) == find(rank)}


def _layer_groups(state) -> list[list[int]]:
    import torch.distributed as dist
    out = []
    for kind in ("tp", "ep", "etp"):
        g = state.group(kind)
        out.append(sorted(dist.get_process_group_ranks(g)) if g is not None else [state.rank])
    return out


def _run_layer(rec, state, moe, x, g, grad_op, fake_cuda):
    """Forward (with the aux loss, as training adds it) and backward under ``rec``'s phases."""
    import moepar
    moe = fake_cuda.to_cuda(moe)
    xc, gc = fake_cuda.to_cuda(x).requires_grad_(), fake_cuda.to_cuda(g)
    with rec.phase("forward"):
        y = moe(xc)
        loss = (y * gc).sum() + moepar.aux_loss(moe)
    with rec.phase("backward"):
        loss.backward()
    if grad_op:
        from moepar import parallel
        with rec.phase(grad_op):
            if grad_op == "grad_norm":
                parallel.grad_norm(moe, state)
            else:
                parallel.clip_grad_norm_(moe, 1e-3, state)
    return y, xc


def case_worker(moepar_path, tp, ep, etp, options, strict, grad_op=None, dtype="float32", ffn=12):
    """On every rank: build the layer, run it under the instrument, return what it saw."""
    _setup_path(moepar_path)
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)   # torch's deprecation notes, per call
    import moepar
    from tests.helpers import fake_cuda, moe_ref
    state = moepar.init_parallel(tp, ep, etp, verbose=False)
    import torch
    kw = dict(options, ffn_hidden=ffn)
    if dtype != "float32":
        kw["dtype"] = getattr(torch, dtype)
    sp = kw.get("sequence_parallel", False)
    moe = moe_ref.build(state, **kw)
    x, g = moe_ref.replica_input(state.dp_rank, TOKENS, dtype=getattr(torch, dtype))
    if sp and state.tp_size > 1:
        per = [TOKENS // state.tp_size + (i < TOKENS % state.tp_size) for i in range(state.tp_size)]
        lo = sum(per[:state.tp_rank])
        x, g = x[lo:lo + per[state.tp_rank]].clone(), g[lo:lo + per[state.tp_rank]].clone()
    out = {"moepar": moepar.__file__, "rank": state.rank, "crash": None, "groups": _layer_groups(state)}
    try:
        with fake_cuda.session(strict=strict) as rec:
            y, xc = _run_layer(rec, state, moe, x, g, grad_op, fake_cuda)
    except RuntimeError as e:
        if not strict:
            raise
        out["crash"] = str(e).replace("fake_cuda: ", "").splitlines()[0]
        return out
    if not strict and not grad_op:
        # The same layer on the CPU: the instrument must not change the numbers.
        ref = moe_ref.build(state, **kw)
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        ((yr * g).sum() + moepar.aux_loss(ref)).backward()
        y_cpu, dx_cpu = fake_cuda.to_cpu(y).detach(), fake_cuda.to_cpu(xc.grad)
        out["max_diff"] = max(float((y_cpu - yr.detach()).abs().max()) if yr.numel() else 0.0,
                              float((dx_cpu - xr.grad).abs().max()) if xr.numel() else 0.0)
    out["summary"] = rec.summary()
    out["events"] = [(e.category, e.kind, e.op, e.phase, e.where) for e in rec.events]
    out["collectives"] = [(c.op, c.ranks, c.nbytes, c.phase, c.async_op, c.stack[0] if c.stack else "")
                          for c in rec.collectives()]
    out["violations"] = list(rec.violations)
    out["launches"] = rec.launches()
    return out


def _spread(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(hi) if lo == hi else f"{hi} ({lo}-{hi})"


def _violations(per_rank) -> str:
    return _spread([len(r["violations"]) for r in per_rank])


def _count(per_rank, phase, key) -> str:
    return _spread([r["summary"].get(phase, {}).get(key, 0) for r in per_rank])


def _run_case(run_ranks, RankFailure, moepar_path, world, tp, ep, etp, options, grad_op, timeout, dtype, ffn):
    counted = run_ranks(case_worker, world, moepar_path, tp, ep, etp, options, False, grad_op, dtype, ffn,
                        fake_cuda=True, timeout=timeout)
    try:
        strict = run_ranks(case_worker, world, moepar_path, tp, ep, etp, options, True, grad_op, dtype, ffn,
                           fake_cuda=True, timeout=timeout)
        crashes = sorted({r["crash"] for r in strict if r["crash"]})
        verdict = "runs" if not crashes else "crash: " + crashes[0]
    except RankFailure as e:
        verdict = f"crash (ranks stopped at different points, hang): {str(e).splitlines()[0]}"
    return counted, verdict


def _groups_text(per_rank, phase, world, block_size) -> tuple[str, list[str]]:
    seen: dict[tuple, None] = {}
    flags = []
    for r in per_rank:
        for op, ranks, _nb, ph, is_async, where in r["collectives"]:
            if ph != phase:
                continue
            seen.setdefault((op + (" (async)" if is_async else ""), tuple(ranks)), None)
            if len(ranks) == world and block_size < world:
                flags.append(f"{op} over the whole world {list(ranks)} (block {block_size}) at {where}")
    text = "; ".join(f"{op} {list(ranks)}" for op, ranks in seen) or "none"
    return text, sorted(set(flags))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moepar-path", help="directory holding moepar and moepar_kernels to measure "
                    "(default: the installed / this checkout's)")
    ap.add_argument("--out", help="also write the markdown to this file")
    ap.add_argument("--cases", help="comma-separated substrings: run only the matching cases")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the layer's and the input's dtype (bfloat16 reaches the grouped_mm path on sm90)")
    ap.add_argument("--ffn", type=int, default=12, help="ffn_hidden (16 makes bf16 rows 16-byte aligned)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per call before a hang is declared")
    args = ap.parse_args(argv)
    if os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Each torchrun process would start its own worker pools: one process is the launcher.
        ap.error("run this script directly (it starts its own gloo workers with the shim), not under torchrun")
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any worker imports triton
    _setup_path(args.moepar_path)
    if args.moepar_path:   # the workers are spawned with this environment
        os.environ["PYTHONPATH"] = os.pathsep.join([os.path.abspath(args.moepar_path), ROOT] + [
            p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    from tests.helpers.multiproc import RankFailure, close_pools, run_ranks

    wanted = [s.strip() for s in args.cases.split(",")] if args.cases else None
    rows, details = [], []
    t0 = time.time()
    jobs = [(name, world, tp, ep, etp, opts, None) for name, world, tp, ep, etp, opts in CASES]
    jobs += [(f"{base} {op}", 4, 2, 2, 1, {}, op) for op, base in GRAD_CASES]
    moepar_file = None
    for name, world, tp, ep, etp, opts, grad_op in jobs:
        if wanted and not any(w in name for w in wanted):
            continue
        per_rank, verdict = _run_case(run_ranks, RankFailure, args.moepar_path, world, tp, ep, etp, opts,
                                      grad_op, args.timeout, args.dtype, args.ffn)
        moepar_file = per_rank[0]["moepar"]
        block = len(_block(world, [g for r in per_rank for g in r["groups"]]))
        if grad_op:
            groups, flags = _groups_text(per_rank, grad_op, world, block)
            rows.append(f"| {name} | {world} | {block} | {_count(per_rank, grad_op, 'host_reads')} | - "
                        f"| {_count(per_rank, grad_op, 'blocking_h2d')} | - | "
                        f"{_count(per_rank, grad_op, 'async_h2d')}/{_count(per_rank, grad_op, 'async_d2h')} "
                        f"| {_violations(per_rank)} | {verdict} | {groups} | {'; '.join(flags) or '-'} | - |")
        else:
            groups, flags = _groups_text(per_rank, "forward", world, block)
            diff = max(r.get("max_diff", 0.0) for r in per_rank)
            rows.append(f"| {name} | {world} | {block} | {_count(per_rank, 'forward', 'host_reads')} "
                        f"| {_count(per_rank, 'backward', 'host_reads')} "
                        f"| {_count(per_rank, 'forward', 'blocking_h2d')} "
                        f"| {_count(per_rank, 'backward', 'blocking_h2d')} "
                        f"| {_count(per_rank, 'all', 'async_h2d')}/{_count(per_rank, 'all', 'async_d2h')} "
                        f"| {_violations(per_rank)} | {verdict} | {groups} | {'; '.join(flags) or '-'} | {diff:.1e} |")
        lines = [f"**{name}** (rank 0 of {world}; violations in the counting run: "
                 f"{len(per_rank[0]['violations'])})"]
        for cat, kind, op, phase, where in per_rank[0]["events"]:
            if grad_op and phase != grad_op:
                continue
            lines.append(f"- {phase}: {cat} {kind} ({op}) at {where}")
        for v in per_rank[0]["violations"]:
            lines.append(f"- violation: {v}")
        details.append("\n".join(lines))
        print(f"[{time.time() - t0:6.1f}s] {name}: {verdict}", file=sys.stderr, flush=True)
    close_pools()
    header = (f"moepar: {moepar_file}; hidden 8, ffn {args.ffn}, {args.dtype}, 4 experts, k=2, {TOKENS} tokens "
              f"a rank; fake CUDA (an sm90 device) "
              f"(tests/helpers/fake_cuda); counts are the max over ranks (min-max where they differ); forward includes "
              f"the aux loss; grad rows count only the grad_norm / clip_grad_norm_ call after a backward; "
              f"'max abs diff vs CPU': the fake-CUDA run (Triton kernels) vs the same layer on the CPU.\n\n"
              "| case | world | layer block | host reads fwd | host reads bwd | blocking H2D fwd "
              "| blocking H2D bwd | async H2D/D2H | GPU errors (lenient run) | strict run "
              "| forward collectives (op [ranks]) | world-wide collectives | max abs diff vs CPU |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    text = header + "\n" + "\n".join(rows) + "\n\n### Events\n\n" + "\n\n".join(details) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m moepar bench local``: the local expert path (permute -> GroupedExperts ->
unpermute, forward + backward, every gradient) against the floor, the fastest available
implementation of the expert GEMMs and activation alone on the same already-permuted rows.

Legend (docs/moe.md): T tokens, D hidden, F ffn hidden (``ffn`` in code, beside torch's F), E
experts, K top-k, N = T*K rows of the permuted buffer (one per route: no drops).

Floor candidates (forward + backward, grads to the rows and the weights): GroupedExperts'
own Function on each GEMM path, and two plain-autograd implementations (a per-expert
``x_e @ w1_e -> act -> @ w2_e`` loop concatenated with ``torch.cat``, as a per-expert
``nn.Linear`` MoE does, and differentiable ``F.grouped_mm``). The local path adds the
permutation, the weighted combine and their backward, including the routing-weight grad.
Every candidate runs once per round, rounds interleaved, medians reported: the machine is
shared and noisy, ratios measured in one process are the figure of merit.

``--device cuda`` adds the bandwidth check of the Triton permute/unpermute (bf16,
T=65536, D=4096, K=8 by default) against a device-to-device copy of the same bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

from moepar.tables import format_table
from moepar.bench.common import matmul_gflops, median, sync
from moepar.moe.experts.grouped import GroupedExperts
from moepar_kernels.permute import permute, unpermute

# name -> (T, D, F, E, K, ratio limit on the 2-core CPU in fp32)
CONFIGS = {
    "A": (4096, 512, 2048, 8, 2, 1.10),
    "B": (4096, 256, 256, 64, 8, 1.30),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def random_routes(T: int, E: int, K: int, device, seed: int = 0):
    """K distinct experts per token, uniformly at random; softmax-normalised fp32 weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    w = torch.softmax(torch.randn(T, K, generator=gen), dim=-1)
    return ids.to(device), w.to(device)


def expert_flops(N: int, D: int, ffn: int, activation: str) -> float:
    """Forward + backward GEMM flops: 3 x (2 or 3 GEMMs of 2*N*D*F)."""
    gemms = 3 if activation == "swiglu" else 2
    return 3.0 * gemms * 2.0 * N * D * ffn


def _act(h1, h3, activation):
    if activation == "swiglu":
        return F.silu(h1) * h3
    return F.gelu(h1) if activation == "gelu" else F.relu(h1)


def autograd_loop(x_ND, counts, m: GroupedExperts):
    """Plain autograd, one small graph per expert, outputs concatenated (a per-expert
    nn.Linear MoE's structure)."""
    outs, s = [], 0
    for e, c in enumerate(counts):
        xe = x_ND[s:s + c]
        s += c
        h3 = xe @ m.w3[e] if m.w3 is not None else None
        outs.append(_act(xe @ m.w1[e], h3, m.activation) @ m.w2[e])
    return torch.cat(outs)


def autograd_grouped_mm(x_ND, offs, m: GroupedExperts):
    h3 = F.grouped_mm(x_ND, m.w3, offs=offs) if m.w3 is not None else None
    return F.grouped_mm(_act(F.grouped_mm(x_ND, m.w1, offs=offs), h3, m.activation), m.w2, offs=offs)


def timed_rounds(fns: dict, rounds: int, warmup: int, device, clock: str = "wall"
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """(median seconds, median minor page faults) per candidate; candidates interleaved within each round. ``clock``
    "cpu" counts this process's CPU seconds (all threads, user + system) instead of wall
    time: steadier on a machine shared with other jobs, where wall time mostly measures
    the scheduler (it equals threads x wall on an idle machine with busy threads). The
    order of the candidates is reversed every other round."""
    now = time.perf_counter if clock == "wall" else time.process_time
    times: dict[str, list[float]] = {k: [] for k in fns}
    faults: dict[str, list[int]] = {k: [] for k in fns}
    order = list(fns.items())
    for r in range(warmup + rounds):
        # Every other round in reverse order, so that no candidate always follows the same one
        # (the one before leaves its heap, caches and frequency state behind).
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            sync(device)
            f0 = _minor_faults()
            t0 = now()
            fn()
            sync(device)
            if r >= warmup:
                times[name].append(now() - t0)
                faults[name].append(_minor_faults() - f0)
    return {k: median(v) for k, v in times.items()}, {k: median(v) for k, v in faults.items()}


def _minor_faults() -> int:
    """This process's minor page faults so far (first touches of freshly mapped memory: on
    the CPU every large tensor allocation pays them, see docs/local.md)."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, OSError):
        return 0


def bench_config(name: str, T: int, D: int, ffn: int, E: int, K: int, dtype, device, activation: str,
                 rounds: int, warmup: int, clock: str = "wall") -> dict:
    torch.manual_seed(0)
    m = GroupedExperts(E, D, ffn, activation, init_seed=1, dtype=dtype).to(device)
    ids, w_TK = random_routes(T, E, K, device)
    x_TD = torch.randn(T, D, dtype=dtype, device=device)
    g_TD = torch.randn(T, D, dtype=dtype, device=device)
    x_ND, counts_E, row_map = permute(x_TD, ids, None, E)
    counts = counts_E.tolist()
    N = sum(counts)
    g_ND = torch.randn(N, D, dtype=dtype, device=device)
    weights = [p for p in m.parameters()]
    xr = x_ND.detach().requires_grad_(True)
    xt = x_TD.detach().requires_grad_(True)
    wt = w_TK.detach().requires_grad_(True)
    offs = torch.cumsum(counts_E, 0).to(torch.int32)

    def floor_fn(path):
        if not path_ok(m, path, xr, counts):
            return None

        def run():
            m.gemm_path = path
            torch.autograd.grad(m(xr, counts), [xr] + weights, g_ND)
        return run

    def autograd_fn(kind):
        if kind == "grouped_mm" and not path_ok(m, "grouped_mm", xr, counts):
            return None

        def run():
            y = autograd_loop(xr, counts, m) if kind == "loop" else autograd_grouped_mm(xr, offs, m)
            torch.autograd.grad(y, [xr] + weights, g_ND)
        return run

    def local():
        m.gemm_path = "auto"
        xN, cE, rm = permute(xt, ids, None, E)
        y = unpermute(m(xN, cE.cpu()), rm, wt, T)
        torch.autograd.grad(y, [xt, wt] + weights, g_TD)

    fns = {f"experts[{p}]": floor_fn(p) for p in ("loop", "grouped_mm", "bmm")}
    fns["autograd per-expert loop"] = autograd_fn("loop")
    fns["autograd F.grouped_mm"] = autograd_fn("grouped_mm")
    fns = {k: v for k, v in fns.items() if v is not None}
    fns["local path (auto)"] = local
    secs, faults = timed_rounds(fns, rounds, warmup, device, clock)
    m.gemm_path = "auto"
    auto_path = m.resolve_gemm_path(xr, counts)
    floor_name = min((k for k in secs if k != "local path (auto)"), key=secs.get)
    flops = expert_flops(N, D, ffn, activation)
    rows = [{"config": name, "impl": k, "ms": s * 1e3, "GFLOP/s": flops / s / 1e9,
             "page faults": faults[k]} for k, s in secs.items()]
    return {"config": name, "T": T, "D": D, "F": ffn, "E": E, "K": K, "N": N, "activation": activation,
            "gflop": flops / 1e9, "auto_path": auto_path, "floor_impl": floor_name,
            "floor_s": secs[floor_name], "local_s": secs["local path (auto)"],
            "ratio": secs["local path (auto)"] / secs[floor_name], "rows": rows}


def path_ok(m: GroupedExperts, path: str, x, counts) -> bool:
    saved = m.gemm_path
    m.gemm_path = path
    try:
        m.resolve_gemm_path(x, counts)
        return True
    except ValueError:
        return False
    finally:
        m.gemm_path = saved


# (E, rows per expert, D, F): small to large GEMMs, few to many experts.
SWEEP = [(64, 32, 256, 256), (64, 128, 256, 256), (64, 256, 256, 256), (64, 512, 256, 256),
         (8, 128, 512, 2048), (8, 256, 512, 2048), (8, 1024, 512, 2048), (32, 256, 512, 1024),
         (8, 1024, 1024, 1024)]


def bench_sweep(dtype, device, activation: str, rounds: int, warmup: int, clock: str,
                shapes=SWEEP) -> list[dict]:
    """GroupedExperts forward + backward on each GEMM path over a grid of shapes, with
    random (multinomial) row counts: the measurements behind ``choose_gemm_path``."""
    rows = []
    for E, per, D, ffn in shapes:
        gen = torch.Generator().manual_seed(E * per)
        counts = torch.bincount(torch.randint(0, E, (E * per,), generator=gen), minlength=E).tolist()
        N = sum(counts)
        m = GroupedExperts(E, D, ffn, activation, init_seed=1, dtype=dtype).to(device)
        x = torch.randn(N, D, dtype=dtype, device=device, requires_grad=True)
        g = torch.randn(N, D, dtype=dtype, device=device)
        params = list(m.parameters())

        def run(path):
            def fn():
                m.gemm_path = path
                torch.autograd.grad(m(x, counts), [x] + params, g)
            return fn
        fns = {p: run(p) for p in ("loop", "grouped_mm", "bmm") if path_ok(m, p, x, counts)}
        secs, _ = timed_rounds(fns, rounds, warmup, device, clock)
        m.gemm_path = "auto"
        flops = expert_flops(N, D, ffn, activation)
        row = {"E": E, "rows/expert": per, "max/mean": max(counts) * E / N, "D": D, "F": ffn}
        row.update({f"{p} ms": t * 1e3 for p, t in secs.items()})
        row["fastest"] = min(secs, key=secs.get)
        row["auto"] = m.resolve_gemm_path(x, counts)
        row["best GFLOP/s"] = flops / min(secs.values()) / 1e9
        rows.append(row)
    return rows


def bench_bandwidth(T: int, D: int, K: int, E: int, dtype, rounds: int, device="cuda") -> dict:
    """Triton permute/unpermute effective bandwidth vs a copy of the same bytes (CUDA; the
    CPU only under TRITON_INTERPRET=1, where the figures mean nothing but the code runs)."""
    dev = torch.device(device)
    ids, w_TK = random_routes(T, E, K, dev)
    x_TD = torch.randn(T, D, dtype=dtype, device=dev)
    x_ND, _, row_map = permute(x_TD, ids, None, E, impl="triton")
    N = x_ND.shape[0]
    item = x_ND.element_size()
    src = torch.empty_like(x_ND)
    dst = torch.empty_like(x_ND)
    from moepar_kernels import permute as pk
    route_N = pk.inverse_row_map(row_map, N)
    fns = {
        "copy N*D": lambda: dst.copy_(src),
        "permute (whole op)": lambda: permute(x_TD, ids, None, E, impl="triton"),
        "permute gather kernel": lambda: pk._gather(x_TD, route_N, K, dtype),
        "unpermute (weighted combine)": lambda: unpermute(x_ND, row_map, w_TK, T, impl="triton"),
    }
    secs, _ = timed_rounds(fns, rounds, 3, dev)
    moved = {"copy N*D": 2 * N * D * item, "permute (whole op)": 2 * N * D * item,
             "permute gather kernel": 2 * N * D * item,
             "unpermute (weighted combine)": (N + T) * D * item}
    copy_bw = moved["copy N*D"] / secs["copy N*D"]
    rows = [{"impl": k, "ms": s * 1e3, "GB/s": moved[k] / s / 1e9, "of copy": moved[k] / s / copy_bw}
            for k, s in secs.items()]
    return {"T": T, "D": D, "K": K, "E": E, "dtype": str(dtype), "rows": rows,
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)}


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine() -> str:
    """CPU model and core count (and the GPU when there is one)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    desc = f"{model}, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        desc += f", {torch.cuda.get_device_name()}"
    return desc


def _parse_config(spec: str):
    if spec in CONFIGS:
        return CONFIGS[spec]
    try:
        T, D, ffn, E, K = (int(v) for v in spec.split(":"))
    except ValueError:
        raise SystemExit(f"config {spec!r} must be one of {sorted(CONFIGS)} or T:D:F:E:K") from None
    if min(T, D, ffn, E, K) < 1 or K > E:
        raise SystemExit(f"config {spec!r}: every size must be >= 1 and K <= E")
    return T, D, ffn, E, K, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moepar bench local", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="A,B",
                   help="comma list of " + ",".join(CONFIGS) + " or custom T:D:F:E:K specs")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--activation", default="gelu", choices=("gelu", "swiglu", "relu"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="wall time, or process CPU time (steadier when other jobs share the machine)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--no-matmul", action="store_true", help="skip the 4096^3 matmul roofline")
    p.add_argument("--bandwidth", default="65536,4096,8", help="T,D,K of the CUDA bandwidth check")
    p.add_argument("--sweep", action="store_true", help="also time every GEMM path over a grid of shapes")
    p.add_argument("--sweep-shapes", default="", help="E:rows_per_expert:D:F,... instead of the default grid")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    device = torch.device(args.device)
    out: dict = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                 "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device),
                 "dtype": args.dtype, "clock": args.clock, "load_avg_1min": loadavg()}
    peak = None if args.no_matmul else matmul_gflops(4096, dtype, str(device))
    out["matmul_gflops"] = peak
    results = []
    for name in [c for c in args.configs.split(",") if c]:
        T, D, ffn, E, K, limit = _parse_config(name)
        r = bench_config(name, T, D, ffn, E, K, dtype, device, args.activation, args.rounds, args.warmup,
                         args.clock)
        r["limit"] = limit
        for row in r["rows"]:
            # A fraction of the wall-clock matmul rate only makes sense for wall times.
            row["of matmul"] = row["GFLOP/s"] / peak if peak and args.clock == "wall" else float("nan")
        results.append(r)
    out["configs"] = results
    if args.sweep:
        shapes = [tuple(int(v) for v in spec.split(":")) for spec in args.sweep_shapes.split(",") if spec] or SWEEP
        out["sweep"] = bench_sweep(dtype, device, args.activation, args.rounds, args.warmup, args.clock, shapes)
    if device.type == "cuda":
        T, D, K = (int(v) for v in args.bandwidth.split(","))
        out["bandwidth"] = bench_bandwidth(T, D, K, 64, torch.bfloat16, args.rounds)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"# bench local  {out['date']}  {out['machine']}  torch {out['torch']}  threads={out['threads']}  "
          f"device={out['device']}  dtype={args.dtype}  activation={args.activation}  clock={args.clock}  "
          f"load(1 min)={out['load_avg_1min']}")
    if peak:
        print(f"4096^3 matmul: {peak:.1f} GFLOP/s")
    for r in results:
        print(f"\nconfig {r['config']}: T={r['T']} D={r['D']} F={r['F']} E={r['E']} K={r['K']} "
              f"({r['gflop']:.1f} GFLOP fwd+bwd), auto GEMM path: {r['auto_path']}")
        if args.clock == "cpu":
            print("(ms are CPU milliseconds of this process, GFLOP/s per CPU-second)")
        print(format_table(r["rows"], ["impl", "ms", "GFLOP/s", "of matmul", "page faults"]))
    print()
    for r in results:
        verdict = "" if r["limit"] is None else (
            f", limit {r['limit']:.2f}: " + ("ok" if r["ratio"] <= r["limit"] else "OVER"))
        print(f"ratio {r['config']}: local / floor = {r['local_s'] * 1e3:.1f} / {r['floor_s'] * 1e3:.1f} ms "
              f"= {r['ratio']:.3f} (floor: {r['floor_impl']}{verdict})")
    if "sweep" in out:
        print("\nGEMM paths (GroupedExperts forward + backward):")
        print(format_table(out["sweep"]))
    if "bandwidth" in out:
        b = out["bandwidth"]
        print(f"\nTriton permute/unpermute bandwidth, T={b['T']} D={b['D']} K={b['K']} bf16 on {b['device_name']}")
        print(format_table(b["rows"], ["impl", "ms", "GB/s", "of copy"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

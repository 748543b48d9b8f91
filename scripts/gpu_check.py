"""The checks a CUDA machine can make and the CPU cannot: the Triton kernels compiled for
the GPU against their plain-torch references, the MoE layer on CUDA against the same layer
on the CPU and against the float64 per-token reference, the host waits of one forward and
one backward counted by the CUDA runtime itself, and the example GPT-MoE trained under
torchrun with NCCL. One section per process (a crash in one leaves the others' results);
``--all`` runs them in order with a time limit each and prints one summary line per check.

    python scripts/gpu_check.py --all [--out DIR]        # every section
    python scripts/gpu_check.py --section kernels|layer|syncs
    python scripts/gpu_profile.py --section profile|hostprof     # where the time goes

The kernels and layer sections draw fresh random inputs (seeded per case), poison the
outputs the kernels write, and compare by max |a - b| or ‖a − b‖ / ‖b‖ as the dtype allows.
The timing benchmarks are the package's own (``python -m moepar bench routing|local|layer
--device cuda``); ``--all`` runs them after the checks.
"""
from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_profile.py")   # the timing sections
sys.path.insert(0, ROOT)

RESULTS: list[tuple[str, bool, str]] = []
DEV = "cuda"   # --device cpu: a dry run of the checks themselves (TRITON_INTERPRET=1, small shapes)
SMALL = False


def record(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def guarded(name: str, fn, *args, **kw) -> None:
    """Run one check; an exception is a failed check with its message, not a lost section."""
    try:
        fn(*args, **kw)
    except Exception as e:   # noqa: BLE001 - reported, the section goes on
        import traceback
        traceback.print_exc()
        record(name, False, f"{type(e).__name__}: {str(e)[:300]}")


def sz(n: int, cap: int = 200) -> int:
    """``n``, or at most ``cap`` in a CPU dry run (the Triton interpreter is slow)."""
    return min(n, cap) if SMALL else n


def rel_err(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ---- kernels ---------------------------------------------------------------------------------

def check_routing(T: int, E: int, k: int, score: str, normalize: bool, bias: bool, seed: int) -> None:
    import torch
    from moepar.bench.routing import verify
    from moepar_kernels import routing as rk
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(T, E, device=DEV, generator=g)
    bias_E = 0.01 * torch.randn(E, device=DEV, generator=g) if bias else None
    name = f"routing T={T} E={E} k={k} {score}{' norm' if normalize else ''}{' bias' if bias else ''}"
    v = verify(logits, k, score, bias_E, normalize)
    # backward: d(sum w * G)/d logits through the kernel's op against torch autograd
    G = torch.randn(T, k, device=DEV, generator=g)
    a = logits.clone().requires_grad_()
    ids, w, _ = rk.routing(a, k, score, bias_E, normalize)
    (w * G).sum().backward()
    b = logits.clone().requires_grad_()
    r_ids, r_w, _ = rk.routing_reference(b, k, score, bias_E, normalize)
    (r_w * G).sum().backward()
    same = (ids == r_ids).all(dim=1)
    gerr = float((a.grad - b.grad)[same].abs().max()) if bool(same.any()) else 0.0
    record(name, v["ok"] and gerr <= 1e-5,
           f"id-mismatch rows {v['ids_mismatch_rows']}, max|dw| {v['max_weight_err']:.1e}, "
           f"hist diff {v['hist_diff']}, max|dgrad| {gerr:.1e}")


def check_permute(T: int, D: int, E: int, k: int, dtype_name: str, drop: bool, capacity: int | None,
                  seed: int) -> None:
    import torch
    from moepar_kernels.permute import permute, permute_reference, unpermute, unpermute_reference
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, D, device=DEV, generator=g).to(dtype)
    ids = torch.randint(0, E, (T, k), device=DEV, generator=g)
    dropped = (torch.rand(T, k, device=DEV, generator=g) < 0.2) if drop else None
    if capacity is not None:   # drop what would not fit, so the kernel's contract holds
        dropped = torch.zeros(T, k, dtype=torch.bool, device=DEV) if dropped is None else dropped
        keep = ~dropped
        order = torch.cumsum(torch.nn.functional.one_hot(ids.masked_fill(~keep, 0).flatten(), E)
                             * keep.flatten()[:, None], 0)
        pos = order.gather(1, ids.flatten()[:, None]).view(T, k)
        dropped = dropped | (pos > capacity)
    name = f"permute/unpermute T={T} D={D} E={E} k={k} {dtype_name}{' drops' if drop else ''}" + (
        f" C={capacity}" if capacity is not None else "")
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    ya, ca, ma = permute(xa, ids, dropped, E, capacity=capacity, impl="triton")
    yb, cb, mb = permute_reference(xb, ids, dropped, E, capacity=capacity)
    fwd_ok = torch.equal(ya, yb) and torch.equal(ca, cb) and torch.equal(ma, mb)
    # num_rows given: the same rows, no host read
    rows = int(cb.sum()) if capacity is None else E * capacity
    yc, _, _ = permute(x, ids, dropped, E, capacity=capacity, num_rows=rows, impl="triton")
    fwd_ok = fwd_ok and torch.equal(yc, yb)
    gy = torch.randn(ya.shape, device=DEV, generator=g).to(dtype)
    ya.backward(gy)
    yb.backward(gy)
    gx_err = rel_err(xa.grad, xb.grad) if xa.grad.numel() else 0.0
    # unpermute: weighted combine, fp32 accumulation; grads of rows and weights
    w = torch.rand(T, k, device=DEV, generator=g)
    y_N = torch.randn(ya.shape, device=DEV, generator=g).to(dtype)
    ua_in, ub_in = y_N.clone().requires_grad_(), y_N.clone().requires_grad_()
    wa, wb = w.clone().requires_grad_(), w.clone().requires_grad_()
    oa = unpermute(ua_in, ma, wa, T, impl="triton")
    ob = unpermute_reference(ub_in, mb, wb, T)
    go = torch.randn(oa.shape, device=DEV, generator=g).to(dtype)
    oa.backward(go)
    ob.backward(go)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    errs = [rel_err(oa, ob), rel_err(ua_in.grad, ub_in.grad) if ua_in.grad.numel() else 0.0,
            rel_err(wa.grad, wb.grad)]
    record(name, fwd_ok and gx_err <= tol and max(errs) <= tol,
           f"permute bitwise {fwd_ok}, grad x {gx_err:.1e}, unpermute {errs[0]:.1e}, "
           f"grad rows {errs[1]:.1e}, grad w {errs[2]:.1e}")


def check_fp8(T: int, D: int, k: int, dtype_name: str, seed: int) -> None:
    import torch
    from moepar_kernels.permute_fp8 import permute_quantize, permute_quantize_reference
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(T, D, device=DEV, generator=g) * 3).to(dtype)
    x[0, 0] = float("nan") if T > 2 else x[0, 0]
    route = torch.randperm(T * k, device=DEV, generator=g)
    route[::7] = -1
    a = permute_quantize(x, route, k, impl="triton")
    b = permute_quantize_reference(x, route, k)
    diff = int((a != b).sum())
    record(f"fp8 permute_quantize T={T} D={D} k={k} {dtype_name}", diff == 0,
           f"{diff} of {b.numel()} bytes differ from the reference")


def section_kernels() -> None:
    import torch
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, " + (
        f"{torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}" if DEV == "cuda" else DEV))
    cases = [(1, 8, 2, "softmax", False, False), (7, 8, 1, "softmax", False, False),
             (4096, 8, 2, "softmax", False, False), (4099, 64, 8, "softmax", False, False),
             (4096, 256, 8, "sigmoid", True, True), (65536, 128, 8, "softmax", True, False),
             (1000, 60, 4, "softmax", False, False), (3000, 160, 6, "sigmoid", True, True)]
    for i, c in enumerate(cases):
        guarded(f"routing {c}", check_routing, sz(c[0]), *c[1:], seed=i)
    perm = [(1, 64, 4, 2, "float32", False, None), (513, 96, 8, 2, "float32", True, None),
            (4096, 1024, 64, 8, "bfloat16", False, None), (2048, 4096, 16, 2, "bfloat16", True, None),
            (1000, 200, 8, 2, "float32", True, 300), (4096, 512, 32, 4, "bfloat16", False, 600),
            (777, 136, 6, 3, "float16", True, None)]
    for i, c in enumerate(perm):
        guarded(f"permute {c}", check_permute, sz(c[0]), sz(c[1], 64), *c[2:5], c[5], c[6] and sz(c[6], 60), seed=100 + i)
    for i, c in enumerate([(5, 128, 2, "bfloat16"), (1000, 7168, 8, "bfloat16"), (333, 200, 3, "float32")]):
        guarded(f"fp8 {c}", check_fp8, sz(c[0]), sz(c[1], 256), *c[2:], seed=200 + i)


# ---- the layer -------------------------------------------------------------------------------

LAYER_CASES = [   # (name, MoE options): world of one, every expert local
    ("dropless top-2 swiglu", dict(k=2, activation="swiglu")),
    ("dropless top-8 sigmoid+bias, shared expert", dict(k=8, score_func="sigmoid", expert_bias=True,
                                                        num_shared_experts=1, activation="swiglu")),
    ("capacity 1.0 (drops)", dict(k=2, capacity_factor=1.0)),
    ("padded capacity 1.5", dict(k=2, capacity_factor=1.5, pad_to_capacity=True)),
    ("recompute experts", dict(k=2, activation="swiglu", recompute_experts=True)),
]


def _layers(opts: dict, hidden: int, experts: int, ffn: int, dtype=None):
    from tests.helpers.moe_ref import build
    cpu = build(None, hidden=hidden, num_experts=experts, ffn_hidden=ffn, **opts)
    gpu = copy.deepcopy(cpu).to(DEV)
    if dtype is not None:
        gpu = gpu.to(dtype)
    return cpu, gpu


def check_layer(name: str, opts: dict) -> None:
    import torch
    torch.manual_seed(0)
    T, D, E, F = sz(512, 64), sz(256, 32), 16, sz(384, 48)
    cpu, gpu = _layers(opts, D, E, F)
    x = torch.randn(T, D)
    gy = torch.randn(T, D)
    xa, xb = x.clone().requires_grad_(), x.to(DEV).requires_grad_()
    ya, yb = cpu(xa), gpu(xb)
    (ya * gy).sum().backward()
    (yb * gy.to(DEV)).sum().backward()
    errs = {"y": rel_err(yb, ya), "dx": rel_err(xb.grad, xa.grad)}
    for (n, p), (_, q) in zip(cpu.named_parameters(), gpu.named_parameters()):
        if p.grad is not None:
            errs["d" + n] = rel_err(q.grad, p.grad)
    worst = max(errs, key=errs.get)
    # fp32 on both; the GPU's reductions are ordered differently (and may use TF32 if enabled)
    record(f"layer fp32 cuda vs cpu: {name}", errs[worst] <= 1e-5 and torch.isfinite(yb).all().item(),
           f"worst {worst} {errs[worst]:.1e}, y {errs['y']:.1e}, dx {errs['dx']:.1e}")


def check_layer_per_token() -> None:
    import torch
    from tests.helpers.moe_ref import full_weights, moe_per_token
    cpu, gpu = _layers(dict(k=2, activation="swiglu"), 64, 8, 96)
    x = torch.randn(48, 64)
    ref, _ = moe_per_token(x.double(), full_weights(cpu), "swiglu", k=2)
    y = gpu(x.to(DEV))
    e = rel_err(y, ref)
    record("layer fp32 cuda vs float64 per-token reference", e <= 1e-5, f"rel err {e:.1e}")


def check_layer_bf16() -> None:
    import torch
    T, D, E, F = sz(4096, 64), sz(1024, 32), 32, sz(512, 48)
    cpu, gpu = _layers(dict(k=4, activation="swiglu"), D, E, F, dtype=torch.bfloat16)
    x = torch.randn(T, D)
    cpu16 = copy.deepcopy(cpu).to(torch.bfloat16)
    ref32 = cpu(x)
    ref16 = cpu16(x.to(torch.bfloat16))
    y = gpu(x.to(DEV).to(torch.bfloat16))
    path = gpu.experts.resolve_gemm_path(x.to(DEV).to(torch.bfloat16), None) if DEV == "cuda" else "cpu"
    e16, e32 = rel_err(y.float(), ref16.float()), rel_err(y.float(), ref32)
    # bf16 router logits may pick other experts than fp32 ones for near-tied tokens: the
    # bf16 CPU layer is the like-for-like reference, the fp32 one for scale
    record("layer bf16 cuda vs bf16 cpu", e16 <= 2e-2, f"rel err {e16:.1e} (vs fp32 cpu {e32:.1e}), gemm path {path}")


def check_experts_bf16() -> None:
    """The grouped GEMM paths on the GPU's bf16 rows against float64 on the CPU, uneven
    blocks (one empty), forward and every gradient."""
    import torch
    torch.manual_seed(3)
    E, D, F = 8, sz(1024, 32), sz(768, 48)
    _, gpu = _layers(dict(k=2, activation="swiglu"), D, E, F, dtype=torch.bfloat16)
    ex = gpu.experts
    counts = [sz(700, 20), 0, sz(1, 1), sz(333, 9), sz(1024, 30), sz(64, 3), sz(17, 5), sz(250, 7)]
    N = sum(counts)
    x = torch.randn(N, D, device=DEV).to(torch.bfloat16)
    g = torch.randn(N, D, device=DEV)
    ref = copy.deepcopy(ex).cpu().double()
    ref.gemm_path = "loop"
    xr = x.double().cpu().requires_grad_()
    yr = ref(xr, torch.tensor(counts))
    (yr * g.double().cpu()).sum().backward()
    paths = ("grouped_mm", "loop", "bmm") if DEV == "cuda" else ("loop", "bmm")
    for path in paths:
        ex.gemm_path = path
        ex.zero_grad()
        xx = x.clone().requires_grad_()
        y = ex(xx, torch.tensor(counts, device=DEV))
        (y.float() * g).sum().backward()
        errs = {"y": rel_err(y, yr), "dx": rel_err(xx.grad, xr.grad)}
        for (n, p), (_, q) in zip(ex.named_parameters(), ref.named_parameters()):
            errs["d" + n] = rel_err(p.grad, q.grad)
        worst = max(errs, key=errs.get)
        record(f"experts bf16 gemm_path={path} vs float64", errs[worst] <= 1e-2,
               f"worst {worst} {errs[worst]:.1e}, y {errs['y']:.1e}")


def section_layer() -> None:
    for name, opts in LAYER_CASES:
        guarded(f"layer {name}", check_layer, name, opts)
    guarded("layer per-token", check_layer_per_token)
    guarded("layer bf16", check_layer_bf16)
    guarded("experts bf16", check_experts_bf16)


# ---- host waits ------------------------------------------------------------------------------

SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def count_syncs(fn, prepare=lambda: None) -> dict:
    """The CUDA runtime calls in ``fn`` that make the host wait, by name (a plain cudaMemcpy
    waits; cudaMemcpyAsync into pinned memory does not), from torch's profiler; and the
    implicit syncs torch's sync-debug mode flags (a second run: ``prepare`` before each)."""
    import traceback
    import warnings
    import torch
    from torch.profiler import ProfilerActivity, profile
    prepare()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    counts: dict[str, int] = {}
    for ev in prof.events():
        if ev.name in SYNC_CALLS:
            counts[ev.name] = counts.get(ev.name, 0) + 1
    prepare()
    torch.cuda.synchronize()
    where: list[str] = []

    def note(message, *args, **kw):   # the innermost moepar / kernels frame of each flagged sync
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "/moepar/" in f.filename or "/kernels/" in f.filename
                      or "moepar_kernels" in f.filename]
            f = frames[-1] if frames else None
            where.append(f"{os.path.basename(f.filename)}:{f.lineno} {(f.line or '').strip()[:60]}" if f else "?")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    if where:
        counts["flagged implicit syncs"] = len(where)
        counts["at"] = where
    torch.cuda.synchronize()
    return {k: v for k, v in counts.items() if v}


def section_syncs() -> None:
    import torch
    from tests.helpers.moe_ref import build
    cases = [(n, o, torch.float32) for n, o in LAYER_CASES[:4]] + [
        ("dropless top-2 bf16", dict(k=2, activation="swiglu"), torch.bfloat16)]
    for name, opts, dtype in cases:
        def one(name=name, opts=opts, dtype=dtype):
            moe = build(None, hidden=256, num_experts=16, ffn_hidden=384, **opts).to(DEV).to(dtype)
            x = torch.randn(1024, 256, device=DEV, dtype=dtype, requires_grad=True)
            for _ in range(2):   # warm-up: kernels compiled, caches filled
                moe(x).sum().backward()
            holder = {}
            fwd = count_syncs(lambda: holder.__setitem__("y", moe(x)))
            bwd = count_syncs(lambda: holder["y"].sum().backward(),
                              prepare=lambda: holder.__setitem__("y", moe(x)))
            # the profiler's own cudaDeviceSynchronize at its stop is not the layer's
            for d in (fwd, bwd):
                d["cudaDeviceSynchronize"] = d.get("cudaDeviceSynchronize", 0) - 1
                if not d["cudaDeviceSynchronize"]:
                    del d["cudaDeviceSynchronize"]
            n_fwd = sum(v for k, v in fwd.items() if k in SYNC_CALLS)
            # the dropless forward reads its counts row once; the backward reads nothing
            record(f"host waits, {name}", n_fwd <= 1 and not any(bwd.get(k) for k in SYNC_CALLS),
                   f"forward {fwd or 'none'}; backward {bwd or 'none'}")
        guarded(f"syncs {name}", one)


# ---- driver ----------------------------------------------------------------------------------

def _run(cmd: list[str], log: str, limit: int, env: dict) -> tuple[int, float]:
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.time() - t0


def run_all(out: str, limits: dict) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if DEV == "cuda":   # compiled kernels, not the interpreter
        env.pop("TRITON_INTERPRET", None)
    py = sys.executable
    steps = [
        ("kernels", [py, __file__, "--section", "kernels", "--device", DEV]),
        ("layer", [py, __file__, "--section", "layer", "--device", DEV]),
        ("syncs", [py, __file__, "--section", "syncs", "--device", DEV]),
        ("profile", [py, PROFILE, "--section", "profile", "--device", DEV]),
        ("hostprof", [py, PROFILE, "--section", "hostprof", "--device", DEV]),
        ("routing_tune", [py, "-m", "moepar", "bench", "routing", "--device", "cuda", "--tune", "--experts", "8", "256",
                          "--k", "8", "--repeats", "3"]),
        ("example", [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                     "examples/train_gpt_moe.py", "--steps", "60"]),
        ("bench_routing", [py, "-m", "moepar", "bench", "routing", "--device", "cuda", "--repeats", "5"]),
        ("bench_local", [py, "-m", "moepar", "bench", "local", "--device", "cuda"]),
        ("bench_layer", [py, "-m", "moepar", "bench", "layer", "--device", "cuda", "--rounds", "3",
                         "--no-peers"]),
    ]
    summary = []
    for name, cmd in steps:
        if name not in limits:
            continue
        log = os.path.join(out, f"{name}.log")
        rc, secs = _run(cmd, log, limits[name], env)
        with open(log) as f:
            text = f.read()
        lines = [ln for ln in text.splitlines() if ln.startswith(("PASS", "FAIL"))]
        fails = [ln for ln in lines if ln.startswith("FAIL")]
        summary.append(f"{name}: rc {rc}, {secs:.0f} s, {len(lines) - len(fails)}/{len(lines)} checks pass")
        summary += [f"  {ln}" for ln in fails]
        print(f"==== {name} (rc {rc}, {secs:.0f} s)\n{text[-2500:]}", flush=True)
    print("\n".join(["==== summary"] + summary), flush=True)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(summary) + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", choices=["kernels", "layer", "syncs"])
    p.add_argument("--all", action="store_true")
    p.add_argument("--only", default=None, help="with --all: comma list of sections to run")
    p.add_argument("--out", default=".")
    p.add_argument("--device", default="cuda", help="cpu: dry-run the checks (TRITON_INTERPRET=1), small shapes")
    a = p.parse_args()
    global DEV, SMALL
    DEV, SMALL = a.device, a.device == "cpu"
    if a.all:
        limits = {"kernels": 90, "layer": 60, "syncs": 60, "profile": 60, "hostprof": 90, "routing_tune": 90, "example": 70,
                  "bench_routing": 45,
                  "bench_local": 60, "bench_layer": 80}
        if a.only:
            limits = {k: v for k, v in limits.items() if k in a.only.split(",")}
        return run_all(a.out, limits)
    {"kernels": section_kernels, "layer": section_layer, "syncs": section_syncs}[a.section]()
    return 1 if any(not ok for _, ok, _ in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())

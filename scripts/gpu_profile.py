"""Where a GPU step's time goes, for ``scripts/gpu_check.py --all`` (or alone): the MoE
layer's fwd + bwd at the bench's configs A/B-bf16 against the device's busy time (torch's
profiler), the routing op and a permute -> unpermute pair through the eager Functions and
the registered custom ops (``--section profile``); cProfile of the layer and the host cost
of single ops (``--section hostprof``). Figures: docs/benchmarks.md, "First GPU run".

    python scripts/gpu_profile.py --section profile|hostprof [--device cpu]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check as gc  # noqa: E402
from gpu_check import SYNC_CALLS, record, sz  # noqa: E402


def timed(fn, n: int, warmup: int = 3) -> tuple[float, float]:
    """(host seconds to issue one call, wall seconds per call until the device is done),
    over ``n`` calls after ``warmup``."""
    import torch
    sync = torch.cuda.synchronize if gc.DEV == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n
    sync()
    return host, (time.perf_counter() - t0) / n


def section_profile() -> None:
    """The bench's configs A/B-bf16 (T 4096, D 512/256, ...) on the GPU: the step's device
    time against the host's time to issue it, the kernels launched, and the ops that cost
    most on each side."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from tests.helpers.moe_ref import build
    sync = torch.cuda.synchronize if gc.DEV == "cuda" else (lambda: None)
    configs = {"A-bf16": (sz(4096, 64), sz(512, 32), sz(2048, 32), 8, 2),
               "B-bf16": (sz(4096, 64), sz(256, 32), sz(256, 32), 64, 8)}
    for name, (T, D, F, E, K) in configs.items():
        moe = build(None, hidden=D, num_experts=E, ffn_hidden=F, k=K).to(gc.DEV).to(torch.bfloat16)
        x = torch.randn(T, D, device=gc.DEV, dtype=torch.bfloat16, requires_grad=True)

        def step():
            moe(x).sum().backward()
        host, wall = timed(step, 20)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            sync()
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kern) / 1e3
        launches = sum(1 for e in prof.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        syncs = {n: sum(1 for e in prof.events() if e.name == n) for n in SYNC_CALLS}
        print(f"\n== {name}: fwd+bwd {wall * 1e3:.3f} ms wall, host issue {host * 1e3:.3f} ms, "
              f"kernels {len(kern)} ({launches} launches), device busy {busy:.3f} ms, syncs {syncs}")
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(ka.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
        record(f"profile {name}", True, f"fwd+bwd {wall * 1e3:.3f} ms, host {host * 1e3:.3f} ms, "
               f"{len(kern)} kernels, device busy {busy:.3f} ms")
    # the routing op alone: is its time the device's or the host's (Python, launch)?
    from moepar_kernels import routing as rk
    for E, k in ((8, 2), (256, 8)):
        logits = torch.randn(sz(65536, 64), E, device=gc.DEV)
        host, wall = timed(lambda: rk.routing(logits, k), 50)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            rk.routing(logits, k)
            sync()
        kern = [(e.name[:40], round(e.time_range.elapsed_us(), 1)) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA]
        record(f"profile routing E={E} k={k}", True, f"{wall * 1e6:.1f} us wall, host {host * 1e6:.1f} us, kernels {kern}")
    # permute -> unpermute fwd + bwd through the eager Functions against the registered ops
    from moepar_kernels import permute as pm
    xr = torch.randn(sz(4096, 64), sz(512, 32), device=gc.DEV, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 8, (xr.shape[0], 2), device=gc.DEV)
    w = torch.rand(xr.shape[0], 2, device=gc.DEV, requires_grad=True)
    for label, (pf, uf) in {"eager Functions": (pm._permute_call, pm._unpermute_call),
                            "custom ops": (pm._permute_op, pm._unpermute_op)}.items():
        def pair(pf=pf, uf=uf):
            x_ND, _, rm, route_N = pf(xr, ids, None, 8, None, ids.numel(), "auto", False)
            uf(x_ND, rm, w, xr.shape[0], "auto", route_N).sum().backward()
        best = min(timed(pair, 50)[1] for _ in range(3))
        record(f"permute+unpermute fwd+bwd via {label}", True, f"{best * 1e6:.1f} us a pair (best of 3 x 50)")


def section_hostprof() -> None:
    """Where the host's time goes in one fwd + bwd (configs A/B-bf16): cProfile over 30
    steps, the top functions by own time and by cumulative time; and the routing / permute
    ops split into the custom op's wrapper, the launcher and the bare kernel launch."""
    import cProfile
    import pstats
    import torch
    from tests.helpers.moe_ref import build
    sync = torch.cuda.synchronize if gc.DEV == "cuda" else (lambda: None)
    for name, (T, D, F, E, K) in {"A-bf16": (sz(4096, 64), sz(512, 32), sz(2048, 32), 8, 2),
                                  "B-bf16": (sz(4096, 64), sz(256, 32), sz(256, 32), 64, 8)}.items():
        moe = build(None, hidden=D, num_experts=E, ffn_hidden=F, k=K).to(gc.DEV).to(torch.bfloat16)
        x = torch.randn(T, D, device=gc.DEV, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3):
            moe(x).sum().backward()
        sync()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(30):
            moe(x).sum().backward()
        prof.disable()
        sync()
        print(f"\n== {name}: cProfile of 30 fwd+bwd (times are per 30 steps)")
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumtime").print_stats(40)
    from moepar_kernels import routing as rk
    from moepar_kernels import permute as pm

    def per_call(f, n=200):
        return timed(f, n, warmup=5)[0] * 1e6
    logits = torch.randn(sz(4096, 64), 8, device=gc.DEV)
    xr = torch.randn(sz(4096, 64), sz(512, 32), device=gc.DEV, dtype=torch.bfloat16)
    ids, w, _ = rk.routing_reference(logits, 2)
    n = ids.numel()
    parts = {
        "routing (public)": lambda: rk.routing(logits, 2),
        "routing _launch (no op wrapper)": lambda: rk._launch(logits, 2, "softmax", None, False, 1.0, 0.0, 0, 0),
        "permute (public, num_rows)": lambda: pm.permute(xr, ids, None, 8, num_rows=n),
        "route_index": lambda: pm.route_index(ids, None, 8, None, n),
        "torch.empty_like": lambda: torch.empty_like(xr),
        "x.sum() (one small kernel)": lambda: logits.sum(),
    }
    for label, f in parts.items():
        record(f"host us per call: {label}", True, f"{per_call(f):.1f} us")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", choices=["profile", "hostprof"], required=True)
    p.add_argument("--device", default="cuda", help="cpu: dry-run the sections (TRITON_INTERPRET=1), small shapes")
    a = p.parse_args()
    gc.DEV, gc.SMALL = a.device, a.device == "cpu"
    {"profile": section_profile, "hostprof": section_hostprof}[a.section]()
    return 1 if any(not ok for _, ok, _ in gc.RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())

"""``bench layer --device cuda``'s kernel checks: the Triton kernels against their torch
references on the GPU (values and gradients), and their bandwidth as a fraction of the
card's copy bandwidth. Legend: T tokens, D hidden, E experts, k top-k."""
from __future__ import annotations

import torch

from moepar.tables import format_table
from moepar_kernels.permute import permute


def gpu_checks(device: torch.device, rounds: int = 5, T: int = 65536, D: int = 4096) -> dict:
    """Routing kernel and permute/unpermute kernels vs their torch references (values and
    gradients), and their achieved bandwidth as a fraction of a 1 GiB device copy."""
    from moepar.bench.local import bench_bandwidth
    from moepar.bench.routing import copy_bandwidth, cuda_time, route_bytes, verify
    from moepar_kernels import routing as rk
    from moepar_kernels.permute import unpermute
    copy_bps = copy_bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows, ok_all = [], True
    for E, k in ((8, 2), (64, 8), (256, 8)):
        logits = torch.randn(T, E, device=device, generator=gen)
        chk = verify(logits, k, "softmax", None, False)
        t = cuda_time(lambda: rk.routing(logits, k), 20, rounds)
        bps = route_bytes(T, E, k) / t
        rows.append({"kernel": f"routing E={E} k={k}", "check": "ok" if chk["ok"] else "FAIL",
                     "max err": chk["max_weight_err"], "us": t * 1e6, "GB/s": bps / 1e9, "of copy": bps / copy_bps})
        ok_all &= chk["ok"]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        E, K, Tc, Dc = 64, 8, 4096, 1024
        x = torch.randn(Tc, Dc, device=device, dtype=dtype, generator=gen).requires_grad_(True)
        ids = torch.rand(Tc, E, device=device, generator=gen).topk(K, -1).indices
        w = torch.rand(Tc, K, device=device, generator=gen).requires_grad_(True)
        g = torch.randn(Tc, Dc, device=device, dtype=dtype, generator=gen)
        res = {}
        for impl in ("triton", "reference"):
            x_ND, counts, rm = permute(x, ids, None, E, impl=impl)
            y = unpermute(x_ND * 2, rm, w, Tc, impl=impl)
            res[impl] = (x_ND.detach(), counts, y.detach(), *torch.autograd.grad(y, [x, w], g))
        errs = [float((a.float() - b.float()).abs().max()) if a.is_floating_point() else float((a != b).sum())
                for a, b in zip(res["triton"], res["reference"])]
        scale = max(float(res["reference"][2].abs().max()), 1.0)
        ok = errs[0] == 0 and errs[1] == 0 and max(errs[2:]) <= tol * scale * 10
        rows.append({"kernel": f"permute+unpermute fwd/bwd {str(dtype)[6:]}", "check": "ok" if ok else "FAIL",
                     "max err": max(errs)})
        ok_all &= ok
    bw = bench_bandwidth(T, D, 8, 64, torch.bfloat16, rounds, device=str(device))
    for r in bw["rows"]:
        rows.append({"kernel": f"{r['impl']} (T={T} D={D} K=8 bf16)", "us": r["ms"] * 1e3, "GB/s": r["GB/s"],
                     "of copy": r["GB/s"] * 1e9 / copy_bps})
    return {"device_name": torch.cuda.get_device_name(device), "copy_GBps": copy_bps / 1e9, "rows": rows,
            "all_ok": bool(ok_all)}


def print_gpu(gpu: dict) -> None:
    print(f"\nGPU checks on {gpu['device_name']} (device copy: {gpu['copy_GBps']:.0f} GB/s):")
    print(format_table(gpu["rows"], ["kernel", "check", "max err", "us", "GB/s", "of copy"]))
    print("kernels vs references: " + ("all ok" if gpu["all_ok"] else "FAILED"))

"""``python -m moepar bench routing``: the fused routing kernel against torch.

On CUDA: checks the Triton kernel against ``routing_reference``, times it with CUDA
events and reports its achieved bandwidth (logits read + ids/weights written) as a
fraction of the device's copy bandwidth (a large ``clone()``), and its speed-up over a
plain torch router (softmax + topk + bincount). Targets: >= 60% of copy bandwidth and
>= 2x the torch router. On CPU: times the torch paths only; the Triton kernel needs CUDA
for timing (under TRITON_INTERPRET it runs in a Python interpreter).
Legend: T tokens, E experts, K top-k.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from typing import Callable

import torch

from moepar.tables import format_table
from moepar.bench.common import median, time_fn
from moepar_kernels import routing as rk

TARGET_BW_FRACTION = 0.60
TARGET_SPEEDUP = 2.0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def torch_router(logits_TE: torch.Tensor, k: int, score_func: str, normalize: bool):
    """The plain torch router the kernel must beat: scores, topk, (normalise), bincount."""
    s = torch.sigmoid(logits_TE) if score_func == "sigmoid" else torch.softmax(logits_TE, dim=-1)
    w, ids = torch.topk(s, k, dim=-1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w, torch.bincount(ids.flatten(), minlength=logits_TE.shape[1])


def cuda_time(fn: Callable[[], object], iters: int, repeats: int) -> float:
    """Median seconds per call: ``repeats`` CUDA-event windows of ``iters`` calls."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a large device clone (read + write), the bandwidth the kernel is held to."""
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    secs = cuda_time(buf.clone, iters=5, repeats=5)
    del buf
    return 2 * nbytes / secs


def route_bytes(T: int, E: int, k: int, logit_bytes: int = 4) -> int:
    """Compulsory traffic: logits in, int64 ids + fp32 weights out, the histogram."""
    return T * E * logit_bytes + T * k * (8 + 4) + E * 8


def verify(logits_TE, k, score_func, bias_E, normalize) -> dict:
    """Kernel vs reference. Ids may differ only on near-ties of score+bias (the GPU's exp
    is not torch's): such rows must select keys equal within 1e-6."""
    ids, w, hist = rk.routing(logits_TE, k, score_func, bias_E, normalize)
    r_ids, r_w, r_hist = rk.routing_reference(logits_TE, k, score_func, bias_E, normalize)
    same = (ids == r_ids).all(dim=1)
    mismatched = int((~same).sum())
    ok = True
    if mismatched:
        x = logits_TE.float()
        key = x if bias_E is None else (torch.sigmoid(x) if score_func == "sigmoid" else torch.softmax(x, -1)) + bias_E
        a = key.gather(1, ids).sort(dim=1).values
        b = key.gather(1, r_ids).sort(dim=1).values
        ok = bool(((a - b).abs()[~same] <= 1e-6).all())
    werr = float((w - r_w)[same].abs().max()) if bool(same.any()) else 0.0
    hist_diff = int((hist - r_hist).abs().sum())
    ok = ok and werr <= 1e-5 and hist_diff <= 2 * k * mismatched
    return {"ids_mismatch_rows": mismatched, "max_weight_err": werr, "hist_diff": hist_diff, "ok": ok}


def tune(tokens: int, experts: list[int], ks: list[int], device: torch.device, repeats: int) -> list[dict]:
    """CUDA only: time every (block_t, num_warps) launch shape, report the best per (E, k)
    next to the default heuristic's time, so the defaults can be set from a GPU run."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for E in experts:
        for k in ks:
            if k > E:
                continue
            logits = torch.randn(tokens, E, device=device, generator=gen)
            default = cuda_time(lambda: rk.routing(logits, k), 20, repeats)
            best = (float("inf"), 0, 0)
            for block_t in (1, 2, 4, 8, 16, 32, 64, 128):
                if block_t * rk._next_pow2(E) > 16384:
                    continue
                for warps in (1, 2, 4, 8):
                    t = cuda_time(lambda: rk.routing(logits, k, block_t=block_t, num_warps=warps), 20, repeats)
                    best = min(best, (t, block_t, warps))
            out.append({"E": E, "k": k, "default_us": default * 1e6, "best_us": best[0] * 1e6,
                        "best_block_t": best[1], "best_num_warps": best[2],
                        "best_GBps": route_bytes(tokens, E, k) / best[0] / 1e9})
    return out


def run(tokens: int, experts: list[int], ks: list[int], score_funcs: list[str], bias: bool,
        device: torch.device, repeats: int) -> tuple[list[dict], dict]:
    on_cuda = device.type == "cuda"
    meta = {"device": torch.cuda.get_device_name(device) if on_cuda else _cpu_name(),
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "tokens": tokens}
    if on_cuda:
        meta["copy_GBps"] = copy_bandwidth(device) / 1e9
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for score_func in score_funcs:
        normalize = score_func == "sigmoid"
        for E in experts:
            for k in ks:
                if k > E:
                    continue
                logits = torch.randn(tokens, E, device=device, generator=gen)
                bias_E = 0.01 * torch.randn(E, device=device, generator=gen) if bias else None
                row = {"score": score_func, "E": E, "k": k}
                if on_cuda:
                    t_torch = cuda_time(lambda: torch_router(logits, k, score_func, normalize), 20, repeats)
                    t_ref = cuda_time(lambda: rk.routing_reference(logits, k, score_func, bias_E, normalize), 5, repeats)
                    check = verify(logits, k, score_func, bias_E, normalize)
                    t_kern = cuda_time(lambda: rk.routing(logits, k, score_func, bias_E, normalize), 20, repeats)
                    gbps = route_bytes(tokens, E, k) / t_kern / 1e9
                    row.update(kernel_us=t_kern * 1e6, GBps=gbps, bw_frac=gbps / meta["copy_GBps"],
                               torch_us=t_torch * 1e6, speedup=t_torch / t_kern, reference_us=t_ref * 1e6,
                               check="ok" if check["ok"] else "FAIL", mismatch_rows=check["ids_mismatch_rows"])
                else:
                    t_torch = median(time_fn(lambda: torch_router(logits, k, score_func, normalize),
                                             warmup=1, repeats=repeats))
                    t_ref = median(time_fn(lambda: rk.routing_reference(logits, k, score_func, bias_E, normalize),
                                           warmup=1, repeats=repeats))
                    row.update(torch_us=t_torch * 1e6, reference_us=t_ref * 1e6,
                               torch_GBps=route_bytes(tokens, E, k) / t_torch / 1e9)
                rows.append(row)
    return rows, meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moepar bench routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--k", type=int, nargs="+", default=[2, 8])
    p.add_argument("--score", nargs="+", default=["softmax"], choices=["softmax", "sigmoid"])
    p.add_argument("--bias", action="store_true", help="route with an expert bias (DeepSeek-V3 style)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--repeats", type=int, default=None, help="timing windows (default 10 on CUDA, 3 on CPU)")
    p.add_argument("--json", default=None, help="also write rows + machine info to this file")
    p.add_argument("--strict", action="store_true", help="exit 1 when a performance target is missed")
    p.add_argument("--tune", action="store_true", help="CUDA: sweep block_t x num_warps, print the best")
    args = p.parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    device = torch.device("cuda" if use_cuda else "cpu")
    repeats = args.repeats or (10 if use_cuda else 3)
    if args.tune:
        if not use_cuda:
            p.error("--tune needs CUDA")
        print(format_table(tune(args.tokens, args.experts, args.k, device, min(repeats, 5))))
        return 0
    rows, meta = run(args.tokens, args.experts, args.k, args.score, args.bias, device, repeats)
    print(f"routing bench: T={args.tokens} bias={args.bias} device={meta['device']} date={meta['date']} "
          f"torch={meta['torch']}")
    rc = 0
    if use_cuda:
        print(f"device copy bandwidth (clone of 1 GiB): {meta['copy_GBps']:.0f} GB/s")
        print(format_table(rows, ["score", "E", "k", "kernel_us", "GBps", "bw_frac", "torch_us", "speedup",
                                  "reference_us", "check", "mismatch_rows"]))
        bad = [r for r in rows if r["check"] != "ok"]
        slow = [r for r in rows if r["bw_frac"] < TARGET_BW_FRACTION or r["speedup"] < TARGET_SPEEDUP]
        print(f"correctness vs reference: {'all ok' if not bad else f'{len(bad)} FAILED'}")
        print(f"targets (>= {TARGET_BW_FRACTION:.0%} of copy bandwidth and >= {TARGET_SPEEDUP:g}x torch): "
              f"{len(rows) - len(slow)}/{len(rows)} rows meet both")
        rc = 1 if bad or (args.strict and slow) else 0
    else:
        print(format_table(rows, ["score", "E", "k", "torch_us", "torch_GBps", "reference_us"]))
        print("the Triton kernel needs CUDA for timing (under TRITON_INTERPRET=1 it runs in a Python "
              "interpreter); rows above are the torch router and routing_reference on this CPU")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())

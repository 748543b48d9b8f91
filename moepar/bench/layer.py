"""``python -m moepar bench layer``: the whole MoE layer (router + permute + grouped experts +
unpermute, forward + backward, every gradient, aux loss included) against

(a) the floor: the fastest available implementation of the expert GEMMs + activation
    alone, forward + backward, on the same routes (``moepar.bench.local``'s candidates);
(b) a plain-torch reference MoE with dense one-hot dispatch (``reference_moe``);
(c) DeepSpeed-MoE, torchtitan's MoE and Megatron-Core when importable (``peers``), on the
    same weights. torchtitan's experts are SwiGLU only: with GELU experts (the default) it is
    timed against a SwiGLU twin of moepar's layer (same router weights), whose row says so.

Legend (docs/moe.md): T tokens, D hidden, F ffn hidden, E experts, K top-k, N = T*K rows of
the permuted buffer (dropless: one per route).

Timing: median over rounds after warm-up; the floor candidates and moepar are interleaved
round by round in one group, and each other yardstick in a group of its own with moepar
again, so that every ratio compares runs made side by side (moepar's row shows the ratio
to DeepSpeed/reference/torchtitan from that pair). Every row: median ms, achieved GFLOP/s (the expert
GEMM flops of N routes, the same numerator for every row) and its fraction of this
machine's matmul rate measured in the same run, the time's ratio to each yardstick, peak
memory (CPU: each case in a fresh process, the resident memory its step adds, see
``common.step_peak_bytes``; CUDA: ``max_memory_allocated`` above the baseline), tokens/s.
``--device cuda`` also checks the Triton kernels against their references and reports the
kernels' bandwidth as a fraction of the card's copy bandwidth (``moepar.bench.kernel_checks``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from typing import Callable

import torch

from moepar.tables import format_table
from moepar.bench.common import (grad_step, keep_freed_memory, matmul_gflops, run_in_fresh_process,
                                 step_peak_bytes)
from moepar.bench.local import (DTYPES, autograd_grouped_mm, autograd_loop, loadavg, machine, path_ok,
                                timed_rounds, expert_flops)
from moepar.bench.peers import (DeepSpeedMoE, TorchTitanMoE, compare_with_moepar, deepspeed_status,
                                megatron_status, torchtitan_gap, torchtitan_status)
from moepar.bench.reference_moe import ReferenceMoE
from moepar.moe.layer import MoE
from moepar.parallel.groups import ParallelState
from moepar_kernels.permute import permute


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """One named benchmark configuration (see the module legend)."""
    T: int
    D: int
    F: int
    E: int
    K: int
    skew: float | None = None          # target busiest-expert load / mean load (Zipf-like logits)
    dtype: str = "fp32"
    floor_limit: float | None = None   # acceptance: moepar / floor (2-core CPU, fp32)
    peer_limit: float | None = None    # acceptance: moepar / DeepSpeed
    ds_drop_tokens: bool = True        # DeepSpeed's setting for this row (moepar is dropless)
    activation: str = "gelu"           # the experts' FFN (torchtitan's is "swiglu")

    def __post_init__(self) -> None:
        for name in ("T", "D", "F", "E", "K"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.K > self.E:
            raise ValueError(f"K={self.K} must be <= E={self.E}")
        if self.skew is not None and not 1.0 <= self.skew <= self.E / self.K:
            raise ValueError(f"skew={self.skew} must lie in [1, E/K={self.E / self.K:g}] (a token picks an "
                             f"expert at most once)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        if self.activation not in ("gelu", "swiglu", "relu"):
            raise ValueError(f"activation={self.activation!r} must be gelu, swiglu or relu")


_CONFIG_A = LayerConfig(4096, 512, 2048, 8, 2, floor_limit=1.10, peer_limit=1.0)
_CONFIG_B = LayerConfig(4096, 256, 256, 64, 8, floor_limit=1.30, peer_limit=1.0)
_CONFIG_C = dataclasses.replace(_CONFIG_A, skew=2.5, floor_limit=1.30, peer_limit=0.5, ds_drop_tokens=False)
CONFIGS = {"A": _CONFIG_A, "B": _CONFIG_B, "C": _CONFIG_C}
for _n, _c in list(CONFIGS.items()):   # D: the bf16 variants (no limits)
    CONFIGS[f"{_n}-bf16"] = dataclasses.replace(_c, dtype="bf16", floor_limit=None, peer_limit=None)



def parse_config(spec: str) -> LayerConfig:
    """A name of ``CONFIGS`` or a custom ``T:D:F:E:K[:skew][:bf16]`` (dropless, no limits)."""
    if spec in CONFIGS:
        return CONFIGS[spec]
    parts = spec.split(":")
    dtype = parts.pop() if parts and parts[-1] in DTYPES else "fp32"
    try:
        T, D, F, E, K = (int(v) for v in parts[:5])
        skew = float(parts[5]) if len(parts) == 6 else None
        if len(parts) not in (5, 6):
            raise ValueError
    except ValueError:
        raise ValueError(f"config {spec!r} must be one of {sorted(CONFIGS)} or T:D:F:E:K[:skew][:bf16]") from None
    return LayerConfig(T, D, F, E, K, skew=skew, dtype=dtype, ds_drop_tokens=skew is None)


FLOOR_PREFIX = "floor: "
MOEPAR, REFERENCE, DEEPSPEED = "moepar MoE", "reference (dense one-hot)", "DeepSpeed-MoE"
TORCHTITAN, MOEPAR_SWIGLU = "torchtitan MoE", "moepar MoE, swiglu twin (torchtitan's FFN)"
# (the twin: moepar's layer with SwiGLU experts and the same router, for a config whose
# experts are not SwiGLU; its "x floor" is left out, the floor being the other FFN's)
TITAN_TOL = 2e-2   # torchtitan's experts run in bf16 whatever the dtype: bf16's rounding


def cpu_bf16_native() -> tuple[bool, str]:
    """Whether this CPU has bf16 arithmetic (avx512_bf16 or AMX); else bf16 is emulated."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    have = [fl for fl in ("avx512_bf16", "amx_bf16") if fl in flags]
    return bool(have), ",".join(have) or "no avx512_bf16/amx_bf16"


def skew_input_shift(gate_ED: torch.Tensor, x_TD: torch.Tensor, k: int, target: float
                     ) -> tuple[torch.Tensor, float]:
    """(u_D, s): adding u to every token adds the fixed offset ``-s * ln(1 + e)`` to expert
    e's logit (probabilities scaled by a Zipf-like ``(1 + e)^-s``), with s bisected so that
    the busiest expert gets ``target`` x the mean load on these tokens. The shift lives in
    the input, so every implementation sees the same skewed routing from the same gate."""
    E = gate_ED.shape[0]
    gate = gate_ED.double()
    logits = x_TD.double() @ gate.t()
    rank = torch.log1p(torch.arange(E, dtype=torch.float64))

    def ratio(s: float) -> float:
        ids = torch.topk(logits - s * rank, k, dim=-1).indices
        counts = torch.bincount(ids.flatten(), minlength=E).double()
        return float(counts.max() / counts.mean())

    lo, hi = 0.0, 1.0
    while ratio(hi) < target and hi < 64:
        lo, hi = hi, 2 * hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < target else (lo, mid)
    s = (lo + hi) / 2
    return zipf_input_shift(gate_ED, s), s


def zipf_input_shift(gate_ED: torch.Tensor, s: float) -> torch.Tensor:
    """u_D with ``gate_ED @ u = -s * ln(1 + e)`` (least-norm; the gate has full row rank)."""
    gate = gate_ED.double()
    offset_E = -s * torch.log1p(torch.arange(gate.shape[0], dtype=torch.float64))
    return (torch.linalg.pinv(gate) @ offset_E).float()


class LayerCase:
    """The inputs of one configuration and a factory of step functions per implementation."""

    def __init__(self, name: str, cfg: LayerConfig, device: torch.device, seed: int = 0):
        self.name, self.cfg, self.device = name, cfg, device
        self.dtype = DTYPES[cfg.dtype]
        torch.manual_seed(seed)
        self.moe = MoE(cfg.D, cfg.E, k=cfg.K, ffn_hidden=cfg.F, init_seed=1, dtype=self.dtype,
                       activation=cfg.activation, state=ParallelState.single()).to(device)
        self._titan_moe = None
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(cfg.T, cfg.D, generator=gen)
        g = torch.randn(cfg.T, cfg.D, generator=gen)
        self.zipf_s = None
        if cfg.skew is not None:
            u, self.zipf_s = skew_input_shift(self.moe.router.weight.detach().cpu(), x, cfg.K, cfg.skew)
            x = x + u
        self.x = x.to(device, self.dtype).requires_grad_(True)
        self.g = g.to(device, self.dtype)
        with torch.no_grad():
            r = self.moe.router(self.x)
        x_ND, counts_E, _ = permute(self.x.detach(), r.expert_ids, None, cfg.E)
        self.counts = counts_E.tolist()
        self.N = sum(self.counts)
        self.load_ratio = max(self.counts) * cfg.E / max(self.N, 1)
        self.x_ND = x_ND.detach().requires_grad_(True)
        self.g_ND = torch.randn(self.N, cfg.D, generator=gen).to(device, self.dtype)
        self.flops = expert_flops(self.N, cfg.D, cfg.F, self.moe.experts.activation)

    @property
    def titan_moe(self) -> MoE:
        """The moepar layer torchtitan is compared with: this case's, or its SwiGLU twin."""
        if self._titan_moe is None:
            self._titan_moe = self.moe if self.cfg.activation == "swiglu" else MoE(
                self.cfg.D, self.cfg.E, k=self.cfg.K, ffn_hidden=self.cfg.F, init_seed=1, dtype=self.dtype,
                activation="swiglu", state=ParallelState.single()).to(self.device)
        return self._titan_moe

    @property
    def titan_pair(self) -> str:
        """The name of the moepar row torchtitan is timed with."""
        return MOEPAR if self.cfg.activation == "swiglu" else MOEPAR_SWIGLU

    def titan_check(self) -> dict:
        """torchtitan against moepar on this case's input: ``peers.compare_with_moepar``."""
        return compare_with_moepar(self.titan_moe, TorchTitanMoE(self.titan_moe), self.x, self.g)

    def factories(self, with_reference: bool = True, with_peers: bool = True
                  ) -> dict[str, Callable[[], Callable[[], None]]]:
        """name -> () -> step: each step runs forward + backward once (grads returned, not kept)."""
        m, x, g = self.moe.experts, self.x, self.g
        out: dict[str, Callable[[], Callable[[], None]]] = {}

        def floor_path(path):
            def make():
                params = list(m.parameters())

                def step():
                    saved, m.gemm_path = m.gemm_path, path
                    try:
                        torch.autograd.grad(m(self.x_ND, self.counts), [self.x_ND] + params, self.g_ND)
                    finally:
                        m.gemm_path = saved
                return step
            return make

        for path in ("loop", "grouped_mm", "bmm"):
            if path_ok(m, path, self.x_ND, self.counts):
                out[f"{FLOOR_PREFIX}experts[{path}]"] = floor_path(path)
        if path_ok(m, "grouped_mm", self.x_ND, self.counts):
            def make_gmm():
                offs = torch.cumsum(torch.tensor(self.counts, device=self.device), 0).to(torch.int32)
                return lambda: torch.autograd.grad(autograd_grouped_mm(self.x_ND, offs, m),
                                                   [self.x_ND] + list(m.parameters()), self.g_ND)
            out[f"{FLOOR_PREFIX}autograd F.grouped_mm"] = make_gmm
        if self.cfg.E <= 16:   # one small graph per expert: only worth timing for few experts
            out[f"{FLOOR_PREFIX}autograd per-expert loop"] = lambda: (
                lambda: torch.autograd.grad(autograd_loop(self.x_ND, self.counts, m),
                                            [self.x_ND] + list(m.parameters()), self.g_ND))

        def module_step(build):
            return lambda: grad_step(build(), x, g)

        out[MOEPAR] = module_step(lambda: self.moe)
        if with_reference:
            out[REFERENCE] = module_step(lambda: ReferenceMoE.from_moepar(self.moe).to(self.device))
        if with_peers and deepspeed_status()[0]:
            out[DEEPSPEED] = module_step(lambda: DeepSpeedMoE(self.moe, drop_tokens=self.cfg.ds_drop_tokens))
        if with_peers and torchtitan_status()[0] and torchtitan_gap(self.titan_moe) is None:
            if self.titan_pair != MOEPAR:
                out[MOEPAR_SWIGLU] = module_step(lambda: self.titan_moe)
            out[TORCHTITAN] = module_step(lambda: TorchTitanMoE(self.titan_moe))
        return out


def _child_peak(name: str, cfg: LayerConfig, impl: str, threads: int, malloc: str) -> tuple[int, str]:
    """Runs in a fresh process: build the case, then measure one step of ``impl``."""
    torch.set_num_threads(threads)
    if malloc == "keep":
        keep_freed_memory()
    case = LayerCase(name, cfg, torch.device("cpu"))
    step = case.factories()[impl]()
    return step_peak_bytes(step)


def _cuda_peak(step: Callable[[], None], device) -> tuple[int, str]:
    step()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base, "max_memory_allocated - baseline"


def bench_config(name: str, cfg: LayerConfig, device: torch.device, rounds: int, warmup: int, clock: str,
                 matmul: float | None, memory: bool = True, with_reference: bool = True,
                 with_peers: bool = True, malloc: str = "default") -> dict:
    """Times every implementation of one configuration; see the module docstring."""
    case = LayerCase(name, cfg, device)
    makers = case.factories(with_reference, with_peers)
    steps = {k: make() for k, make in makers.items()}
    # Each yardstick is timed interleaved with moepar in its own group, so that a ratio
    # compares runs that saw the same machine and the same heap (the reference's GiB-sized
    # buffers would otherwise disturb the floor's and moepar's page-fault counts).
    floor_group = {k: v for k, v in steps.items() if k.startswith(FLOOR_PREFIX) or k == MOEPAR}
    secs, faults = timed_rounds(floor_group, rounds, warmup, device, clock)
    pair_moepar: dict[str, float] = {}
    for other in (DEEPSPEED, REFERENCE, TORCHTITAN):
        if other in steps:
            mine = case.titan_pair if other == TORCHTITAN else MOEPAR
            t, f = timed_rounds({mine: steps[mine], other: steps[other]}, rounds, warmup, device, clock)
            secs[other], pair_moepar[other], faults[other] = t[other], t[mine], f[other]
            if mine != MOEPAR:
                secs[mine], faults[mine] = t[mine], f[mine]
    titan = case.titan_check() if TORCHTITAN in steps else None
    floor_name = min((k for k in secs if k.startswith(FLOOR_PREFIX)), key=secs.get)
    floor_s = secs[floor_name]
    peaks: dict[str, int] = {}
    mem_method = None
    if memory:
        for impl in [floor_name, MOEPAR, REFERENCE, DEEPSPEED, MOEPAR_SWIGLU, TORCHTITAN]:
            if impl not in steps:
                continue
            if device.type == "cuda":
                peaks[impl], mem_method = _cuda_peak(steps[impl], device)
            else:
                peaks[impl], mem_method = run_in_fresh_process(_child_peak, name, cfg, impl,
                                                               torch.get_num_threads(), malloc)
    rows = []
    for impl, s in secs.items():
        # The SwiGLU rows of a GELU config compute 1.5x the GEMM flops, and only each other's function.
        swiglu_pair = impl in (MOEPAR_SWIGLU, TORCHTITAN) and case.titan_pair == MOEPAR_SWIGLU
        flops = expert_flops(case.N, cfg.D, cfg.F, "swiglu") if swiglu_pair else case.flops
        row = {"impl": impl, "ms": s * 1e3, "GFLOP/s": flops / s / 1e9,
               "of matmul": flops / s / 1e9 / matmul if matmul and clock == "wall" else float("nan"),
               "x floor": float("nan") if swiglu_pair else s / floor_s}
        for col, ref in (("x reference", REFERENCE), ("x deepspeed", DEEPSPEED), ("x torchtitan", TORCHTITAN)):
            same = (ref == TORCHTITAN) == swiglu_pair or case.titan_pair == MOEPAR
            # moepar's row: its time in the pair's own group; others: against that yardstick.
            mine = pair_moepar[ref] if impl == (case.titan_pair if ref == TORCHTITAN else MOEPAR) \
                and ref in pair_moepar else s
            row[col] = mine / secs[ref] if ref in secs and same else float("nan")
        row["peak MB"] = peaks[impl] / 2 ** 20 if impl in peaks else float("nan")
        row["tokens/s"] = cfg.T / s
        row["page faults"] = faults[impl]
        rows.append(row)
    return {"config": name, **dataclasses.asdict(cfg), "N": case.N, "load_max_over_mean": case.load_ratio,
            "zipf_s": case.zipf_s, "gflop": case.flops / 1e9, "floor_impl": floor_name,
            "auto_gemm_path": case.moe.experts.resolve_gemm_path(case.x_ND, case.counts),
            "memory_method": mem_method, "rows": rows, "seconds": secs, "moepar_s_in_pair": pair_moepar,
            "peak_bytes": peaks, "torchtitan_check": titan}


def verdicts(r: dict) -> list[tuple[str, bool | None]]:
    """The acceptance checks of one config result: (text, ok or None when not measured)."""
    secs, peaks, out = r["seconds"], r["peak_bytes"], []
    m = secs[MOEPAR]
    ratio = m / secs[r["floor_impl"]]
    lim = r["floor_limit"]
    out.append((f"moepar / floor = {ratio:.3f}" + (f" (limit {lim:.2f})" if lim else ""),
                None if lim is None else ratio <= lim))
    if DEEPSPEED in secs:
        ratio = r["moepar_s_in_pair"][DEEPSPEED] / secs[DEEPSPEED]
        lim = r["peer_limit"]
        out.append((f"moepar / DeepSpeed (drop_tokens={r['ds_drop_tokens']}) = {ratio:.3f}"
                    + (f" (limit {lim:.2f})" if lim else ""), None if lim is None else ratio <= lim))
        if MOEPAR in peaks and DEEPSPEED in peaks:
            mm, dm = peaks[MOEPAR] / 2 ** 20, peaks[DEEPSPEED] / 2 ** 20
            out.append((f"peak memory moepar {mm:.0f} MB vs DeepSpeed {dm:.0f} MB", mm <= dm))
    if TORCHTITAN in secs:
        mine = MOEPAR_SWIGLU if MOEPAR_SWIGLU in secs else MOEPAR
        out.append((f"{mine} / torchtitan = {r['moepar_s_in_pair'][TORCHTITAN] / secs[TORCHTITAN]:.3f}", None))
        c = r["torchtitan_check"]
        out.append((f"torchtitan computes moepar's function: output within {c['rel_err_y']:.1e}, input gradient "
                    f"within {c['rel_err_dx']:.1e} (relative; limit {TITAN_TOL:g}, its experts run in bf16), "
                    f"same experts on {c['same_experts']} of {c['tokens']} tokens",
                    max(c["rel_err_y"], c["rel_err_dx"]) <= TITAN_TOL))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moepar bench layer", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=None,
                   help=f"comma list of {','.join(CONFIGS)} or T:D:F:E:K[:skew][:bf16] (default: A,B,C, plus "
                        f"the bf16 variants on a CPU with native bf16; on CUDA the bf16 variants)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    p.add_argument("--no-reference", action="store_true", help="skip the dense one-hot reference MoE")
    p.add_argument("--no-peers", action="store_true",
                   help="skip DeepSpeed / torchtitan / Megatron even when importable")
    p.add_argument("--activation", default=None, choices=("gelu", "swiglu", "relu"),
                   help="the experts' FFN in every config (default: gelu, docs/bench.md's configs)")
    p.add_argument("--no-matmul", action="store_true", help="skip the matmul roofline")
    p.add_argument("--malloc", default="default", choices=("default", "keep"),
                   help="keep: glibc keeps freed memory (no page faults from re-mapping large buffers at every "
                        "step, as with jemalloc/tcmalloc); default: the allocator as it is")
    p.add_argument("--strict", action="store_true", help="exit 1 when an acceptance limit is missed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    args.bf16 = (True, "cuda") if args.device.type == "cuda" else cpu_bf16_native()
    cuda_default = ["A-bf16", "B-bf16", "C-bf16"]
    args.names = args.configs.split(",") if args.configs else (
        cuda_default if args.device.type == "cuda" else ["A", "B", "C"] + (cuda_default if args.bf16[0] else []))
    try:
        args.parsed = {n: parse_config(n) for n in args.names}
        if args.activation:
            args.parsed = {n: dataclasses.replace(c, activation=args.activation) for n, c in args.parsed.items()}
    except ValueError as e:
        p.error(str(e))
    return args


def run(args: argparse.Namespace) -> dict:
    """Every configuration of ``args``: the JSON-ready result (also what ``main`` prints)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if args.malloc == "keep" and not keep_freed_memory():
        raise SystemExit("--malloc keep needs glibc's mallopt")
    out: dict = {"malloc": args.malloc, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
                 "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device),
                 "clock": args.clock, "load_avg_1min": loadavg(), "deepspeed": deepspeed_status()[1],
                 "torchtitan": torchtitan_status()[1],
                 "megatron": megatron_status()[1], "bf16_native": args.bf16[1]}
    on_cuda = device.type == "cuda"
    matmul = None if args.no_matmul else matmul_gflops(8192 if on_cuda else 4096,
                                                       torch.bfloat16 if on_cuda else torch.float32, str(device),
                                                       repeats=5, best=True)
    out["matmul_gflops"] = matmul
    results = [bench_config(n, cfg, device, args.rounds, args.warmup, args.clock, matmul, not args.no_memory,
                            not args.no_reference, not args.no_peers, args.malloc) for n, cfg in args.parsed.items()]
    out["configs"] = [{k: v for k, v in r.items() if k not in ("seconds", "peak_bytes", "moepar_s_in_pair")}
                      for r in results]
    out["checks"] = {r["config"]: [{"check": t, "ok": ok} for t, ok in verdicts(r)] for r in results}
    if on_cuda:
        from moepar.bench.kernel_checks import gpu_checks
        out["gpu"] = gpu_checks(device, args.rounds)
    out["failed"] = any(c["ok"] is False for v in out["checks"].values() for c in v) or (
        "gpu" in out and not out["gpu"]["all_ok"])
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.json:   # stdout is the one JSON object: what the peers print (DeepSpeed's logger) goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            out = run(args)
        print(json.dumps(out, indent=1, default=str))
        return 1 if args.strict and out["failed"] else 0
    out = run(args)
    rc = 1 if args.strict and out["failed"] else 0
    print(f"# bench layer  {out['date']}  {out['machine']}  torch {out['torch']}  threads={out['threads']}  "
          f"device={out['device']}  clock={args.clock}  malloc={args.malloc}  load(1 min)={out['load_avg_1min']}")
    if out["matmul_gflops"]:
        print(f"{'8192^3 bf16' if args.device.type == 'cuda' else '4096^3 fp32'} matmul: "
              f"{out['matmul_gflops']:.1f} GFLOP/s (this run, fastest of 5)")
    print(f"DeepSpeed: {out['deepspeed']}; torchtitan: {out['torchtitan']}; Megatron-Core: {out['megatron']}")
    if args.device.type == "cpu" and not args.bf16[0] and not args.configs:
        print(f"bf16 configs (D) skipped: this CPU has {args.bf16[1]} (bf16 would be emulated); "
              f"--configs A-bf16,B-bf16,C-bf16 runs them anyway")
    for r in out["configs"]:
        skew = (f", skewed: busiest expert {r['load_max_over_mean']:.2f}x the mean load (Zipf s={r['zipf_s']:.3f})"
                if r["skew"] else f", max/mean load {r['load_max_over_mean']:.2f}")
        print(f"\nconfig {r['config']}: T={r['T']} D={r['D']} F={r['F']} E={r['E']} K={r['K']} {r['dtype']} "
              f"{r['activation']} "
              f"dropless{skew}; {r['gflop']:.1f} GFLOP expert fwd+bwd; moepar GEMM path: {r['auto_gemm_path']}; "
              f"DeepSpeed drop_tokens={r['ds_drop_tokens']}")
        print(format_table(r["rows"], ["impl", "ms", "GFLOP/s", "of matmul", "x floor", "x reference",
                                       "x deepspeed", "x torchtitan", "peak MB", "tokens/s", "page faults"]))
        if r["memory_method"]:
            print(f"(peak MB: {r['memory_method']}, one fresh process per row)")
    print()
    for name, items in out["checks"].items():
        for c in items:
            print(f"{name}: {c['check']}" + ("" if c["ok"] is None else (": ok" if c["ok"] else ": MISSED")))
    if "gpu" in out:
        from moepar.bench.kernel_checks import print_gpu
        print_gpu(out["gpu"])
    return rc


if __name__ == "__main__":
    raise SystemExit(main())

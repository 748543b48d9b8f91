"""One prepared GPU run: moepar's MoE layer eager, compiled whole and captured in a
CUDA graph, torchtitan's MoE eager and compiled, and the autograd ``F.grouped_mm`` floor,
forward + backward, at docs/bench.md's A, B, C-bf16 and at two model-sized layers
(Mixtral-8x7B's and a DeepSeek-V3-shaped one); then the routing kernel alone against the
device's copy bandwidth, measured here. At most 8 minutes on one H100 or H200.

    python scripts/gpu_bench.py --out gpu_bench.md
    python scripts/gpu_bench.py --device cpu --out /tmp/dry.md     # dry run: tiny shapes

Legend: T tokens, D hidden, F ffn hidden, E experts, K top-k, N = T*K routes. Every layer
has SwiGLU experts (torchtitan's only FFN, and the model layers'), bf16, dropless, ep = 1.
A row's time is the median of CUDA-event windows of whole steps after a warm-up: forward,
then gradients to the input and every parameter (moepar's aux loss included; torchtitan has
none). "compiled": ``torch.compile(layer, fullgraph=True)``; "graph": the eager step captured
with ``torch.cuda.graph`` and replayed. The floor is the expert GEMMs alone on moepar's routes.

Every section (a configuration's eager rows, a layer compiled at one or two configurations,
the routing kernel) runs in its own forked process under a time limit and inside an overall
budget; a section that fails or runs out of time prints its error in its rows and the rest
go on. Rows go to ``--out`` (markdown) as each section ends. The parent never touches CUDA
(a forked child must be the first to). torchtitan rows need it importable: ``--peer-path
DIR`` puts a directory first on sys.path (``pip install --no-deps --target DIR
torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring-parser typeguard``, all pure Python).
The dry run (``--device cpu``: TRITON_INTERPRET=1, tiny shapes, compile with dynamo's eager
backend, no CUDA graphs) is run by the test suite.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (T, D, F, E, K, router options, skew: busiest expert / mean load); dry-run shapes after
CONFIGS = {
    "A-bf16": ((4096, 512, 2048, 8, 2, {}, None), (64, 32, 64, 8, 2)),
    "B-bf16": ((4096, 256, 256, 64, 8, {}, None), (64, 32, 32, 16, 4)),
    "C-bf16": ((4096, 512, 2048, 8, 2, {}, 2.5), (64, 32, 64, 8, 2)),
    "Mixtral-8x7B": ((8192, 4096, 14336, 8, 2, {}, None), (64, 32, 48, 8, 2)),
    "DeepSeek-V3": ((4096, 7168, 2048, 32, 8, {"score_func": "sigmoid", "expert_bias": True}, None),
                    (64, 32, 16, 32, 8)),
}
ROUTING = (65536, 256, 8)   # T, E, K of the routing kernel alone (dry run: T 256)
# Sections: (name, kind, arguments, time limit in seconds). Cheap and certain first, compiles last.
SECTIONS = ([("device", "device", (), 60)]
            + [(f"eager {c}", "eager", (c,), 90) for c in CONFIGS]
            + [("routing kernel", "routing", (), 60)]
            + [(f"{impl} compiled {'+'.join(cs)}", "compiled", (impl, cs), 110)
               for cs in (("A-bf16", "C-bf16"), ("B-bf16",), ("Mixtral-8x7B",), ("DeepSeek-V3",))
               for impl in ("moepar", "torchtitan")])
FLOOR, MOEPAR, TITAN = "floor: autograd F.grouped_mm", "moepar", "torchtitan"


# ---- run in the section's process ------------------------------------------------------------

class Section:
    """What a section's process knows: device, dry run, where rows go."""

    def __init__(self, device: str, rows_path: str, rounds: int):
        self.device, self.rows_path, self.rounds = device, rows_path, rounds
        self.dry = device == "cpu"

    def emit(self, **row) -> None:
        with open(self.rows_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"  {row}", flush=True)

    def sync(self) -> None:
        import torch
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time(self, fn, warmup: int = 3) -> float:
        """Median seconds per call: windows of calls timed with CUDA events (CPU: the clock)."""
        import statistics
        for _ in range(warmup):
            fn()
        self.sync()
        iters, out = (1 if self.dry else 5), []
        if self.device == "cuda":   # the CUDA-event windows `bench routing` times its kernel with
            from moepar.bench.routing import cuda_time
            return cuda_time(fn, iters, max(self.rounds, 1))
        for _ in range(max(self.rounds, 1)):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) / iters)
        return statistics.median(out)

    def row(self, config: str, name: str, fn, **extra) -> None:
        """Time ``fn()`` (a step), or report why it could not run; never raises."""
        try:
            step = fn()
            t0 = time.perf_counter()
            step()   # the first step: a compiled row's compile, a graph's capture
            self.sync()
            first = time.perf_counter() - t0
            self.emit(config=config, row=name, ms=self.time(step) * 1e3, first_s=round(first, 2), **extra)
        except Exception as e:   # noqa: BLE001 - the row shows it, the section goes on
            traceback.print_exc()
            self.emit(config=config, row=name, error=first_line(e), **extra)
        finally:
            import gc
            import torch
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()


def first_line(e: Exception, width: int = 200) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:width] if str(e) else ''}"


def shapes(config: str, dry: bool):
    full, tiny = CONFIGS[config]
    T, D, F, E, K = tiny if dry else full[:5]
    return T, D, F, E, K, full[5], full[6]


def build(config: str, device: str, dry: bool):
    """(moe, x, g): moepar's layer built on the meta device and initialised on ``device`` (a
    model-sized layer's CPU init would take longer than its benchmark), input and gradient."""
    import math
    import torch
    from moepar.moe.layer import MoE
    from moepar.parallel.groups import ParallelState
    T, D, F, E, K, options, skew = shapes(config, dry)
    with torch.device("meta"):
        moe = MoE(D, E, k=K, ffn_hidden=F, activation="swiglu", dtype=torch.bfloat16, init_seed=1,
                  state=ParallelState.single(), **options)
    moe.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            bound = 1 / math.sqrt(F if name.endswith("w2") else D)
            p.uniform_(-bound, bound, generator=gen)
        for name, b in moe.named_buffers():
            b.zero_()
        if moe.router.expert_bias is not None:   # a trained bias is not zero
            moe.router.expert_bias.uniform_(-0.05, 0.05, generator=gen)
    x = torch.randn(T, D, device=device, generator=gen)
    if skew:
        from moepar.bench.layer import skew_input_shift
        u, _ = skew_input_shift(moe.router.weight.detach().cpu(), x.cpu(), K, skew)
        x = x + u.to(device)
    x = x.to(torch.bfloat16).requires_grad_(True)
    g = torch.randn(T, D, device=device, generator=gen).to(torch.bfloat16)
    return moe, x, g


def graph_step(sec: Section, step):
    """``step`` captured once in a CUDA graph (after a warm-up on a side stream); replays."""
    import torch
    if sec.dry:
        raise RuntimeError("not run: no CUDA graphs in the CPU dry run")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def compile_module(sec: Section, module):
    import torch
    # The dry run checks that dynamo traces the layer whole (no graph break); compiling the
    # forward and backward with inductor is the GPU run's work.
    return torch.compile(module, fullgraph=True, backend="eager" if sec.dry else "inductor")


def section_eager(sec: Section, config: str) -> None:
    import torch
    from moepar.bench.common import grad_step
    from moepar.bench.local import autograd_grouped_mm
    from moepar.bench.peers import TorchTitanMoE, torchtitan_status
    from moepar_kernels.permute import permute
    moe, x, g = build(config, sec.device, sec.dry)
    T, D, F, E, K, _, _ = shapes(config, sec.dry)
    with torch.no_grad():
        r = moe.router(x.detach(), count=False)
        x_ND, counts_E, _ = permute(x.detach(), r.expert_ids, None, E)
    x_ND.requires_grad_(True)
    g_ND = torch.randn_like(x_ND)
    offs = torch.cumsum(counts_E, 0).to(torch.int32)
    params = list(moe.experts.parameters())
    extra = {"N": int(x_ND.shape[0]), "load": round(float(counts_E.max()) * E / max(int(x_ND.shape[0]), 1), 2)}
    sec.row(config, FLOOR, lambda: lambda: torch.autograd.grad(autograd_grouped_mm(x_ND, offs, moe.experts),
                                                                [x_ND] + params, g_ND), **extra)
    sec.row(config, f"{MOEPAR} eager", lambda: grad_step(moe, x, g))
    ok, why = torchtitan_status()
    if ok:
        sec.row(config, f"{TITAN} eager", lambda: grad_step(TorchTitanMoE(moe), x, g))
    else:
        sec.emit(config=config, row=f"{TITAN} eager", error=why)
    # last: a capture that fails can leave the device unusable for the rest of the process
    sec.row(config, f"{MOEPAR} graph", lambda: graph_step(sec, grad_step(moe, x, g)))


def section_compiled(sec: Section, impl: str, configs: tuple[str, ...]) -> None:
    """One compiled layer, at configs of equal shapes (C is A with skewed routing: one compile).
    A layer that does not compile before its first eager call (state a first call sets up)
    is compiled again after one eager step; the row then says why it needed one."""
    import torch
    from moepar.bench.common import grad_step
    from moepar.bench.peers import TorchTitanMoE, torchtitan_status
    ok, why = torchtitan_status()
    compiled, first_error = None, None
    for config in configs:
        if impl == TITAN and not ok:
            sec.emit(config=config, row=f"{TITAN} compiled", error=why)
            continue
        moe, x, g = build(config, sec.device, sec.dry)
        layer = moe if impl == MOEPAR else TorchTitanMoE(moe)
        note = {}
        if compiled is None:
            compiled = compile_module(sec, layer)
            try:
                t0 = time.perf_counter()
                grad_step(compiled, x, g)()
                sec.sync()
                note["note"] = f"compile + first step {time.perf_counter() - t0:.1f} s"
            except Exception as e:   # noqa: BLE001 - reported in the row
                first_error = first_line(e, 160)
                torch._dynamo.reset()
                grad_step(layer, x, g)()   # one eager step, then compile again (the row's first step)
                compiled = compile_module(sec, layer)
        else:   # same shapes: the graph compiled for the first config, this config's weights
            compiled._orig_mod.load_state_dict(layer.state_dict())
        if first_error:
            note["note"] = f"compiled only after an eager step; before it: {first_error}"
        sec.row(config, f"{impl} compiled", lambda: grad_step(compiled, x, g), **note)


def section_routing(sec: Section) -> None:
    import torch
    from moepar.bench.routing import route_bytes
    from moepar_kernels import routing as rk
    T, E, K = ROUTING
    T = 256 if sec.dry else T
    nbytes = (64 << 20) if sec.dry else (1 << 30)
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=sec.device)
    copy_bps = 2 * nbytes / sec.time(buf.clone)   # read + write
    del buf
    logits = torch.randn(T, E, device=sec.device)
    t = sec.time(lambda: rk.routing(logits, K))
    bps = route_bytes(T, E, K) / t
    sec.emit(config=f"routing T={T} E={E} K={K}", row="routing kernel (softmax, fwd)", us=t * 1e6,
             GBps=bps / 1e9, copy_GBps=copy_bps / 1e9, of_copy=bps / copy_bps)


def section_device(sec: Section) -> None:
    import torch
    import triton
    from moepar.bench.peers import torchtitan_status
    name = torch.cuda.get_device_name() if sec.device == "cuda" else "CPU (dry run)"
    sec.emit(config="-", row="device", name=name, torch=torch.__version__, triton=triton.__version__,
             torchtitan=torchtitan_status()[1])


def run_section(kind: str, args: tuple, device: str, rows_path: str, rounds: int) -> None:
    sec = Section(device, rows_path, rounds)
    {"eager": section_eager, "compiled": section_compiled, "routing": section_routing,
     "device": section_device}[kind](sec, *args)


# ---- the parent: sections in turn, the table as it goes ---------------------------------------

def markdown_rows(rows: list[dict], floors: dict, titans: dict) -> list[str]:
    out = []
    for r in rows:
        if r["row"] == "device":
            continue
        if "us" in r:
            out.append(f"| {r['config']} | {r['row']} | {r['us']:.1f} us | | | {r['GBps']:.0f} GB/s, "
                       f"{100 * r['of_copy']:.0f} % of copy ({r['copy_GBps']:.0f} GB/s) | |")
            continue
        if "error" in r:
            out.append(f"| {r['config']} | {r['row']} | - | | | | {r['error']} |")
            continue
        fl, ti = floors.get(r["config"]), titans.get(r["config"])
        T, D, F, E, K = shapes(r["config"], r.get("dry", False))[:5]
        from moepar.bench.local import expert_flops
        tflops = expert_flops(T * K, D, F, "swiglu") / (r["ms"] / 1e3) / 1e12
        note = f"first step {r['first_s']} s" + (f", N {r['N']}, busiest expert {r['load']}x mean" if "N" in r else "")
        note += f"; {r['note']}" if "note" in r else ""
        out.append(f"| {r['config']} | {r['row']} | {r['ms']:.3f} | {r['ms'] / fl:.2f} |" if fl else
                   f"| {r['config']} | {r['row']} | {r['ms']:.3f} | - |")
        out[-1] += f" {r['ms'] / ti:.2f} |" if ti else " - |"
        out[-1] += f" {tflops:.3g} | {note} |"
    return out


def _kernels_from_source() -> None:
    """A checkout that was not pip-installed (a GPU machine without a package index) has
    ``kernels/`` but no ``moepar_kernels``: import the one as the other (pyproject's mapping)."""
    import importlib.util
    if importlib.util.find_spec("moepar_kernels") is not None:
        return
    path = os.path.join(ROOT, "kernels")
    spec = importlib.util.spec_from_file_location("moepar_kernels", os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules["moepar_kernels"] = module
    spec.loader.exec_module(module)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the dry run (TRITON_INTERPRET=1, tiny shapes, backend eager, no CUDA graphs)")
    p.add_argument("--out", default="gpu_bench.md", help="the markdown table, written as sections end")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for every section together")
    p.add_argument("--rounds", type=int, default=10, help="timed windows per row (dry run: 1)")
    p.add_argument("--sections", default=None, help="comma-separated substrings of section names to run")
    p.add_argument("--peer-path", default=None, help="a directory put first on sys.path (torchtitan)")
    args = p.parse_args(argv)
    dry = args.device == "cpu"
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported, here and in the children
        args.rounds = 1
    for path in (args.peer_path, ROOT):
        if path and os.path.abspath(path) not in sys.path:
            sys.path.insert(0, os.path.abspath(path))
    _kernels_from_source()
    # Imported once here, before the forks (no CUDA call: a forked child must be the first).
    import torch  # noqa: F401
    import moepar.bench.layer  # noqa: F401
    from moepar.bench.peers import torchtitan_status
    torchtitan_status()
    wanted = [s.strip() for s in args.sections.split(",")] if args.sections else None
    sections = [s for s in SECTIONS if not wanted or any(w in s[0] for w in wanted)]
    start = time.monotonic()
    head = (f"# scripts/gpu_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}\n\n"
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; SwiGLU experts, bf16, dropless, ep 1; "
            f"fwd + bwd per step{' (DRY RUN on the CPU: tiny shapes, not timings)' if dry else ''}\n\n"
            "| config | row | ms fwd+bwd | x floor | x torchtitan eager | TFLOP/s (expert GEMMs) | note |\n"
            "|---|---|---|---|---|---|---|\n")
    with open(args.out, "w") as f:
        f.write(head)
    print(head, end="", flush=True)
    ctx = mp.get_context("fork")
    floors, titans, failed = {}, {}, 0
    for name, kind, sargs, limit in sections:
        left = args.budget - (time.monotonic() - start)
        if left < 10:
            lines = [f"| {name} | - | - | | | | not run: the {args.budget:.0f} s budget is spent |"]
            failed += 1
        else:
            fd, rows_path = tempfile.mkstemp(suffix=".jsonl")
            os.close(fd)
            t0 = time.monotonic()
            proc = ctx.Process(target=run_section, args=(kind, sargs, args.device, rows_path, args.rounds))
            proc.start()
            proc.join(min(limit, left))
            status = None
            if proc.is_alive():
                proc.kill()
                proc.join()
                status = f"stopped after {time.monotonic() - t0:.0f} s (its limit)"
            elif proc.exitcode != 0:
                status = f"its process exited with {proc.exitcode}"
            with open(rows_path) as f:
                rows = [dict(json.loads(ln), dry=dry) for ln in f if ln.strip()]
            os.unlink(rows_path)
            for r in rows:
                if "ms" in r and r["row"] == FLOOR:
                    floors[r["config"]] = r["ms"]
                if "ms" in r and r["row"] == f"{TITAN} eager":
                    titans[r["config"]] = r["ms"]
                if r["row"] == "device":
                    print(f"device: {r['name']}; torch {r['torch']}, triton {r['triton']}; {r['torchtitan']}")
                    with open(args.out, "a") as f:
                        f.write(f"| - | device: {r['name']}; torch {r['torch']}, triton {r['triton']}; "
                                f"{r['torchtitan']} | | | | | |\n")
            print(f"[{name}: {time.monotonic() - t0:.1f} s]", flush=True)
            failed += sum("error" in r for r in rows) + (status is not None)
            lines = markdown_rows(rows, floors, titans)
            if status:
                lines.append(f"| {name} | (section) | - | | | | {status} |")
        with open(args.out, "a") as f:
            f.write("".join(ln + "\n" for ln in lines))
        print("\n".join(lines), flush=True)
    print(f"\n{len(sections)} sections in {time.monotonic() - start:.0f} s; rows with an error or not run: "
          f"{failed}; table: {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

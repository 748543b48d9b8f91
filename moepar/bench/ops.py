"""``python -m moepar bench ops``: what one forward and one backward make the host do, counted
on the project's fake-CUDA instrument (tests/helpers/fake_cuda: "cuda" tensors holding CPU
data), for moepar's layer and torchtitan's MoE at the same configuration.

Per forward and per backward (one of each after a warm-up step; world of one, ep = 1):

* device ops: the aten ops a GPU would run as a kernel or a copy (views and allocations
  are not), as the instrument records them;
* Triton launches;
* Python function calls: every Python frame entered (``sys.setprofile``'s "call" events)
  in the calling thread and, for the backward, in the autograd engine's device thread
  (the profiler is installed there by a hook on the loss, the first thing the engine runs).
  Not counted: the instrument's own frames and whatever they call (its dispatch mode, the
  pytree work around each op), with the frames torch adds only because a dispatch mode is
  active (its dispatch-rule lookup and the wrapper around the mode), except the code under
  test they hand control back to (a custom op's body is moepar's); and every frame from a
  call into Triton's package down
  (its launcher and, under TRITON_INTERPRET=1, the interpreted kernel), since the
  interpreter's Python is not what a compiled launch runs. A real launch adds its launcher's
  Python on top (docs/benchmarks.md, "First GPU run", measured what that costs).

The forward is the layer plus ``y.float().sum()`` (plus moepar's aux loss when it is on);
the backward is ``loss.backward()``. Configurations: ``small`` (bf16, T 64, D 32, F 64, E 8,
K 2, the one tests/parallel/test_device_ops.py holds) and ``B-bf16`` (docs/bench.md's B:
T 4096, D 256, F 256, E 64, K 8). moepar runs with SwiGLU experts (the FFN torchtitan's
experts compute) and, for the budget's own layer, GELU (the default).

Needs a source checkout (the instrument lives in its tests/) and g++ (the instrument's
shim is compiled once); torchtitan rows appear when it imports (moepar.bench.peers).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (T, D, F, E, K) in bf16
CONFIGS = {"small": (64, 32, 64, 8, 2), "B-bf16": (4096, 256, 256, 64, 8)}
# The layers counted at each configuration: (row name, implementation, moepar options)
LAYERS = [
    ("torchtitan", "torchtitan", {"activation": "swiglu"}),
    ("moepar swiglu aux on", "moepar", {"activation": "swiglu"}),
    ("moepar swiglu aux off", "moepar", {"activation": "swiglu", "aux_loss": None}),
    ("moepar gelu aux on", "moepar", {}),
    ("moepar gelu aux off", "moepar", {"aux_loss": None}),
]


# ---- counting Python calls -------------------------------------------------------------------

_COUNT, _SKIP, _OPAQUE = 0, 1, 2          # what the frames below the top of a thread's stack are
_PLAIN, _INSTRUMENT, _TRITON, _UNDER_TEST, _HARNESS = range(5)


# Frames torch runs only because a Python dispatch mode (the instrument's) is active: the
# lookup of dispatch rules for the mode's type before each op, and the _disable_dynamo
# wrapper torch puts around every mode's __torch_dispatch__ (told apart from its other uses
# by the function it wraps).
_DISPATCH_RULES = os.path.join("torch", "_library", "simple_registry.py")
_DISABLE_DYNAMO = os.path.join("torch", "_compile.py")
_MODE_WRAPPER = ("mode wrapper",)


def _pkg_dir(name: str) -> str | None:
    """The directory of an installed package, imported or not yet (None: not installed)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.abspath(list(spec.submodule_search_locations)[0]) + os.sep


class PythonCalls:
    """Counts the Python frames entered between ``start(phase)`` and ``stop()`` in every thread
    it is installed in (``install()``: the calling thread; ``backward_hook``: the autograd
    engine's). What is left out: the module docstring. ``counts[phase]``: the total;
    ``by_package[phase]``: per top-level package."""

    def __init__(self, instrument_dir: str):
        self.instrument = os.path.abspath(instrument_dir) + os.sep
        self.triton = _pkg_dir("triton")
        self.under_test = tuple(d for d in (_pkg_dir("moepar"), _pkg_dir("moepar_kernels"), _pkg_dir("torchtitan"))
                                if d)
        # this module and the peers' adapters: the measuring code, not the layers'
        self.harness = (os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers.py"))
        self.phase: str | None = None
        self.counts: dict[str, int] = {}
        self.by_package: dict[str, dict[str, int]] = {}
        self._kinds: dict[object, tuple[int, str]] = {}
        self._local = threading.local()
        self._lock = threading.Lock()

    def _kind(self, frame) -> tuple[int, str]:
        code = frame.f_code
        k = self._kinds.get(code)
        if k is _MODE_WRAPPER:   # one code object for every wrapped function: look at this one's
            fn = frame.f_locals.get("fn")
            path = getattr(getattr(fn, "__code__", None), "co_filename", "")
            return (_INSTRUMENT, "instrument") if os.path.abspath(path).startswith(self.instrument) else \
                (_PLAIN, "torch")
        if k is None:
            path = os.path.abspath(code.co_filename)
            if path.startswith(self.instrument) or (code.co_name, path.endswith(_DISPATCH_RULES)) == \
                    ("find_torch_dispatch_rule", True):
                k = (_INSTRUMENT, "instrument")
            elif code.co_name == "inner" and path.endswith(_DISABLE_DYNAMO):
                self._kinds[code] = _MODE_WRAPPER
                return self._kind(frame)
            elif self.triton and path.startswith(self.triton):
                k = (_TRITON, "triton")
            elif path in self.harness:
                k = (_HARNESS, "harness")
            else:
                under = next((d for d in self.under_test if path.startswith(d)), None)
                pkg = os.path.basename(under.rstrip(os.sep)) if under else _package_of(path)
                k = (_UNDER_TEST if under else _PLAIN, pkg)
            self._kinds[code] = k
        return k

    def _profile(self, frame, event, arg):
        if event != "call" and event != "return":
            return
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        if event == "return":
            if stack and stack[-1][0] is frame:
                stack.pop()
            return
        if self.phase is None:
            return
        mode = stack[-1][1] if stack else _COUNT
        if mode == _OPAQUE:
            return
        kind, pkg = self._kind(frame)
        if kind == _INSTRUMENT or kind == _TRITON:
            if mode == _COUNT or kind == _TRITON:
                stack.append((frame, _OPAQUE if kind == _TRITON else _SKIP))
            return
        if mode == _SKIP:
            if kind != _UNDER_TEST:
                return
            stack.append((frame, _COUNT))   # the instrument handed control back to the code under test
        if kind == _HARNESS:
            return
        with self._lock:
            self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
            per = self.by_package.setdefault(self.phase, {})
            per[pkg] = per.get(pkg, 0) + 1

    def install(self) -> None:
        """Profile the calling thread from now on."""
        self._local.stack = []
        sys.setprofile(self._profile)

    def backward_hook(self, grad) -> None:
        """A hook for the loss: profiles the autograd engine's thread that runs this backward,
        until the backward ends (a final callback of the engine, in the same thread)."""
        import torch
        self.install()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: sys.setprofile(None))

    def start(self, phase: str) -> None:
        self.counts.setdefault(phase, 0)
        self.phase = phase

    def stop(self) -> None:
        self.phase = None


def _package_of(path: str) -> str:
    parts = path.replace(os.sep, "/").split("/")
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].removesuffix(".py")
    return "python" if "/lib/python" in path.replace(os.sep, "/") else "other"


# ---- one layer under the instrument ---------------------------------------------------------

@dataclasses.dataclass
class Count:
    """What one forward and one backward of a layer issued."""
    ops: dict[str, list[str]]            # phase -> aten device ops, in order
    launches: dict[str, list[str]]       # phase -> Triton kernel names
    python_calls: dict[str, int]         # phase -> Python frames entered
    by_package: dict[str, dict[str, int]]
    host_reads: dict[str, int]


def build_layer(impl: str, T: int, D: int, F: int, E: int, K: int, options: dict):
    """moepar's MoE (bf16, world of one) or torchtitan's holding its weights (the module a
    torchtitan user calls, ``TorchTitanMoE.inner``), on the CPU."""
    import torch
    from moepar.moe.layer import MoE
    from moepar.parallel.groups import ParallelState
    moe = MoE(D, E, k=K, ffn_hidden=F, init_seed=77, dtype=torch.bfloat16, state=ParallelState.single(),
              **options)
    if impl == "moepar":
        return moe
    from moepar.bench.peers import TorchTitanMoE
    return TorchTitanMoE(moe).inner


def count_layer(impl: str, shape: tuple[int, int, int, int, int], options: dict) -> dict:
    """In a process started with the instrument's shim: build, warm up, then count one
    forward and one backward (the dict of a ``Count``)."""
    import warnings

    import torch
    import moepar
    from tests.helpers import fake_cuda
    T, D, F, E, K = shape
    aux = impl == "moepar" and options.get("aux_loss", "switch") is not None
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    calls = PythonCalls(os.path.dirname(os.path.abspath(fake_cuda.__file__)))
    # On a GPU torch enables torchtitan's autocast(float32) region around its gate; the
    # instrument keeps torch.cuda.is_available() False, for which torch disables the region
    # instead, after an import-system probe and a warning at every call that a GPU never
    # makes. Let autocast see the device as a GPU would (it casts the fake-CUDA operands).
    amp = torch.cuda.amp.common
    saved = amp.amp_definitely_not_available
    amp.amp_definitely_not_available = lambda: False
    with warnings.catch_warnings(), _restore(amp, "amp_definitely_not_available", saved):
        warnings.simplefilter("ignore")
        with fake_cuda.session(strict=True) as rec:
            mod = fake_cuda.to_cuda(build_layer(impl, T, D, F, E, K, options))
            xc = fake_cuda.to_cuda(x).requires_grad_()

            def loss_of():
                y = mod(xc)
                return y.float().sum() + moepar.aux_loss(mod) if aux else y.float().sum()
            loss_of().backward()   # warm-up: first-call work (checks, caches) is not per-step cost
            calls.install()
            with rec.phase("forward"):
                calls.start("forward")
                loss = loss_of()
                calls.stop()
            loss.register_hook(calls.backward_hook)   # runs first in the engine's device thread
            with rec.phase("backward"):
                calls.start("backward")
                loss.backward()
                calls.stop()
            sys.setprofile(None)
    phases = ("forward", "backward")
    return dataclasses.asdict(Count(
        ops={p: rec.device_ops(p) for p in phases}, launches={p: rec.launches(p) for p in phases},
        python_calls={p: calls.counts.get(p, 0) for p in phases},
        by_package={p: dict(calls.by_package.get(p, {})) for p in phases},
        host_reads={p: len(rec.host_reads(p)) for p in phases}))


class _restore:
    def __init__(self, obj, name, value):
        self.obj, self.name, self.value = obj, name, value

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        setattr(self.obj, self.name, self.value)


def count_all(shape, layers=LAYERS) -> dict[str, dict]:
    """``count_layer`` for every row of ``layers`` whose implementation is available here
    (a row that is not gets ``{"absent": reason}``)."""
    from moepar.bench.peers import torchtitan_status
    ok, why = torchtitan_status()
    out = {}
    for name, impl, options in layers:
        out[name] = count_layer(impl, shape, options) if impl != "torchtitan" or ok else {"absent": why}
    return out


# ---- the table ---------------------------------------------------------------------------

def row_cells(c: dict) -> dict:
    """The table's cells of one counted layer."""
    f, b = c["ops"], c["launches"]
    calls = c["python_calls"]
    return {"fwd": f"{len(f['forward'])} + {len(b['forward'])}", "bwd": f"{len(f['backward'])} + {len(b['backward'])}",
            "ops+launches": sum(len(f[p]) + len(b[p]) for p in f),
            "py fwd": calls["forward"], "py bwd": calls["backward"], "py": calls["forward"] + calls["backward"],
            "host reads": f"{c['host_reads']['forward']} / {c['host_reads']['backward']}"}


def table(results: dict[str, dict[str, dict]]) -> str:
    """Markdown: one row per configuration and layer; ratios to torchtitan where it ran."""
    lines = ["| config | layer | forward ops + launches | backward | total | x torchtitan | Python calls fwd "
             "| bwd | total | x torchtitan | host reads fwd / bwd |", "|---" * 11 + "|"]
    for cfg, rows in results.items():
        peer = next((row_cells(c) for n, c in rows.items() if n.startswith("torchtitan") and "absent" not in c),
                    None)
        for name, c in rows.items():
            if "absent" in c:
                lines.append(f"| {cfg} | {name} | {c['absent']} |" + " |" * 8)
                continue
            r = row_cells(c)
            ro = f"{r['ops+launches'] / peer['ops+launches']:.2f}" if peer else "-"
            rp = f"{r['py'] / peer['py']:.2f}" if peer else "-"
            lines.append(f"| {cfg} | {name} | {r['fwd']} | {r['bwd']} | {r['ops+launches']} | {ro} | {r['py fwd']} "
                         f"| {r['py bwd']} | {r['py']} | {rp} | {r['host reads']} |")
    return "\n".join(lines)


def _worker(shape, layers):
    return count_all(tuple(shape), layers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moepar bench ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="small,B-bf16", help=f"comma list of {','.join(CONFIGS)}")
    p.add_argument("--layers", default=None, help="comma-separated substrings of the row names to count "
                   f"(default: all of {[n for n, _, _ in LAYERS]})")
    p.add_argument("--details", action="store_true", help="also list each row's device ops and Python "
                   "calls by package")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the counting process")
    args = p.parse_args(argv)
    names = args.configs.split(",")
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        p.error(f"unknown configs {bad}; choose from {list(CONFIGS)}")
    layers = [row for row in LAYERS if not args.layers or any(s in row[0] for s in args.layers.split(","))]
    if not os.path.isdir(os.path.join(ROOT, "tests", "helpers", "fake_cuda")):
        print(f"bench ops needs a source checkout: the fake-CUDA instrument (tests/helpers/fake_cuda) is not "
              f"beside this moepar ({ROOT})", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the worker imports triton
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.helpers.multiproc import run_ranks   # its workers are stopped at exit
    t0, date = time.time(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {n: run_ranks(_worker, 1, CONFIGS[n], layers, fake_cuda=True, timeout=args.timeout)[0]
               for n in names}
    import torch
    from moepar.bench.peers import torchtitan_status
    head = {"date": date, "torch": torch.__version__,
            "torchtitan": torchtitan_status()[1], "configs": {n: dict(zip("TDFEK", CONFIGS[n])) for n in names},
            "seconds": round(time.time() - t0, 1)}
    if args.json:
        print(json.dumps({**head, "results": results}, indent=1))
        return 0
    print(f"# bench ops  {head['date']}  torch {head['torch']}  {head['torchtitan']}  fake CUDA (tests/helpers/"
          f"fake_cuda), bf16, world of one, one forward and backward after a warm-up ({head['seconds']} s)")
    print("; ".join(f"{n}: T {c['T']} D {c['D']} F {c['F']} E {c['E']} K {c['K']}" for n, c in head["configs"].items()))
    print()
    print(table(results))
    if args.details:
        for cfg, rows in results.items():
            for name, c in rows.items():
                if "absent" in c:
                    continue
                for ph in ("forward", "backward"):
                    print(f"\n{cfg} / {name} / {ph}: ops {c['ops'][ph]}; launches {c['launches'][ph]}; "
                          f"Python calls by package {dict(sorted(c['by_package'][ph].items(), key=lambda kv: -kv[1]))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

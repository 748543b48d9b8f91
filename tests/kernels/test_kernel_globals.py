"""Every global a Triton kernel reads is one the GPU compiler accepts.

The interpreter (``TRITON_INTERPRET=1``, how the kernels run on the CPU) runs a kernel as
Python and reads any global; compiled for a GPU, a ``@triton.jit`` function may only read
globals that are ``tl.constexpr`` values, modules or other jitted functions (a plain
``E4M3_MAX = 448.0`` is a ``NameError`` at compile time). The permute-quantize kernel passed
every CPU test and failed its first compile on an H200 that way; this test fails where the
compiler would."""
import dis
import importlib
import types

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

MODULES = ["moepar_kernels.routing", "moepar_kernels.permute", "moepar_kernels.permute_fp8"]


def _jitted(module):
    for name, value in vars(module).items():
        fn = getattr(value, "fn", None)
        if isinstance(fn, types.FunctionType) and type(value).__module__.startswith("triton"):
            yield name, fn


def _bad_globals(fn) -> list[str]:
    bad = []
    for ins in dis.get_instructions(fn):
        if ins.opname != "LOAD_GLOBAL" or ins.argval not in fn.__globals__:
            continue
        v = fn.__globals__[ins.argval]
        ok = (isinstance(v, (types.ModuleType, tl.constexpr)) or isinstance(getattr(v, "fn", None), types.FunctionType)
              or getattr(v, "__module__", "").startswith("triton"))
        if not ok:
            bad.append(f"{ins.argval} = {v!r} ({type(v).__name__})")
    return bad


@pytest.mark.parametrize("modname", MODULES)
def test_kernels_read_only_globals_the_gpu_compiler_accepts(modname):
    module = importlib.import_module(modname)
    found = dict(_jitted(module))
    assert found, f"no jitted functions found in {modname}: the scan would prove nothing"
    bad = {name: b for name, fn in found.items() if (b := _bad_globals(fn))}
    assert not bad, f"{modname}: kernels read non-constexpr globals (a compile error on a GPU): {bad}"


def test_the_scan_catches_a_plain_float_global():
    ns = {"tl": tl, "LIMIT": 448.0, "OK": tl.constexpr(2.0)}
    exec("def k(x):\n    return tl.minimum(x, LIMIT) * OK\n", ns)
    assert _bad_globals(ns["k"]) == ["LIMIT = 448.0 (float)"]

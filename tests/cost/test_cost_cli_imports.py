"""The cost model's commands run without torch: ``python -m moepar price | report |
recommend`` and ``validate --published`` (and their --help) leave torch and triton unimported, so they work where torch is
not installed and start quickly; ``moepar``'s public names, now imported on first use, still
resolve. Each check runs in a fresh interpreter: this one has torch loaded already."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ("torch", "triton")

# Runs `python -m moepar ARGS...` in this interpreter, then reports on stderr which of HEAVY
# it imported (last line, after the command's own output).
WRAPPER = """
import json, runpy, sys
sys.argv = ["moepar"] + sys.argv[1:]
code = 0
try:
    runpy.run_module("moepar", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
sys.stdout.flush()
print(json.dumps({"code": code, "loaded": [m for m in %r if m in sys.modules]}), file=sys.stderr)
""" % (HEAVY,)


def _python(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


COMMANDS = {
    "price": "price all_reduce --size 1GiB --gpus 16 --gpus-per-node 8 --hardware h100",
    "report": "report --hf-config tests/data/qwen3-30b-a3b.json --tokens 4096 --gpus 16 --ep 8 --hardware h100",
    "recommend": "recommend --model mixtral-8x7b --tokens 4096 --gpus 64 --hardware h100",
    "price --help": "price --help",
    "validate --published": "validate --published",
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_cost_command_imports_neither_torch_nor_triton(name):
    r = _python("-c", WRAPPER, *COMMANDS[name].split())
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stderr.strip().splitlines()[-1])
    assert result["code"] == 0, r.stderr
    assert r.stdout.strip(), f"`{COMMANDS[name]}` printed nothing"
    assert result["loaded"] == [], f"`python -m moepar {COMMANDS[name]}` imported {result['loaded']}"


def test_torch_free_modules_import_without_torch():
    # What the cost model reads from the layer's side: the layout arithmetic, the counts
    # message and the dedup threshold (one definition each, shared with the layer).
    code = ("import sys, moepar, moepar.cost, moepar.cost.cli, moepar.parallel.layout, "
            "moepar.moe.traffic, moepar.moe.exchange.dedup_policy; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    r = _python("-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_public_names_resolve_on_first_use():
    code = """
import sys
import moepar
assert "torch" not in sys.modules, "import moepar loaded torch"
import moepar.parallel
for pkg in (moepar, moepar.parallel):
    missing = [n for n in pkg.__all__ if n not in dir(pkg)]
    assert not missing, (pkg.__name__, "dir() lacks", missing)
    for n in pkg.__all__:
        assert getattr(pkg, n) is not None, n
from moepar import MoE, aux_loss, fully_shard, grad_norm
from moepar.moe.layer import MoE as layer_MoE
from moepar.moe.cpu import release
from moepar.parallel.groups import Layout
from moepar.parallel.layout import Layout as torch_free_Layout
from moepar.moe.exchange.dedup import DEDUP_MAX_FRACTION
from moepar.moe.exchange.dedup_policy import DEDUP_MAX_FRACTION as policy_fraction
assert MoE is layer_MoE and moepar.release_cpu_buffers is release
assert Layout is torch_free_Layout is moepar.parallel.Layout
assert DEDUP_MAX_FRACTION is policy_fraction
assert moepar.moe.cpu.pool_disabled and moepar.parallel.comm.track   # submodules, as before
for bad in (moepar, moepar.parallel, moepar.moe):
    assert not hasattr(bad, "no_such_name")
print("ok")
"""
    r = _python("-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"

"""scripts/gpu_check.py and scripts/gpu_profile.py run on a GPU only when a session has one:
their dry run (``--device cpu``: the kernels under the Triton interpreter, small shapes)
keeps them working in between, and each check in it must pass."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("script,section", [("gpu_check.py", "kernels"), ("gpu_check.py", "layer"),
                                            ("gpu_profile.py", "profile")])
def test_the_gpu_scripts_dry_run_on_the_cpu(script, section):
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), "--section", section, "--device", "cpu"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
    assert r.returncode == 0 and lines and all(ln.startswith("PASS") for ln in lines), r.stdout[-3000:] + r.stderr[-3000:]


def test_the_gpu_bench_dry_runs_every_kind_of_section(tmp_path):
    """scripts/gpu_bench.py --device cpu, one section of each kind: the eager rows at A-bf16
    and at the DeepSeek-V3 shape (sigmoid scores, expert bias), the routing kernel, and both
    layers compiled at A and C-bf16 (the other sections differ from these only in shape)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import gpu_bench
    finally:
        sys.path.pop(0)
    from moepar.bench.peers import torchtitan_status
    out = tmp_path / "bench.md"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_bench.py"), "--device", "cpu", "--out",
                        str(out), "--sections", "device,eager A-bf16,eager DeepSeek-V3,routing,compiled A-bf16"],
                       cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = out.read_text()
    cells = {tuple(c.strip() for c in ln.split("|")[1:3]): ln for ln in table.splitlines() if ln.startswith("| ")}

    def timed(config, row):
        return float(cells[(config, row)].split("|")[3])   # ms: a number, not an error
    titan = torchtitan_status()[0]
    for config in ("A-bf16", "DeepSeek-V3"):
        assert timed(config, gpu_bench.FLOOR) > 0 and timed(config, "moepar eager") > 0, table
        assert "no CUDA graphs" in cells[(config, "moepar graph")], table
        if titan:
            assert timed(config, "torchtitan eager") > 0, table
        else:
            assert "not importable" in cells[(config, "torchtitan eager")], table
    for config in ("A-bf16", "C-bf16"):   # a row each, timed or with its error
        assert (config, "moepar compiled") in cells and (config, "torchtitan compiled") in cells, table
        assert not titan or timed(config, "torchtitan compiled") > 0, table
    assert "% of copy" in next(ln for (c, _), ln in cells.items() if c.startswith("routing T=256")), table
    assert "device: CPU (dry run)" in table and "budget is spent" not in table and "(section)" not in table

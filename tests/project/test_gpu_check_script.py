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

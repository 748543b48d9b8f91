"""The repository's ``kernels/`` folder never stands in for the PyPI package ``kernels``
(transformers imports that one when it is installed): with the repository root on sys.path,
``import kernels`` gives the PyPI package where it is installed and a clear ImportError
where it is not; ``moepar_kernels`` is always this folder."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = """
import os, sys
sys.path.insert(0, {root!r})
try:
    import kernels
    print("imported", os.path.dirname(os.path.abspath(kernels.__file__)))
except ImportError as e:
    print("refused", e)
import moepar_kernels
print("moepar_kernels", os.path.dirname(os.path.abspath(moepar_kernels.__file__)))
"""


def _installed_elsewhere() -> bool:
    import importlib.machinery
    path = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != ROOT]
    return importlib.machinery.PathFinder.find_spec("kernels", path) is not None


def test_bare_kernels_is_the_pypi_package_or_a_clear_refusal():
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=ROOT)], capture_output=True, text=True,
                         cwd="/", timeout=120).stdout.splitlines()
    assert out[-1] == f"moepar_kernels {os.path.join(ROOT, 'kernels')}", out
    if _installed_elsewhere():
        assert out[0].startswith("imported ") and not out[0].endswith(os.path.join(ROOT, "kernels")), out
    else:
        assert out[0].startswith("refused this package must be imported as 'moepar_kernels'"), out

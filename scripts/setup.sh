# Sourced by the other scripts: make .venv (once) with the pinned CPU torch first, then
# moepar itself with its dev, plot, hf and deepspeed extras, and activate it.
# MOEPAR_VENV overrides the location; MOEPAR_TORCH the torch requirement installed first.
set -euo pipefail
VENV="${MOEPAR_VENV:-.venv}"
PY="$(command -v python3.11 || command -v python3)"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q --upgrade pip
    # The CPU build of a known version first: a bare "torch" would pull a multi-GB CUDA build.
    python -m pip install -q "${MOEPAR_TORCH:-torch==2.13.0}"
fi
if ! python -c "import moepar, moepar_kernels, pytest, triton, transformers, safetensors, deepspeed" 2>/dev/null; then
    python -m pip install -q -e ".[dev,plot,hf,deepspeed]"
fi
# The benchmark peer torchtitan (bench extra, torchtitan without its trainer's dependencies);
# the suite compares moepar's host work with it, and counts without it where it fails.
python -c "import importlib.util as u, sys; sys.exit(0 if all(map(u.find_spec, ('torchtitan', 'spmd_types', 'tyro'))) else 1)" 2>/dev/null || { python -m pip install -q -e ".[bench]" && python -m pip install -q --no-deps "torchtitan==0.3.0"; } || echo "setup: torchtitan not installed; the benchmarks and tests run without the peer" >&2

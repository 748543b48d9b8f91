#!/usr/bin/env bash
# Quick start, command 2: set up (first run only) and run the whole test suite on the CPU.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k router`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
export TRITON_INTERPRET=1
python -m pytest -q "$@"

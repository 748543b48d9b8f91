#!/usr/bin/env bash
# Quick start, command 1: set up (first run only) and run the main job on the CPU.
# Placeholder while the GPT-MoE example is being built: shows what the package offers.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
python -m moepar --help

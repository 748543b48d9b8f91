#!/usr/bin/env bash
# Quick start, command 1: set up (first run only), then train the example GPT-MoE on the
# CPU with 4 gloo processes (tensor parallel 2 x expert parallel 2) on the Python standard
# library's source, and print the summary, a sample and the communication cost report.
# Extra arguments go to the training script, e.g. `bash scripts/main.sh --steps 50`;
# `bash scripts/main.sh --pp 2` cuts the model into 2 pipeline stages of 2 ranks each
# (pp 2 x tp 2, experts ep 2 inside each stage; 1F1B over 4 micro-batches, docs/pipeline.md).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nproc_per_node=4 examples/train_gpt_moe.py --tp 2 --ep 2 "$@"

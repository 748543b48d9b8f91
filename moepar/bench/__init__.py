"""``python -m moepar bench [mode]``: benchmarks. Each mode is a module with ``main(argv)``.

Without a mode: the single-process modes one after the other (routing, local, layer) with
their defaults, or, under torchrun (WORLD_SIZE > 1), the multi-process ``dispatch`` mode.
"""
from __future__ import annotations

import importlib
import os

MODES = {
    "routing": "moepar.bench.routing",    # router kernel vs torch reference
    "local": "moepar.bench.local",        # permute + grouped experts + unpermute vs the GEMM floor
    "layer": "moepar.bench.layer",        # the whole MoE layer vs floor / plain torch / peers
    "dispatch": "moepar.bench.dispatch",  # all-to-all dispatch vs raw all_to_all_single (torchrun)
    "replicas": "moepar.bench.replicas",  # expert replication on skewed routing (torchrun)
    "fsdp": "moepar.bench.fsdp",          # model-state memory per rank, fully_shard vs all-reduce (torchrun)
    "ops": "moepar.bench.ops",            # device ops, launches, Python calls per step on fake CUDA (checkout)
}
SINGLE_PROCESS = ("routing", "local", "layer")


def _run(mode: str, argv: list[str]) -> int:
    return int(importlib.import_module(MODES[mode]).main(argv) or 0)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help") or argv and argv[0] not in MODES:
        print("usage: python -m moepar bench [{" + ",".join(MODES) + "}] [options]\n"
              "  no mode: " + ", ".join(SINGLE_PROCESS) + " in turn (dispatch under torchrun)\n"
              "  run `python -m moepar bench <mode> --help` for a mode's options")
        return 0 if argv[0] in ("-h", "--help") else 2
    if argv:
        return _run(argv[0], argv[1:])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _run("dispatch", [])
    rc = 0
    for mode in SINGLE_PROCESS:
        print(f"\n===== python -m moepar bench {mode} =====", flush=True)
        rc = max(rc, _run(mode, []))
    print("\nmulti-process: python -m torch.distributed.run --nproc_per_node=4 -m moepar bench dispatch")
    return rc

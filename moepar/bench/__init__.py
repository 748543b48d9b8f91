"""``python -m moepar bench <mode>``: benchmarks. Each mode is a module with ``main(argv)``."""
from __future__ import annotations

import importlib

MODES = {
    "routing": "moepar.bench.routing",    # router kernel vs torch reference
    "local": "moepar.bench.local",        # permute + grouped experts + unpermute vs the GEMM floor
    "layer": "moepar.bench.layer",        # the whole MoE layer vs floor / plain torch / peers
    "dispatch": "moepar.bench.dispatch",  # all-to-all dispatch vs raw all_to_all_single (torchrun)
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in MODES:
        print("usage: python -m moepar bench {" + ",".join(MODES) + "} [options]\n"
              "  run `python -m moepar bench <mode> --help` for a mode's options")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return int(importlib.import_module(MODES[argv[0]]).main(argv[1:]) or 0)

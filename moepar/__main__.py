"""``python -m moepar <command> ...``: the command-line entry point.

Each command lives in its own module, imported only when it runs, so ``--help`` is quick
and a missing optional extra only affects the command that needs it.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "report": ("moepar.cost.cli", "report_main", "communication cost report for a model and layout"),
    "recommend": ("moepar.cost.cli", "recommend_main", "rank the layouts that fit a GPU count and memory"),
    "price": ("moepar.cost.cli", "price_main", "time, algbw and busbw of one collective (nccl-tests style)"),
    "calibrate": ("moepar.cost.cli_measure", "calibrate_main", "measure collectives (run under torchrun), save a profile"),
    "validate": ("moepar.cost.cli_measure", "validate_main", "predicted vs measured collectives and MoE dispatch"),
    "bench": ("moepar.bench", "main", "benchmarks: routing | local | layer | dispatch"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m moepar",
        description="moepar: expert-parallel MoE for PyTorch. Run `python -m moepar <command> --help`.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {name:<10} {h}" for name, (_, _, h) in COMMANDS.items()))
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), help=argparse.SUPPRESS)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    args = parser.parse_args(argv[:1])
    module, func, _ = COMMANDS[args.command]
    result = getattr(importlib.import_module(module), func)(argv[1:])
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())

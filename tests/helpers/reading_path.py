"""Which of the project's files a path through the code runs, in the order it meets them.

A newcomer reads the default forward (or the cost report) by following the calls; the files
whose functions run are the files to read. ``traced_files(fn)`` runs ``fn`` under
``sys.setprofile`` and returns those files (paths from the repository root, package
``__init__``/``__main__`` modules, ``moepar/_lazy.py`` (the packages' lazy imports) and module
and class bodies run at import left out: they only import and dispatch), in first-call order.

``python -m tests.helpers.reading_path forward|report`` prints the list with each file's lines
(forward: a dropless top-2 layer at ep = 2 on two gloo ranks, after one warm-up call).
"""
from __future__ import annotations

import inspect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DIRS = (os.path.join(ROOT, "moepar") + os.sep, os.path.join(ROOT, "kernels") + os.sep)
_GLUE = ("__init__.py", "__main__.py", "_lazy.py")   # _lazy.py: the packages' lazy imports


def traced_files(fn, *args, **kwargs) -> list[str]:
    seen: dict[str, None] = {}

    def prof(frame, event, arg):
        # Functions only: module and class bodies (run once, at import) are not reading.
        if event == "call" and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            path = frame.f_code.co_filename
            if path.startswith(_DIRS) and os.path.basename(path) not in _GLUE and path not in seen:
                seen[path] = None

    old = sys.getprofile()
    sys.setprofile(prof)
    try:
        fn(*args, **kwargs)
    finally:
        sys.setprofile(old)
    return [os.path.relpath(p, ROOT) for p in seen]


def line_count(path: str) -> int:
    with open(os.path.join(ROOT, path)) as f:
        return sum(1 for _ in f)


def default_forward_files() -> list[str]:
    """On each rank of an ep = 2 world: the files one default forward runs (after a warm-up)."""
    import torch
    import moepar
    moepar.init_parallel(expert_parallel_size=2)
    moe = moepar.MoE(16, 4, 2, k=2, ffn_hidden=32, init_seed=0)
    x = torch.randn(8, 16)
    moe(x)
    return traced_files(moe, x)


def report_files(argv: list[str]) -> list[str]:
    """The files ``python -m moepar <argv>`` runs (its output discarded)."""
    import contextlib
    import io
    import runpy

    def run():
        sys.argv = ["moepar", *argv]
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                runpy.run_module("moepar", run_name="__main__")
            except SystemExit as e:
                if e.code not in (0, None):
                    raise
    old = sys.argv
    try:
        return traced_files(run)
    finally:
        sys.argv = old


REPORT_ARGS = ["report", "--model", "mixtral-8x7b", "--gpus", "16", "--tp", "2", "--ep", "8"]


def _print(files: list[str]) -> None:
    total = 0
    for f in files:
        n = line_count(f)
        total += n
        print(f"{n:5d}  {f}")
    print(f"{len(files)} files, {total} lines")


if __name__ == "__main__":
    # --list: the paths alone, one a line (what the tests read: the trace runs in a process
    # of its own, since caches warmed by earlier work in a process would hide calls).
    listing = "--list" in sys.argv
    argv = [a for a in sys.argv[1:] if a != "--list"]
    what = argv[0] if argv else "forward"
    if what == "forward":
        from .multiproc import run_ranks
        files = run_ranks(default_forward_files, 2, fresh=True)[0]
    else:
        files = report_files(argv[1:] or REPORT_ARGS)
    print("\n".join(files)) if listing else _print(files)

"""Which of the project's files a path through the code runs, in the order it meets them.

A newcomer reads the default forward (or the cost report) by following the calls; the files
whose functions run are the files to read. ``traced_functions(fn)`` runs ``fn`` under
``sys.setprofile`` and returns those files, each with the lines of its functions that ran
(paths from the repository root, package ``__init__``/``__main__`` modules,
``moepar/_lazy.py`` (the packages' lazy imports) and module and class bodies run at import
left out: they only import and dispatch), in first-call order.

``python -m tests.helpers.reading_path forward|report`` prints the list with each file's lines
(forward: a dropless top-2 layer at ep = 2 on two gloo ranks, after one warm-up call);
``--functions`` adds, per file, the lines of the functions that ran (their def-to-last-line
spans, nested ones counted once): what a reader of that path must read at the least.
"""
from __future__ import annotations

import inspect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DIRS = (os.path.join(ROOT, "moepar") + os.sep, os.path.join(ROOT, "kernels") + os.sep)
_GLUE = ("__init__.py", "__main__.py", "_lazy.py")   # _lazy.py: the packages' lazy imports


def traced_functions(fn, *args, **kwargs) -> dict[str, int]:
    """{file: lines of the functions that ran there}, files in first-call order."""
    seen: dict[str, set[int]] = {}
    codes: set = set()

    def prof(frame, event, arg):
        # Functions only: module and class bodies (run once, at import) are not reading.
        code = frame.f_code
        if event == "call" and code.co_flags & inspect.CO_OPTIMIZED and code not in codes:
            codes.add(code)
            path = code.co_filename
            if path.startswith(_DIRS) and os.path.basename(path) not in _GLUE:
                last = max((line for _, _, line in code.co_lines() if line), default=code.co_firstlineno)
                seen.setdefault(path, set()).update(range(code.co_firstlineno, last + 1))

    old = sys.getprofile()
    sys.setprofile(prof)
    try:
        fn(*args, **kwargs)
    finally:
        sys.setprofile(old)
    return {os.path.relpath(p, ROOT): len(lines) for p, lines in seen.items()}


def line_count(path: str) -> int:
    with open(os.path.join(ROOT, path)) as f:
        return sum(1 for _ in f)


def default_forward_files() -> dict[str, int]:
    """On each rank of an ep = 2 world: the files one default forward runs (after a warm-up),
    each with the lines of its functions that ran."""
    import torch
    import moepar
    moepar.init_parallel(expert_parallel_size=2)
    moe = moepar.MoE(16, 4, 2, k=2, ffn_hidden=32, init_seed=0)
    x = torch.randn(8, 16)
    moe(x)
    return traced_functions(moe, x)


def report_files(argv: list[str]) -> dict[str, int]:
    """The files ``python -m moepar <argv>`` runs (its output discarded), each with the lines
    of its functions that ran."""
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
        return traced_functions(run)
    finally:
        sys.argv = old


REPORT_ARGS = ["report", "--model", "mixtral-8x7b", "--gpus", "16", "--tp", "2", "--ep", "8"]


def _print(files, ran: dict[str, int] | None = None) -> None:
    total = total_ran = 0
    for f in files:
        n = line_count(f)
        total += n
        if ran is None:
            print(f"{n:5d}  {f}")
        else:
            total_ran += ran[f]
            print(f"{n:5d}  {ran[f]:5d} ran  {f}")
    ran_note = "" if ran is None else f", {total_ran} of them in functions that ran"
    print(f"{len(files)} files, {total} lines{ran_note}")


if __name__ == "__main__":
    # --list: the paths alone, one a line (what the tests read: the trace runs in a process
    # of its own, since caches warmed by earlier work in a process would hide calls).
    listing, functions = "--list" in sys.argv, "--functions" in sys.argv
    argv = [a for a in sys.argv[1:] if a not in ("--list", "--functions")]
    what = argv[0] if argv else "forward"
    if what == "forward":
        from .multiproc import run_ranks
        ran = run_ranks(default_forward_files, 2, fresh=True)[0]
    else:
        ran = report_files(argv[1:] or REPORT_ARGS)
    print("\n".join(ran)) if listing else _print(list(ran), ran if functions else None)

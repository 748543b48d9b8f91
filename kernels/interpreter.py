"""The Triton CPU interpreter (``TRITON_INTERPRET=1``) and the versions it works with.

Triton's interpreter before 3.7 turns scalar kernel arguments and program ids into
1-element NumPy arrays and calls ``int()`` on them (in ``range(...)`` inside a kernel).
NumPy 2.4 refuses that ("only 0-dimensional arrays can be converted to Python scalars";
NumPy 1.25 to 2.3 only warn), so such a pair fails deep inside the interpreter. Triton 3.7
squeezes the array first. ``check()`` names the pair and the fix before any launch.
Seen: triton 3.4.0 (torch 2.8) and 3.5.1 (torch 2.9) fail with NumPy 2.4.6, pass with 2.2.6
and 2.3.5; triton 3.9.0 passes with 2.4.6.
"""
from __future__ import annotations

import os


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


# Read once, at import: ``triton.jit`` decides when our kernels are defined (at import)
# whether they are interpreted, so a later change would not change what runs; and no
# launch reads the environment.
ACTIVE = os.environ.get("TRITON_INTERPRET", "0") == "1"   # read as a constant in the launchers


def active() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return ACTIVE


def incompatibility(triton_version: str, numpy_version: str) -> str | None:
    """Why this Triton interpreter cannot run with this NumPy, or None."""
    if _version(triton_version) < (3, 7) and _version(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s CPU interpreter (TRITON_INTERPRET=1) cannot run with NumPy "
                f"{numpy_version}: before Triton 3.7 it converts 1-element arrays to Python ints, which "
                f"NumPy 2.4 and later refuse. Install 'numpy<2.4' or triton>=3.7 (with a torch that "
                f"allows it), or run on CUDA")
    return None


_checked = False


def check() -> None:
    """Under TRITON_INTERPRET=1, raise a clear error for a Triton/NumPy pair that fails."""
    global _checked
    if _checked or not active():
        return
    import numpy
    import triton
    why = incompatibility(triton.__version__, numpy.__version__)
    if why:
        raise RuntimeError(why)
    _checked = True

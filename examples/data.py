"""Byte-level text data with nothing to download.

The default corpus is the Python standard library's own top-level source files (found
through ``sysconfig``): real text on every machine with Python. ``--data PATH`` takes a
text file or a folder (every regular file under it, sorted) instead. Tokens are bytes
(vocabulary 256). The train/validation split is fixed: every 10th file (by sorted path)
is validation, or for a single file (or fewer than 10 files) the last 10% of the bytes.

Batches are a pure function of (seed, step): every rank draws the same *global* batch
and keeps only its data-parallel rank's rows, so any layout sees the same data and a
resumed run continues exactly where it stopped.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig

import torch


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise RuntimeError(f"no Python source files found in the standard library folder {root!r}")
    return files


@dataclasses.dataclass
class Corpus:
    train: torch.Tensor   # uint8 [N_train]
    val: torch.Tensor     # uint8 [N_val]
    description: str


def _read(files: list[str]) -> list[bytes]:
    return [open(f, "rb").read() for f in files]


def load_corpus(path: str | None, context: int) -> Corpus:
    """Load and split the corpus; clear errors for missing, empty or too-short data."""
    if path is None:
        files = stdlib_files()
        what = f"Python {sysconfig.get_python_version()} standard library sources ({len(files)} files)"
    elif os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(f))
        what = f"{path} ({len(files)} files)"
        if not files:
            raise ValueError(f"--data {path!r}: the folder contains no files")
    elif os.path.isfile(path):
        files, what = [path], path
    else:
        raise ValueError(f"--data {path!r}: no such file or folder")
    blobs = _read(files)
    total = sum(len(b) for b in blobs)
    if total == 0:
        raise ValueError(f"--data {path!r}: the data is empty (0 bytes)")
    if len(files) >= 10:
        train = b"".join(b for i, b in enumerate(blobs) if i % 10 != 9)
        val = b"".join(b for i, b in enumerate(blobs) if i % 10 == 9)
    else:
        data = b"".join(blobs)
        cut = int(len(data) * 0.9)
        train, val = data[:cut], data[cut:]
    need = context + 2
    if len(train) < need or len(val) < need:
        raise ValueError(f"--data {path!r}: {total} bytes split into {len(train)} train / {len(val)} "
                         f"validation bytes; each part needs at least context+2 = {need} bytes")
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(val), f"{what}: {len(train):,} train / {len(val):,} val bytes")


class Batches:
    """Deterministic batches: rows [dp_rank*b, (dp_rank+1)*b) of global batch number ``step``."""

    def __init__(self, data: torch.Tensor, context: int, global_batch: int, seed: int):
        self.data, self.context, self.global_batch, self.seed = data, context, global_batch, seed

    def get(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.global_batch % dp_size:
            raise ValueError(f"global batch {self.global_batch} is not divisible by the "
                             f"data-parallel size {dp_size}")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - self.context - 1, (self.global_batch,), generator=gen)
        b = self.global_batch // dp_size
        mine = starts[dp_rank * b:(dp_rank + 1) * b]
        rows = torch.stack([self.data[s:s + self.context + 1] for s in mine.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]

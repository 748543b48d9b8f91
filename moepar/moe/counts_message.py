"""The layout of the dispatcher's counts message (torch-free, so the cost model can read it).

Before any token moves, every EP rank sends each EP peer one int64 row: the number of
routes it sends to each of the E global experts (the same E counts to every peer, so that
after the one all-to-all every rank holds the group's whole [P, E] load matrix: the
overload figures of ``moe.stats`` and the receive guard's quotas need it, and every rank
computes them alike, with no second collective), then the metadata ``FIELDS`` that the
group checks and agrees on (so that a bad input on one rank raises on all of them, and
every rank picks the same exchange form). One all-to-all of ``ep`` rows of ``width(E)``
int64 each per rank: ``message_bytes`` is what the cost model prices.
"""
from __future__ import annotations

INT64_BYTES = 8

# Metadata columns after the E counts, in order.
FIELDS = (
    "hidden",              # the sender's hidden size (must agree)
    "dtype",               # the sender's activation dtype, as a small code (must agree)
    "error",               # 1 if the sender's input is invalid: everyone raises
    "capacity",            # the sender's per-expert capacity (padded mode), 0 dropless
    "routes",              # routes the sender dispatches in all
    "dedup_mode",          # the sender's dedup vote: 0 off, 1 auto, 2 on
    "dedup_rows",          # the sender's rows in all with dedup
    "forms",               # exchange forms the sender allows (bit flags)
    "dedup_rows_to_peer",  # the sender's rows with dedup for this recipient
)


def width(num_experts: int) -> int:
    """int64 columns of one row: the E counts and the metadata."""
    return num_experts + len(FIELDS)


def column(name: str, num_experts: int) -> int:
    """Column index of metadata field ``name`` in a row."""
    return num_experts + FIELDS.index(name)


def message_bytes(num_experts: int, ep: int) -> int:
    """Bytes one rank sends in the counts all-to-all: ep rows of width(E) int64."""
    return ep * width(num_experts) * INT64_BYTES

"""The layout of the dispatcher's counts message (torch-free, so the cost model can read it).

Before any token moves, every rank of the MoE block (the ranks one MoE layer's collectives
span: its TP, EP and ETP groups, ``moepar.parallel.groups``) contributes one int64 row and
the block all-gathers them: the row holds the number of routes the rank sends to each of
the E global experts, then the metadata ``FIELDS``, then, with dedup, the rows it sends to
each of its P EP peers. After the one all-gather every rank holds every row of its block,
so with no further collective it knows

* its EP group's whole [P, E] load (the overload figures of ``moe.stats`` and the receive
  guard's quotas, computed alike on every rank) and so the all-to-all's split sizes;
* what each expert-TP peer receives (the ETP all-gather's sizes) and each TP peer's token
  count (sequence parallelism);
* whether any rank of the block has a bad input: every rank then raises, nobody waits.

This row is also what the forward reads back to the host, once (``comm.read_to_host``):
one all-gather of ``block`` rows of ``columns(E, P).width`` int64, ``message_bytes`` in nccl-tests'
all-gather size convention (the gathered bytes), which the cost model prices.
"""
from __future__ import annotations

import dataclasses

INT64_BYTES = 8

# Metadata columns after the E counts, in order.
FIELDS = (
    "hidden",            # the sender's hidden size (must agree)
    "dtype",             # the sender's dispatch dtype, as a small code (must agree)
    "error",             # 1 if the sender found its input invalid on the host: everyone raises
    "nonfinite_input",   # non-finite input values (check_finite): everyone raises
    "nonfinite_logits",  # tokens with non-finite router logits (router nonfinite="raise")
    "bad_ids",           # routes with an expert id outside [0, E)
    "routes",            # kept routes the sender dispatches in all
    "tokens",            # the sender's tokens (its slice under sequence parallelism)
    "dedup_mode",        # the sender's dedup vote: 0 off, 1 auto, 2 on
    "dedup_rows",        # the sender's rows in all with dedup
    "forms",             # exchange forms the sender allows (bit flags)
)
# Device-valued fields: each a count the sender computed on its device (never read alone).
DEVICE_FIELDS = ("nonfinite_input", "nonfinite_logits", "bad_ids", "routes", "dedup_rows")


@dataclasses.dataclass(frozen=True)
class Columns:
    """Where each part of one row lies for E experts and P EP peers: what a sender fills and
    every reader indexes (a dispatcher computes it once; its forward only indexes)."""

    num_experts: int
    width: int                 # int64 columns of a row: E counts, the metadata, P dedup rows
    field: dict[str, int]      # metadata field name -> its column
    dedup: slice               # the P columns of rows sent to each EP peer with dedup


def columns(num_experts: int, ep: int) -> Columns:
    """The row's columns for ``num_experts`` counts and ``ep`` EP peers."""
    start = num_experts + len(FIELDS)
    return Columns(num_experts, start + ep, {name: num_experts + i for i, name in enumerate(FIELDS)},
                   slice(start, start + ep))


def message_bytes(num_experts: int, ep: int, block: int) -> int:
    """Bytes of the counts all-gather over a block of ``block`` ranks (the gathered rows)."""
    return block * columns(num_experts, ep).width * INT64_BYTES

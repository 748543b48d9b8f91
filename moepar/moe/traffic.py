"""What the MoE layer sends, as data (torch-free): the table of the collectives a forward and
its backward issue, and the layout of the counts row its first collective gathers.

The cost model's per-layer accounting (``moepar.cost.accounting``) prices this
list, and ``tests/moe/test_traffic.py`` compares it, op by op, with the collectives the layer
records in ``moe.stats.comm`` across the layouts and options the suite runs. The steps it
names are docs/moe.md's (one numbering); letters as in the legend there.

Bytes per rank in nccl-tests' size convention (all-reduce: the tensor; all-gather: the
gathered output; reduce-scatter: the input; all-to-all: what this rank sends), the
convention ``moepar.parallel.comm`` records.

The counts row. Before any token moves, every rank of the MoE block (the ranks one MoE
layer's collectives span: its TP, EP and ETP groups, ``moepar.parallel.groups``) contributes
one int64 row and the block all-gathers them: the row holds the number of routes the rank sends to each of
the E global experts, then the metadata ``FIELDS``, then, with dedup, the rows it sends to
each of its P EP peers. After the one all-gather every rank holds every row of its block,
so with no further collective it knows

* its EP group's whole [P, E] load (the overload figures of ``moe.stats`` and the receive
  guard's quotas, computed alike on every rank) and so the all-to-all's split sizes;
* what each expert-TP peer receives (the ETP all-gather's sizes) and each TP peer's token
  count (sequence parallelism);
* whether any rank of the block has a bad input: every rank then raises, nobody waits.

This row is also what the forward reads back to the host, once (``comm.read_to_host``):
one all-gather of ``block`` rows of ``columns(E, P).width`` int64, ``message_bytes`` in
nccl-tests' all-gather size convention (the gathered bytes), which the cost model prices.
"""
from __future__ import annotations

import dataclasses
import math

FP32_BYTES = 4
INT64_BYTES = 8
FP8_BLOCK = 128   # channels per fp32 scale of an FP8 row (moepar.moe.exchange.fp8)

# ---- the counts row (the dispatcher's first collective) ------------------------------------

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


def fp8_row_bytes(D: int) -> int:
    """Bytes of one FP8 dispatch row: D e4m3 values and ceil(D / 128) fp32 scales."""
    return D + FP32_BYTES * (-(-D // FP8_BLOCK))


def aux_group_name(scope: str, sequence_parallel: bool) -> str | None:
    """The group the router's aux/z statistics are summed over: "global" scope, the whole
    global batch ("world" under sequence parallelism, else "dp"); "local", this replica's
    batch ("tp" under sequence parallelism, else None: this rank's tokens alone)."""
    if scope == "global":
        return "world" if sequence_parallel else "dp"
    return "tp" if sequence_parallel else None


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What one MoE layer's collectives depend on, for one rank and one micro-batch.

    T the TP group's tokens at the layer input (replicated over its ranks; with sequence
    parallelism each rank holds a slice of them), D hidden, K top-k, E experts;
    ``rows`` (R): the rows this rank sends in the token all-to-all (its kept routes; with dedup
    its dedup rows); ``fp8_dispatch``: the dispatch rows cross as FP8 with their scales
    (``fp8_row_bytes`` a row, ``b_dispatch`` unused), the rest in the compute dtype;
    ``fp8_combine_grad``: so does the combine's gradient, sent back to the experts' ranks;
    ``received`` (M): the rows it receives there (None: R, balanced), which it
    sends back in the combine; ``etp_rows``: the rows its expert-TP group gathers (etp x rows when
    balanced); b bytes per activation element, ``b_dispatch`` / ``b_combine`` per element of
    the rows sent out / back.

    Expert replication (``redundant_experts`` X > 0, docs/routing.md "Expert replication"):
    every forward issues one all-to-all in the EP group carrying the remote copies' weights,
    and its backward one carrying their gradients back to the owners (docs/moe.md step 8);
    ``replica_sent``: the copies of this rank's home experts held on other EP ranks (whose
    weights it sends forward; 0 still joins the call), ``replica_received``: the remote copies
    its own slots hold (whose gradients it sends back; None: as many as it sent),
    ``expert_bytes``: bytes of one expert's slice
    on this rank (w1, w3 if gated, w2 and biases, expert-TP sliced, in the parameter dtype)."""

    tp: int
    ep: int
    etp: int
    sp: bool
    T: int
    D: int
    K: int
    E: int
    rows: float
    etp_rows: float
    b: int
    b_dispatch: int
    b_combine: int
    dedup: bool = False
    padded: bool = False
    shared: bool = False
    aux_group: str | None = None       # "tp" | "dp" | "world" | None: the aux/z statistics' group
    aux_loss: bool = True
    z_loss: bool = False
    received: float | None = None
    fp8_dispatch: bool = False
    fp8_combine_grad: bool = False
    redundant_experts: int = 0
    replica_sent: float = 0.0
    replica_received: float | None = None
    expert_bytes: float = 0.0

    @property
    def block(self) -> int:
        """Ranks of the layer's MoE block: lcm(tp, ep·etp) (``moepar.parallel.groups``)."""
        return math.lcm(self.tp, self.ep * self.etp)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the layer: ``group`` one of moe | ep | etp | tp | dp | world."""

    step: str        # docs/moe.md's step
    name: str        # as the cost report names it
    op: str
    group: str
    phase: str       # fwd | bwd
    nbytes: float
    formula: str


def layer_collectives(s: LayerShape, group_size: dict[str, int] | None = None,
                      phases: tuple[str, ...] = ("fwd", "bwd")) -> list[Collective]:
    """Every collective of one MoE layer's forward and backward, in the order they run (the
    backward listed in forward order). ``group_size`` (name -> ranks) drops the groups of one
    rank, which issue nothing; by default the sizes follow from ``s``."""
    sizes = {"moe": s.block, "ep": s.ep, "etp": s.etp, "tp": s.tp}
    sizes.update(group_size or {})
    if s.aux_group is not None and s.aux_group not in sizes:
        raise ValueError(f"aux_group={s.aux_group!r}: pass its size in group_size")
    T, D, K, E, b = s.T, s.D, s.K, s.E, s.b
    R, M = s.rows, s.rows if s.received is None else s.received
    # Forward: R rows out, M back; backward: the gradients of the M rows this rank got back
    # to the senders, the gradients of its R rows to it. Expert inputs (dispatch, combine
    # gradient) travel in b_dispatch, expert outputs (combine, dispatch gradient) in b_combine.
    dd = " (dedup)" if s.dedup else ""
    bd = "b" if s.b_dispatch == b else str(s.b_dispatch)
    bc = "b" if s.b_combine == b else str(s.b_combine)
    out: list[Collective] = []

    def add(step, name, op, group, phase, nbytes, formula):
        if sizes[group] > 1:
            out.append(Collective(step, name, op, group, phase, float(nbytes), formula))

    for phase in phases:
        fwd = phase == "fwd"
        if fwd and not s.padded:
            # with redundant experts the message counts the E + X slots
            slots = E + s.redundant_experts
            add("3", "MoE counts", "all_gather", "moe", phase, message_bytes(slots, s.ep, s.block),
                f"block·({'E+X' if s.redundant_experts else 'E'}+{len(FIELDS)}+ep)·8")
        if (s.fp8_dispatch if fwd else s.fp8_combine_grad):
            add("5", "MoE dispatch" if fwd else "MoE combine grad", "all_to_all", "ep", phase,
                R * fp8_row_bytes(D), f"R·(D+4·⌈D/{FP8_BLOCK}⌉) fp8{dd}")
        else:   # the combine's gradient travels in the expert outputs' dtype
            add("5", "MoE dispatch" if fwd else "MoE combine grad", "all_to_all", "ep", phase,
                R * D * (s.b_dispatch if fwd else s.b_combine), f"R·D·{bd if fwd else bc}{dd}")
        if s.dedup:   # the side message: weights and local ids, 2K fp32 per row (grads back)
            add("5", "MoE dedup side" if fwd else "MoE dedup side grad", "all_to_all", "ep", phase,
                (R if fwd else M) * 2 * K * FP32_BYTES, "R·2K·4" if fwd else "M·2K·4")
        b_etp = s.b_combine if s.fp8_dispatch else s.b_dispatch   # FP8 rows are dequantized first
        add("6", "expert-TP gather rows", "all_gather", "etp", phase, s.etp_rows * D * b_etp,
            f"etp·M·D·{bc if s.fp8_dispatch else bd}")
        if s.redundant_experts > 0:   # the remote copies' weights out, their gradients back
            back = s.replica_sent if s.replica_received is None else s.replica_received
            add("8", "MoE replica weights" if fwd else "MoE replica grads", "all_to_all", "ep", phase,
                (s.replica_sent if fwd else back) * s.expert_bytes,
                "copies sent·P_slice·b_w" if fwd else "copies held·P_slice·b_w")
        add("9", "expert-TP reduce-scatter", "reduce_scatter", "etp", phase, s.etp_rows * D * s.b_combine,
            f"etp·M·D·{bc}")
        add("9", "MoE combine" if fwd else "MoE dispatch grad", "all_to_all", "ep", phase,
            M * D * s.b_combine, f"M·D·{bc}{dd}")
        if not s.sp:
            add("11", "MoE TP gather" if fwd else "MoE input-grad gather", "all_gather", "tp", phase,
                T * D * b, "T·D·b")
            if not fwd:
                add("11", "routing-weight grad gather", "all_gather", "tp", phase, T * K * FP32_BYTES, "T·K·4")
        if s.shared and s.sp:
            add("11", "shared experts SP gather", "all_gather", "tp", phase, T * D * b, "T·D·b")
            add("11", "shared experts SP scatter", "reduce_scatter", "tp", phase, T * D * b, "T·D·b")
        elif s.shared:
            add("11", "shared experts", "all_reduce", "tp", phase, T * D * b, "T·D·b")
        if fwd and s.aux_group and (s.aux_loss or s.z_loss):
            # the router's sums over the group's tokens: fp32 score sums (E) and logsumexp^2
            # (1), int64 routes per expert (E) and the token count (1)
            n_f, n_i = E * s.aux_loss + s.z_loss, E * s.aux_loss + 1
            add("1", "aux-loss statistics", "all_reduce", s.aux_group, phase, n_f * FP32_BYTES, f"{n_f}·4")
            add("1", "aux-loss counts", "all_reduce", s.aux_group, phase, n_i * INT64_BYTES, f"{n_i}·8")
    return out


# Below this many expert slots (E + X) over a stage's replicated layers, every rank plans
# every layer (``moepar.rebalance``): that takes less than the second all-reduce would, and
# a small model's rebalance stays one collective. Above it the layers are planned in parallel.
SPREAD_SLOTS = 1024


def rebalance_collectives(layers: int, experts: int, redundant: int, ranks: int) -> list[int]:
    """The bytes of each all-reduce one ``moepar.rebalance`` issues over a stage of ``ranks``
    ranks with ``layers`` replicated MoE layers: the routes per expert ([layers, E] int64),
    then, where the planning is spread (SPREAD_SLOTS slots or more), the plans
    ([layers, 1 + 2 (E + X)] float64)."""
    if ranks <= 1 or layers == 0:
        return []
    out = [layers * experts * 8]
    if layers * (experts + redundant) >= SPREAD_SLOTS:
        out.append(layers * (1 + 2 * (experts + redundant)) * 8)
    return out

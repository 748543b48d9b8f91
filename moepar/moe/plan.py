"""Step 3 of the forward (docs/moe.md): the counts exchange and what the MoE block decides from it.

Legend: E global experts, L = E/P local experts, P EP ranks, B ranks in the MoE block,
W int64 columns of a counts row (``counts_message``), S = etp*P source blocks.

Every rank of the block builds its row on its device (the route counts, its input's
verdict, its token count, its dedup vote: no host data crosses to the device, the
host-known fields are written as scalar fills), the block all-gathers the rows, and the
result is read back to the host once (``device.read_to_host``): the one host read of a
dropless forward. Everything else the dispatch needs is decided here on the host from that
read, identically on every rank, or taken as device views of the gathered rows:

* a bad input anywhere in the block raises on every rank of it, before any token moves;
* the EP group's load and the receive guard's quotas (``guard.py``), hence the token
  all-to-all's split sizes; the expert-TP peers' row counts; the TP peers' token counts;
* the exchange form (row per route, source-major on gloo, dedup).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..parallel import comm, device
from ..parallel.groups import MoeRows
from . import counts_message as msg
from .dedup import group_dedups
from .guard import GroupLoad, quotas

# dtypes are exchanged as small integer codes.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DEDUP_VOTES = {"off": 0, "auto": 1, "on": 2}
SOURCE_MAJOR = 1      # bit of the "forms" field: this rank takes source-major rows (cpu.py)
FORMS = ("rows", "source_major", "dedup")


def dtype_code(dtype: torch.dtype) -> int:
    """The small integer that stands for ``dtype`` in a message (-1: none of DTYPES)."""
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def dtype_name(code: int) -> str:
    """The inverse of ``dtype_code``, for messages."""
    return str(DTYPES[code]) if 0 <= code < len(DTYPES) else "?"


@dataclasses.dataclass(frozen=True)
class Topology:
    """This rank's groups for one call, read from the ParallelState (never kept).

    ``block``: the MoE block group (None: this rank alone); ``rows``: where its EP and TP
    peers sit among the block's rows; ``tp_group``: the TP group whose ranks hold the same
    tokens and split them (None under sequence parallelism, where each holds its own)."""

    block: object | None
    block_size: int
    rows: MoeRows
    ep_group: object | None
    ep: int
    ep_rank: int
    etp_group: object | None
    etp: int
    etp_rank: int
    tp_group: object | None
    tp: int

    @classmethod
    def of_state(cls, state, sequence_parallel: bool) -> "Topology":
        tp_group = None if sequence_parallel else state.tp_group
        return cls(state.moe_group, state.moe_size, state.moe_rows, state.ep_group, state.ep_size,
                   state.ep_rank, state.etp_group, state.etp_size, state.etp_rank, tp_group,
                   comm.group_size(tp_group))

    @classmethod
    def of_ep_group(cls, ep_group) -> "Topology":
        """An EP group alone (no TP, no expert TP): the block is the EP group."""
        P, me = comm.group_size(ep_group), comm.group_rank(ep_group)
        return cls(ep_group, P, MoeRows(me, 0, tuple(range(P)), (me,)), ep_group, P, me, None, 1, 0, None, 1)

    def global_rank(self, row: int) -> int:
        """The global rank of block row ``row`` (for messages)."""
        if self.block is None:
            return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return dist.get_global_rank(self.block, row)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Contribution:
    """This rank's row, before it is built: device counts and host facts."""

    counts_E: torch.Tensor | None        # [E] kept routes per expert (device); None: abort
    hidden: int
    dtype: int                           # dtype_code of the dispatched rows
    error: str | None = None             # this rank's host-side verdict
    tokens: int = 0
    flags: dict = dataclasses.field(default_factory=dict)   # device counts named as DEVICE_FIELDS
    dedup_P: torch.Tensor | None = None  # [P] rows to each EP peer with dedup (device)
    dedup_vote: int = 0
    forms: int = 0


def build_row(c: Contribution, num_experts: int, ep: int, dev: torch.device) -> torch.Tensor:
    """This rank's [1, W] int64 row on ``dev``: device counts copied, host facts filled."""
    E = num_experts
    row = torch.zeros(1, msg.width(E, ep), dtype=torch.int64, device=dev)
    if c.counts_E is not None:
        row[0, :E] = c.counts_E
        row[0, msg.column("routes", E)] = c.counts_E.sum()
    for name, value in (("hidden", c.hidden), ("dtype", c.dtype), ("error", int(c.error is not None)),
                        ("tokens", c.tokens), ("dedup_mode", c.dedup_vote), ("forms", c.forms)):
        row[0, msg.column(name, E)].fill_(value)   # a fill kernel: no host data is copied
    for name, t in c.flags.items():
        row[0, msg.column(name, E)] = t
    if c.dedup_P is not None:
        row[0, msg.dedup_columns(E, ep)] = c.dedup_P
        row[0, msg.column("dedup_rows", E)] = c.dedup_P.sum()
    return row


def exchange(c: Contribution, topo: Topology, num_experts: int, like: torch.Tensor,
             stats: comm.CommStats | None) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather the rows over the block (bytes: ``counts_message.message_bytes``) and read
    them to the host once: (rows on the device [B, W], the same on the host)."""
    row = build_row(c, num_experts, topo.ep, comm.small_device(topo.block, like))
    rows = comm.all_gather_rows(row, topo.block, stats=stats)
    return rows, device.read_to_host(rows)


FLAG_ERRORS = {   # the message a rank gives for its own device-side verdict
    "nonfinite_input": "check_finite=True: non-finite values in the MoE layer input",
    "nonfinite_logits": "router logits are NaN or inf for {n} token(s); nonfinite='propagate' turns them into "
                        "NaN outputs instead",
    "bad_ids": "expert_ids has {n} route(s) outside [0, num_experts={E})",
}


def raise_on_bad_input(host: torch.Tensor, topo: Topology, num_experts: int, own_error: str | None) -> None:
    """Raise on every rank of the block when any rank's input is bad: a rank with its own
    reason, the others naming the bad ranks. Also when hidden sizes or dtypes differ."""
    E, me = num_experts, topo.rows.me
    if own_error is not None:
        raise ValueError(own_error)
    col = lambda name: host[:, msg.column(name, E)]   # noqa: E731
    for name, text in FLAG_ERRORS.items():
        n = int(col(name)[me])
        if n:
            raise ValueError(text.format(n=n, E=E))
    bad_B = col("error") > 0
    for name in FLAG_ERRORS:
        bad_B |= col(name) > 0
    bad = torch.nonzero(bad_B).flatten().tolist()
    if bad:
        raise ValueError(f"MoE forward aborted: rank(s) {[topo.global_rank(r) for r in bad]} reported invalid "
                         f"input (see their error); this is rank {topo.global_rank(me)}")
    hidden, dtypes = col("hidden"), col("dtype")
    if (hidden != hidden[me]).any() or (dtypes != dtypes[me]).any():
        ranks = [topo.global_rank(r) for r in range(host.shape[0])]
        raise ValueError(f"MoE forward: the hidden sizes {hidden.tolist()} and dtypes "
                         f"{[dtype_name(c) for c in dtypes.tolist()]} of ranks {ranks} differ; every rank of "
                         f"the layer's block must pass the same hidden size and dtype")
    if (host[:, :E] < 0).any():
        raise ValueError(f"MoE forward: negative route counts received: {host[:, :E].tolist()}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What the counts exchange decided, the same on every rank of an EP group.

    ``send``/``recv``: rows to / from each EP peer (dedup: token rows); ``counts_SL``: rows
    per (source block, local expert) after the token and ETP exchanges, on the host and as a
    device tensor (S = etp*P blocks, ETP peer-major); ``etp_sizes``: rows each ETP peer
    received; ``tp_tokens``: every TP peer's token count; ``load``: the EP group's load."""

    form: str
    send: tuple[int, ...]
    recv: tuple[int, ...]
    counts_SL: torch.Tensor
    counts_SL_dev: torch.Tensor
    etp_sizes: tuple[int, ...] | None
    tp_tokens: tuple[int, ...]
    load: GroupLoad


def decide(rows_dev: torch.Tensor, host: torch.Tensor, topo: Topology, num_experts: int,
           receive_capacity_factor: float | None) -> Plan:
    """The plan from the block's rows (no communication, no host read)."""
    E, P, etp, R = num_experts, topo.ep, topo.etp, topo.rows
    L = E // P
    mine = slice(topo.ep_rank * L, (topo.ep_rank + 1) * L)

    def kept_of(t: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """(load, kept, cap) of the EP group of ETP peer t: rows sub + e*etp + t."""
        load = host[R.sub + t:R.sub + P * etp:etp, :E].contiguous()
        if receive_capacity_factor is None:
            return load, load, None
        return (load, *quotas(load, receive_capacity_factor))

    groups = [kept_of(t) for t in range(etp)]
    load_PE, kept_PE, cap = groups[topo.etp_rank]
    load = GroupLoad(load_PE, kept_PE, cap, topo.ep_rank)
    cut = any(k is not lo and bool((k != lo).any()) for lo, k, _ in groups)
    counts_SL = torch.cat([k[:, mine] for _, k, _ in groups])              # [etp*P, L]
    if cut:
        counts_SL_dev = device.to_device(counts_SL, rows_dev.device)
    else:   # views of the gathered rows: the sub-block's [P, etp] rows, ETP peer-major
        W = rows_dev.shape[1]
        counts_SL_dev = rows_dev[R.sub:R.sub + P * etp].view(P, etp, W).transpose(0, 1)[:, :, mine].reshape(-1, L)
    col = lambda name: host[list(R.ep_rows), msg.column(name, E)]   # noqa: E731
    tp_tokens = tuple(host[list(R.tp_rows), msg.column("tokens", E)].tolist())
    etp_sizes = tuple(int(k[:, mine].sum()) for _, k, _ in groups) if etp > 1 else None
    send = tuple(kept_PE[topo.ep_rank].view(P, L).sum(1).tolist())
    recv = tuple(kept_PE[:, mine].sum(1).tolist())
    form = "rows"
    if not cut and int(col("dedup_mode").min()) > 0 and group_dedups(col("dedup_mode"), col("dedup_rows"),
                                                                       col("routes")):
        dcols = msg.dedup_columns(E, P)
        send = tuple(host[R.me, dcols].tolist())
        recv = tuple(host[list(R.ep_rows), dcols.start + topo.ep_rank].tolist())
        form = "dedup"
    elif P > 1 and L > 1 and etp == 1 and int(col("forms").min()) & SOURCE_MAJOR:
        form = "source_major"
    return Plan(form=form, send=send, recv=recv, counts_SL=counts_SL, counts_SL_dev=counts_SL_dev,
                etp_sizes=etp_sizes, tp_tokens=tp_tokens, load=load)

"""Token dispatch to the experts' ranks and back: the MoE forward between router and experts.

Legend (docs/moe.md): T tokens (from step 2 on, T_r: this rank's TP share), D hidden, E
global experts, L = E/ep local experts, K top-k, R routes, P the EP group size, B the MoE
block's size (``moepar.parallel.groups``).

``dispatch`` runs steps 2-7 of docs/moe.md's one list of the forward's steps (step 1 is the
router's), each a method or a module: ``_tp_share`` (2); ``_exchange_counts`` and ``decide``,
at the end of this file (3; ``_apply_guard`` with a receive guard, ``guard.py``); the exchange
form (4-7, ``rows.py``). ``combine`` runs 9-11. Padded capacity mode (``padded.py``)
replaces steps 2-4: its splits are known on every rank without an exchange, so it reads
nothing back to the host. A layer whose block is one rank (tp = ep = etp = 1) exchanges
nothing either.

Its collectives, with their groups and bytes, are rows of the layer's table
(``moepar/moe/traffic.py``), which the cost model prices and tests/moe/test_traffic.py checks
against what a call records; the backward reads nothing back to the host.
The dispatcher keeps no state between calls (``combine`` needs only the metadata) and no
process group: it reads them from the ParallelState at each call (``moe_topology``).
"""
from __future__ import annotations

import dataclasses

import torch

from moepar_kernels.permute_index import check_permute_args

from ...parallel import comm, regions
from ...parallel.groups import MoeTopology as Topology
from .. import cpu, traffic as msg
from .dedup import DEDUP_MAX_FRACTION, DedupMeta, DedupRows, dedup_rows, group_dedups
from .rows import Call, Meta, Plan, RouteRows, Routes, SourceMajorMeta, SourceMajorRows
from ..config import DEDUP_MODES, MoEConfig
from .guard import GroupLoad, guard_drops, quotas
from .padded import PaddedMeta, PaddedRows

__all__ = ["Dispatcher", "Dispatched"]

# The exchange forms by name (rows.py, dedup.py, padded.py); step 3 picks one.
FORMS = {"rows": RouteRows(), "source_major": SourceMajorRows(), "dedup": DedupRows(), "padded": PaddedRows()}

# dtypes are exchanged as small integer codes.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DEDUP_VOTES = {mode: i for i, mode in enumerate(DEDUP_MODES)}   # the counts row's dedup_mode codes
SOURCE_MAJOR = 1      # bit of the "forms" field: this rank takes source-major rows (cpu.py)


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """``dispatch``'s result: this rank's expert rows, the metadata ``combine`` needs, and
    what the caller's ``during`` work returned (None without it)."""

    x_local: torch.Tensor
    meta: Meta
    during: torch.Tensor | None = None

    def __iter__(self):   # x_local, meta, during = dispatcher.dispatch(...)
        return iter((self.x_local, self.meta, self.during))


class Dispatcher:
    """Moves routes to the ranks that own their experts and back.

    ``Dispatcher(config, state, stats)``: the layer's ``MoEConfig`` (validated there; read
    here: ``sequence_parallel``, ``dedup`` (``dedup.py``), ``receive_capacity_factor``
    (``guard.py``), ``cpu_source_major`` (``cpu.py``), the router's ``pad_to_capacity``
    (capacity mode: ``dispatch`` gets the capacity), ``dispatch_dtype`` and
    ``combine_grad_dtype`` (FP8 rows, ``fp8.py``), ``redundant_experts`` (the exchange then
    runs over the E + X slots as if each were an expert)). Groups: ``state`` (a
    ParallelState, read at every call; with ``sequence_parallel`` the TP ranks' tokens are
    their own, so no TP share), or an explicit ``ep_group`` alone (None = one rank). Global
    expert g lives on EP rank ``g // L`` as its local expert ``g % L``. ``stats`` receives
    every collective's event.
    """

    def __init__(self, config: MoEConfig, state=None, stats: comm.CommStats | None = None, *, ep_group=None):
        if not isinstance(config, MoEConfig):
            raise ValueError(f"Dispatcher(config) takes a MoEConfig, got {config!r}")
        if state is not None and ep_group is not None:
            raise ValueError("pass either state or an explicit ep_group to the Dispatcher, not both")
        self.config, self.stats = config, stats
        self._state, self._ep_group = state, ep_group
        self.ep = comm.group_size(self.ep_group)
        if self.ep != config.ep_size:
            raise ValueError(f"the EP group has {self.ep} ranks but config.ep_size={config.ep_size}")
        # slots: what the exchange moves (E + X with redundant experts)
        self.num_experts = config.num_experts + config.exchange.redundant_experts
        self.num_local = self.num_experts // self.ep
        self.columns = msg.columns(self.num_experts, self.ep)   # the counts row's layout, fixed per layer

    @property
    def ep_group(self):
        return self._state.ep_group if self._state is not None else self._ep_group

    def topology(self) -> Topology:
        """This call's groups, read from the state at each call (the state computes them once
        and forgets them at teardown, so a layer that outlives destroy_parallel holds no
        group); a layer built on a bare group keeps the topology it computed."""
        if self._state is not None:
            return self._state.moe_topology_sp if self.config.sequence_parallel else self._state.moe_topology
        topo = self.__dict__.get("_topology")
        if topo is None:
            topo = self.__dict__["_topology"] = Topology.of_ep_group(self._ep_group)
        return topo

    def _call(self) -> Call:
        x = self.config.exchange
        return Call(self.topology(), self.num_experts, self.stats, fp8=x.dispatch_dtype == "fp8",
                    fp8_grad=x.combine_grad_dtype == "fp8")

    # ---- dispatch ---------------------------------------------------------------------
    def dispatch(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
                 weights_TK: torch.Tensor, capacity: int | None = None, *, during=None,
                 flags: dict | None = None, error: str | None = None, trusted: bool = False,
                 tokens: int | None = None, counts_E: torch.Tensor | None = None) -> Dispatched:
        """Rows for this rank's local experts, expert-major (or source-major where the form
        says so), and the metadata to ``combine`` them.

        Dropless: with a TP group of replicated tokens, each TP rank dispatches its
        near-even share. Padded (``capacity`` = the router's slots per expert): every expert
        gets the same slots, the TP ranks split each expert's slots.
        ``during(tp_tokens)``: work to run while the token all-to-all is in flight (the
        shared experts), called with every TP peer's token count (None where not known).
        ``flags``: the caller's device-side verdicts ({"nonfinite_input": count, ...},
        ``traffic.DEVICE_FIELDS``), raised on every rank of the block if nonzero.
        ``error``: the caller found its input invalid (it dispatches an empty routing): every
        rank of the block raises, this one with ``error``, after the counts exchange.
        ``trusted``: the ids, drops and weights come from the layer's router (valid by
        construction): their checks are skipped, and a rank alone reads nothing.
        ``tokens``: this rank's token count as ``during`` sees it (default: x_TD's rows; the
        layer's differ when every route travels as its own row). ``counts_E``: the kept routes
        per expert where the caller has them (the router's histogram; saves making it again).
        """
        # The layer's own routes (trusted) were made valid by its router: only others are checked.
        problem = None if trusted else _dispatch_arg_error(x_TD, expert_ids_TK, dropped_TK, weights_TK,
                                                           self.num_experts, capacity)
        padded = self.config.router.pad_to_capacity
        if problem is None and padded != (capacity is not None):
            problem = (f"capacity={capacity} but this dispatcher was built with pad_to_capacity={padded}: padded "
                       f"capacity mode takes the router's capacity, dropless mode none")
        if error is not None or problem is not None:   # tell the block first (it waits in the counts exchange)
            ok = isinstance(x_TD, torch.Tensor)
            self.abort(error or f"MoE dispatch: {problem}", int(x_TD.shape[-1]) if ok and x_TD.dim() else 0,
                       x_TD.dtype if ok else torch.float32, x_TD.device if ok else torch.device("cpu"))
        call = self._call()
        if padded:
            _check_alone(flags, call, self.num_experts)
            return Dispatched(*FORMS["padded"].dispatch(call, x_TD, expert_ids_TK, dropped_TK, weights_TK,
                                                        capacity, during))
        routes = self._tp_share(call, x_TD, expert_ids_TK, dropped_TK, weights_TK, counts_E)   # 2
        if call.topo.block_size == 1:
            _check_alone(flags, call, self.num_experts)
            return Dispatched(*FORMS["rows"].dispatch(call, routes, None, during, trusted))
        plan = self._exchange_counts(call, routes, x_TD.shape[0] if tokens is None else tokens, flags)  # 3
        routes = self._apply_guard(routes, plan)
        return Dispatched(*FORMS[plan.form].dispatch(call, routes, plan, during))        # 4-7

    def _tp_share(self, call: Call, x_TD, expert_ids_TK, dropped_TK, weights_TK, counts_E=None) -> Routes:
        """Step 2. Inside a TP group the tokens are replicated: each TP rank dispatches its
        near-even share (DeepSpeed's parallelism-coordinated dispatch); the slices are
        differentiable (their backward all-gathers, T*D*b and T*K*4 bytes)."""
        group, tp = call.topo.tp_group, call.topo.tp
        if tp == 1:
            return Routes(x_TD=x_TD, expert_ids_TK=expert_ids_TK, dropped_TK=dropped_TK, weights_TK=weights_TK,
                          token_sizes=None, counts_E=counts_E)
        sizes = tuple(comm.split_sizes(x_TD.shape[0], tp))
        rank = comm.group_rank(group)
        lo = sum(sizes[:rank])
        hi = lo + sizes[rank]
        x_TD = regions.scatter_to_region(x_TD, group, 0, sizes, stats=self.stats)
        weights_TK = regions.scatter_to_region(weights_TK, group, 0, sizes, stats=self.stats)
        return Routes(x_TD=x_TD, expert_ids_TK=expert_ids_TK[lo:hi], weights_TK=weights_TK,
                      dropped_TK=None if dropped_TK is None else dropped_TK[lo:hi], token_sizes=sizes)

    def _exchange_counts(self, call: Call, routes: Routes, tokens: int, flags: dict | None) -> Plan:
        """Step 3: a histogram of the kept routes per global expert (out-of-range ids in a
        spare bin and counted: every rank raises on them), the dedup vote and whether this
        rank may take source-major rows, all-gathered over the block and read once."""
        E, L = self.num_experts, self.num_local
        ids_R = routes.expert_ids_TK.reshape(-1).long()
        bad_R = (ids_R < 0) | (ids_R >= E)
        ids_R = ids_R.masked_fill(bad_R, E)
        ones_R = torch.ones_like(ids_R) if routes.dropped_TK is None else (~routes.dropped_TK).reshape(-1).long()
        counts_E = torch.zeros(E + 1, dtype=torch.int64, device=ids_R.device).scatter_add_(0, ids_R, ones_R)[:E]
        vote = self._dedup_vote(call, routes.expert_ids_TK)
        x = routes.x_TD
        # A CUDA tensor never enters cpu.py: source-major rows pay only on gloo.
        on_cpu = (self.config.exchange.cpu_source_major and x.device.type == "cpu" and call.topo.etp == 1
                  and call.topo.ep > 1)
        forms = SOURCE_MAJOR if on_cpu and cpu.source_major_pays(call.topo.ep_group, L) else 0
        contribution = Contribution(
            counts_E=counts_E, hidden=x.shape[1], dtype=dtype_code(x.dtype), tokens=tokens, forms=forms,
            flags={**(flags or {}), "bad_ids": bad_R.sum()}, dedup_vote=vote,
            dedup_P=dedup_rows(routes.expert_ids_TK, routes.dropped_TK, L, call.topo.ep) if vote else None)
        rows_dev, host = exchange(contribution, call.topo, self.columns, x, self.stats)
        raise_on_bad_input(host, call.topo, self.columns, None)
        return decide(rows_dev, host, call.topo, self.columns, self.config.exchange.receive_capacity_factor)

    def _apply_guard(self, routes: Routes, plan: Plan) -> Routes:
        """Step 3, receive guard: drop this rank's routes past its quotas, lowest routing
        weight first within each expert (``guard.py``); they weigh 0 in the combine and the
        permute skips them. No communication: the quotas came with the counts exchange."""
        load = plan.load
        if load.cap is None or load.guard_dropped == 0:
            return routes
        drop_TK = guard_drops(routes.expert_ids_TK, routes.weights_TK, routes.dropped_TK, load.kept_PE[load.rank])
        dropped_TK = drop_TK if routes.dropped_TK is None else routes.dropped_TK | drop_TK
        weights_TK = torch.where(drop_TK, torch.zeros_like(routes.weights_TK), routes.weights_TK)
        return dataclasses.replace(routes, dropped_TK=dropped_TK, weights_TK=weights_TK)

    def _dedup_vote(self, call: Call, expert_ids_TK: torch.Tensor) -> int:
        """This rank's dedup vote: 0 off, 1 auto, 2 on. Dedup needs more than one route per
        token, an EP group and no expert TP. "auto" votes off at once where it can never
        apply (a token sends at least one row, so rows/routes >= 1/K)."""
        K, mode = expert_ids_TK.shape[1], self.config.exchange.dedup
        if (mode == "off" or call.topo.ep == 1 or call.topo.etp > 1 or K < 2
                or (mode == "auto" and 1 / K > DEDUP_MAX_FRACTION)):
            return 0
        return DEDUP_VOTES[mode]

    def abort(self, error: str, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raise ``error`` here and on every rank of the block: a rank whose input is invalid
        calls this instead of ``dispatch``; its peers learn of it in the counts exchange.
        ``device``: where the layer's collectives run (its parameters' device)."""
        call = self._call()
        if not self.config.router.pad_to_capacity and call.topo.block_size > 1:
            contribution = Contribution(counts_E=None, hidden=hidden, dtype=dtype_code(dtype), error=error)
            exchange(contribution, call.topo, self.columns, torch.empty(0, device=device), self.stats)
        raise ValueError(error)

    def exchange_empty_counts(self, like: torch.Tensor) -> None:
        """The counts exchange alone, of no routes (benchmarks time it)."""
        call = self._call()
        zeros = torch.zeros(self.num_experts, dtype=torch.int64, device=like.device)
        contribution = Contribution(counts_E=zeros, hidden=like.shape[-1], dtype=dtype_code(like.dtype))
        exchange(contribution, call.topo, self.columns, like, self.stats)

    # ---- combine ----------------------------------------------------------------------
    def combine(self, y_local: torch.Tensor, meta: Meta) -> torch.Tensor:
        """Inverse of ``dispatch``; weights each route's output and sums per token: [T, D]."""
        if isinstance(meta, PaddedMeta):
            form = FORMS["padded"]
        elif isinstance(meta, DedupMeta):
            form = FORMS["dedup"]
        elif isinstance(meta, SourceMajorMeta):
            form = FORMS["source_major"]
        else:
            form = FORMS["rows"]
        return form.combine(self._call(), y_local, meta)


def _check_alone(flags: dict | None, call: Call, num_experts: int) -> None:
    """Where no counts exchange runs (padded mode, a block of one rank), the caller's device
    verdicts are read here: one host read, only when the caller asked for a check."""
    if not flags:
        return
    counts = {name: int(t) for name, t in flags.items()}
    for name, n in counts.items():
        if n:
            raise ValueError(FLAG_ERRORS[name].format(n=n, E=num_experts))


def _dispatch_arg_error(x_TD, expert_ids_TK, dropped_TK, weights_TK, num_experts, capacity) -> str | None:
    """What is wrong with ``dispatch``'s arguments, or None: checked before any collective so
    that a rank with bad arguments raises together with its peers, not alone after them. The
    permute's own checks, plus what only the dispatcher needs (floating x, the weights)."""
    for name, t in (("x_TD", x_TD), ("expert_ids_TK", expert_ids_TK), ("weights_TK", weights_TK),
                    ("dropped_TK", dropped_TK)):
        if not (isinstance(t, torch.Tensor) or (t is None and name == "dropped_TK")):
            return f"{name} must be a tensor, got {type(t).__name__}"
    try:
        check_permute_args(x_TD, expert_ids_TK, dropped_TK, num_experts, capacity)
    except ValueError as e:
        return str(e)
    if not x_TD.is_floating_point():
        return f"x_TD must be floating point, got {x_TD.dtype}"
    shape = tuple(expert_ids_TK.shape)
    if not weights_TK.is_floating_point() or tuple(weights_TK.shape) != shape:
        return f"weights_TK must be a floating-point tensor of expert_ids_TK's shape {shape}, got " \
               f"{weights_TK.dtype} of shape {tuple(weights_TK.shape)}"
    if weights_TK.device != x_TD.device:
        return f"weights_TK is on {weights_TK.device} but x_TD is on {x_TD.device}"
    return None


# ---- step 3: the counts message, its exchange and the plan decided from it ------------
def dtype_code(dtype: torch.dtype) -> int:
    """The small integer that stands for ``dtype`` in a message (-1: none of DTYPES)."""
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def dtype_name(code: int) -> str:
    """The inverse of ``dtype_code``, for messages."""
    return str(DTYPES[code]) if 0 <= code < len(DTYPES) else "?"


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


def build_row(c: Contribution, cols: msg.Columns, dev: torch.device) -> torch.Tensor:
    """This rank's [1, W] int64 row on ``dev``: device counts copied, host facts filled."""
    E, at = cols.num_experts, cols.field
    row = torch.zeros(1, cols.width, dtype=torch.int64, device=dev)
    if c.counts_E is not None:
        row[0, :E] = c.counts_E
        row[0, at["routes"]] = c.counts_E.sum()
    for name, value in (("hidden", c.hidden), ("dtype", c.dtype), ("error", int(c.error is not None)),
                        ("tokens", c.tokens), ("dedup_mode", c.dedup_vote), ("forms", c.forms)):
        row[0, at[name]].fill_(value)   # a fill kernel: no host data is copied
    for name, t in c.flags.items():
        row[0, at[name]] = t
    if c.dedup_P is not None:
        row[0, cols.dedup] = c.dedup_P
        row[0, at["dedup_rows"]] = c.dedup_P.sum()
    return row


def exchange(c: Contribution, topo: Topology, cols: msg.Columns, like: torch.Tensor,
             stats: comm.CommStats | None) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather the rows over the block (bytes: ``traffic.message_bytes``) and read
    them to the host once: (rows on the device [B, W], the same on the host)."""
    row = build_row(c, cols, comm.small_device(topo.block, like))
    rows = comm.all_gather_rows(row, topo.block, stats=stats)
    return rows, comm.read_to_host(rows)


FLAG_ERRORS = {   # the message a rank gives for its own device-side verdict
    "nonfinite_input": "check_finite=True: non-finite values in the MoE layer input",
    "nonfinite_logits": "router logits are NaN or inf for {n} token(s); nonfinite='propagate' turns them into "
                        "NaN outputs instead",
    "bad_ids": "expert_ids has {n} route(s) outside [0, num_experts={E})",
}


def raise_on_bad_input(host: torch.Tensor, topo: Topology, cols: msg.Columns, own_error: str | None) -> None:
    """Raise on every rank of the block when any rank's input is bad: a rank with its own
    reason, the others naming the bad ranks. Also when hidden sizes or dtypes differ."""
    E, me = cols.num_experts, topo.rows.me
    if own_error is not None:
        raise ValueError(own_error)
    col = lambda name: host[:, cols.field[name]]   # noqa: E731
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


def decide(rows_dev: torch.Tensor, host: torch.Tensor, topo: Topology, cols: msg.Columns,
           receive_capacity_factor: float | None) -> Plan:
    """The plan from the block's rows (no communication, no host read)."""
    E, P, etp, R = cols.num_experts, topo.ep, topo.etp, topo.rows
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
        counts_SL_dev = comm.to_device(counts_SL, rows_dev.device)
    else:   # views of the gathered rows: the sub-block's [P, etp] rows, ETP peer-major
        W = rows_dev.shape[1]
        counts_SL_dev = rows_dev[R.sub:R.sub + P * etp].view(P, etp, W).transpose(0, 1)[:, :, mine].reshape(-1, L)
    col = lambda name: host[list(R.ep_rows), cols.field[name]]   # noqa: E731
    tp_tokens = tuple(host[list(R.tp_rows), cols.field["tokens"]].tolist())
    etp_sizes = tuple(int(k[:, mine].sum()) for _, k, _ in groups) if etp > 1 else None
    send = tuple(kept_PE[topo.ep_rank].view(P, L).sum(1).tolist())
    recv = tuple(kept_PE[:, mine].sum(1).tolist())
    form = "rows"
    if not cut and int(col("dedup_mode").min()) > 0 and group_dedups(col("dedup_mode"), col("dedup_rows"),
                                                                     col("routes")):
        dcols = cols.dedup
        send = tuple(host[R.me, dcols].tolist())
        recv = tuple(host[list(R.ep_rows), dcols.start + topo.ep_rank].tolist())
        form = "dedup"
    elif P > 1 and L > 1 and etp == 1 and int(col("forms").min()) & SOURCE_MAJOR:
        form = "source_major"
    return Plan(form=form, send=send, recv=recv, counts_SL=counts_SL, counts_SL_dev=counts_SL_dev,
                etp_sizes=etp_sizes, tp_tokens=tp_tokens, load=load)

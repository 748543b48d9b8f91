"""Token dispatch to the experts' ranks and back, as the steps of the MoE forward.

Legend: T tokens this rank dispatches, D hidden, E global experts, L = E/ep local experts,
K top-k, N routes this rank sends (kept routes, or E*C rows when padded to capacity),
M rows this rank's experts process, S = ep*etp source blocks, P the EP group size.

``dispatch`` (dropless), each step a method below:
  1. ``_tp_share``        with a TP group whose ranks hold the same tokens, keep this TP
                          rank's 1/tp share of them (a slice: no communication);
  2. ``_exchange_counts`` count the routes per expert, and send each EP peer the counts
                          plus the metadata of ``counts_message.FIELDS``: every rank
                          checks its peers' (a bad input on one rank raises on all) and the
                          group agrees on the exchange form and on the receive guard's
                          quotas (``guard.py``);
     ``_apply_guard``     drop the routes past this rank's quotas (receive guard only);
  3. ``_permute``         the rows, expert-major (global expert = peer-major);
  4. ``_exchange_tokens`` one all-to-all-v of the rows over the EP group;
  5. ``_gather_etp``      with expert TP, all-gather the rows of the ETP peers;
  6. ``_expert_major``    regroup the source-major rows by local expert (or, on gloo with a
                          caller that takes them, leave them source-major: ``cpu.py``).
``combine`` undoes them in reverse: regroup back, ETP reduce-scatter, the reverse all-to-all,
the weighted unpermute, the TP all-gather of the token shares. Padded capacity mode
(``_dispatch_padded``) and dedup (``_dispatch_dedup``, ``dedup.py``) replace steps 1-6.

Collectives per call (b = bytes per element), in order:
  dispatch: [ep>1] counts all-to-all, P * counts_message.width(E) int64 ; [ep>1] token
            all-to-all, N*D*b sent; [etp>1] all-gather of the counts matrix (etp*ep*L*8) and
            of the rows (etp*M_r*D*b)
  combine:  [etp>1] reduce-scatter of the partial outputs (etp*M_r*D*b) ; [ep>1] token all-to-all back
  backward: the mirror of each token collective (all-to-all <-> all-to-all, all-gather <-> reduce-scatter).
  dedup:    token all-to-alls of S*D*b (S = rows, one per token and destination rank) and a
            side all-to-all of S*2K*4 each way.
The dispatcher keeps no state between calls (everything ``combine`` needs is in the frozen
``DispatchMeta``) and no process group: it reads them from the ParallelState at each call.

Dedup (``dedup="auto"|"on"``; dropless, no expert TP, K > 1; any backend): a token whose K
routes go to fewer than K EP ranks is sent once to each of those ranks, not once per route
(DeepEP's layout); the token all-to-alls then carry (distinct ranks per token) / K of the
bytes: for E=64, K=8 about 0.25 at ep=2 and 0.46 at ep=4 under uniform routing. It costs the
receiver's expansion passes, so "auto" uses it when the EP group's fraction is at most
``dedup.DEDUP_MAX_FRACTION``. The ranks vote in the counts exchange and decide the same.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moepar_kernels.permute import permute, unpermute
from moepar_kernels.permute_checks import check_permute_args

from ..parallel import comm
from . import counts_message, cpu
from .dedup import DEDUP_MAX_FRACTION, dedup_expand, dedup_rows, dedup_send, group_dedups  # noqa: F401
from .guard import GroupLoad, check_receive_capacity_factor, guard_drops, quotas

# dtypes are exchanged as small integer codes (the counts message, the layer's preflight).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DEDUP_VOTES = {"off": 0, "auto": 1, "on": 2}
SOURCE_MAJOR = 1      # bit of the counts message's "forms" field: this rank takes source-major rows


def dtype_code(dtype: torch.dtype) -> int:
    """The small integer that stands for ``dtype`` in a message (-1: none of DTYPES)."""
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def dtype_name(code: int) -> str:
    """The inverse of ``dtype_code``, for messages."""
    return str(DTYPES[code]) if 0 <= code < len(DTYPES) else "?"


class _PermuteRows(torch.autograd.Function):
    """x[idx] for a permutation idx; the backward applies the inverse permutation (a gather,
    not the scatter-add that index_select's generic backward would use)."""

    @staticmethod
    def forward(ctx, x, idx, inv):
        ctx.save_for_backward(inv)
        return _gather_rows(x, idx)

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return _gather_rows(g, inv), None, None


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[idx] (into a buffer from the CPU pool on the CPU)."""
    return torch.index_select(x, 0, idx, out=cpu.empty_like_rows(x, idx.shape[0]))


@dataclasses.dataclass(frozen=True)
class DispatchMeta:
    """What ``combine`` needs to undo ``dispatch`` (no autograd state of its own)."""

    num_tokens: int
    row_map_TK: torch.Tensor             # [T, K] row of each route in the permuted buffer, -1 dropped
    weights_TK: torch.Tensor | None      # [T, K] combine weights (in the graph); None with dedup
    send_splits: list[int] | None        # rows sent to each EP peer
    recv_splits: list[int] | None        # rows received from each EP peer
    etp_sizes: list[int] | None          # rows each ETP peer received (all-gather sizes)
    regroup: tuple[torch.Tensor, torch.Tensor] | None  # (idx, inverse) source-major -> expert-major
    tokens_per_local_expert: torch.Tensor  # [L] int64 on CPU: rows per local expert, expert-major
    counts_SL: torch.Tensor              # [S, L] int64 on CPU: rows per (source block, local expert)
    capacity: int | None = None          # per-expert slots when padded, else None
    token_sizes: list[int] | None = None  # TP shares of the tokens (dropless coordinated dispatch)
    # Source-major rows (``dispatch(..., source_major=True)``): block i of x_local has
    # segment_counts[i] rows for local expert segment_experts[i]; None = expert-major.
    segment_experts: tuple | None = None
    segment_counts: list[int] | None = None
    # Dedup form (one row per token and destination rank): (row_map_RK [R, K] of the received
    # rows into x_local, weights_RK [R, K] in the graph); row_map_TK then maps routes to the
    # sent rows, -1 for a route whose rank an earlier route of its token already covers.
    dedup: tuple | None = None
    load: GroupLoad | None = None        # the EP group's load (and the receive guard's cut)

    @property
    def exchange_form(self) -> str:
        """The form this dispatch took: "padded" (capacity slots), "dedup", "source_major"
        (rows left as they arrived, cpu.py), "regroup" (gathered expert-major), or "direct"
        (one source block or one local expert: the rows arrived expert-major)."""
        if self.capacity is not None:
            return "padded"
        if self.dedup is not None:
            return "dedup"
        return "source_major" if self.segment_experts else "regroup" if self.regroup else "direct"


@dataclasses.dataclass(frozen=True)
class _Routes:
    """This rank's share of the routes (step 1): tokens, their K expert ids, drops, weights."""
    x_TD: torch.Tensor
    expert_ids_TK: torch.Tensor
    dropped_TK: torch.Tensor | None
    weights_TK: torch.Tensor
    token_sizes: list[int] | None        # every TP rank's share (None without TP)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the counts exchange (step 2) decided, the same on every EP rank."""
    counts_E: torch.Tensor               # [E] kept routes this rank sends per global expert
    counts_PL: torch.Tensor              # [P, L] int64 host: rows each peer sends my experts
    send: list[int] | None               # rows to each peer (None: ep = 1)
    recv: list[int] | None               # rows from each peer
    dedup_rows: list[int] | None = None  # with dedup: rows to each peer / from each peer
    dedup_recv: list[int] | None = None
    source_major: bool = False           # leave the received rows source-major (cpu.py)
    load: GroupLoad | None = None        # the group's [P, E] load, before and after the guard


class Dispatcher:
    """Moves routes to the ranks that own their experts and back.

    Groups: ``state`` (a ParallelState, read at every call; ``sequence_parallel=True``:
    the TP ranks' tokens are their own, so no TP share), or explicit ``ep_group``,
    ``etp_group``, ``tp_group`` (torch.distributed groups or None = one rank). Global expert
    g lives on EP rank ``g // L`` as its local expert ``g % L``. ``dedup``: "off" | "auto" |
    "on" (see the module docstring); ``stats`` receives every collective's event.
    ``receive_capacity_factor``: None, or f >= 1: no rank receives more than
    ceil(f x mean) rows (``guard.py`` states the rule; dropless mode only).
    """

    def __init__(self, num_experts: int, ep_group=None, etp_group=None, tp_group=None,
                 stats: comm.CommStats | None = None, *, state=None, sequence_parallel: bool = False,
                 dedup: str = "auto", receive_capacity_factor: float | None = None):
        if state is not None and any(g is not None for g in (ep_group, etp_group, tp_group)):
            raise ValueError("pass either state or explicit groups to the Dispatcher, not both")
        if dedup not in DEDUP_VOTES:
            raise ValueError(f"dedup={dedup!r} must be one of {tuple(DEDUP_VOTES)}")
        check_receive_capacity_factor(receive_capacity_factor)
        self.receive_capacity_factor = receive_capacity_factor
        self._state, self._groups = state, (ep_group, etp_group, tp_group)
        self.sequence_parallel, self.dedup = sequence_parallel, dedup
        self.num_experts, self.stats = num_experts, stats
        self.ep, self.etp = comm.group_size(self.ep_group), comm.group_size(self.etp_group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={self.ep}")
        self.num_local = num_experts // self.ep

    @property
    def ep_group(self):
        return self._state.ep_group if self._state is not None else self._groups[0]

    @property
    def etp_group(self):
        return self._state.etp_group if self._state is not None else self._groups[1]

    @property
    def tp_group(self):
        """The TP group whose ranks hold the same (replicated) tokens; None under SP."""
        if self._state is not None:
            return None if self.sequence_parallel else self._state.tp_group
        return self._groups[2]

    # ---- dispatch ---------------------------------------------------------------------
    def dispatch(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
                 weights_TK: torch.Tensor, capacity: int | None = None, source_major: bool = False
                 ) -> tuple[torch.Tensor, DispatchMeta]:
        """Rows for this rank's local experts and the meta to ``combine`` them.

        Dropless (``capacity=None``): with a TP group, each TP rank dispatches only its
        near-even share of the (replicated) tokens. Padded (``capacity`` = slots per expert):
        every expert gets the same number of slots, the max over the EP group rounded up to
        a multiple of tp, empty slots zero; the TP ranks split each expert's slots.
        ``source_major=True``: the caller can take the rows as they arrive, source-rank-major
        (``meta.segment_experts``/``segment_counts`` name each block's local expert; see
        GroupedExperts' ``segment_experts``); used on gloo with CPU tensors only (cpu.py).
        """
        error = _dispatch_arg_error(x_TD, expert_ids_TK, dropped_TK, weights_TK, self.num_experts, capacity)
        if error is not None:   # tell the EP peers first (they wait in the counts exchange)
            hidden = int(x_TD.shape[-1]) if isinstance(x_TD, torch.Tensor) and x_TD.dim() else 0
            dtype = x_TD.dtype if isinstance(x_TD, torch.Tensor) else torch.float32
            self.preflight_error(f"MoE dispatch: {error}", hidden, dtype)
        if capacity is not None:
            return self._dispatch_padded(x_TD, expert_ids_TK, dropped_TK, weights_TK, capacity)
        routes = self._tp_share(x_TD, expert_ids_TK, dropped_TK, weights_TK)          # 1
        plan = self._exchange_counts(routes, source_major)                            # 2
        routes = self._apply_guard(routes, plan)
        if plan.dedup_rows is not None:
            return self._dispatch_dedup(routes, plan)
        x_ND, row_map_TK = self._permute(routes)                                      # 3
        x_recv = self._exchange_tokens(x_ND, plan)                                    # 4
        x_recv, counts_SL, etp_sizes = self._gather_etp(x_recv, plan.counts_PL)       # 5
        x_local, regroup, segments = self._expert_major(x_recv, counts_SL, plan)      # 6
        return x_local, DispatchMeta(routes.x_TD.shape[0], row_map_TK, routes.weights_TK, plan.send, plan.recv,
                                     etp_sizes, regroup, counts_SL.sum(0), counts_SL, None, routes.token_sizes,
                                     *(segments or (None, None)), load=plan.load)

    def _tp_share(self, x_TD, expert_ids_TK, dropped_TK, weights_TK) -> _Routes:
        """Step 1. Inside a TP group the tokens are replicated: each TP rank dispatches its
        near-even share (DeepSpeed's parallelism-coordinated dispatch); the slices are
        differentiable (their backward all-gathers, T*D*b and T*K*4 bytes)."""
        tp = comm.group_size(self.tp_group)
        if tp == 1:
            return _Routes(x_TD, expert_ids_TK, dropped_TK, weights_TK, None)
        sizes = comm.split_sizes(x_TD.shape[0], tp)
        lo = sum(sizes[:comm.group_rank(self.tp_group)])
        hi = lo + sizes[comm.group_rank(self.tp_group)]
        x_TD = comm.scatter_to_region(x_TD, self.tp_group, 0, sizes, stats=self.stats)
        weights_TK = comm.scatter_to_region(weights_TK, self.tp_group, 0, sizes, stats=self.stats)
        dropped_TK = None if dropped_TK is None else dropped_TK[lo:hi]
        return _Routes(x_TD, expert_ids_TK[lo:hi], dropped_TK, weights_TK, sizes)

    def _exchange_counts(self, routes: _Routes, source_major: bool) -> _Plan:
        """Step 2: a histogram of the kept routes per global expert, then (ep > 1) the counts
        all-to-all. Out-of-range ids (dropped routes' too: the permute rejects any) land in
        a spare bin; a rank that has any reports it in the exchange and every rank raises
        there, nobody waits in the token all-to-all. Also the dedup vote and whether this
        rank may take source-major rows: the group takes either only if every rank does."""
        E, L, P = self.num_experts, self.num_local, self.ep
        ids_R = routes.expert_ids_TK.reshape(-1).long()
        bad_R = (ids_R < 0) | (ids_R >= E)
        ids_R = ids_R.masked_fill(bad_R, E)
        ones_R = torch.ones_like(ids_R) if routes.dropped_TK is None else (~routes.dropped_TK).reshape(-1).long()
        counts_E = torch.zeros(E + 1, dtype=torch.int64, device=ids_R.device).scatter_add_(0, ids_R, ones_R)[:E]
        if P == 1:   # (the guard never cuts one rank: its cap is >= its rows)
            load_PE = counts_E.to("cpu", torch.int64).view(1, E)
            return _Plan(counts_E, load_PE, None, None, load=GroupLoad(load_PE, load_PE, None, 0))
        n_bad = int(bad_R.sum())
        error = None if n_bad == 0 else f"expert_ids has {n_bad} route(s) outside [0, num_experts={E})"
        vote = self._dedup_vote(routes.expert_ids_TK)
        rows_P = dedup_rows(routes.expert_ids_TK, routes.dropped_TK, L, P) if vote else None
        x = routes.x_TD
        # A CUDA tensor never enters cpu.py: source-major rows pay only on gloo (below).
        on_cpu = x.device.type == "cpu" and source_major and self.etp == 1
        forms = SOURCE_MAJOR if on_cpu and cpu.source_major_pays(self.ep_group, L) else 0
        recv = self.counts_all_to_all(counts_E, x.shape[1], x.dtype, error, None, rows_P, vote, forms)
        field = lambda name: recv[:, counts_message.column(name, E)]   # noqa: E731
        # Every rank holds the group's [P, E] load: the same quotas everywhere.
        load_PE, me = recv[:, :E].contiguous(), dist.get_rank(self.ep_group)
        kept_PE, cap = load_PE, None
        if self.receive_capacity_factor is not None:
            kept_PE, cap = quotas(load_PE, self.receive_capacity_factor)
        load = GroupLoad(load_PE, kept_PE, cap, me)
        counts_PL = kept_PE[:, me * L:(me + 1) * L]
        send, got = kept_PE[me].view(P, L).sum(1).tolist(), counts_PL.sum(1).tolist()
        cut = kept_PE is not load_PE and bool((kept_PE != load_PE).any())
        # Dedup rows were counted before the guard: the group takes dedup only if it cut nothing.
        if vote and not cut and group_dedups(field("dedup_mode"), field("dedup_rows"), field("routes")):
            return _Plan(counts_E, counts_PL, send, got, rows_P.tolist(), field("dedup_rows_to_peer").tolist(),
                         load=load)
        group_source = bool(int(field("forms").min()) & SOURCE_MAJOR)
        return _Plan(counts_E, counts_PL, send, got, source_major=group_source and L > 1, load=load)

    def _apply_guard(self, routes: _Routes, plan: _Plan) -> _Routes:
        """Step 2b (receive guard): drop this rank's routes past its quotas, lowest routing
        weight first within each expert (``guard.py``); they weigh 0 in the combine and the
        permute skips them. No communication: the quotas came with the counts exchange."""
        load = plan.load
        if load is None or load.cap is None or load.guard_dropped == 0:
            return routes
        drop_TK = guard_drops(routes.expert_ids_TK, routes.weights_TK, routes.dropped_TK,
                              load.kept_PE[load.rank])
        dropped_TK = drop_TK if routes.dropped_TK is None else routes.dropped_TK | drop_TK
        weights_TK = torch.where(drop_TK, torch.zeros_like(routes.weights_TK), routes.weights_TK)
        return dataclasses.replace(routes, dropped_TK=dropped_TK, weights_TK=weights_TK)

    def _permute(self, routes: _Routes) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 3: x_ND [N, D], each kept route's token row, expert-major; row_map_TK."""
        x_ND, _, row_map_TK = permute(routes.x_TD, routes.expert_ids_TK, routes.dropped_TK, self.num_experts)
        return x_ND, row_map_TK

    def _exchange_tokens(self, x_ND: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """Step 4: one all-to-all-v over the EP group, N*D*b bytes sent; block s of the
        result holds peer s's rows for my L experts, expert-major inside it."""
        if self.ep == 1:
            return x_ND
        return comm.all_to_all(x_ND, self.ep_group, plan.recv, plan.send, stats=self.stats, empty=cpu.empty)

    def _gather_etp(self, x_recv: torch.Tensor, counts_PL: torch.Tensor):
        """Step 5: with expert TP every ETP rank computes a slice of the same experts, so it
        needs the rows of all its ETP peers: gather their counts matrices ([P, L] int64
        each), then the rows. Returns (rows, counts_SL [S, L], each peer's row count)."""
        if self.etp == 1:
            return x_recv, counts_PL, None
        group = self.etp_group
        mats = comm.all_gather_rows(counts_PL.to(comm.small_device(group, x_recv)), group, stats=self.stats).cpu()
        etp_sizes = mats.view(self.etp, -1).sum(1).tolist()
        x_recv = comm.gather_from_sequence_region(x_recv, group, 0, etp_sizes, stats=self.stats)
        return x_recv, mats.view(-1, self.num_local), etp_sizes

    def _expert_major(self, x_recv: torch.Tensor, counts_SL: torch.Tensor, plan: _Plan):
        """Step 6: the grouped GEMM wants each local expert's rows contiguous: a gather
        (``_regroup_index``) from source-major (s, l) blocks to expert-major (l, s), undone
        in ``combine``. Returns (rows, regroup or None, source-major segments or None)."""
        if counts_SL.shape[0] == 1 or self.num_local == 1:   # already expert-major
            return x_recv, None, None
        if plan.source_major:
            return x_recv, None, cpu.source_major_segments(counts_SL)
        regroup = _regroup_index(counts_SL, x_recv.device)
        return _PermuteRows.apply(x_recv, *regroup), regroup, None

    def _dispatch_padded(self, x_TD, expert_ids_TK, dropped_TK, weights_TK, capacity: int):
        """Capacity mode: every expert gets C slots (the EP group's max capacity, rounded up
        to a multiple of tp), so every split is equal; the TP ranks split each expert's
        slots ([E, C/tp, D] each) instead of the tokens."""
        E, L, P, D = self.num_experts, self.num_local, self.ep, x_TD.shape[1]
        tp = comm.group_size(self.tp_group)
        if P > 1:  # agree on one capacity
            recv = self.counts_all_to_all(torch.zeros(E, dtype=torch.int64), D, x_TD.dtype, None, capacity)
            capacity = int(recv[:, counts_message.column("capacity", E)].max())
        capacity = -(-capacity // tp) * tp
        x_ND, _, row_map_TK = permute(x_TD, expert_ids_TK, dropped_TK, E, capacity=capacity)
        if tp > 1:
            x_ND = comm.scatter_to_region(x_ND.view(E, capacity, D), self.tp_group, 1,
                                          stats=self.stats).reshape(-1, D)
        slots = capacity // tp
        counts_PL = torch.full((P, L), slots, dtype=torch.int64)
        split = [L * slots] * P
        plan = _Plan(counts_PL.view(-1), counts_PL, split, split)
        x_recv = self._exchange_tokens(x_ND, plan)
        x_recv, counts_SL, etp_sizes = self._gather_etp(x_recv, counts_PL)
        x_local, regroup, _ = self._expert_major(x_recv, counts_SL, plan)
        return x_local, DispatchMeta(x_TD.shape[0], row_map_TK, weights_TK, split, split, etp_sizes, regroup,
                                     counts_SL.sum(0), counts_SL, capacity)

    def _dispatch_dedup(self, routes: _Routes, plan: _Plan):
        """Dedup form: one row per (token, destination rank), not per route. The sender sends
        each token once to every rank that holds any of its experts, with a small side message
        per row ([rows, 2K] fp32: the routing weights and local expert ids of the token's
        routes to that rank, 0 and -1 elsewhere). The receiver expands the rows into its
        experts' rows (a permute, expert-major: no regroup) and, in ``combine``, sums each
        row's expert outputs with its weights before the return all-to-all; the sender then
        sums a token's returned rows. Gradients reach the weights through the side message's
        reverse all-to-all."""
        P, L = self.ep, self.num_local
        x_SD, row_map_TK, side_S = dedup_send(routes.x_TD, routes.expert_ids_TK, routes.dropped_TK,
                                              routes.weights_TK, L, P)
        send, recv = plan.dedup_rows, plan.dedup_recv
        x_recv = comm.all_to_all(x_SD, self.ep_group, recv, send, stats=self.stats, empty=cpu.empty)
        side_R = comm.all_to_all(side_S, self.ep_group, recv, send, stats=self.stats)
        x_local, row_map_RK, w_RK = dedup_expand(x_recv, side_R, L)
        # The weights were applied on the receiver: the sender's unpermute sums with weight 1.
        return x_local, DispatchMeta(routes.x_TD.shape[0], row_map_TK, None, send, recv, None, None,
                                     plan.counts_PL.sum(0), plan.counts_PL, None, routes.token_sizes,
                                     dedup=(row_map_RK, w_RK), load=plan.load)

    def _dedup_vote(self, expert_ids_TK: torch.Tensor) -> int:
        """This rank's dedup vote: 0 off, 1 auto, 2 on. Dedup needs more than one route per
        token and no expert TP. "auto" votes off at once where it can never apply (a token
        sends at least one row, so rows/routes >= 1/K): the row count is then not computed."""
        K = expert_ids_TK.shape[1]
        if self.dedup == "off" or self.etp > 1 or K < 2 or (self.dedup == "auto" and 1 / K > DEDUP_MAX_FRACTION):
            return 0
        return DEDUP_VOTES[self.dedup]

    # ---- the counts message doubles as a collective sanity check ------------------------
    def counts_all_to_all(self, counts_E: torch.Tensor, hidden: int, dtype: torch.dtype, error: str | None,
                           capacity: int | None, dedup_P: torch.Tensor | None = None, dedup_vote: int = 0,
                           forms: int = 0) -> torch.Tensor:
        """Send each EP peer the counts for its experts plus the metadata of
        ``counts_message.FIELDS``; receive [P, width(E)]. Every rank checks every peer's
        metadata, so a bad input on one rank raises on all of them here, before any token
        moves. Bytes: P * width(E) * 8 each way."""
        P, E = self.ep, self.num_experts
        if dedup_P is None:
            dedup_P, dedup_vote = torch.zeros(P, dtype=torch.int64), 0
        values = {"hidden": hidden, "dtype": dtype_code(dtype), "error": int(error is not None),
                  "capacity": capacity or 0, "routes": int(counts_E.sum()), "dedup_mode": dedup_vote,
                  "dedup_rows": int(dedup_P.sum()), "forms": forms}
        meta = torch.tensor([values.get(name, 0) for name in counts_message.FIELDS], dtype=torch.int64)
        # Every peer gets all E counts (the group's load matrix, counts_message): P*E*8 bytes.
        send = torch.cat([counts_E.to("cpu", torch.int64).view(1, E).expand(P, -1), meta.expand(P, -1)], dim=1)
        send[:, counts_message.column("dedup_rows_to_peer", E)] = dedup_P.to("cpu", torch.int64)
        # Counts travel on the tokens' device (NCCL needs CUDA tensors); tiny.
        device = comm.small_device(self.ep_group, counts_E)
        recv = comm.all_to_all_rows(send.to(device), self.ep_group, None, None, stats=self.stats).cpu()
        field = lambda name: recv[:, counts_message.column(name, E)]   # noqa: E731
        me = dist.get_rank(self.ep_group)
        if error is not None:
            raise ValueError(error)
        bad = torch.nonzero(field("error")).flatten().tolist()
        if bad:
            raise ValueError(f"MoE dispatch aborted: EP rank(s) {bad} reported invalid input "
                             f"(see their error); this is EP rank {me}")
        if (field("hidden") != hidden).any() or (field("dtype") != field("dtype")[me]).any():
            raise ValueError(f"MoE dispatch: hidden sizes {field('hidden').tolist()} and dtypes "
                             f"{[dtype_name(c) for c in field('dtype').tolist()]} differ across the EP "
                             f"group; every rank must send the same hidden size and dtype")
        if (recv[:, :E] < 0).any():
            raise ValueError(f"MoE dispatch: negative route counts received: {recv[:, :E].tolist()}")
        return recv

    def preflight_error(self, error: str, hidden: int, dtype: torch.dtype) -> None:
        """A rank whose input is invalid calls this instead of ``dispatch``: its EP peers
        learn of it in the counts exchange and everyone raises, nobody hangs."""
        if self.ep > 1:
            self.counts_all_to_all(torch.zeros(self.num_experts, dtype=torch.int64), hidden, dtype, error, None)
        raise ValueError(error)

    # ---- combine ----------------------------------------------------------------------
    def combine(self, y_local: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """Inverse of ``dispatch``; weights each route's output and sums per token: [T, D]."""
        y = y_local
        if meta.dedup is not None:   # each received row's weighted expert outputs, summed here
            row_map_RK, w_RK = meta.dedup
            y = unpermute(y, row_map_RK, w_RK, row_map_RK.shape[0])
        if meta.regroup is not None:
            idx, inv = meta.regroup
            y = _PermuteRows.apply(y, inv, idx)
        if self.etp > 1:   # the partial sums of the ETP peers' FFN slices, each peer its rows
            y = comm.reduce_scatter_to_region(y, self.etp_group, 0, meta.etp_sizes, stats=self.stats)
        if self.ep > 1:
            y = comm.all_to_all(y, self.ep_group, meta.send_splits, meta.recv_splits, stats=self.stats,
                                empty=cpu.empty)
        tp_group = self.tp_group
        if meta.capacity is not None:
            if comm.group_size(tp_group) > 1:  # gather every expert's slot slices back: [E, C, D]
                y = comm.gather_from_region(y.view(self.num_experts, -1, y.shape[-1]), tp_group, 1,
                                            stats=self.stats).reshape(-1, y.shape[-1])
            return unpermute(y, meta.row_map_TK, meta.weights_TK, meta.num_tokens)
        # row_map/weights cover this rank's token share only (all tokens without TP).
        y = unpermute(y, meta.row_map_TK, meta.weights_TK, meta.row_map_TK.shape[0])
        if meta.token_sizes is not None:
            y = comm.gather_from_region(y, tp_group, 0, meta.token_sizes, stats=self.stats)
        return y


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


def _regroup_index(counts_SL: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation taking rows from source-major blocks (s, l) to expert-major (l, s), and
    its inverse. O(M) with repeat_interleave; counts_SL lives on the host."""
    S, L = counts_SL.shape
    flat = counts_SL.reshape(-1)
    src_start = torch.cumsum(flat, 0) - flat                   # start of block (s, l), source order
    order = torch.arange(S * L).view(S, L).t().reshape(-1)     # blocks in (l, s) order
    cnt, starts = flat[order], src_start[order]
    tgt_start = torch.cumsum(cnt, 0) - cnt
    M = int(flat.sum())
    idx = torch.arange(M) + torch.repeat_interleave(starts - tgt_start, cnt, output_size=M)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(M)
    return idx.to(device), inv.to(device)

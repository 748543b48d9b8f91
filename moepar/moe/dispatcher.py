"""Token dispatch to the experts' ranks and back: permute, exchange counts, all-to-all-v,
(expert-TP all-gather), regroup by local expert; and the mirror of each step to combine.

Legend: T tokens this rank dispatches, D hidden, E global experts, L = E/ep local experts,
K top-k, N routes this rank sends (kept routes, or E*C rows when padded to capacity),
M rows this rank's experts process, S = ep*etp source blocks, P the EP group size.

Collectives per call (b = bytes per element), in order:
  dispatch: [ep>1] counts all-to-all, P*(L+9) int64 ; [ep>1] token all-to-all, N*D*b sent;
            [etp>1] all-gather of the counts matrix (etp*ep*L*8) and of the rows (etp*M_r*D*b)
  combine:  [etp>1] reduce-scatter of the partial outputs (etp*M_r*D*b) ; [ep>1] token all-to-all back
  backward: the mirror of each token collective (all-to-all <-> all-to-all, all-gather <-> reduce-scatter).
  dedup (below): token all-to-alls of S*D*b (S = rows, one per token and destination rank) and a
            side all-to-all of S*2K*4 each way.
The dispatcher keeps no state between calls: everything ``combine`` needs is in ``DispatchMeta``.

Regroup. The token all-to-all delivers source-major rows (block s from EP peer s, inside it
the peer's rows for each local expert); the grouped GEMM wants each local expert's rows
contiguous. Three ways, same numbers:
  * one all-to-all, then a local gather (``_regroup_index``) to expert-major, and its inverse
    on the way back (NCCL, padded capacity mode, and a caller that needs expert-major rows);
  * blocked (gloo on the CPU, dropless, no expert TP, 2..BLOCKED_MAX_LOCAL local experts):
    the sender permutes its rows in (local expert, peer) order and issues one all-to-all per
    local expert, each landing in that expert's contiguous block: no regroup passes (on this
    CPU a pass over the rows costs about as much as moving them; docs/bench.md).
    ``MOEPAR_BLOCKED_A2A=0`` turns it off. Recorded as one all-to-all in the stats;
  * source-major (gloo, dropless, no expert TP, the caller passes ``source_major=True`` as
    the MoE layer does): one all-to-all whose rows stay as they arrive, each (peer, local
    expert) block named in ``meta.segment_experts``/``segment_counts`` for GroupedExperts'
    ``segment_experts``. Used instead of the regroup, and instead of the blocked form from
    SOURCE_MAJOR_MIN_LOCAL local experts on (many smaller calls cost more than one).
    ``MOEPAR_SOURCE_MAJOR=0`` turns it off.

Dedup (dropless, no expert TP, K > 1; any backend): a token whose K routes go to fewer than
K EP ranks is sent once to each of those ranks, not once per route (DeepEP's layout), with a
[rows, 2K] fp32 side all-to-all of its weights and local expert ids there; the receiver
expands the rows expert-major (a permute: no regroup) and sums each row's weighted expert
outputs before the return all-to-all (``dedup_send``/``dedup_expand``). The token
all-to-alls then carry the fraction (distinct ranks per token) / K of the bytes: for E=64,
K=8 about 0.25 at ep=2 and 0.46 at ep=4 under uniform routing. It costs the receiver's
expansion passes, so ``MOEPAR_DEDUP=auto`` (default) uses it when the EP group's fraction
is at most DEDUP_MAX_FRACTION; ``1`` forces it, ``0`` turns it off. The ranks vote in the
counts exchange and decide the same. Collectives: one more (small) all-to-all each way.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import os

import torch
import torch.distributed as dist

from moepar_kernels import workspace
from moepar_kernels.permute import _check_permute, permute, unpermute

from ..parallel import comm
from . import counts_message
from .dedup import DEDUP_MAX_FRACTION, dedup_expand, dedup_rows, dedup_send, group_dedups

# dtypes are exchanged as small integer codes in the counts message.
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# metadata appended to every counts row: the fields of counts_message.FIELDS, in order.
_META = len(counts_message.FIELDS)
# Most local experts for the blocked all-to-all (each block is one all-to-all call).
BLOCKED_MAX_LOCAL = 16
# ... and only when the EP group's mean bytes per (rank, local expert) block reach this:
# below it the extra calls' latency costs more than the regroup pass saves (measured, docs/bench.md).
BLOCKED_MIN_BLOCK_BYTES = 1 << 20
# With a caller that takes source-major rows, they replace the blocked all-to-all from this
# many local experts on (measured, docs/bench.md).
SOURCE_MAJOR_MIN_LOCAL = 8


def check_finite_enabled() -> bool:
    return os.environ.get("MOEPAR_CHECK_FINITE", "0") == "1"


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
    """x[idx] into a buffer from the CPU pool (``workspace``)."""
    return torch.index_select(x, 0, idx, out=workspace.empty_like_rows(x, idx.shape[0]))


@dataclasses.dataclass
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
    capacity: int | None                 # per-expert slots when padded, else None
    token_sizes: list[int] | None = None  # TP shares of the tokens (dropless coordinated dispatch)
    blocks: tuple | None = None          # (recv per local expert [L][P], send [L][P]): blocked all-to-all
    # Source-major rows (``dispatch(..., source_major=True)``): block i of x_local has
    # segment_counts[i] rows for local expert segment_experts[i]; None = expert-major.
    segment_experts: tuple | None = None
    segment_counts: list[int] | None = None
    # Dedup form (one row per token and destination rank): (row_map_RK [R, K] of the received
    # rows into x_local, weights_RK [R, K] in the graph); row_map_TK then maps routes to the
    # sent rows, -1 for a route whose rank an earlier route of its token already covers.
    dedup: tuple | None = None


class Dispatcher:
    """Moves routes to the ranks that own their experts and back, over explicit groups.

    ``ep_group``/``etp_group`` are torch.distributed groups or ``None`` (size one). Global
    expert g lives on EP rank ``g // L`` as its local expert ``g % L``.
    """

    def __init__(self, num_experts: int, ep_group=None, etp_group=None, tp_group=None,
                 stats: comm.CommStats | None = None):
        self.num_experts = num_experts
        # tp_group: the TP group whose ranks hold the same (replicated) tokens; None under
        # sequence parallelism, where each TP rank's tokens are its own.
        self.ep_group, self.etp_group, self.tp_group = ep_group, etp_group, tp_group
        self.ep = comm.group_size(ep_group)
        self.etp = comm.group_size(etp_group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={self.ep}")
        self.num_local = num_experts // self.ep
        self.stats = stats

    # ---- the counts exchange doubles as a collective sanity check ----------------------
    def _exchange_counts(self, counts_E: torch.Tensor, hidden: int, dtype: torch.dtype,
                         error: str | None, capacity: int | None, dedup_P: torch.Tensor | None = None,
                         dedup_mode: int = 0, forms: int = 0) -> torch.Tensor:
        """Send each EP peer the counts for its experts plus (hidden, dtype, error, capacity);
        receive [P, L + META]. Every rank checks every peer's metadata, so a bad input on one
        rank raises on all of them here, before any token moves."""
        P, L = self.ep, self.num_local
        if dedup_P is None:
            dedup_P, dedup_mode = torch.zeros(P, dtype=torch.int64), 0
        meta = torch.tensor([hidden, _DTYPES.index(dtype) if dtype in _DTYPES else -1,
                             0 if error is None else 1, capacity or 0, int(counts_E.sum()), dedup_mode,
                             int(dedup_P.sum()), forms], dtype=torch.int64)
        send = torch.cat([counts_E.to("cpu", torch.int64).view(P, L), meta.expand(P, _META - 1),
                          dedup_P.to("cpu", torch.int64).view(P, 1)], dim=1)
        # Counts travel on the tokens' device (NCCL needs CUDA tensors); tiny.
        device = comm.small_device(self.ep_group, counts_E)
        recv = comm.all_to_all_rows(send.to(device), self.ep_group, None, None, stats=self.stats).cpu()
        peers = recv[:, L:]
        me = dist.get_rank(self.ep_group)
        if error is not None:
            raise ValueError(error)
        bad = [int(r) for r in torch.nonzero(peers[:, 2]).flatten()]
        if bad:
            raise ValueError(f"MoE dispatch aborted: EP rank(s) {bad} reported invalid input "
                             f"(see their error); this is EP rank {me}")
        if (peers[:, 0] != hidden).any() or (peers[:, 1] != peers[me, 1]).any():
            raise ValueError(f"MoE dispatch: hidden sizes {peers[:, 0].tolist()} and dtypes "
                             f"{[str(_DTYPES[c]) if c >= 0 else '?' for c in peers[:, 1].tolist()]} "
                             f"differ across the EP group; every rank must send the same hidden size and dtype")
        counts = recv[:, :L]
        if (counts < 0).any():
            raise ValueError(f"MoE dispatch: negative route counts received: {counts.tolist()}")
        return recv

    def preflight_error(self, error: str, hidden: int, dtype: torch.dtype) -> None:
        """A rank whose input is invalid calls this instead of ``dispatch``: its EP peers
        learn of it in the counts exchange and everyone raises, nobody hangs."""
        if self.ep > 1:
            self._exchange_counts(torch.zeros(self.num_experts, dtype=torch.int64), hidden, dtype, error, None)
        raise ValueError(error)

    def dispatch(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
                 weights_TK: torch.Tensor, capacity: int | None = None, source_major: bool = False
                 ) -> tuple[torch.Tensor, DispatchMeta]:
        """Rows for this rank's local experts, expert-major, and the meta to combine.

        ``source_major=True``: the caller can take the rows as they arrive, source-rank-major
        (``meta.segment_experts``/``segment_counts`` name each block's local expert; see
        GroupedExperts' ``segment_experts``). Where the rows would otherwise be regrouped or
        sent in many per-expert calls (``_source_allowed``), that is then skipped.

        Dropless (``capacity=None``): with a TP group, each TP rank dispatches only its
        near-even share of the (replicated) tokens. Padded (``capacity`` = slots per expert):
        every expert gets the same number of slots, the max over the EP group rounded up to
        a multiple of tp, empty slots zero; the TP ranks split each expert's slots, so every
        all-to-all split is equal.
        """
        error = _dispatch_arg_error(x_TD, expert_ids_TK, dropped_TK, weights_TK, self.num_experts, capacity)
        if error is not None:   # tell the EP peers first (they wait in the counts exchange)
            hidden = int(x_TD.shape[-1]) if isinstance(x_TD, torch.Tensor) and x_TD.dim() else 0
            dtype = x_TD.dtype if isinstance(x_TD, torch.Tensor) else torch.float32
            self.preflight_error(f"MoE dispatch: {error}", hidden, dtype)
        T, D = x_TD.shape
        E, L, P = self.num_experts, self.num_local, self.ep
        keep_source = False
        if check_finite_enabled():
            flag = torch.tensor([0 if bool(torch.isfinite(x_TD).all()) else 1])
            if dist.is_available() and dist.is_initialized():
                comm.all_reduce_(flag, dist.group.WORLD, op=dist.ReduceOp.MAX, stats=self.stats)
            if int(flag):
                raise ValueError("MOEPAR_CHECK_FINITE=1: non-finite values in the MoE layer input (on some rank)")
        tp, tp_rank = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        token_sizes, blocked = None, False
        if capacity is not None:
            if P > 1:  # agree on one capacity so that every split is equal
                recv = self._exchange_counts(torch.zeros(E, dtype=torch.int64), D, x_TD.dtype, None, capacity)
                capacity = int(recv[:, L + 3].max())
            capacity = -(-capacity // tp) * tp
            x_ND, counts_E, row_map = permute(x_TD, expert_ids_TK, dropped_TK, E, capacity=capacity)
            if tp > 1:  # this TP rank's slice of every expert's slots: [E, C/tp, D]
                x_ND = comm.scatter_to_region(x_ND.view(E, capacity, D), self.tp_group, 1,
                                              stats=self.stats).reshape(-1, D)
            slots = capacity // tp
            counts_PL = torch.full((P, L), slots, dtype=torch.int64)
            send = recv_ = [L * slots] * P
        else:
            if tp > 1:  # parallelism-coordinated: this TP rank's share of the replicated tokens
                token_sizes = comm.split_sizes(T, tp)
                lo = sum(token_sizes[:tp_rank])
                hi = lo + token_sizes[tp_rank]
                x_TD = comm.scatter_to_region(x_TD, self.tp_group, 0, token_sizes, stats=self.stats)
                weights_TK = comm.scatter_to_region(weights_TK, self.tp_group, 0, token_sizes, stats=self.stats)
                expert_ids_TK = expert_ids_TK[lo:hi]
                dropped_TK = None if dropped_TK is None else dropped_TK[lo:hi]
            if P > 1:
                # Counts first (a histogram of the kept routes), so that the EP group can agree
                # on the all-to-all's form before the rows are permuted for it.
                # Out-of-range ids (dropped routes' too: the permute rejects any) land in bin E;
                # a rank that has any tells its peers in the exchange, and every rank raises
                # there (nobody waits in the token all-to-all).
                ids_R = expert_ids_TK.reshape(-1).long()
                bad_R = (ids_R < 0) | (ids_R >= E)
                ids_R = ids_R.masked_fill(bad_R, E)
                ones_R = torch.ones_like(ids_R) if dropped_TK is None else (~dropped_TK).reshape(-1).long()
                counts_E = torch.zeros(E + 1, dtype=torch.int64, device=ids_R.device).scatter_add_(
                    0, ids_R, ones_R)[:E]
                n_bad = int(bad_R.sum())
                error = None if n_bad == 0 else (
                    f"expert_ids has {n_bad} route(s) outside [0, num_experts={E})")
                mode = self._dedup_mode(expert_ids_TK)
                rows_P = dedup_rows(expert_ids_TK, dropped_TK, L, P) if mode else None
                # The forms this rank allows (environment switches, caller): the group takes
                # one only if every rank allows it, so no two ranks issue different calls.
                forms = int(self._blocked(x_TD)) | int(source_major and self._source_allowed()) << 1
                recv = self._exchange_counts(counts_E, D, x_TD.dtype, error, None, rows_P, mode, forms)
                counts_PL = recv[:, :L]
                if mode and group_dedups(recv[:, L + 5], recv[:, L + 6], recv[:, L + 4]):
                    return self._dispatch_dedup(x_TD, expert_ids_TK, dropped_TK, weights_TK, rows_P, recv,
                                                token_sizes)
                group_forms = functools.reduce(operator.and_, recv[:, L + 7].tolist())
                block_bytes = int(recv[:, L + 4].sum()) * D * x_TD.element_size() / (P * L)
                blocked = bool(group_forms & 1) and block_bytes >= BLOCKED_MIN_BLOCK_BYTES
                # Source-major replaces the blocked form from SOURCE_MAJOR_MIN_LOCAL local experts
                # on (a few large calls cost no more than one; many smaller ones do, docs/bench.md).
                if group_forms & 2 and not (blocked and L < SOURCE_MAJOR_MIN_LOCAL):
                    blocked, keep_source = False, True
            key_TK = expert_ids_TK
            if blocked:
                # Rows in (local expert, peer) order, so that each local expert's all-to-all
                # lands contiguous on the receiver: expert-major with no regroup copy.
                key_TK = (expert_ids_TK % L) * P + torch.div(expert_ids_TK, L, rounding_mode="floor")
            x_ND, counts_key, row_map = permute(x_TD, key_TK, dropped_TK, E)
            if P > 1:   # counts_E, in global expert order, came from the histogram above
                send = counts_E.view(P, L).sum(1).tolist()
                recv_ = counts_PL.sum(1).tolist()
            else:
                counts_PL, send, recv_ = counts_key.to("cpu", torch.int64).view(1, L), None, None
        blocks = None
        if blocked:
            counts_sent = counts_E.to("cpu", torch.int64).view(P, L)
            blocks = (tuple(tuple(c) for c in counts_PL.t().tolist()), tuple(tuple(c) for c in counts_sent.t().tolist()))
            x_recv = comm.all_to_all_blocks(x_ND, self.ep_group, blocks[0], blocks[1], stats=self.stats,
                                            empty=workspace.empty)
        elif P > 1:
            x_recv = comm.all_to_all(x_ND, self.ep_group, recv_, send, stats=self.stats, empty=workspace.empty)
        else:
            x_recv = x_ND
        etp_sizes = None
        counts_SL = counts_PL
        if self.etp > 1:
            # Every ETP rank needs the rows of all its ETP peers (each holds a slice of the
            # same experts): gather the counts matrices, then the rows.
            mats = comm.all_gather_rows(counts_PL.to(comm.small_device(self.etp_group, x_TD)), self.etp_group,
                                        stats=self.stats).cpu()
            counts_SL = mats.view(self.etp * P, L)
            etp_sizes = mats.view(self.etp, P * L).sum(1).tolist()
            x_recv = comm.gather_from_sequence_region(x_recv, self.etp_group, 0, etp_sizes, stats=self.stats)
        regroup = segments = None
        if counts_SL.shape[0] > 1 and L > 1 and blocks is None:   # one local expert: source-major is expert-major
            if keep_source:
                segments = (tuple(range(L)) * counts_SL.shape[0], counts_SL.reshape(-1).tolist())
            else:
                regroup = _regroup_index(counts_SL, x_recv.device)
                x_recv = _PermuteRows.apply(x_recv, *regroup)
        meta = DispatchMeta(T, row_map, weights_TK, send, recv_, etp_sizes, regroup,
                            counts_SL.sum(0), counts_SL, capacity, token_sizes, blocks,
                            *(segments or (None, None)))
        return x_recv, meta

    def _dispatch_dedup(self, x_TD, expert_ids_TK, dropped_TK, weights_TK, rows_P, recv, token_sizes):
        """Dedup form: one row per (token, destination rank), not per route. The sender sends
        each token once to every rank that holds any of its experts, with a small side message
        per row ([rows, 2K] fp32: the routing weights and local expert ids of the token's
        routes to that rank, 0 and -1 elsewhere). The receiver expands the rows into its
        experts' rows (a permute, expert-major: no regroup) and, in ``combine``, sums each
        row's expert outputs with its weights before the return all-to-all; the sender then
        sums a token's returned rows. DeepEP sends tokens this way. The token all-to-alls
        move (rows with dedup) / (routes) of the bytes; gradients reach the weights through the
        side message's reverse all-to-all."""
        P, L = self.ep, self.num_local
        T = x_TD.shape[0]
        x_SD, row_map_TK, side_S = dedup_send(x_TD, expert_ids_TK, dropped_TK, weights_TK, L, P)
        send, recv_ = rows_P.tolist(), recv[:, L + 8].tolist()
        x_recv = comm.all_to_all(x_SD, self.ep_group, recv_, send, stats=self.stats, empty=workspace.empty)
        side_R = comm.all_to_all(side_S, self.ep_group, recv_, send, stats=self.stats)
        x_local, row_map_RK, w_RK = dedup_expand(x_recv, side_R, L)
        counts_PL = recv[:, :L]
        # The weights were applied on the receiver: the sender's unpermute sums with weight 1.
        meta = DispatchMeta(T, row_map_TK, None, send, recv_, None, None, counts_PL.sum(0), counts_PL,
                            None, token_sizes, dedup=(row_map_RK, w_RK))
        return x_local, meta

    def _dedup_mode(self, expert_ids_TK: torch.Tensor) -> int:
        """This rank's dedup vote: 0 off, 1 auto, 2 forced (``MOEPAR_DEDUP`` = 0 / auto / 1).
        Dedup needs more than one route per token and no expert TP. "auto" votes off at once
        where it can never apply (a token sends at least one row, so rows/routes >= 1/K):
        the row count is then not computed on the hot path."""
        env = os.environ.get("MOEPAR_DEDUP", "auto")
        if env not in ("0", "1", "auto"):
            raise ValueError(f"MOEPAR_DEDUP={env!r} must be 0, 1 or auto")
        K = expert_ids_TK.shape[1]
        if env == "0" or self.etp > 1 or K < 2 or (env == "auto" and 1 / K > DEDUP_MAX_FRACTION):
            return 0
        return 2 if env == "1" else 1

    def combine(self, y_local: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """Inverse of ``dispatch``; weights each route's output and sums per token: [T, D]."""
        y = y_local
        if meta.dedup is not None:   # each received row's weighted expert outputs, summed here
            row_map_RK, w_RK = meta.dedup
            y = unpermute(y, row_map_RK, w_RK, row_map_RK.shape[0])
        if meta.regroup is not None:
            idx, inv = meta.regroup
            y = _PermuteRows.apply(y, inv, idx)
        if self.etp > 1:
            y = comm.reduce_scatter_to_region(y, self.etp_group, 0, meta.etp_sizes, stats=self.stats)
        if meta.blocks is not None:
            y = comm.all_to_all_blocks(y, self.ep_group, meta.blocks[1], meta.blocks[0], stats=self.stats,
                                       empty=workspace.empty)
        elif self.ep > 1:
            y = comm.all_to_all(y, self.ep_group, meta.send_splits, meta.recv_splits, stats=self.stats,
                                empty=workspace.empty)
        tp = comm.group_size(self.tp_group)
        if meta.capacity is not None:
            if tp > 1:  # gather every expert's slot slices back: [E, C, D]
                y = comm.gather_from_region(y.view(self.num_experts, -1, y.shape[-1]), self.tp_group, 1,
                                            stats=self.stats).reshape(-1, y.shape[-1])
            return unpermute(y, meta.row_map_TK, meta.weights_TK, meta.num_tokens)
        # row_map/weights cover this rank's token share only (all tokens without TP).
        y = unpermute(y, meta.row_map_TK, meta.weights_TK, meta.row_map_TK.shape[0])
        if meta.token_sizes is not None:
            y = comm.gather_from_region(y, self.tp_group, 0, meta.token_sizes, stats=self.stats)
        return y

    def _blocked(self, x: torch.Tensor) -> bool:
        """Dropless dispatch as one all-to-all per local expert (``all_to_all_blocks``)
        instead of one all-to-all and a regroup copy: on gloo (CPU), where a pass over the
        rows costs about as much as moving them, for 2..``BLOCKED_MAX_LOCAL`` local experts
        and no expert TP. NCCL keeps the single all-to-all (the regroup is cheap in HBM)."""
        return (self.ep > 1 and self.etp == 1 and 1 < self.num_local <= BLOCKED_MAX_LOCAL
                and x.device.type == "cpu" and dist.get_backend(self.ep_group) == "gloo"
                and os.environ.get("MOEPAR_BLOCKED_A2A", "1") == "1")

    def _source_allowed(self) -> bool:
        """Whether a caller that takes source-major rows may get them: on gloo (CPU), without
        expert TP, with more than one local expert (``dispatch`` then prefers the blocked
        form below SOURCE_MAJOR_MIN_LOCAL local experts). NCCL keeps expert-major rows (the
        regroup is cheap in HBM and grouped_mm wants one block per expert).
        ``MOEPAR_SOURCE_MAJOR=0`` turns it off."""
        if os.environ.get("MOEPAR_SOURCE_MAJOR", "1") == "0" or self.ep == 1 or self.etp > 1 or self.num_local == 1:
            return False
        return dist.get_backend(self.ep_group) == "gloo"


def _dispatch_arg_error(x_TD, expert_ids_TK, dropped_TK, weights_TK, num_experts, capacity) -> str | None:
    """What is wrong with ``dispatch``'s arguments, or None: checked before any collective so
    that a rank with bad arguments raises together with its peers, not alone after them. The
    permute's own checks, plus what only the dispatcher needs (floating x, the weights)."""
    for name, t in (("x_TD", x_TD), ("expert_ids_TK", expert_ids_TK), ("weights_TK", weights_TK),
                    ("dropped_TK", dropped_TK)):
        if not (isinstance(t, torch.Tensor) or (t is None and name == "dropped_TK")):
            return f"{name} must be a tensor, got {type(t).__name__}"
    try:
        _check_permute(x_TD, expert_ids_TK, dropped_TK, num_experts, capacity)
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

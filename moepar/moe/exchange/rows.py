"""The token exchange forms: how the rows travel to the experts' ranks and back.

Legend (docs/moe.md): T tokens this rank dispatches (T_r after the TP share), D hidden, E
global experts, L = E/P local experts, K top-k, P EP ranks, S = etp*P source blocks, R rows
this rank sends, M rows its experts process, C slots per expert (padded).

Each form is a stateless class with ``dispatch`` (the rows for this rank's local experts,
expert-major unless said otherwise, and a frozen metadata record) and ``combine`` (its
inverse: [T, D], each token's expert outputs summed with its routing weights). The
dispatcher (``dispatcher.py``) picks the form from the counts exchange (``Dispatcher._exchange_counts``):

* ``RouteRows``: one row per kept route (the default, every backend): permute expert-major,
  one all-to-all-v, the ETP all-gather, a regroup of the received source-major blocks by
  local expert (skipped when there is one block or one local expert: "direct");
* ``SourceMajorRows``: the same rows left source-major for the experts (``cpu.py``: on gloo
  with CPU tensors only, opt-in: ``ExchangeConfig.cpu_source_major``);
* ``DedupRows`` (``dedup.py``): one row per token and destination rank plus a side message
  of weights and local ids, expanded by the receiver;
* ``PaddedRows`` (``padded.py``): capacity slots, every split equal and known without any
  exchange.

The last two are options, in files of their own built on the steps below (``start_rows``,
``combine_rows``, ...); the dispatcher's ``FORMS`` names all four.

The token all-to-all is issued without waiting (``comm.all_to_all_start``); the caller's
``during`` work (the shared experts) runs while it is in flight.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from moepar_kernels.permute import permute_routes, unpermute

from ...parallel import comm, regions
from ...parallel.groups import MoeTopology as Topology
from .. import cpu
from . import fp8
from .guard import GroupLoad

During = Callable[[tuple[int, ...] | None], torch.Tensor] | None


@dataclasses.dataclass(frozen=True)
class Call:
    """One call's groups and accounting (read from the state at each call)."""

    topo: Topology
    num_experts: int
    stats: comm.CommStats | None
    fp8: bool = False    # the dispatch all-to-all's rows in FP8 (``fp8.py``)
    fp8_grad: bool = False   # the combine's gradient, sent to the experts' ranks, in FP8

    @property
    def L(self) -> int:
        return self.num_experts // self.topo.ep


@dataclasses.dataclass(frozen=True, kw_only=True)
class Routes:
    """This rank's share of the routes (step 2): tokens, their K expert ids, drops, weights,
    and every TP rank's share size (None without a TP group of replicated tokens)."""

    x_TD: torch.Tensor
    expert_ids_TK: torch.Tensor
    dropped_TK: torch.Tensor | None
    weights_TK: torch.Tensor
    token_sizes: tuple[int, ...] | None
    counts_E: torch.Tensor | None = None   # routes per expert where the caller had them (the router's)


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Meta:
    """What every form's metadata holds: the form's name (``MoEStats.exchange_form``), the
    tokens to combine into, the rows per local expert (on the host when known, None where
    nothing was read back; and on the device), the EP group's load, the TP peers' tokens."""

    form: str
    num_tokens: int
    counts: tuple[int, ...] | None
    counts_dev: torch.Tensor
    load: GroupLoad | None
    tp_tokens: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowsMeta(Meta):
    row_map_TK: torch.Tensor             # [T, K] row of each route in the sent rows, -1 dropped
    route_N: torch.Tensor | None         # its inverse, the route of each sent row (the permute's)
    weights_TK: torch.Tensor             # [T, K] combine weights (in the graph)
    send: tuple[int, ...]
    recv: tuple[int, ...]
    etp_sizes: tuple[int, ...] | None    # rows each ETP peer received
    regroup: tuple[torch.Tensor, torch.Tensor] | None   # (idx, inverse): source- to expert-major
    token_sizes: tuple[int, ...] | None  # TP shares of the tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceMajorMeta(Meta):
    row_map_TK: torch.Tensor
    route_N: torch.Tensor | None
    weights_TK: torch.Tensor
    send: tuple[int, ...]
    recv: tuple[int, ...]
    token_sizes: tuple[int, ...] | None
    segments: tuple[tuple[int, ...], list[int]]   # (local expert, rows) of each received block


class PermuteRows(torch.autograd.Function):
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


def regroup_index(counts_SL: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The permutation taking rows from source-major blocks (s, l) to expert-major (l, s),
    and its inverse; on ``counts_SL``'s device, O(M), no host read (M = ``num_rows``)."""
    S, L = counts_SL.shape
    dev = counts_SL.device
    flat = counts_SL.reshape(-1)
    src_start = torch.cumsum(flat, 0) - flat                   # start of block (s, l), source order
    order = torch.arange(S * L, device=dev).view(S, L).t().reshape(-1)   # blocks in (l, s) order
    cnt, starts = flat[order], src_start[order]
    tgt_start = torch.cumsum(cnt, 0) - cnt
    rows = torch.arange(num_rows, device=dev)
    idx = rows + torch.repeat_interleave(starts - tgt_start, cnt, output_size=num_rows)
    return idx, torch.empty_like(idx).scatter_(0, idx, rows)


def start_rows(call: Call, x: torch.Tensor, recv, send):
    """Step 5's token all-to-all, issued without waiting; with FP8 dispatch the rows go as
    bytes and are dequantized when it is waited on."""
    if call.fp8:
        return fp8.all_to_all_start(x, call.topo.ep_group, recv, send, stats=call.stats)
    return comm.all_to_all_start(x, call.topo.ep_group, recv, send, stats=call.stats, empty=cpu.empty)


def _send_routes(call: Call, r: "Routes", plan: Plan):
    """Steps 4-5 for one row per route: permute the routes expert-major and start their
    all-to-all; with FP8 dispatch the permute quantizes in the same pass. Returns
    (rows in flight, pending, row_map_TK, route_N)."""
    if call.fp8 and call.topo.ep > 1:
        return fp8.permute_all_to_all_start(r.x_TD, r.expert_ids_TK, r.dropped_TK, call.num_experts,
                                            sum(plan.send), call.topo.ep_group, plan.recv, plan.send, call.stats)
    x_ND, _, row_map_TK, route_N = permute_routes(r.x_TD, r.expert_ids_TK, r.dropped_TK, call.num_experts,
                                                  num_rows=sum(plan.send), want_counts=False, checked=True)
    return (*start_rows(call, x_ND, plan.recv, plan.send), row_map_TK, route_N)


def combine_rows(call: Call, y: torch.Tensor, send, recv) -> torch.Tensor:
    """Step 9's all-to-all of the expert outputs back to their senders (its backward in FP8
    with ``combine_grad_dtype="fp8"``)."""
    if call.fp8_grad:
        return fp8.combine_all_to_all(y, call.topo.ep_group, send, recv, stats=call.stats)
    return comm.all_to_all(y, call.topo.ep_group, send, recv, stats=call.stats, empty=cpu.empty)


def run_during(during: During, tp_tokens) -> torch.Tensor | None:
    return None if during is None else during(tp_tokens)


def gather_etp(call: Call, x_recv: torch.Tensor, etp_sizes) -> torch.Tensor:
    """With expert TP every ETP rank computes a slice of the same experts on the rows of all
    its ETP peers: all-gather them (backward: reduce-scatter)."""
    if call.topo.etp == 1:
        return x_recv
    return regions.gather_partial_grads(x_recv, call.topo.etp_group, 0, etp_sizes, stats=call.stats)


def return_rows(call: Call, y: torch.Tensor, etp_sizes, send, recv) -> torch.Tensor:
    """The ETP reduce-scatter of the partial outputs, then the all-to-all back to the senders."""
    if call.topo.etp > 1:
        y = regions.reduce_scatter_to_region(y, call.topo.etp_group, 0, etp_sizes, stats=call.stats)
    return combine_rows(call, y, send, recv)


def tokens_back(call: Call, y_TD: torch.Tensor, token_sizes) -> torch.Tensor:
    """Undo the TP share: all-gather every TP rank's tokens (backward: keep this share)."""
    if token_sizes is None:
        return y_TD
    return regions.gather_from_region(y_TD, call.topo.tp_group, 0, token_sizes, stats=call.stats)


def _alone_rows(r: Routes, num_experts: int, trusted: bool, free: bool) -> tuple[int | None, tuple | None]:
    """(the permute's rows, the experts' host counts) for a rank alone, where known without
    a wait. Router ids with drops on an accelerator: one read of the kept counts gives both
    (else the permute reads its histogram and the experts their counts: two waits)."""
    if trusted and r.dropped_TK is None:
        return r.expert_ids_TK.numel(), None
    if not trusted or free or torch.compiler.is_compiling():
        return None, None
    kept = (~r.dropped_TK).reshape(-1).long()
    kept_E = torch.zeros(num_experts, dtype=torch.int64, device=kept.device).scatter_add_(
        0, r.expert_ids_TK.reshape(-1), kept)
    host = tuple(comm.read_to_host(kept_E).tolist())
    return sum(host), host


class RouteRows:
    """One row per kept route, expert-major after a regroup of the received blocks."""

    def dispatch(self, call: Call, routes: Routes, plan: Plan | None, during: During = None,
                 trusted: bool = False):
        r = routes
        if plan is None:   # this rank alone (no exchange): the permute's own counts
            free = r.x_TD.device.type == "cpu" and not torch.compiler.is_compiling()   # a read costs nothing
            n, host = _alone_rows(r, call.num_experts, trusted, free)
            x_ND, counts_E, row_map_TK, route_N = permute_routes(
                r.x_TD, r.expert_ids_TK, r.dropped_TK, call.num_experts, num_rows=n,
                counts_E=r.counts_E, checked=True)
            extra = run_during(during, None)
            host = tuple(counts_E.tolist()) if free else host
            M = x_ND.shape[0]
            load_PE = counts_E.view(1, -1)   # one rank: its load (read only if a user asks for figures)
            return x_ND, RowsMeta(form="direct", num_tokens=r.x_TD.shape[0], counts=host, counts_dev=counts_E,
                                  load=GroupLoad(load_PE, load_PE, None, 0), tp_tokens=None, row_map_TK=row_map_TK,
                                  route_N=route_N, weights_TK=r.weights_TK,
                                  send=(M,), recv=(M,), etp_sizes=None, regroup=None,
                                  token_sizes=r.token_sizes), extra
        x_recv, pending, row_map_TK, route_N = _send_routes(call, r, plan)
        extra = run_during(during, plan.tp_tokens)
        x_recv = gather_etp(call, comm.wait_for(x_recv, pending), plan.etp_sizes)
        x_local, regroup = self._expert_major(x_recv, plan)
        return x_local, self._meta(call, r, plan, row_map_TK, route_N, regroup), extra

    @staticmethod
    def _expert_major(x_recv: torch.Tensor, plan: Plan):
        """The grouped GEMM wants each local expert's rows contiguous: a gather from the
        source-major (s, l) blocks to expert-major (l, s), undone in ``combine``."""
        S, L = plan.counts_SL.shape
        if S == 1 or L == 1:   # already expert-major
            return x_recv, None
        regroup = regroup_index(plan.counts_SL_dev, x_recv.shape[0])
        return PermuteRows.apply(x_recv, *regroup), regroup

    @staticmethod
    def _meta(call, r: Routes, plan: Plan, row_map_TK, route_N, regroup) -> RowsMeta:
        return RowsMeta(form="regroup" if regroup is not None else "direct", num_tokens=r.x_TD.shape[0],
                        counts=tuple(plan.counts_SL.sum(0).tolist()), counts_dev=plan.counts_SL_dev.sum(0),
                        load=plan.load, tp_tokens=plan.tp_tokens, row_map_TK=row_map_TK, route_N=route_N,
                        weights_TK=r.weights_TK, send=plan.send, recv=plan.recv, etp_sizes=plan.etp_sizes,
                        regroup=regroup, token_sizes=r.token_sizes)

    def combine(self, call: Call, y: torch.Tensor, meta: RowsMeta) -> torch.Tensor:
        if meta.regroup is not None:
            idx, inv = meta.regroup
            y = PermuteRows.apply(y, inv, idx)
        y = return_rows(call, y, meta.etp_sizes, meta.send, meta.recv)
        y = unpermute(y, meta.row_map_TK, meta.weights_TK, meta.row_map_TK.shape[0], route_N=meta.route_N, checked=True)
        return tokens_back(call, y, meta.token_sizes)


class SourceMajorRows(RouteRows):
    """``RouteRows`` without the regroup: the experts take the received (peer, local expert)
    blocks as they arrived (gloo with CPU tensors only; ``cpu.py`` says why)."""

    def dispatch(self, call: Call, routes: Routes, plan: Plan, during: During = None, trusted: bool = False):
        r = routes
        x_recv, pending, row_map_TK, route_N = _send_routes(call, r, plan)
        extra = run_during(during, plan.tp_tokens)
        x_recv = comm.wait_for(x_recv, pending)
        meta = SourceMajorMeta(form="source_major", num_tokens=r.x_TD.shape[0],
                               counts=tuple(plan.counts_SL.sum(0).tolist()), counts_dev=plan.counts_SL_dev.sum(0),
                               load=plan.load, tp_tokens=plan.tp_tokens, row_map_TK=row_map_TK, route_N=route_N,
                               weights_TK=r.weights_TK, send=plan.send, recv=plan.recv,
                               token_sizes=r.token_sizes, segments=cpu.source_major_segments(plan.counts_SL))
        return x_recv, meta, extra

    def combine(self, call: Call, y: torch.Tensor, meta: SourceMajorMeta) -> torch.Tensor:
        y = combine_rows(call, y, meta.send, meta.recv)
        y = unpermute(y, meta.row_map_TK, meta.weights_TK, meta.row_map_TK.shape[0], route_N=meta.route_N, checked=True)
        return tokens_back(call, y, meta.token_sizes)

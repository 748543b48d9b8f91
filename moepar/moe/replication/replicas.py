"""Expert replication in the layer: E + X expert slots per EP group, the hot experts copied.

``MoE(..., redundant_experts=X)`` gives each of the ep ranks H = (E + X) / ep slots; the
slot map is a ``moepar.moe.replication.placement.Placement`` (first uniform, then from measured load at
each ``rebalance``). Three rules keep it exact and cheap to reason about:

- **Ownership never moves.** Logical expert g's parameters stay on its home rank
  ``g // L`` (L = E / ep, the unreplicated layout), so the optimizer, its state, FSDP2's
  shards and checkpoints see the unreplicated layer; a rebalance moves no parameter and
  no optimizer state. A slot on g's home rank is a view of the local parameter; a slot
  elsewhere is a copy that arrives in one all-to-all per forward over the EP group, in the
  dtype the experts compute in (``receive``), and whose gradient goes back to the owner in
  one all-to-all per backward, summed there with the other copies' (the optimizer sees
  each logical expert once). The GEMMs read the slots' weights as one [H, ...] tensor
  (``assemble``: the parameters and the received copies, concatenated or gathered), which
  autograd does not keep: the experts' backward assembles it again from the same pieces.
- **Routes split by rule, not by timing.** Each rank splits its kept routes to a
  replicated expert among the copies with ``placement.split_counts`` of the planned shares,
  in token order (``route_slots``; on the device, no host read), the routes left over after
  the proportional split going first to copy ``(ep_rank + g) mod A`` of expert g rather than
  always to its first copy (small batches would overload the owners); the token exchange
  then runs over the H slots per rank as if they were experts.
- **Tables built once per placement.** Every index the forward and backward use lives on
  the device, copied there without blocking when a placement is first used on a device.
- **Loads measured on the device.** Every training forward adds the router's routes per
  logical expert to ``loads_E``; ``rebalance`` all-reduces them once for every layer and
  re-plans every layer's slot map from them.

Legend (docs/moe.md): E logical experts, L = E/ep owned here, H slots per rank, A copies of one
expert, T tokens, K routes per token, R routes T·K.
"""
from __future__ import annotations

import dataclasses

import torch

from ...parallel import comm
from .placement import Placement, check_placement_args, plan_placement

# A placement that keeps every expert's first copy on its owner wins when its most-loaded
# rank carries at most this much more than the best plan's: then only the X copies' weights
# travel each forward, not those of moved experts.
OWNER_SLACK = 0.05


def local_order(placement: Placement, rank: int) -> list[int]:
    """The order of EP rank ``rank``'s slots in the layer (indices into
    ``placement.slots[rank]``): its own experts first, by id, then the copies it receives, by
    owner and id, so that its slot weights are its parameters followed by what arrives."""
    L = placement.num_experts // placement.ep_size
    held = placement.slots[rank]
    return sorted(range(len(held)), key=lambda i: (held[i] // L != rank, held[i] // L, held[i]))


@dataclasses.dataclass(frozen=True)
class SlotMap:
    """Host-side tables of one placement, seen from one EP rank (the same on every rank but
    ``rank``): which expert each local slot holds and what this rank sends to and receives
    from each peer per forward."""

    placement: Placement
    rank: int
    owned: int                     # L: logical experts per rank (home rank of g: g // L)
    held: tuple[int, ...]          # the expert of each local slot, in the layer's slot order
    send_local: tuple[int, ...]    # local expert index of each copy sent, grouped by peer
    send_splits: tuple[int, ...]   # copies sent to each peer
    recv_splits: tuple[int, ...]   # copies received from each peer
    slot_source: tuple[int, ...]   # per slot: a local expert (< L) or L + its received row

    @classmethod
    def of(cls, placement: Placement, rank: int) -> "SlotMap":
        E, ep = placement.num_experts, placement.ep_size
        L = E // ep
        held = [[placement.slots[r][i] for i in local_order(placement, r)] for r in range(ep)]
        send_local, send_splits, recv_splits = [], [], []
        for peer in range(ep):
            # the copies of my experts that peer holds, in peer's slot order
            mine = [g - rank * L for g in held[peer] if peer != rank and g // L == rank]
            send_local += mine
            send_splits.append(len(mine))
            recv_splits.append(sum(1 for g in held[rank] if peer != rank and g // L == peer))
        source, received = [], 0
        for g in held[rank]:   # remote copies come last, by owner: the received rows' order
            if g // L == rank:
                source.append(g - rank * L)
            else:
                source.append(L + received)
                received += 1
        return cls(placement, rank, L, tuple(held[rank]), tuple(send_local), tuple(send_splits),
                   tuple(recv_splits), tuple(source))

    @property
    def in_place(self) -> bool:
        """Whether the slots are the local experts in order, then the received copies (their
        weights: the parameters and what arrived, concatenated, no gather)."""
        return self.slot_source == tuple(range(len(self.slot_source)))

    @property
    def moves_weights(self) -> bool:
        """Whether any slot of the EP group is a remote copy (the all-to-alls run)."""
        L = self.owned
        return any(g // L != r for r, held in enumerate(self.placement.slots) for g in held)


class Replicas:
    """One MoE layer's slot map and measured load. ``state``: the layer's ParallelState
    (the EP group read from it at every call, never kept)."""

    def __init__(self, num_experts: int, redundant_experts: int, ep_size: int, state,
                 stats: comm.CommStats | None = None):
        check_placement_args([1.0] * num_experts, num_experts, redundant_experts, ep_size)
        self.num_experts, self.redundant_experts, self.ep_size = num_experts, redundant_experts, ep_size
        self.state, self.stats = state, stats
        self.loads_E: torch.Tensor | None = None   # created on the routing's device
        self.planned_loads: list | None = None      # the load the slot map was made from (host)
        # uniform load: the unreplicated layout plus copies balances it; only copies travel
        self.set_placement(plan_placement([1.0] * num_experts, num_experts, redundant_experts, ep_size,
                                          owner_slack=OWNER_SLACK))

    @property
    def slots_per_rank(self) -> int:
        return (self.num_experts + self.redundant_experts) // self.ep_size

    def set_placement(self, placement: Placement) -> None:
        """Use ``placement`` from the next forward on (a step boundary: every rank alike)."""
        if (placement.num_experts, placement.redundant_experts, placement.ep_size) != \
                (self.num_experts, self.redundant_experts, self.ep_size):
            raise ValueError(f"placement for E={placement.num_experts}, X={placement.redundant_experts}, "
                             f"ep={placement.ep_size} does not fit this layer's E={self.num_experts}, "
                             f"X={self.redundant_experts}, ep={self.ep_size}")
        self.placement = placement
        self.map = SlotMap.of(placement, self.state.ep_rank)
        self._tables: dict = {}   # device -> _Tables

    def tables(self, device) -> "_Tables":
        """This placement's index tables on ``device`` (built at its first use there)."""
        t = self._tables.get(device)
        if t is None:
            t = self._tables[device] = _Tables.of(self.placement, self.map, self.state.ep_rank, device)
        return t

    # ---- routes -> slots ------------------------------------------------------------------
    def route_slots(self, expert_ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None) -> torch.Tensor:
        """The slot id of every route, [T, K] like ``expert_ids_TK``: expert g's kept routes,
        in token order, split among g's copies with ``split_counts`` of the planned shares
        (leftovers from copy ``(ep_rank + g) mod A`` on). Dropped routes keep g's first copy
        (never sent)."""
        t = self.tables(expert_ids_TK.device)
        ids_R = expert_ids_TK.reshape(-1).long()
        kept_R = torch.ones_like(ids_R, dtype=torch.bool) if dropped_TK is None else ~dropped_TK.reshape(-1)
        E = self.num_experts
        counts_E = torch.zeros(E, dtype=torch.int64, device=ids_R.device).index_add_(0, ids_R, kept_R.long())
        per_copy_EA = split_counts_device(counts_E, t.share_EA, t.tie_EA)
        ends_EA = per_copy_EA.cumsum(1)
        # position of each kept route among its expert's kept routes, in token order
        key_R = torch.where(kept_R, ids_R, ids_R.new_full((), E))
        order = torch.sort(key_R, stable=True).indices
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        pos_R = torch.empty_like(ids_R)
        pos_R[order] = torch.arange(ids_R.numel(), device=ids_R.device)
        pos_R = pos_R - torch.where(kept_R, starts_E[ids_R], pos_R.new_zeros(()))
        copy_R = (pos_R.unsqueeze(1) >= ends_EA[ids_R]).sum(1).clamp_(max=t.slot_EA.shape[1] - 1)
        copy_R = torch.where(kept_R, copy_R, torch.zeros_like(copy_R))
        return t.slot_EA[ids_R, copy_R].view_as(expert_ids_TK)

    # ---- weights -> slots -----------------------------------------------------------------
    def receive(self, params: tuple) -> tuple | None:
        """The copies of other ranks' experts this rank's slots hold, [R, ...] per present
        tensor of ``params`` (the local experts' [L, ...], in the dtype the experts compute
        in: they travel in it), in one all-to-all over the EP group; None where no slot of
        the group is a remote copy."""
        if not self.map.moves_weights:
            return None
        present = [p for p in params if p is not None]
        t = self.tables(present[0].device)
        return _ReceiveCopies.apply(self.map, t, self.state.ep_group, self.stats, *present)

    def assemble(self, params: tuple, copies: tuple | None):
        """(this rank's H slots' weights [H, ...] from the local experts' ``params`` and the
        received ``copies``, differentiable; ``again(params)``: the same from the parameters
        read anew, no graph, for a backward that kept none of them). Without copies and with
        the slots in place: the parameters themselves, and ``again`` None."""
        present = [p for p in params if p is not None]
        t = self.tables(present[0].device)
        out = iter(_Assemble.apply(self.map, t, len(present), *present, *(copies or ())))
        slots = tuple(None if p is None else next(out) for p in params)
        if copies is None and t.slot_source is None:
            return slots, None

        def again(fresh: tuple) -> tuple:
            with torch.no_grad():
                got = iter(copies or [None] * len(present))
                return tuple(None if f is None else _assembled(t, (f,) if copies is None else (f, next(got)))
                             for f in fresh)
        return slots, again

    def record_load(self, tokens_per_expert: torch.Tensor) -> None:
        """Add one training forward's routes per logical expert (device, no host read)."""
        counts = tokens_per_expert.detach().to(torch.int64)
        self.loads_E = counts.clone() if self.loads_E is None else self.loads_E + counts


@dataclasses.dataclass(frozen=True)
class _Tables:
    """One placement's indices on one device, for one EP rank (legend: A copies, H slots)."""

    slot_EA: torch.Tensor     # [E, A] global slot id of each copy of each expert
    share_EA: torch.Tensor    # [E, A] float64 planned share of each copy (0: no such copy)
    tie_EA: torch.Tensor      # [E, A] order in which copies take leftover routes
    send_local: torch.Tensor  # local expert index of each copy sent, grouped by peer
    slot_source: torch.Tensor | None   # [H] local expert (< L) or L + received row; None: in place
    home_slots: torch.Tensor  # slots holding a local expert
    home_at: torch.Tensor     # their local expert index
    remote_slots: torch.Tensor   # slots holding a received copy, in the received order

    @classmethod
    def of(cls, p: Placement, smap: SlotMap, rank: int, device) -> "_Tables":
        A = max(len(c) for c in p.copies)
        slot_EA = torch.zeros(p.num_experts, A, dtype=torch.int64)
        share_EA = torch.zeros(p.num_experts, A, dtype=torch.float64)
        tie_EA = torch.full((p.num_experts, A), A, dtype=torch.int64)
        H = (p.num_experts + p.redundant_experts) // p.ep_size
        position = [{i: at for at, i in enumerate(local_order(p, r))} for r in range(p.ep_size)]
        for g, copies in enumerate(p.copies):
            total = sum(c.share for c in copies)
            first = (rank + g) % len(copies)
            for i, c in enumerate(copies):
                slot_EA[g, i] = c.rank * H + position[c.rank][c.slot]
                share_EA[g, i] = c.share if total > 0 else float(i == 0)
                tie_EA[g, i] = (i - first) % len(copies)
        L, src = smap.owned, smap.slot_source
        home = [i for i, s in enumerate(src) if s < L]
        remote = [i for _, i in sorted((s - L, i) for i, s in enumerate(src) if s >= L)]

        def dev(values, dtype=torch.int64):
            t = values if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=dtype)
            return comm.to_device(t, device)
        return cls(dev(slot_EA), dev(share_EA), dev(tie_EA), dev(smap.send_local),
                   None if smap.in_place else dev(src), dev(home), dev([src[i] for i in home]), dev(remote))


def split_counts_device(counts_E: torch.Tensor, share_EA: torch.Tensor, tie_EA: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """``placement.split_counts`` for every expert at once, on the device: [E, A] routes per
    copy. floor(count x share / sum(shares)) each (float64, the host's arithmetic), then the
    leftovers one each to the largest remainders, ties in ``tie_EA``'s order (None: to the
    earlier copy, the host rule's)."""
    total_E1 = share_EA.sum(1, keepdim=True)
    exact = counts_E.unsqueeze(1).double() * share_EA / torch.where(total_E1 > 0, total_E1, torch.ones_like(total_E1))
    floor = torch.minimum(exact.floor(), counts_E.unsqueeze(1).double())
    left_E = counts_E - floor.sum(1).long()
    rem = exact - floor
    A = share_EA.shape[1]
    order = torch.arange(A, device=share_EA.device).view(1, A) if tie_EA is None else tie_EA
    # rank of copy i among the copies by (-remainder, tie order)
    ahead = (rem.unsqueeze(1) > rem.unsqueeze(2)) | ((rem.unsqueeze(1) == rem.unsqueeze(2))
                                                     & (order.unsqueeze(1) < order.unsqueeze(2)))
    rank_EA = ahead.sum(2)
    return floor.long() + (rank_EA < left_E.unsqueeze(1)).long()


def _assembled(t: _Tables, pieces: tuple) -> torch.Tensor:
    """One tensor's slots [H, ...]: the local experts, then the received copies, gathered
    into the slot order where it is not that."""
    whole = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return whole if t.slot_source is None else whole.index_select(0, t.slot_source)


class _Assemble(torch.autograd.Function):
    """The slots' weights [H, ...] from the local experts' [L, ...] and the received copies
    [R, ...] (local: no collective); backward: each slot's gradient to its piece."""

    @staticmethod
    def forward(ctx, smap: SlotMap, t: _Tables, n: int, *tensors):
        params, copies = tensors[:n], tensors[n:]
        ctx.smap, ctx.t, ctx.n, ctx.has_copies = smap, t, n, bool(copies)
        ctx.shapes = [p.shape for p in params]
        if not copies and t.slot_source is None:   # the parameters themselves: hand autograd views
            return tuple(p.view_as(p) for p in params)
        return tuple(_assembled(t, (p, c) if copies else (p,)) for p, c in zip(params, copies or params))

    @staticmethod
    def backward(ctx, *grads):
        t, L = ctx.t, ctx.smap.owned
        g_params, g_copies = [], []
        for g, shape in zip(grads, ctx.shapes):
            if g is None:
                g_params.append(None)
                g_copies.append(None)
                continue
            if t.slot_source is None:   # in place: the first L slots are the local experts
                g_params.append(g[:L])
                g_copies.append(g[L:] if ctx.has_copies else None)
            else:
                g_params.append(g.new_zeros(shape).index_add_(0, t.home_at, g.index_select(0, t.home_slots)))
                g_copies.append(g.index_select(0, t.remote_slots) if ctx.has_copies else None)
        return (None, None, None, *g_params, *(g_copies if ctx.has_copies else ()))


class _ReceiveCopies(torch.autograd.Function):
    """Forward: the remote copies this rank's slots hold, [R, ...] per tensor, from their
    owners' [L, ...] (one all-to-all over the EP group, all tensors packed in one buffer);
    backward: the copies' gradients back to their owners (one all-to-all), as gradients of
    the owners' [L, ...]."""

    @staticmethod
    def forward(ctx, smap: SlotMap, t: _Tables, group, stats, *params):
        ctx.smap, ctx.t, ctx.group, ctx.stats = smap, t, group, stats
        ctx.shapes = [p.shape for p in params]
        send = torch.cat([p.detach().index_select(0, t.send_local).flatten(1) for p in params], 1)
        recv = comm.all_to_all_rows(send, group, smap.recv_splits, smap.send_splits, stats=stats)
        return tuple(_unflatten(recv, [s[1:] for s in ctx.shapes]))

    @staticmethod
    def backward(ctx, *grads):
        smap, t = ctx.smap, ctx.t
        R = sum(smap.recv_splits)
        like = next(g for g in grads if g is not None)
        flat = torch.cat([(g if g is not None else like.new_zeros((R, *s[1:]))).flatten(1)
                          for g, s in zip(grads, ctx.shapes)], 1)
        back = comm.all_to_all_rows(flat, ctx.group, smap.send_splits, smap.recv_splits, backward=True,
                                    stats=ctx.stats)
        out = [like.new_zeros(s).index_add_(0, t.send_local, b)
               for s, b in zip(ctx.shapes, _unflatten(back, [s[1:] for s in ctx.shapes]))]
        return (None, None, None, None, *out)


def _unflatten(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    out, at = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        out.append(flat[:, at:at + n].reshape(flat.shape[0], *shape))
        at += n
    return out

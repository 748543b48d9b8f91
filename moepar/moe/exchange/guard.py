"""The EP group's load figures and the receive guard (``ExchangeConfig.receive_capacity_factor``).

Legend: P EP ranks, E global experts, L = E/P local experts, T tokens, K top-k.

After the counts all-to-all every EP rank holds the same ``load_PE`` [P, E]: the kept routes
each EP rank dispatches to each global expert (``traffic.columns``: every row carries the
sender's E counts). Everything here is a pure function of it, so every rank computes the
same figures and the same quotas with no further collective.

The guard's rule (deterministic, integer arithmetic):
  * cap = ceil(f x total / P): f the factor, total the group's routes (sum of load_PE);
  * a rank whose received rows M_r = sum over senders s and its experts l of n[s, l]
    exceed the cap keeps ``cap`` of them, shared out over its P*L (sender, local expert)
    cells in proportion to n (largest remainder): q = floor(cap*n/M_r), then one more row
    to the cells with the largest remainders (cap*n mod M_r), ties to the lower cell
    index s*L + l; a rank at or under the cap keeps everything;
  * the sender drops, within each cell, its n - q routes of lowest routing weight (ties:
    the later in slot-major order, every token's first choice before any second choice;
    NaN weights rank lowest).
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import torch

from ... import checks
from ...parallel.comm import to_device


def check_receive_capacity_factor(value) -> None:
    """ValueError unless ``value`` is None or a finite number >= 1."""
    if value is None:
        return
    if not checks.is_number(value) or value < 1:
        raise ValueError(f"receive_capacity_factor={value!r} must be None or a finite number >= 1 "
                         f"(a rank keeps at most ceil(factor x mean) received rows; below 1 the cap would "
                         f"drop routes even from a perfectly balanced group)")


def receive_cap(total_routes: int, ep: int, factor: float) -> int:
    """ceil(factor x total_routes / ep), exact (the factor read as its decimal)."""
    return math.ceil(Fraction(total_routes, ep) * Fraction(repr(float(factor))))


def quotas(load_PE: torch.Tensor, factor: float) -> tuple[torch.Tensor, int]:
    """(kept_PE [P, E] int64, cap): the routes each sender may send to each expert under
    the rule of the module docstring. ``load_PE`` int64 on the host."""
    P, E = load_PE.shape
    L = E // P
    cells = load_PE.view(P, P, L).permute(1, 0, 2).reshape(P, P * L)   # [receiver, s*L + l]
    M_P = cells.sum(1)
    cap = receive_cap(int(M_P.sum()), P, factor)
    over_P = M_P > cap
    if not bool(over_P.any()):
        return load_PE, cap
    scaled = cap * cells                                       # < 2**63: cap, n <= routes
    M = M_P.clamp_min(1)[:, None]
    q = scaled // M
    short_P = cap - q.sum(1)                                   # rows left to hand out, < P*L
    order = torch.sort(-(scaled % M), dim=1, stable=True).indices
    pos = torch.empty_like(order).scatter_(1, order, torch.arange(P * L).expand(P, -1).contiguous())
    q = q + (pos < short_P[:, None]).long()
    q = torch.where(over_P[:, None], q, cells)
    return q.view(P, P, L).permute(1, 0, 2).reshape(P, E).contiguous(), cap


def guard_drops(expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
                quota_E: torch.Tensor) -> torch.Tensor:
    """[T, K] bool: the kept routes past ``quota_E`` [E] (routes this rank may send per
    expert), lowest weight first (ties: later in slot-major order). Routes already dropped
    neither count nor get dropped again."""
    T, K = expert_ids_TK.shape
    N, E = T * K, quota_E.numel()
    device = expert_ids_TK.device
    ids_N = expert_ids_TK.t().reshape(-1).long()
    kept_N = torch.ones(N, dtype=torch.bool, device=device) if dropped_TK is None else ~dropped_TK.t().reshape(-1)
    ids_N = torch.where(kept_N, ids_N, torch.full_like(ids_N, E))        # spare bin E: never dropped
    w_N = weights_TK.detach().t().reshape(-1).float().nan_to_num(nan=float("-inf"))
    order_N = torch.sort(w_N, descending=True, stable=True).indices
    by_expert = torch.sort(ids_N[order_N], stable=True)
    route_N = order_N[by_expert.indices]
    # scatter_add, not bincount (which reads its input's max back to the host on CUDA)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device).scatter_add_(0, ids_N, torch.ones_like(ids_N))
    start = torch.cumsum(counts, 0) - counts
    rank_N = torch.arange(N, device=device) - start[by_expert.values]
    quota = torch.cat([to_device(quota_E.to(torch.int64), device), counts.new_full((1,), N)])
    drop_N = torch.empty(N, dtype=torch.bool, device=device).scatter_(
        0, route_N, rank_N >= quota[by_expert.values])
    return (drop_N & kept_N).view(K, T).t()


@dataclasses.dataclass(frozen=True)
class GroupLoad:
    """The EP group's load in one forward, the same on every EP rank (host tensors).

    ``load_PE``: kept routes each EP rank dispatched per global expert, before the guard;
    ``kept_PE``: after it (equal without a guard); ``cap``: the guard's cap (None: off);
    ``rank``: this rank's index in the EP group. Under TP without sequence parallelism each
    TP rank dispatches a share of the replicated tokens: the figures cover this EP group's
    shares."""

    load_PE: torch.Tensor
    kept_PE: torch.Tensor
    cap: int | None
    rank: int

    @property
    def expert_overload(self) -> float:
        """max / mean routes per expert over the EP group (before the guard; 0 with no routes)."""
        return _max_over_mean(self.load_PE.sum(0))

    @property
    def rows_per_rank(self) -> torch.Tensor:
        """[P] rows each EP rank would receive without the guard."""
        return _rows_per_receiver(self.load_PE)

    @property
    def rank_overload(self) -> float:
        """max / mean rows received per EP rank (before the guard; 0 with no routes)."""
        return _max_over_mean(self.rows_per_rank)

    @property
    def received_P(self) -> torch.Tensor:
        """[P] rows each EP rank receives after the guard."""
        return _rows_per_receiver(self.kept_PE)

    @property
    def dispatched(self) -> int:
        """Kept routes this rank dispatched, before the guard."""
        return int(self.load_PE[self.rank].sum())

    @property
    def guard_dropped(self) -> int:
        """Routes of this rank the guard dropped."""
        if self.kept_PE is self.load_PE:   # no guard, or it cut nothing (no host read)
            return 0
        return int((self.load_PE[self.rank] - self.kept_PE[self.rank]).sum())

    @property
    def group_guard_dropped(self) -> int:
        """Routes the guard dropped over the EP group."""
        if self.kept_PE is self.load_PE:
            return 0
        return int((self.load_PE - self.kept_PE).sum())


def _rows_per_receiver(counts_PE: torch.Tensor) -> torch.Tensor:
    """[P] rows each EP rank receives from a [P senders, E] count matrix (rank r owns experts
    r*L .. r*L+L-1)."""
    P = counts_PE.shape[0]
    return counts_PE.view(P, P, -1).sum((0, 2))


def _max_over_mean(values: torch.Tensor) -> float:
    """max / mean of ``values`` (0 when they sum to 0: no routes)."""
    values = values.double()
    mean = float(values.mean())
    return float(values.max()) / mean if mean > 0 else 0.0

"""``MoEStats``: what one MoE layer's last forward (and its backward) did on this rank
(``moe.stats``): routes, drops, the EP group's load and the collectives with their bytes."""
from __future__ import annotations

import dataclasses

import torch

from ..parallel import comm
from .exchange.guard import GroupLoad


@dataclasses.dataclass
class MoEStats:
    """What the last forward (and its backward) did on this rank."""

    tokens_per_expert: torch.Tensor | None = None  # [E] kept routes per global expert (this rank's router)
    routes: int = 0                                 # T*K routes the router produced
    dropped: torch.Tensor | None = None             # scalar: routes dropped for capacity + by the receive guard
    comm: comm.CommStats = dataclasses.field(default_factory=comm.CommStats)
    # The EP group's load from the counts exchange (moepar.moe.exchange.guard.GroupLoad; None in
    # padded capacity mode): overload factors, the receive guard's cap and drops.
    load: GroupLoad | None = None
    capacity_dropped: torch.Tensor | None = None    # scalar: the router's capacity drops alone
    # The token exchange form the dispatch took (DispatchMeta.exchange_form): "padded" |
    # "dedup" | "source_major" | "regroup" | "direct"; the same on every rank of an EP group.
    exchange_form: str | None = None

    @property
    def dropped_fraction(self) -> float:
        """Fraction of the router's routes dropped, for capacity or by the receive guard.
        Under TP without SP the guard cuts this TP rank's share of the tokens: its part is
        the share's fraction of the routes kept after capacity (exact elsewhere)."""
        if self.dropped is None or self.routes == 0:
            return 0.0
        cap = float(self.capacity_dropped if self.capacity_dropped is not None else self.dropped)
        guard = self.load.guard_dropped if self.load is not None else 0
        if guard == 0:
            return cap / self.routes
        kept = 1.0 - cap / self.routes
        return cap / self.routes + kept * guard / max(self.load.dispatched, 1)

    @property
    def expert_overload(self) -> float | None:
        """max / mean routes per expert over the EP group (before the guard)."""
        return None if self.load is None else self.load.expert_overload

    @property
    def rank_overload(self) -> float | None:
        """max / mean rows received per EP rank (before the guard)."""
        return None if self.load is None else self.load.rank_overload

    def comm_bytes(self, op: str | None = None, backward: bool | None = None) -> int:
        return sum(e.nbytes for e in self.comm.events
                   if (op is None or e.op == op) and (backward is None or e.backward == backward))

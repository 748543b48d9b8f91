"""``moepar.load_report(model)``: every MoE layer's load figures from its last forward."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..tables import format_table
from .layer import MoE
from .replication.replicas import local_order

COLUMNS = ("layer", "expert_overload", "rank_overload", "unreplicated_overload", "dropped_fraction",
           "receive_cap", "max_received", "guard_dropped")


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """One row per MoE layer (in ``model.named_modules()`` order), each a dict of COLUMNS:

    expert_overload: max / mean routes per expert over the EP group; rank_overload: max /
    mean rows received per EP rank (both before the receive guard; None before the first
    forward or in padded capacity mode); dropped_fraction: this rank's routes dropped, for
    capacity or by the guard; receive_cap: the guard's cap (None: off, or one EP rank); max_received: the
    most rows any EP rank received (after the guard); guard_dropped: routes the guard
    dropped over the EP group. ``str(report)`` is the table as text. No collective: every
    figure is this rank's view of its EP group from the counts exchange."""

    rows: list

    def __str__(self) -> str:
        fmt = [{c: ("-" if r[c] is None else r[c]) for c in COLUMNS} for r in self.rows]
        return format_table(fmt, COLUMNS)

    @property
    def text(self) -> str:
        """The formatted table."""
        return str(self)

    def worst(self, column: str = "expert_overload") -> dict:
        """The row with the largest ``column`` (None values rank lowest)."""
        if column not in COLUMNS[1:]:
            raise ValueError(f"column={column!r} must be one of {COLUMNS[1:]}")
        return max(self.rows, key=lambda r: float("-inf") if r[column] is None else r[column])


def unreplicated_overload(placement, load_PE) -> float | None:
    """max / mean over EP ranks of the routes their own experts got (``load_PE``: [P, P x H]
    slot counts, H slots per EP rank, summed per logical expert, then per owner); None without
    a placement."""
    if placement is None:
        return None
    experts = [placement.slots[r][i] for r in range(placement.ep_size)
               for i in local_order(placement, r)]   # global slot (the layer's order) -> expert
    per_expert = torch.zeros(placement.num_experts, dtype=torch.float64)
    per_expert.index_add_(0, torch.tensor(experts), load_PE.sum(0).double())
    per_owner = per_expert.view(placement.ep_size, -1).sum(1)
    mean = float(per_owner.mean())
    return float(per_owner.max()) / mean if mean > 0 else 0.0


def load_report(model: nn.Module) -> LoadReport:
    """The load figures of every ``moepar.MoE`` layer in ``model`` (see ``LoadReport``).
    ValueError when ``model`` holds no MoE layer (on every rank alike: no collective)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"load_report needs a torch.nn.Module, got {type(model).__name__}")
    rows = []
    for name, m in model.named_modules():
        if not isinstance(m, MoE):
            continue
        st, load = m.stats, m.stats.load
        rows.append({
            "layer": name or "(model)",
            "expert_overload": st.expert_overload,
            "rank_overload": st.rank_overload,
            "unreplicated_overload": None if load is None else unreplicated_overload(m.placement, load.load_PE),
            "dropped_fraction": st.dropped_fraction,
            "receive_cap": None if load is None else load.cap,
            "max_received": None if load is None else int(load.received_P.max()),
            "guard_dropped": None if load is None else load.group_guard_dropped,
        })
    if not rows:
        raise ValueError(f"load_report: the model ({type(model).__name__}) holds no moepar.MoE layer")
    return LoadReport(rows)

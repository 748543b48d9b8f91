"""A plain-torch reference MoE with dense one-hot dispatch (the GShard formulation that
older DeepSpeed-MoE and fairscale used): the yardstick ``bench layer`` compares with.

Legend (docs/moe.md): T tokens, D hidden, F ffn hidden, E experts, K top-k, C slots per expert;
``_T_slots``: [T, E*C + 1], every expert's C slots and one column that collects dropped routes.

    logits_TE = x_TD @ gate^T (fp32) ; scores_TE = softmax ; top-k ids/weights
    slot of route (t, k) in its expert: slot-major arrival order (every token's first
        choice in token order, then every second choice, ...), as GShard's cumsum of masks
    combine_TEC = sum_k w[t,k] * onehot(ids[t,k]) (x) onehot(slot[t,k])   (dense [T, E, C])
    x_ECD = einsum("tec,td->ecd", combine != 0, x)      y_ECD = FFN_e(x_ECD) by bmm
    y_TD  = einsum("tec,ecd->td", combine, y_ECD)

Dropless (``capacity=None``): C = the busiest expert's count, so every expert is padded to
it. With a capacity, routes arriving beyond C are dropped, which is moepar's
``drop_policy="position"``. The dense dispatch and combine cost 2*T*E*C*D flops each and
hold [T, E, C] tensors: this is the baseline, not a fast path. Nothing here is shared with
moepar's layer except the weights (``from_moepar``), so that the two can check each other.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _act(h1: torch.Tensor, h3: torch.Tensor | None, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        return F.silu(h1) * h3
    return F.gelu(h1) if activation == "gelu" else F.relu(h1)


class ReferenceMoE(nn.Module):
    """Dense one-hot dispatch MoE: softmax top-k gate, switch aux loss, bmm experts.

    ``forward(x) -> y`` (same shape as x); ``self.aux_loss`` holds the scaled aux loss of
    the last forward (``aux_loss_coeff * E/K * sum_e f_e P_e``, counts before drops).
    """

    def __init__(self, hidden: int, num_experts: int, k: int = 2, ffn_hidden: int | None = None,
                 activation: str = "gelu", capacity_factor: float | None = None, min_capacity: int = 4,
                 aux_loss_coeff: float = 1e-2, dtype: torch.dtype | None = None):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k} must be in [1, num_experts={num_experts}]")
        if activation not in ("gelu", "swiglu", "relu"):
            raise ValueError(f"activation={activation!r} must be 'gelu', 'swiglu' or 'relu'")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor!r} must be None or > 0")
        self.hidden, self.num_experts, self.k = hidden, num_experts, k
        self.ffn_hidden = ffn_hidden or 4 * hidden
        self.activation = activation
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.aux_loss_coeff = aux_loss_coeff
        E, D, ffn = num_experts, hidden, self.ffn_hidden
        dtype = dtype or torch.get_default_dtype()
        self.gate = nn.Parameter(torch.empty(E, D, dtype=torch.float32))
        self.w1 = nn.Parameter(torch.empty(E, D, ffn, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(E, D, ffn, dtype=dtype)) if activation == "swiglu" else None
        self.w2 = nn.Parameter(torch.empty(E, ffn, D, dtype=dtype))
        for p in self.parameters():
            nn.init.uniform_(p, -1 / math.sqrt(p.shape[-2] if p.dim() == 3 else D),
                             1 / math.sqrt(p.shape[-2] if p.dim() == 3 else D))
        self.aux_loss: torch.Tensor | None = None
        self.last_capacity: int | None = None

    @classmethod
    def from_moepar(cls, moe, capacity_factor: float | None = None) -> "ReferenceMoE":
        """The same experts and gate as ``moe`` (a single-process ``moepar.MoE`` without
        expert biases or shared experts); dropless unless ``capacity_factor`` is given."""
        ex = moe.experts
        if ex.bias or moe.shared is not None or moe.ep != 1 or ex.etp_size != 1:
            raise ValueError("ReferenceMoE.from_moepar needs an ep=1, etp=1 MoE without expert bias "
                             "or shared experts")
        cfg = moe.router.config
        ref = cls(moe.hidden, moe.num_experts, moe.k, ex.ffn_hidden, ex.activation, capacity_factor,
                  cfg.min_capacity, cfg.aux_loss_coeff, dtype=ex.w1.dtype)
        with torch.no_grad():
            ref.gate.copy_(moe.router.weight)
            ref.w1.copy_(ex.w1)
            ref.w2.copy_(ex.w2)
            if ex.w3 is not None:
                ref.w3.copy_(ex.w3)
        return ref

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TD = x.reshape(-1, self.hidden)
        T, E, K = x_TD.shape[0], self.num_experts, self.k
        logits_TE = F.linear(x_TD.float(), self.gate)
        scores_TE = torch.softmax(logits_TE, dim=-1)
        w_TK, ids_TK = torch.topk(scores_TE, K, dim=-1)
        onehot_KTE = F.one_hot(ids_TK.t(), E)                       # slot-major: choice k, token t
        counts_E = onehot_KTE.sum((0, 1))
        # Arrival position of each route in its expert: cumsum over (k, t) in that order.
        pos_KT = ((torch.cumsum(onehot_KTE.reshape(K * T, E), 0).view(K, T, E) - 1) * onehot_KTE).sum(-1)
        if self.capacity_factor is None:
            C = int(counts_E.max()) if T else 0
            keep_KT = torch.ones_like(pos_KT, dtype=torch.bool)
        else:
            C = max(math.ceil(T * K / E * self.capacity_factor), self.min_capacity)
            keep_KT = pos_KT < C
        self.last_capacity = C
        # Dense [T, E*C + 1] combine weights and dispatch mask (scattered, not built from a
        # [K, T, E, C] outer product); dropped routes land in the last column, cut off: they
        # add nothing.
        col_KT = (ids_TK.t() * C + pos_KT.clamp(max=max(C - 1, 0))).masked_fill(~keep_KT, E * C)
        t_KT = torch.arange(T, device=x_TD.device).expand(K, T)
        combine_T_slots = logits_TE.new_zeros(T, E * C + 1).index_put(
            (t_KT.reshape(-1), col_KT.reshape(-1)), (w_TK.t() * keep_KT).reshape(-1), accumulate=True)
        dispatch_T_slots = torch.zeros(T, E * C + 1, dtype=x_TD.dtype, device=x_TD.device)
        dispatch_T_slots[t_KT.reshape(-1), col_KT.reshape(-1)] = 1
        combine_TEC = combine_T_slots[:, :E * C].view(T, E, C)
        dispatch_TEC = dispatch_T_slots[:, :E * C].view(T, E, C)
        x_ECD = torch.einsum("tec,td->ecd", dispatch_TEC, x_TD)
        h3 = torch.bmm(x_ECD, self.w3) if self.w3 is not None else None
        y_ECD = torch.bmm(_act(torch.bmm(x_ECD, self.w1), h3, self.activation), self.w2)
        y_TD = torch.einsum("tec,ecd->td", combine_TEC.to(y_ECD.dtype), y_ECD)
        f_E = counts_E.float() / max(T, 1)
        P_E = scores_TE.mean(0) if T else scores_TE.sum(0)
        self.aux_loss = self.aux_loss_coeff * (E / K) * (f_E * P_E).sum()
        return y_TD.reshape(shape)

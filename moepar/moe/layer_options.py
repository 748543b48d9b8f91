"""Layer-level options that Hugging Face MoE families need, kept out of the layer's steps.

Legend (docs/moe.md): T tokens, D hidden, K routes per token, N = T*K rows (one route each).

* ``score_before_experts`` (Llama 4): each route's row is scaled by its routing weight
  *before* the expert FFN and the outputs are summed with weight 1, i.e.
  ``y_t = sum_k expert_k(w_tk * x_t)`` instead of ``sum_k w_tk * expert_k(x_t)``.
  ``routes_as_rows`` turns the T tokens into N single-route rows (row t*K + k is route
  (t, k)), which the dispatcher moves like any k=1 routing; ``sum_routes`` folds the N
  outputs back. The weights stay in the graph through the scaling, so their gradient
  flows (d w_tk = <dy_t-through-expert, x_t>).
* ``SharedExperts`` (``num_shared_experts``): a dense FFN every token passes through.
* ``shared_expert_gate`` (Qwen2-MoE): ``out += sigmoid(x . w_gate) * shared(x)`` per token,
  ``w_gate`` [1, D]; ``SharedExpertGate`` holds it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import comm
from ..parallel.fsdp import copy_local
from ..parallel.groups import ParallelState
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .experts.activations import GATED, Elementwise


def routes_as_rows(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                   dropped_TK: torch.Tensor | None):
    """(x_ND, ids_N1, dropped_N1, ones_N1): every route as its own row scaled by its weight
    (in the input's dtype), with combine weight 1. Dropped routes weigh 0 already."""
    T, K = expert_ids_TK.shape
    w_TK1 = weights_TK.to(x_TD.dtype).unsqueeze(-1)
    x_ND = (x_TD.unsqueeze(1) * w_TK1).reshape(T * K, x_TD.shape[-1])
    ids_N1 = expert_ids_TK.reshape(T * K, 1)
    dropped_N1 = None if dropped_TK is None else dropped_TK.reshape(T * K, 1)
    ones_N1 = torch.ones(T * K, 1, dtype=weights_TK.dtype, device=weights_TK.device)
    return x_ND, ids_N1, dropped_N1, ones_N1


def sum_routes(y_ND: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T, D]: the sum of each token's K route outputs (rows t*K .. t*K+K-1)."""
    return y_ND.view(num_tokens, -1, y_ND.shape[-1]).sum(1)


class SharedExpertGate(nn.Module):
    """``sigmoid(x @ weight.T)`` [T, 1], the per-token scale of the shared experts' output.

    ``weight`` [1, D] is replicated over the TP group; under sequence parallelism each TP
    rank gates only its own tokens, so the weight is marked ``sequence_parallel`` (its
    gradient is summed over the TP group, as the router's)."""

    def __init__(self, hidden: int, init_seed: int, sequence_parallel: bool = False, dtype=None):
        super().__init__()
        self.init_seed = int(init_seed)
        w = self._drawn(hidden, None)
        self.weight = nn.Parameter(w.to(dtype) if dtype else w)
        if sequence_parallel:
            self.weight.sequence_parallel = True

    def _drawn(self, hidden: int, device) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.init_seed)
        bound = 1.0 / math.sqrt(hidden)   # nn.Linear's default init
        return torch.empty(1, hidden, device=device).uniform_(-bound, bound, generator=gen)

    def reset_parameters(self) -> None:
        """The construction's values again (e.g. after ``to_empty`` from the meta device)."""
        copy_local(self.weight, self._drawn(self.weight.shape[-1], "cpu"))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x_TD, self.weight))


class SharedExperts(nn.Module):
    """A dense FFN every token passes through, TP-sliced like Megatron's MLP
    (column-parallel in, row-parallel out: one all-reduce forward, one backward).
    ``gate``: Qwen2-MoE's shared_expert_gate, sigmoid(x . w_gate) [T, 1] scaling the output
    (``self.gate.weight`` [1, D]; None without it)."""

    def __init__(self, hidden: int, ffn_hidden: int, activation: str, state: ParallelState,
                 sequence_parallel: bool, init_seed: int, init_std: float | None, dtype, gate: bool = False):
        super().__init__()
        self.activation = activation
        kw = dict(bias=False, state=state, sequence_parallel=sequence_parallel, init_std=init_std, dtype=dtype)
        self.w1 = ColumnParallelLinear(hidden, ffn_hidden, init_seed=init_seed, **kw)
        self.w3 = (ColumnParallelLinear(hidden, ffn_hidden, init_seed=init_seed + 1, **kw)
                   if activation in GATED else None)
        self._act = Elementwise.of(activation)   # None for the built-in gelu / relu / swiglu
        self.w2 = RowParallelLinear(ffn_hidden, hidden, init_seed=init_seed + 2, **kw)
        self.gate = SharedExpertGate(hidden, init_seed + 3, sequence_parallel, dtype) if gate else None

    def reset_parameters(self) -> None:
        """Re-draw the weights as at construction (same seed: the same values, this rank's
        TP slice of each), e.g. after ``to_empty`` of a layer built on the meta device."""
        for part in (self.w1, self.w3, self.w2, self.gate):
            if part is not None:
                part.reset_parameters()

    def forward(self, x: torch.Tensor, sequence_sizes: list[int] | None = None,
                stats: comm.CommStats | None = None) -> torch.Tensor:
        """``sequence_sizes``: with sequence parallelism, every TP rank's token count.
        One input collective for w1 and w3 (an all-gather with SP; the backward's all-reduce
        without), one output collective: Megatron's MLP, as the cost model counts it."""
        x_in = self.w1.region_input(x, sequence_sizes, stats)
        h = self.w1.local(x_in, stats)
        if self.activation == "swiglu":
            h = F.silu(h) * self.w3.local(x_in, stats)
        elif self._act is not None:
            h = self._act.forward(h, self.w3.local(x_in, stats) if self._act.gated else None)
        elif self.activation == "gelu":
            h = F.gelu(h)
        else:
            h = F.relu(h)
        y = self.w2(h, sequence_sizes, stats)
        return y if self.gate is None else self.gate(x) * y

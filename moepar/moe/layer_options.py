"""Layer-level options that Hugging Face MoE families need, kept out of the layer's steps.

Legend (docs/moe.md): T tokens, D hidden, K routes per token, N = T*K routes.

* ``score_before_experts`` (Llama 4): each route's row is scaled by its routing weight
  *before* the expert FFN and the outputs are summed with weight 1, i.e.
  ``y_t = sum_k expert_k(w_tk * x_t)`` instead of ``sum_k w_tk * expert_k(x_t)``.
  ``routes_as_rows`` turns the T tokens into N single-route rows (row t*K + k is route
  (t, k)), which the dispatcher moves like any k=1 routing; ``sum_routes`` folds the N
  outputs back. The weights stay in the graph through the scaling, so their gradient
  flows (d w_tk = <dy_t-through-expert, x_t>).
* ``shared_expert_gate`` (Qwen2-MoE): ``out += sigmoid(x . w_gate) * shared(x)`` per token,
  ``w_gate`` [1, D]; ``SharedExpertGate`` holds it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# The initialisers' write that also lands in a parameter FSDP2 sharded; it lives with FSDP
# (moepar.parallel.fsdp) and is re-exported here for the modules that still import it from here.
from ..parallel.fsdp import copy_local  # noqa: F401


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

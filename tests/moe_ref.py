"""Helpers for comparing a distributed MoE layer with the single-process one.

The reference is the same layer built with a world-of-one state and the same seed: all
experts local, no collectives. Expert g's weights are identical in both (deterministic
per global expert index), so the distributed parameters are slices of the reference's.
"""
from __future__ import annotations

import torch

from moepar.moe.layer import MoE
from moepar.parallel.groups import ParallelState

D, F = 8, 12


def build(state: ParallelState | None, **kw) -> MoE:
    kw.setdefault("init_seed", 77)
    kw.setdefault("ffn_hidden", F)
    hidden = kw.pop("hidden", D)
    num_experts = kw.pop("num_experts", 4)
    ep = 1 if state is None else state.ep_size
    etp = 1 if state is None else state.etp_size
    return MoE(hidden, num_experts, ep, expert_tensor_parallel_size=etp,
               state=state if state is not None else ParallelState.single(), **kw)


def replica_input(dp_rank: int, tokens: int, hidden: int = D, dtype=torch.float32):
    """x and the output-gradient weights g of data-parallel replica ``dp_rank``."""
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    x = torch.randn(tokens, hidden, generator=gen, dtype=dtype)
    g = torch.randn(tokens, hidden, generator=gen, dtype=dtype)
    return x, g


def local_slice(ref: torch.Tensor, param: torch.nn.Parameter, state: ParallelState) -> torch.Tensor:
    """The part of the reference (full) tensor that ``param`` holds on this rank."""
    out = ref
    if getattr(param, "moepar_expert", False):
        L = param.shape[0]
        out = out[state.ep_rank * L:(state.ep_rank + 1) * L]
        pdim = getattr(param, "moepar_expert_partition_dim", None)
        if pdim is not None and state.etp_size > 1:
            n = param.shape[pdim]
            out = out.narrow(pdim, state.etp_rank * n, n)
    elif getattr(param, "tensor_model_parallel", False) and state.tp_size > 1:
        dim = param.partition_dim
        n = param.shape[dim]
        out = out.narrow(dim, state.tp_rank * n, n)
    return out


def max_param_diff(model, ref, state, use_grad: bool) -> dict[str, float]:
    ref_params = dict(ref.named_parameters())
    out = {}
    for name, p in model.named_parameters():
        a = p.grad if use_grad else p.data
        b = ref_params[name].grad if use_grad else ref_params[name].data
        if a is None or b is None:
            out[name] = float("inf") if (a is None) != (b is None) else 0.0
            continue
        out[name] = float((a - local_slice(b, p, state)).abs().max()) if a.numel() else 0.0
    return out

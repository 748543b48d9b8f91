"""``HFMoEBlock``: a moepar ``MoE`` in the place of a transformers sparse-MoE block.

It keeps the block's call and return convention, and hands transformers what the block's
router would have: with ``output_router_logits`` (config or call), transformers 5.x collects
each layer's router logits with forward hooks on the family's router class into the
forward's collector (``transformers.utils.output_capturing``); the swapped block appends
its router logits [T, E] (Switch: [batch, seq, E]) to that same collector, in the dtype the
family's router gives them (the input's; float32 for DeepSeek-V2/V3, GLM-4-MoE,
GraniteMoE, Switch). The model's own ``aux_loss`` (``load_balancing_loss_func``) then
comes out as transformers' own. Off, nothing is computed or kept.

The block holds its tensors where transformers' block does, under its names and layouts
(``moepar.hf.modules``): ``named_parameters()``, ``named_buffers()`` and ``state_dict()``
are transformers', and transformers' loader sets them through the same submodule paths.
The ``MoE`` stays reachable as ``block.moe`` (a child without children of its own).

Legend (docs/moe.md): T tokens, D hidden, E experts, K top-k.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from moepar.moe.layer import MoE
from moepar.moe.routing.recompute import rng_replayed

from . import names
from .families import Family
from .modules import adopt

# Families whose router computes its logits in float32 whatever the input's dtype.
FP32_LOGITS = ("deepseek_v3", "glm4_moe", "deepseek_v2", "granitemoe", "switch_transformers")
_collector_var = None   # transformers' output collector (a context variable), looked up once


def logits_collector() -> list | None:
    """The list the running transformers forward collects router logits into, or None
    (not asked for, or a transformers without the collector)."""
    global _collector_var
    if _collector_var is None:
        try:
            from transformers.utils.output_capturing import _active_collector
        except ImportError:   # an older transformers: nothing records router logits this way
            _active_collector = False
        _collector_var = _active_collector
    if _collector_var is False:
        return None
    collected = _collector_var.get()
    return None if not collected else collected.get("router_logits")


class HFMoEBlock(nn.Module):
    """A moepar ``MoE`` in place of an HF sparse-MoE block, with the block's call and return
    convention: a tensor, or (tensor, router scores [T, K]) for GPT-OSS, (tensor, router
    logits [T, E]) for Llama 4. For Switch Transformers, whose ``expert_capacity`` counts per
    sequence, each call routes with ``seq_len`` = the input's sequence length (dim -2).
    Mixtral's ``router_jitter_noise`` scales the block's input in training, as transformers
    does (the same draw from the same RNG state)."""

    def __init__(self, moe: MoE, family: Family, config, hf_dtypes: dict | None = None):
        super().__init__()
        for path, module in adopt(moe, family, hf_dtypes).items():   # transformers' children
            parent = self
            *heads, last = path.split(".")
            for head in heads:   # e.g. Switch's router.classifier
                if head not in parent._modules:
                    parent.add_module(head, nn.Module())
                parent = parent._modules[head]
            parent.add_module(last, module)
        self.moe = moe   # no children of its own: its modules are the ones above
        self.family = family
        # dtypes of transformers' tensors ("experts": the expert weights'; HF key -> dtype)
        self.hf_dtypes = dict(hf_dtypes or {})
        self.model_type = family.model_type
        self.returns = family.returns
        self.hf_config = config
        self._last = None
        self._hooked = False
        self.input_jitter = float(getattr(config, "router_jitter_noise", 0.0) or 0.0) \
            if family.model_type == "mixtral" else 0.0
        if self.returns != "tensor":
            self._hook_router()
        # load_state_dict() of transformers' full tensors into a sharded block (moepar.hf.names)
        self.register_load_state_dict_pre_hook(names.load_hook)

    def _hook_router(self) -> None:
        """Keep the router's input and Routing of each call (registered once, when first needed)."""
        if not self._hooked:
            self.moe.router.register_forward_hook(self._keep_routing)
            self._hooked = True

    def _keep_routing(self, module, args, output) -> None:
        self._last = (args[0], output)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if self.model_type == "switch_transformers" and hidden_states.dim() >= 2:
            cfg = self.moe.router.config
            if cfg.seq_len != hidden_states.shape[-2]:
                self.moe.router.config = dataclasses.replace(cfg, seq_len=hidden_states.shape[-2])
        if self.training and self.input_jitter > 0:   # the same draw as transformers' block
            j = self.input_jitter
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - j, 1.0 + j)
        record = logits_collector()
        if record is not None:
            self._hook_router()
        y = self.moe(hidden_states)
        last, self._last = self._last, None
        if record is not None:
            record.append(self.router_logits(*last, hidden_states))
        if self.returns == "tensor":
            return y
        x_TD, routing = last
        if self.returns == "tuple_weights":
            return y, routing.weights.to(y.dtype)
        # Llama 4's block returns its output flattened, [T, D]
        return y.reshape(-1, y.shape[-1]), self.router_logits(x_TD, routing, hidden_states)

    def router_logits(self, x_TD: torch.Tensor, routing, hidden_states: torch.Tensor) -> torch.Tensor:
        """The logits the router routed with [T, E] (Switch: [batch, seq, E]), recomputed from its
        input (with the jitter's noise redrawn from the state it was drawn from), in the
        dtype the family's router gives."""
        r = self.moe.router
        x = x_TD.float()
        if routing.noise_rng is not None and r.config.noisy_gate_policy == "jitter":
            eps = r.config.noise_eps
            with rng_replayed(x.device, routing.noise_rng):
                x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        logits = F.linear(x, r.weight.float(), None if r.bias is None else r.bias.float())
        if self.model_type not in FP32_LOGITS:
            logits = logits.to(hidden_states.dtype)
        if self.model_type == "switch_transformers":
            logits = logits.view(*hidden_states.shape[:-1], logits.shape[-1])
        return logits

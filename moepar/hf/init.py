"""Initialising swapped blocks as transformers initialises the blocks they replace.

A model built on the meta device, swapped (``replace_moe_blocks``), moved with ``to_empty``
and initialised with transformers' ``model.init_weights()`` must come out as transformers'
own model would: every weight drawn from the distribution the family's ``_init_weights``
uses, every buffer at its default. ``replace_moe_blocks`` binds ``HFInitWeights`` as the
``_init_weights`` of each ``PreTrainedModel`` inside the model, which hands an
``HFMoEBlock`` to ``init_block`` and everything else to the class's own ``_init_weights``.

What transformers (5.x) draws for the blocks, per family (``init_spec``): the experts'
weights and the router's N(0, initializer_range); the shared experts' and Qwen2-MoE's
shared-expert gate (nn.Linear) the same; the expert biases of GPT-OSS zeros and its router
bias N(0, initializer_range); ``e_score_correction_bias`` zeros. Switch Transformers:
experts N(0, initializer_factor / sqrt(d_model)), the router N(0, initializer_factor), its
bias zeros.

The draws are layout-free: one seed per block from the default CPU RNG (the same on every
rank, as ``init_parallel`` seeds it), then each tensor from a generator of (seed, tensor,
global expert), so a rank draws only its experts and every layout gets the same values.
"""
from __future__ import annotations

import torch

from moepar.moe.experts.grouped import _expert_seed
from moepar.parallel.fsdp import copy_local

from . import families
from .modules import HFExperts, canonical_local

# canonical tensor -> its index in the seed mix (fixed: the draws depend on it)
_TENSORS = ("router_weight", "router_bias", "w1", "w3", "w2", "b1", "b3", "b2", "shared_w1", "shared_w3",
            "shared_w2", "shared_gate")


def init_spec(config) -> dict[str, float]:
    """canonical tensor -> the std of the N(0, std) transformers draws it from (0.0: zeros),
    for ``config``'s family; tensors a block lacks are simply not looked up."""
    fam = families.family_of(config)
    if fam.model_type == "switch_transformers":
        f = float(getattr(config, "initializer_factor", 1.0))
        expert = f * config.d_model ** -0.5
        return {"router_weight": f, "router_bias": 0.0, "w1": expert, "w2": expert}
    std = float(getattr(config, "initializer_range", None) or 0.02)
    spec = dict.fromkeys(("router_weight", "w1", "w3", "w2", "shared_w1", "shared_w3", "shared_w2",
                          "shared_gate"), std)
    spec.update(b1=0.0, b3=0.0, b2=0.0, router_bias=std if fam.model_type == "gpt_oss" else 0.0)
    return spec


def _draw(seed: int, name: str, shape, std: float, g: int = 0) -> torch.Tensor:
    """The full (unsliced) fp32 tensor ``name`` (of global expert ``g``), on the CPU."""
    out = torch.zeros(shape, device="cpu")
    if std > 0:
        gen = torch.Generator().manual_seed(_expert_seed(_expert_seed(seed, _TENSORS.index(name)), g))
        out.normal_(0.0, std, generator=gen)
    return out


def _loaded(t) -> bool:
    """A tensor transformers' loader (or init) flagged as set: its init leaves it alone."""
    return bool(getattr(t, "_is_hf_initialized", False))


def _put(p, value) -> None:
    if p is not None and not _loaded(p):
        copy_local(p, value.to(p.dtype))


@torch.no_grad()
def init_block(block) -> None:
    """Initialise an ``HFMoEBlock``'s tensors as transformers initialises its family's block
    (``init_spec``); this rank's share of each (its experts, its ffn columns, its TP rows).
    Tensors flagged ``_is_hf_initialized`` (read from a safetensors checkpoint) keep their
    values; the draws are the same either way."""
    moe, spec = block.moe, init_spec(block.hf_config)
    seed = int(torch.randint(0, 2 ** 62, (), device="cpu"))
    r, ex, sh, st = moe.router, moe.experts, moe.shared, moe.state
    _put(r.weight, _draw(seed, "router_weight", r.weight.shape, spec["router_weight"]))
    if r.bias is not None:
        _put(r.bias, _draw(seed, "router_bias", r.bias.shape, spec["router_bias"]))
    if r.expert_bias is not None:
        if not _loaded(r.expert_bias):
            r.expert_bias.zero_()
        r.load_accum.zero_()
    cols = slice(ex.etp_rank * ex.ffn_local, (ex.etp_rank + 1) * ex.ffn_local)
    D, F = ex.hidden, ex.ffn_hidden
    full_shapes = {"w1": (D, F), "w3": (D, F), "w2": (F, D), "b1": (F,), "b3": (F,), "b2": (D,)}
    local = {}
    for name, view in canonical_local(ex).items():   # [L, ...] this rank's experts
        t_local = torch.empty(view.shape, dtype=torch.float32, device="cpu")
        for e in range(ex.num_local_experts):
            t = _draw(seed, name, full_shapes[name], spec[name], ex.first_expert + e)
            t_local[e] = t[:, cols] if name in ("w1", "w3") else t[cols] if name in ("w2", "b1", "b3") else t
        local[name] = t_local
    if isinstance(ex, HFExperts):
        ex.write_canonical(local, skip=_loaded)
    else:
        for name, t in local.items():
            _put(getattr(ex, name), t)
    del local
    if sh is not None:
        for name, lin, rows in (("shared_w1", sh.w1, True), ("shared_w3", sh.w3, True), ("shared_w2", sh.w2, False)):
            if lin is None:
                continue
            full = _draw(seed, name, (lin.out_features, lin.in_features), spec[name])
            n = lin.weight.shape[0] if rows else lin.weight.shape[1]
            part = full[st.tp_rank * n:(st.tp_rank + 1) * n] if rows else full[:, st.tp_rank * n:(st.tp_rank + 1) * n]
            _put(lin.weight, part)
        if sh.gate is not None:
            _put(sh.gate.weight, _draw(seed, "shared_gate", sh.gate.weight.shape, spec["shared_gate"]))


class HFInitWeights:
    """transformers' ``_init_weights`` for a model with swapped blocks, bound to one
    ``PreTrainedModel`` inside it by ``replace_moe_blocks``: an ``HFMoEBlock`` goes to
    ``init_block``, every other module to the model class's own ``_init_weights``. (A
    picklable callable, so that a swapped model survives ``torch.save`` / ``deepcopy``.)"""

    def __init__(self, model):
        self.model = model

    def __call__(self, module) -> None:
        from .block import HFMoEBlock
        if isinstance(module, HFMoEBlock):
            init_block(module)
        elif not getattr(module, "_moepar_hf_part", False):   # a block's part: init_block's
            type(self.model)._init_weights(self.model, module)


def hook_init_weights(model) -> None:
    """Bind ``HFInitWeights`` as the ``_init_weights`` of every transformers model in ``model``
    (a composite model dispatches each sub-model's modules to that sub-model's own)."""
    for m in model.modules():
        if callable(getattr(type(m), "_init_weights", None)) and hasattr(m, "initialize_weights"):
            if not isinstance(m.__dict__.get("_init_weights"), HFInitWeights):
                m._init_weights = HFInitWeights(m)

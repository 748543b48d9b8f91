"""Hugging Face sparse-MoE blocks -> moepar ``MoE`` and back.

``convert_block`` builds the MoE a block's family needs (``families.moe_options``) and
copies this rank's share of its weights: its experts under EP, its ffn columns/rows of
them under expert TP, its rows/columns of the shared experts under TP. The source is the
block itself or a safetensors checkpoint read lazily (``SafetensorsCheckpoint``), so that a
rank reads only its own experts. ``hf_state_dict`` is the way back: the block's HF tensors
gathered from every rank, the exact inverse of the copy.

Legend (docs/moe.md): D hidden, E experts, F expert ffn hidden (full), Fs the shared experts'.

Every check (model_type, options, tensor names and shapes) runs before anything is built
and sees the same config and shapes on every rank, so every rank raises the same
ValueError, and none waits in a collective for a peer that raised.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from moepar.moe.layer import MoE
from moepar.parallel.groups import ParallelState, get_parallel_state

from . import families
from .families import Family
from .block import HFMoEBlock
from .init import hook_init_weights
from .modules import CANONICAL_PDIM, canonical_local, unsharded


class DictSource:
    """Tensors of one block from a state dict (keys relative to the block)."""

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str = ""):
        self.tensors, self.prefix = tensors, prefix

    def shape(self, key: str):
        t = self.tensors.get(self.prefix + key)
        return None if t is None else tuple(t.shape)

    def dtype(self, key: str):
        return self.tensors[self.prefix + key].dtype

    def get(self, key: str, rows: slice | None = None) -> torch.Tensor:
        t = self.tensors[self.prefix + key]
        return t.detach() if rows is None else t.detach()[rows]


def hf_dtypes(source, config) -> dict:
    """The dtypes of a block's tensors ("experts": the expert weights'; each dense HF key's),
    from the block or a safetensors checkpoint's view of it."""
    fam = families.family_of(config)
    if isinstance(source, nn.Module):
        source = DictSource(dict(source.state_dict()))
    _, E, _, _, opts = families.block_dims(config)
    out = {"experts": source.dtype(families.expert_keys(fam, E)[0])}
    for key in families.dense_keys(fam, opts.get("router_bias", False)).values():
        out[key] = source.dtype(key)
    return out


def check_source(source, config) -> None:
    """ValueError naming every missing or misshapen tensor of the block."""
    fam = families.family_of(config)
    D, E, F, Fs, opts = families.block_dims(config)
    want = families.expected_shapes(fam, E, D, F, Fs, opts.get("router_bias", False))
    missing = [k for k in want if source.shape(k) is None]
    wrong = [f"{k}: {source.shape(k)} (expected {want[k]})" for k in want
             if source.shape(k) is not None and source.shape(k) != want[k]]
    if missing or wrong:
        raise ValueError(f"{fam.model_type} block: " + "; ".join(
            ([f"missing tensors {missing}"] if missing else []) + ([f"misshapen {wrong}"] if wrong else [])))


def convert_block(block: nn.Module | None, config, state: ParallelState | None = None, *,
                  safetensors=None, prefix: str = "", **overrides) -> MoE:
    """A moepar ``MoE`` equal to the HF ``block`` of ``config``'s family, holding this rank's
    share of its weights.

    ``state``: the parallel layout (default: the last ``moepar.init_parallel``).
    ``safetensors`` (a ``SafetensorsCheckpoint``) with ``prefix`` (the block's key prefix,
    e.g. ``"model.layers.0.mlp."``) reads the weights from there instead, only this rank's
    experts; ``block`` may then be None. ``overrides``: MoE options set on top of the
    family's (e.g. ``aux_loss="switch"``, ``capacity_factor``; ``seq_len`` for Switch's
    per-sequence capacity, which otherwise counts over all of the rank's tokens).
    """
    state = state if state is not None else get_parallel_state()
    fam = families.family_of(config)
    D, E, F, _, opts = families.block_dims(config)   # options first: ValueError for what moepar cannot express
    if safetensors is not None:
        source = safetensors.block(prefix, fam)
    elif block is not None:
        if type(block).__name__ != fam.block_class:
            raise ValueError(f"block is a {type(block).__name__}, but model_type={fam.model_type!r} "
                             f"has {fam.block_class} blocks")
        source = DictSource(dict(block.state_dict()))
    else:
        raise ValueError("convert_block needs a block or a safetensors checkpoint to read the weights from")
    check_source(source, config)
    opts.update(overrides)
    first = families.expert_keys(fam, E)[0]
    dtype = source.dtype(first)
    # A block built on the meta device has no values to copy: the MoE is built there too,
    # and transformers' init_weights (after to_empty) initialises it (moepar.hf.init).
    meta = block is not None and safetensors is None and source.tensors[first].is_meta
    with torch.device("meta") if meta else contextlib.nullcontext():
        moe = MoE(D, E, state.ep_size, ffn_hidden=F, expert_tensor_parallel_size=state.etp_size, state=state,
                  init_seed=0, dtype=dtype, **opts)
    if not meta:
        load_weights(moe, fam, source, F)
    if block is not None:
        moe.train(block.training)   # e.g. no router jitter for a block in eval mode
    return moe


@torch.no_grad()
def load_weights(moe: MoE, fam: Family, source, F: int) -> None:
    """Copy this rank's share of the source's tensors into ``moe``."""
    for name, e, t in families.local_parts(moe, fam, source, F):
        p = moe.get_parameter(name) if name != "router.expert_bias" else moe.router.expert_bias
        (p if e is None else p[e:e + 1]).copy_(t)


def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``t`` of ``group`` along ``dim`` (bytes: size * numel * b)."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def hf_state_dict(moe: MoE, config, prefix: str = "", grads: bool = False) -> dict[str, torch.Tensor]:
    """The HF block's tensors (``prefix`` + its keys), full, on every rank: experts gathered
    over EP (and ETP), shared experts over TP, each in the dtype the block holds it.
    A collective: call it on every rank. ``grads=True``: the parameters' gradients in the
    same layout (buffers left out). Under ``moepar.fully_shard`` (FSDP2) each sharded tensor
    is first all-gathered over its FSDP2 group (dense ones over DP, experts over EDP), then
    gathered over EP / TP as without it."""
    fam = families.family_of(config)
    st, ex = moe.state, moe.experts

    def val(p):
        if p is None:
            return None
        return unsharded((p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p)
    full = {}
    for name, t in canonical_local(ex, grads, full=True).items():
        t = t.detach()
        if CANONICAL_PDIM[name] is not None and st.etp_size > 1:
            t = _gather(t, st.etp_group, CANONICAL_PDIM[name])
        full[name] = _gather(t, st.ep_group, 0)
    out = {prefix + k: v for k, v in families.write_experts(fam, full).items()}
    keys = families.dense_keys(fam, moe.router.bias is not None)
    dense = {"router_weight": val(moe.router.weight), "router_bias": val(moe.router.bias),
             "expert_bias": None if grads else getattr(moe.router, "expert_bias", None)}
    sh = moe.shared
    if sh is not None:
        dense.update(shared_w1=_gather(val(sh.w1.weight).detach(), st.tp_group, 0),
                     shared_w3=_gather(val(sh.w3.weight).detach(), st.tp_group, 0),
                     shared_w2=_gather(val(sh.w2.weight).detach(), st.tp_group, 1),
                     shared_gate=None if sh.gate is None else val(sh.gate.weight))
    for name, key in keys.items():
        if dense[name] is not None:
            out[prefix + key] = dense[name].detach().clone()
    return out


def text_config(model_or_config):
    """The config holding the MoE fields (a multimodal model's text config)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def moe_block_names(model: nn.Module, config=None) -> list[str]:
    """Names of ``model``'s sparse-MoE blocks of its family (not yet replaced)."""
    fam = families.family_of(config or text_config(model))
    return [n for n, m in model.named_modules() if type(m).__name__ == fam.block_class]


def replace_moe_blocks(model: nn.Module, state: ParallelState | None = None, *, safetensors=None,
                       **overrides) -> int:
    """Swap every sparse-MoE block of the HF ``model`` for an ``HFMoEBlock`` (a moepar MoE
    with the block's call convention), in place; returns how many were replaced.
    ``safetensors`` (a ``SafetensorsCheckpoint``): read each block's weights (this rank's
    experts only) from it instead of from the block. ``overrides`` as in ``convert_block``."""
    config = text_config(model)
    fam = families.family_of(config)
    names = moe_block_names(model, config)
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        block = getattr(parent, attr)
        moe = convert_block(None if safetensors is not None else block, config, state, safetensors=safetensors,
                            prefix=name + ".", **overrides)
        new = HFMoEBlock(moe, fam, config, hf_dtypes(block if safetensors is None else safetensors.block(
            name + ".", fam), config)).train(block.training)
        if getattr(block, "_is_hf_initialized", False):   # transformers' init_weights leaves it alone
            new._is_hf_initialized = True
        setattr(parent, attr, new)
    hook_init_weights(model)
    return len(names)


def hf_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The HF state dict of a model whose blocks ``replace_moe_blocks`` swapped: its own
    tensors, with every ``HFMoEBlock`` written back as the HF block's keys (gathered; a
    collective, call it on every rank). transformers loads it into the original class.
    Under ``moepar.fully_shard`` (FSDP2) the sharded parameters are all-gathered (dense ones
    over DP, the experts over EDP, then over EP / TP): the same state dict as without it."""
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, HFMoEBlock)}
    out = {}
    for key, t in model.state_dict().items():   # the blocks' own shards: replaced by the gathered ones
        if not any(key.startswith(n + ".") for n in blocks):
            t = t.detach()
            # clone: tied tensors become separate for safetensors (full_tensor's result is new)
            out[key] = t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
    for n, m in blocks.items():
        out.update(hf_state_dict(m.moe, m.hf_config, prefix=n + "."))
    return out

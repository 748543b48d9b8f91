"""``load_state_dict`` of transformers' full tensors into a sharded swapped block.

A swapped block holds its tensors under transformers' names and layouts
(``moepar.hf.modules``), so ``state_dict()`` and ``load_state_dict()`` need no translation:
in one process they are transformers' own. Under EP / TP each rank holds its shard under
the same names: its experts ``[L, ...]`` (Switch's per-expert keys by global index), its ffn
columns under expert TP (gate columns, then up columns), its rows / columns of the shared
experts. ``HFMoEBlock`` registers ``load_hook``, which lets ``load_state_dict`` take the
full tensors too (transformers' state dict, on every rank): each rank keeps its share of
them (the other experts' Switch keys are dropped). ``hf_model_state_dict`` is the way back
to the full tensors (a collective).
"""
from __future__ import annotations

import torch

from . import families


class _Source:
    """One block's HF tensors in a state dict being loaded (keys relative to the block)."""

    def __init__(self, state_dict, prefix):
        self.sd, self.prefix = state_dict, prefix

    def shape(self, key):
        t = self.sd.get(self.prefix + key)
        return None if t is None else tuple(t.shape)

    def get(self, key, rows=None):
        t = self.sd[self.prefix + key]
        return t if rows is None else t[rows]


def local_shapes(block) -> dict[str, tuple]:
    """HF key (relative to the block) -> this rank's shape, for every tensor of the block."""
    return {k: tuple(t.shape) for k, t in block.state_dict(keep_vars=True).items()}


def load_hook(block, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
              error_msgs) -> None:
    """transformers' full tensors of the block -> this rank's shard, in place in ``state_dict``
    (nothing to do when they have this rank's shapes already, e.g. in one process)."""
    moe, fam, cfg = block.moe, block.family, block.hf_config
    mine = local_shapes(block)
    source = _Source(state_dict, prefix)
    if all(source.shape(k) in (None, v) for k, v in mine.items()) and not any(
            k.startswith(prefix + "experts.") and k[len(prefix):] not in mine for k in state_dict):
        return   # this rank's shapes (or nothing of the block): torch's loading as usual
    D, E, F, Fs, _ = families.block_dims(cfg)
    full = families.expected_shapes(fam, E, D, F, Fs, moe.router.bias is not None)
    if not all(source.shape(k) == v for k, v in full.items()):
        return   # neither this rank's nor the full shapes: torch reports the mismatch
    local: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, e, t in families.local_parts(moe, fam, source, F):
        if e is None:
            dense[name] = t
            continue
        name = name.split(".", 1)[1]   # experts.w1 -> w1
        if name not in local:
            local[name] = t.new_empty((moe.num_local_experts,) + tuple(t.shape[1:]))
        local[name][e] = t[0]
    for key in [k for k in state_dict if k.startswith(prefix) and k[len(prefix):] in full]:
        del state_dict[key]
    for key, t in moe.experts._hf_from_canonical(local).items():
        state_dict[prefix + "experts." + key] = t
    dense_keys = families.dense_keys(fam, moe.router.bias is not None)
    names = {"router.weight": "router_weight", "router.bias": "router_bias", "router.expert_bias": "expert_bias",
             "shared.w1.weight": "shared_w1", "shared.w3.weight": "shared_w3", "shared.w2.weight": "shared_w2",
             "shared.gate.weight": "shared_gate"}
    for name, t in dense.items():
        key = dense_keys[names[name]]
        state_dict[prefix + key] = t.to(source_dtype(block, key, t))


def source_dtype(block, key: str, t: torch.Tensor) -> torch.dtype:
    """The dtype the block holds ``key`` in (local_parts reads the router in float32)."""
    held = block.state_dict(keep_vars=True).get(key)
    return t.dtype if held is None else held.dtype

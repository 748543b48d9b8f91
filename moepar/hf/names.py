"""transformers' names and layouts in a swapped block's state dict.

``HFMoEBlock`` registers ``state_dict_hook`` and ``load_hook``: ``model.state_dict()`` of a
swapped model holds, in place of moepar's ``moe.experts.w1`` ..., the keys transformers'
block has (``experts.gate_up_proj``, ``gate.weight``, ``gate.e_score_correction_bias``,
``shared_experts.down_proj.weight`` ...; the per-family layouts of ``families``), and
``load_state_dict`` reads them back. So ``save_pretrained`` writes a checkpoint the plain
transformers class loads, and the tp_plan / ``_keep_in_fp32_modules`` names and the
missing-key checks see the names they know. The parameters themselves keep moepar's
names and layouts (``named_parameters()``, optimizers, ``moepar.checkpoint``, FSDP2).

Under EP / TP each rank's ``state_dict()`` holds its shard under the same names: its
experts ``[L, ...]`` (per-expert keys by global index), its ffn columns under expert TP
(gate columns, then up columns), its rows of the shared experts. ``hf_model_state_dict``
gathers the full tensors (a collective). ``load_state_dict`` takes either the full tensors
(any rank reads its share) or this rank's shard. The expert tensors are built for the
state dict (the HF layouts fuse and transpose moepar's): a copy of this rank's experts.
Parameters that FSDP2 sharded (DTensors) keep moepar's names: their layouts cannot be
rebuilt without a collective.
"""
from __future__ import annotations

import contextlib

import torch

from . import families

_NATIVE = [0]   # > 0 inside ``moepar_names()``


@contextlib.contextmanager
def moepar_names():
    """``state_dict()`` / ``load_state_dict()`` with moepar's own names and layouts inside."""
    _NATIVE[0] += 1
    try:
        yield
    finally:
        _NATIVE[0] -= 1


def _translating(block) -> bool:
    return _NATIVE[0] == 0 and not hasattr(block.moe.experts.w1, "to_local")


def hf_dtype(block, key: str) -> torch.dtype:
    """The dtype transformers' block holds ``key`` in: the experts' (now), except where the
    converted block kept a tensor in another (float32 routers and correction biases)."""
    kept, expert = block.hf_dtypes.get(key), block.hf_dtypes.get("experts")
    return kept if kept is not None and kept != expert else block.moe.experts.w1.dtype


@torch.no_grad()
def local_hf_tensors(block) -> dict[str, torch.Tensor]:
    """This rank's shard of the block's tensors under transformers' keys (relative to the block)."""
    moe, fam = block.moe, block.family
    ex, sh, st = moe.experts, moe.shared, moe.state
    local = {n: getattr(ex, n).detach() for n in ("w1", "w3", "w2", "b1", "b3", "b2") if getattr(ex, n) is not None}
    out = families.write_experts(fam, local)
    if fam.layout == "per_expert" and ex.first_expert:   # keys by global expert index
        out = {_shift(k, ex.first_expert): v for k, v in out.items()}
    dense = {"router_weight": moe.router.weight, "router_bias": moe.router.bias,
             "expert_bias": moe.router.expert_bias}
    if sh is not None:
        dense.update(shared_w1=sh.w1.weight, shared_w3=sh.w3.weight, shared_w2=sh.w2.weight,
                     shared_gate=None if sh.gate is None else sh.gate.weight)
    for name, key in families.dense_keys(fam, moe.router.bias is not None).items():
        out[key] = dense[name].detach()
    return {k: v.to(hf_dtype(block, k)) for k, v in out.items()}


def _shift(key: str, offset: int) -> str:
    """experts.expert_{e}.* -> experts.expert_{e + offset}.*"""
    head, e, tail = key.split(".", 2)
    return f"{head}.expert_{int(e.split('_')[1]) + offset}.{tail}"


def state_dict_hook(block, state_dict, prefix, local_metadata) -> None:
    """moepar's keys of the block -> transformers' (this rank's shard)."""
    if not _translating(block):
        return
    for key in [k for k in state_dict if k.startswith(prefix + "moe.")]:
        del state_dict[key]
    for key, t in local_hf_tensors(block).items():
        state_dict[prefix + key] = t


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


def load_hook(block, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
              error_msgs) -> None:
    """transformers' keys of the block (full tensors, or this rank's shard) -> moepar's."""
    moe, fam, cfg = block.moe, block.family, block.hf_config
    if not _translating(block) or not any(k.startswith(prefix) and not k.startswith(prefix + "moe.")
                                          for k in state_dict):
        return   # moepar's own names (or nothing of this block): torch's loading as usual
    D, E, Fh, S, _ = families.block_dims(cfg)
    source = _Source(state_dict, prefix)
    router_bias = moe.router.bias is not None
    full = families.expected_shapes(fam, E, D, Fh, S, router_bias)
    shard = _shard_shapes(block, E, D, Fh, S, router_bias)
    is_full = all(source.shape(k) == v for k, v in full.items())
    if not is_full and not all(source.shape(k) == shard.get(k) for k in shard):
        bad = {k: source.shape(k) for k in shard if source.shape(k) != shard[k]}
        error_msgs.append(f"{prefix[:-1]}: {bad} are neither the full shapes {[full.get(k) for k in bad]} nor "
                          f"this rank's shard {[shard[k] for k in bad]}")
        return
    whole: dict[str, torch.Tensor] = {}
    for name, e, t in families.local_parts(moe, fam, source, Fh, local=not is_full):
        if e is None:
            whole[name] = t
            continue
        if name not in whole:
            p = moe.get_parameter(name)
            whole[name] = torch.empty(p.shape, dtype=t.dtype, device=t.device)
        whole[name][e] = t[0]
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "moe.")]:
        del state_dict[key]
    for name, t in whole.items():
        state_dict[prefix + "moe." + name] = t


def _shard_shapes(block, E, D, Fh, S, router_bias) -> dict[str, tuple]:
    """HF key -> the shape of this rank's shard (``local_hf_tensors``)."""
    moe, fam = block.moe, block.family
    ex, st = moe.experts, moe.state
    L, Fl = ex.num_local_experts, ex.ffn_local
    Sl = S // st.tp_size if S else 0
    out = families.expected_shapes(fam, L, D, Fl, Sl, router_bias)
    for name, key in families.dense_keys(fam, router_bias).items():   # the router is replicated
        if name in ("router_weight", "router_bias", "expert_bias"):
            out[key] = (E, D) if name == "router_weight" else (E,)
    if fam.layout == "per_expert" and ex.first_expert:
        out = {(_shift(k, ex.first_expert) if k.startswith("experts.") else k): v for k, v in out.items()}
    return out

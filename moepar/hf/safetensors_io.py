"""Hugging Face weights on disk (safetensors): lazy reads of (sharded) checkpoints, and
saving one. Named apart from ``moepar.checkpoint`` (the training state through
torch.distributed.checkpoint) and from activation recomputation (``recompute_experts``).

``SafetensorsCheckpoint(path)`` opens ``model.safetensors`` or the shards named by
``model.safetensors.index.json``, each with ``safe_open`` on first use; ``get(key, rows)``
reads only ``rows`` of dim 0 (a rank's experts of a fused [E, ...] tensor), ``shape(key)``
reads only the header. So a rank whose experts do not fit in memory with everyone else's
reads its own experts and the dense part, nothing more.

``load_pretrained`` builds an HF causal LM from such a checkpoint with its parameters on
the meta device (buffers stay real), replaces its MoE blocks from the checkpoint (this
rank's experts) and then reads the remaining (dense) parameters.
"""
from __future__ import annotations

import contextlib
import json
import os

import torch
from torch import nn

from moepar.parallel.groups import ParallelState


# Hub checkpoints of some families keep the layout transformers 4.x had: the block under
# another name, and one tensor per expert instead of the fused [E, ...] ones of the 5.x
# modules. model_type -> (block module name on the Hub, per-expert gate/up/down names,
# renamed keys). Read as the fused keys, per expert rows: only this rank's experts.
HUB_LAYOUTS = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), {}),
    "granitemoe": ("block_sparse_moe", None, {"experts.gate_up_proj": "input_linear.weight",
                                              "experts.down_proj": "output_linear.weight",
                                              "router.weight": "router.layer.weight"}),
}
_PER_EXPERT_DEFAULT = ("gate_proj", "up_proj", "down_proj")   # Qwen, DeepSeek, OLMoE, GLM


class _BlockView:
    """One block's keys of a checkpoint, the interface ``convert_block`` reads, in the 5.x
    module layout whatever the checkpoint's (``HUB_LAYOUTS``)."""

    def __init__(self, ckpt: "SafetensorsCheckpoint", prefix: str, family=None):
        self.ckpt, self.prefix = ckpt, prefix
        hub_block, per_expert, renames = HUB_LAYOUTS.get(getattr(family, "model_type", None), (None, None, {}))
        self.renames = renames
        self.per_expert = per_expert or (_PER_EXPERT_DEFAULT if getattr(family, "layout", "") == "fused_chunk"
                                         else None)
        self.hub_prefix = None
        if hub_block and prefix.endswith(".") and "." in prefix[:-1]:
            self.hub_prefix = prefix[:-1].rsplit(".", 1)[0] + "." + hub_block + "."

    def _key(self, key):
        """The checkpoint key holding ``key`` as is, or None."""
        for pre in (self.prefix, self.hub_prefix):
            if pre is None:
                continue
            for k in (key, self.renames.get(key)):
                if k is not None and self.ckpt.shape(pre + k) is not None:
                    return pre + k
        return None

    def _expert_keys(self, key, e):
        """Per-expert checkpoint keys making up row e of fused ``key`` (None: not there)."""
        if self.per_expert is None or key not in ("experts.gate_up_proj", "experts.down_proj"):
            return None
        gate, up, down = self.per_expert
        names = (gate, up) if key == "experts.gate_up_proj" else (down,)
        found = [self._key(f"experts.{e}.{n}.weight") for n in names]
        return None if any(k is None for k in found) else found

    def shape(self, key):
        k = self._key(key)
        if k is not None:
            return self.ckpt.shape(k)
        first = self._expert_keys(key, 0)
        if first is None:
            return None
        E = 0
        while self._expert_keys(key, E) is not None:
            E += 1
        rows = [self.ckpt.shape(k) for k in first]
        return (E, sum(r[0] for r in rows), rows[0][1])

    def dtype(self, key):
        k = self._key(key)
        return self.ckpt.dtype(k if k is not None else self._expert_keys(key, 0)[0])

    def get(self, key, rows=None):
        k = self._key(key)
        if k is not None:
            return self.ckpt.get(k, rows)
        if self._expert_keys(key, 0) is None:
            raise ValueError(f"checkpoint has no tensor {self.prefix + key!r}")
        E = self.shape(key)[0]
        lo, hi, _ = (rows or slice(0, E)).indices(E)
        # [L, rows, cols]: gate and up stacked along the rows (the fused chunk order)
        return torch.stack([torch.cat([self.ckpt.get(k_) for k_ in self._expert_keys(key, e)], dim=0)
                            for e in range(lo, hi)])


class SafetensorsCheckpoint:
    """Lazy, per-tensor (and per-row-range) reads of a safetensors checkpoint directory or file.

    ``reads`` lists (key, rows) of every ``get``, for tests and accounting."""

    def __init__(self, path: str):
        from safetensors import safe_open   # the hf extra
        self._safe_open = safe_open
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                self.files = {k: os.path.join(path, v) for k, v in weight_map.items()}
            else:
                path = os.path.join(path, "model.safetensors")
        if not os.path.isdir(path):
            if not os.path.exists(path):
                raise ValueError(f"no safetensors checkpoint at {path!r}")
            with safe_open(path, framework="pt") as f:
                self.files = {k: path for k in f.keys()}
        self._handles: dict[str, object] = {}
        self.reads: list[tuple[str, slice | None]] = []

    def _open(self, key):
        if key not in self.files:
            return None
        fn = self.files[key]
        if fn not in self._handles:
            self._handles[fn] = self._safe_open(fn, framework="pt")
        return self._handles[fn]

    def keys(self) -> list[str]:
        return list(self.files)

    def shape(self, key: str):
        h = self._open(key)
        return None if h is None else tuple(h.get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        """From the header only (no tensor read)."""
        name = self._open(key).get_slice(key).get_dtype()
        dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
        if name not in dtypes:
            raise ValueError(f"checkpoint tensor {key!r} has dtype {name}; moepar reads F32, BF16, F16, F64")
        return dtypes[name]

    def get(self, key: str, rows: slice | None = None) -> torch.Tensor:
        h = self._open(key)
        if h is None:
            raise ValueError(f"checkpoint has no tensor {key!r}")
        self.reads.append((key, rows))
        return h.get_tensor(key) if rows is None else h.get_slice(key)[rows]

    def close(self) -> None:
        """Drop the open files (and their memory maps); later reads reopen them."""
        self._handles.clear()

    def block(self, prefix: str, family=None) -> _BlockView:
        """The tensors of the block at ``prefix`` (e.g. "model.layers.0.mlp.") of ``family``."""
        return _BlockView(self, prefix, family)


@contextlib.contextmanager
def params_on_meta():
    """Parameters created inside go to the meta device (no memory); buffers stay real, so
    that computed ones (rotary frequencies) keep their values."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)
    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def load_pretrained(path: str, state: ParallelState | None = None, model_class=None, keep_open: bool = False,
                    **overrides):
    """An HF causal LM from the checkpoint at ``path`` with moepar MoE blocks, where this rank
    reads only its own experts (and the dense part). Returns (model, number of blocks).
    The checkpoint's files are closed afterwards (their memory maps released) unless
    ``keep_open``; ``model.hf_checkpoint`` is the ``SafetensorsCheckpoint``."""
    import transformers
    from .convert import replace_moe_blocks
    config = transformers.AutoConfig.from_pretrained(path)
    cls = model_class or transformers.AutoModelForCausalLM
    with params_on_meta():
        model = cls.from_config(config)
    ckpt = SafetensorsCheckpoint(path)
    n = replace_moe_blocks(model, state, safetensors=ckpt, **overrides)
    tied = []
    with torch.no_grad():
        for name, p in list(model.named_parameters(remove_duplicate=False)):
            if p.device.type != "meta":
                continue
            if ckpt.shape(name) is None:
                tied.append(name)
                continue
            mod_name, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            mod.register_parameter(attr, nn.Parameter(ckpt.get(name), requires_grad=p.requires_grad))
        for name, b in list(model.named_buffers()):
            if ckpt.shape(name) is not None and b.device.type != "meta":
                b.copy_(ckpt.get(name))
    if tied:
        model.tie_weights()
        left = [n_ for n_, p in model.named_parameters() if p.device.type == "meta"]
        if left:
            raise ValueError(f"checkpoint {path!r} lacks tensors {left}")
    model.hf_checkpoint = ckpt
    if not keep_open:
        ckpt.close()
    return model, n


def save_hf_checkpoint(model: nn.Module, path: str, rank0_only: bool = True) -> dict:
    """Write ``model`` (after ``replace_moe_blocks``) as an HF checkpoint transformers loads:
    its config and one ``model.safetensors`` of the gathered HF state dict. A collective
    (the gather); only global rank 0 writes when ``rank0_only``. Returns the state dict."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from .convert import hf_model_state_dict
    sd = hf_model_state_dict(model)
    if not rank0_only or not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        model.config.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
    return sd

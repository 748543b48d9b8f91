"""Lazy reads from (sharded) safetensors checkpoints, and saving an HF checkpoint.

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


class _BlockView:
    """One block's keys (a prefix) of a checkpoint, the interface ``convert_block`` reads."""

    def __init__(self, ckpt: "SafetensorsCheckpoint", prefix: str):
        self.ckpt, self.prefix = ckpt, prefix

    def shape(self, key):
        return self.ckpt.shape(self.prefix + key)

    def dtype(self, key):
        return self.ckpt.dtype(self.prefix + key)

    def get(self, key, rows=None):
        return self.ckpt.get(self.prefix + key, rows)


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
        return self.get(key, slice(0, 0)).dtype

    def get(self, key: str, rows: slice | None = None) -> torch.Tensor:
        h = self._open(key)
        if h is None:
            raise ValueError(f"checkpoint has no tensor {key!r}")
        if rows is not None and rows != slice(0, 0):
            self.reads.append((key, rows))
        elif rows is None:
            self.reads.append((key, None))
        return h.get_tensor(key) if rows is None else h.get_slice(key)[rows]

    def block(self, prefix: str) -> _BlockView:
        return _BlockView(self, prefix)


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


def load_pretrained(path: str, state: ParallelState | None = None, model_class=None, **overrides):
    """An HF causal LM from the checkpoint at ``path`` with moepar MoE blocks, where this rank
    reads only its own experts (and the dense part). Returns (model, number of blocks)."""
    import transformers
    from .convert import replace_moe_blocks
    config = transformers.AutoConfig.from_pretrained(path)
    cls = model_class or transformers.AutoModelForCausalLM
    with params_on_meta():
        model = cls.from_config(config)
    ckpt = SafetensorsCheckpoint(path)
    n = replace_moe_blocks(model, state, checkpoint=ckpt, **overrides)
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

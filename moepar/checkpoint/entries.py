"""The entries a model and its optimizer make, the same for a save and a load (a load
builds them from the model it fills, so DCP reads into them in place)."""
from __future__ import annotations

import torch
from torch import nn

from ..parallel.groups import ParallelState
from . import layout
from . import optim as _optim
from .layout import layout_name
from .safe import pack


def _non_persistent(model: nn.Module) -> set:
    """ids of the buffers some module registered with ``persistent=False``."""
    return {id(m._buffers[n]) for m in model.modules() for n in m._non_persistent_buffers_set
            if m._buffers.get(n) is not None}


def model_entries(model: nn.Module, state: ParallelState) -> tuple[dict, set]:
    """(model.* entries, the names of this model's non-persistent buffers)."""
    sd: dict = {}
    for name, p in model.named_parameters():
        sd[f"model.{name}"] = layout.wrap(p.data, p, state)
    skip = _non_persistent(model)
    transient = set()
    for name, b in model.named_buffers():
        if id(b) in skip:
            transient.add(f"model.{name}")
        else:
            sd[f"model.{name}"] = b
    return sd, transient


def optim_entry(name: str, key: str, value, p, state: ParallelState) -> tuple[str, object]:
    full = f"optim.{name}.{key}"
    if not torch.is_tensor(value):
        return full, pack(value, f"optimizer state {full}")
    if value.shape == p.shape:
        return full, layout.wrap(value, p, state)
    if value.dim() == 0 or not layout.sharded(p, state):
        return full, value
    return f"{full}@{layout_name(state)}.rank{state.rank}", value   # optim module docstring


def optim_entries(model: nn.Module, optimizer, state: ParallelState) -> dict:
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    sd = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                k, v = optim_entry(names[id(p)], key, value, p, state)
                sd[k] = v
    sd.update(_optim.group_entries(optimizer, names))
    return sd

"""A load's checks, made on each rank without a collective before DCP is entered.

``LoadPlan.prepare`` reads ``.metadata`` (checked), checks every shard file, builds the
entries DCP will fill, decodes every non-tensor entry this rank needs and re-plans the slot
maps; the only things it changes (param-group settings, the optimizer state it creates to
load into) ``undo`` puts back. ``apply`` sets what DCP does not fill in place.
"""
from __future__ import annotations

import math
import os
import warnings

import torch
from torch import nn

from ..moe.replication.rebalance import apply_placement, named_moe_layers, prepare_placements
from ..parallel.groups import ParallelState
from . import optim as _optim
from . import ranks
from .entries import model_entries, optim_entry
from .layout import layout_name
from .safe import CheckpointError, checked_reader, read_entry


def _is_tensor(value) -> bool:
    return torch.is_tensor(value) or hasattr(value, "to_local")


class LoadPlan:
    """One rank's part of ``moepar.checkpoint.load(path, model, optimizer, ...)``."""

    def __init__(self, path: str, model: nn.Module, optimizer, state: ParallelState, trust_pickles: bool):
        self.path, self.model, self.optimizer, self.state = path, model, optimizer, state
        self.trust = trust_pickles
        self.sd: dict = {}
        self.reader = self.md = None
        self.extras: dict = {}
        self.optim_values: dict = {}
        self.groups_before: list | None = None
        self.created: list = []
        self.rng = None
        self.counters: dict | None = None
        self.placements: list = []
        self.held: set = set()
        self.warnings: list[str] = []

    def read(self, key: str):
        return read_entry(self.path, self.md, key, self.trust)

    # ---- checks --------------------------------------------------------------------------
    def prepare(self, extra_keys, rng: bool) -> None:
        path, state = self.path, self.state
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no checkpoint directory at {path!r}")
        self.reader, self.md = checked_reader(path)   # .metadata first, before any other file
        _check_files(path, self.md)
        saved = self.md.state_dict_metadata
        self.here, self.there = layout_name(state), ranks.saved_layout(saved)
        absent = [k for k in extra_keys if f"extra.{k}" not in saved]
        if absent:
            raise CheckpointError(f"{path} has no extra value {absent} (saved keys: "
                                  f"{sorted(k[len('extra.'):] for k in saved if k.startswith('extra.'))})")
        self.sd, transient = model_entries(self.model, state)
        nontensor = []
        if self.optimizer is not None:
            nontensor = self._optimizer_entries(saved)
        self._check_entries(saved, nontensor, transient)
        self.extras = {k: self.read(f"extra.{k}") for k in extra_keys}
        self.optim_values = {k: self.read(k) for k in nontensor}
        if rng:
            key = ranks.rng_key(state)
            if key in saved:
                self.rng = self.read(key)
            else:
                self.warnings.append(f"{path}: no RNG streams saved for this layout and rank ({key}); "
                                     f"the RNG streams are left as they are")
        self._counters_and_placements(saved)

    def _optimizer_entries(self, saved) -> list:
        """Apply the saved group settings, create the state to load into, add its tensor
        entries to ``sd``; returns the keys of its non-tensor entries."""
        opt, state = self.optimizer, self.state
        params = dict(self.model.named_parameters())
        names = {id(p): n for n, p in params.items()}
        group_keys = sorted(k for k in saved if k.startswith("optim.group."))
        legacy = self.read("optim.param_groups") if not group_keys and "optim.param_groups" in saved else None
        if not group_keys and legacy is None and not any(k.startswith("optim.") for k in saved):
            raise CheckpointError(f"{self.path} has no optimizer state (saved without an optimizer): "
                                  f"load it without one")
        settings = _optim.plan_groups(opt, names, [self.read(k) for k in group_keys], legacy, self.path)
        self.groups_before = [dict(g) for g in opt.param_groups]
        for group, s in zip(opt.param_groups, settings):
            if s is not None:
                group.update({k: v for k, v in s.items() if k != "params"})
        self.created = _optim.create_state(opt)
        created = {id(p) for p in self.created}
        nontensor = []
        for p in (p for g in opt.param_groups for p in g["params"]):
            st = opt.state.get(p, {})
            entries = [optim_entry(names[id(p)], key, value, p, state) + (key,) for key, value in st.items()]
            if id(p) in created and entries and not any(k in saved for k, _, _ in entries):
                opt.state.pop(p)   # saved without state (it never had a gradient): as saved
                continue
            for k, v, key in entries:
                if _is_tensor(st[key]):
                    self.sd[k] = v
                else:
                    nontensor.append(k)
        if not group_keys and legacy is None:
            raise CheckpointError(f"{self.path} has optimizer state but no param groups (optim.group.*): "
                                  f"not written by moepar")
        return nontensor

    def _check_entries(self, saved, nontensor: list, transient: set) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        path, here, there = self.path, self.here, self.there
        missing = [k for k in list(self.sd) + nontensor if k not in saved]
        per_rank = [k for k in missing if "@" in k]
        if per_rank:
            raise CheckpointError(f"{path} has no {per_rank[0]}: optimizer state of another shape than its sliced "
                                  f"parameter is saved per rank and loads only in the layout it was saved at "
                                  f"({there}), not at {here}")
        self.held = held = set(self.sd) | transient
        foreign = [k for k in self.saved_model_keys() if k not in held] if self.state.layout.pp == 1 else []
        if missing or foreign:
            what = (f"has no entry for {len(missing)} of this model's, e.g. {missing[:3]}" if missing else
                    f"has {len(foreign)} parameters this model lacks, e.g. {foreign[:3]}")
            raise CheckpointError(f"{path} {what}: a checkpoint of another model"
                                  + (" (or one saved without optimizer state)" if missing and all(
                                      k.startswith("optim.") for k in missing) else ""))
        for key, value in self.sd.items():
            entry = saved[key]
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointError(f"{path}: {key} is saved as an object, this model has a tensor there")
            if tuple(entry.size) != tuple(value.shape):
                raise CheckpointError(f"{path}: {key} has global shape {list(entry.size)} in the checkpoint "
                                      f"(saved at {there}) but {list(value.shape)} in this model (at {here}): "
                                      f"a checkpoint of another model configuration")
            covered = sum(math.prod(c.sizes) for c in entry.chunks)
            if covered != math.prod(entry.size):
                raise CheckpointError(f"{path}: the shards of {key} (saved at {there}) hold {covered} of its "
                                      f"{math.prod(entry.size)} elements, so it cannot be resharded into this "
                                      f"layout ({here})")
        for key in nontensor:
            if isinstance(saved[key], TensorStorageMetadata):
                raise CheckpointError(f"{path}: {key} is saved as a tensor, this optimizer has another value there")

    def _counters_and_placements(self, saved) -> None:
        state = self.state
        layers = [(name, m) for name, m in named_moe_layers(self.model)]
        if not layers:
            return
        same = self.there == self.here
        if same:
            key = ranks.local_key(state)
            self.counters = self.read(key) if key in saved else {}
        replicas = {k: self.read(k) for k in (f"replicas.{n}" for n, m in layers if m.replicas is not None)
                    if k in saved}
        every = None
        accum = any(torch.is_tensor(getattr(m.router, "load_accum", None)) for _, m in layers)
        if not same and (replicas or accum):
            every = [self.read(k) for k in sorted(saved) if k.startswith("local.")]
        if every and accum and any(bool(c.get("load_accum", torch.zeros(1)).any()) for e in every for c in e.values()):
            self.warnings.append(f"{self.path}: saved at {self.there}, loaded at {self.here}: the routes each "
                                 f"rank counted for update_expert_bias since its last call are not restored")
        if replicas:
            first = state.rank % state.layout.stage_size == 0
            wanted = ranks.placement_state_from(self.model, replicas, self.counters, every, first)
            try:
                self.placements = prepare_placements(self.model, wanted)
            except ValueError as e:
                raise CheckpointError(f"{self.path}: {e}") from None

    def saved_model_keys(self) -> list[str]:
        """The checkpoint's model entries, sorted (empty when its metadata was not read)."""
        return sorted(k for k in self.md.state_dict_metadata if k.startswith("model.")) if self.md else []

    def held_bits(self) -> tuple[int, int]:
        """(how many model entries the checkpoint has, a bit per entry: this rank holds it)."""
        keys = self.saved_model_keys()
        return len(keys), sum(1 << i for i, k in enumerate(keys) if k in self.held)

    def undo(self) -> None:
        """Put back what ``prepare`` changed (the load was refused)."""
        if self.groups_before is not None:
            for group, before in zip(self.optimizer.param_groups, self.groups_before):
                group.clear()
                group.update(before)
        for p in self.created:
            self.optimizer.state.pop(p, None)

    # ---- after DCP -----------------------------------------------------------------------
    def apply(self) -> dict:
        for message in self.warnings:
            warnings.warn(message, stacklevel=3)
        if self.rng is not None:
            ranks.set_rng_streams(self.rng, self.state)
        if self.optimizer is not None:
            names = dict(self.model.named_parameters())
            for key, value in self.optim_values.items():
                pname, skey = key[len("optim."):].rsplit(".", 1)
                self.optimizer.state[names[pname]][skey] = value
        if self.counters:
            ranks.set_load_accum(self.model, self.counters)
        for m, placement, loads, planned in self.placements:
            apply_placement(m, placement, loads, planned)
        return dict(self.extras)


def _check_files(path: str, md) -> None:
    """Every shard file the metadata lists is there, at least as long as it needs."""
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise CheckpointError(f"{shard}: missing shard (the metadata lists it, with {size} bytes)")
        if os.path.getsize(shard) < size:
            raise CheckpointError(f"{shard}: truncated shard, {os.path.getsize(shard)} bytes where "
                                  f"the metadata needs {size}")

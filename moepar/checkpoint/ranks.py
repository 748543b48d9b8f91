"""Entries that are not one value for the whole model: each rank's RNG streams and MoE
counters, and each pipeline stage's slot maps.

DCP writes an entry that several ranks hold under one key once (from one of them) and gives
every rank that copy back. That is right for a replicated parameter and wrong for anything a
rank counts or draws by itself, so:

* ``rng.<layout>.rank<R>``: rank R's RNG streams (restored only in the same layout);
* ``local.<layout>.rank<R>``: rank R's MoE counters, per layer: the router's ``load_accum``
  (routes since the last ``update_expert_bias``, a non-persistent buffer) and the routes its
  replicated layers counted since the last ``moepar.rebalance``;
* ``replicas.<layer>``: a replicated layer's slot map and the load it was planned from, the
  same on every rank of the layer's stage (so one key per layer: each stage writes its own).

At another layout the counted routes of a replicated layer are summed over every saved rank
and given to the first rank of the stage (``rebalance`` all-reduces them over the stage, so
its next plan is the same); ``load_accum`` (summed over the data-parallel group only) is left
out there, with a warning, as the RNG streams are.
"""
from __future__ import annotations

import random
import sys

import torch

from ..moe.replication.rebalance import named_moe_layers, placement_plain
from ..parallel.groups import ParallelState
from .layout import layout_name


def rng_key(state: ParallelState) -> str:
    return f"rng.{layout_name(state)}.rank{state.rank}"


def local_key(state: ParallelState, rank: int | None = None) -> str:
    return f"local.{layout_name(state)}.rank{state.rank if rank is None else rank}"


def saved_layout(keys) -> str:
    """The layout a checkpoint's per-rank entries name ("an unknown layout" if none)."""
    for k in keys:
        if k.startswith(("rng.", "local.")):
            return k.split(".", 1)[1].rsplit(".rank", 1)[0]
    return "an unknown layout"


def rng_streams(state: ParallelState) -> dict:
    """Every RNG stream this rank draws from, as plain values: torch's CPU generator (the
    router's noise, dropout), the CUDA device's, the model-parallel tracker's
    (``fork_model_parallel_rng``), Python's ``random`` and NumPy's global generator if NumPy
    is loaded (its key array as a list)."""
    streams = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        streams["cuda"] = torch.cuda.get_rng_state()
    if state.rng is not None:
        streams["tracker"] = (state.rng._cpu, state.rng._cuda)
    if "numpy" in sys.modules:
        name, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        streams["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(gauss))
    return streams


def set_rng_streams(streams: dict, state: ParallelState) -> None:
    torch.set_rng_state(streams["torch"])
    random.setstate(tuple(tuple(v) if isinstance(v, list) else v for v in streams["python"]))
    if "cuda" in streams and torch.cuda.is_available():
        torch.cuda.set_rng_state(streams["cuda"])
    if "tracker" in streams:
        if state.rng is None:
            from ..parallel.groups import RNGTracker
            state.rng = RNGTracker(state.model_parallel_seed)
        state.rng._cpu, state.rng._cuda = streams["tracker"]
    if "numpy" in streams:
        import numpy
        name, keys, *rest = streams["numpy"]
        numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), *rest))


def counters(model) -> dict:
    """{layer: {"load_accum": tensor, "replica_loads": list or None}} of this rank (one host
    read per replicated layer), the layers with neither left out."""
    out = {}
    for name, m in named_moe_layers(model):
        entry = {}
        accum = getattr(m.router, "load_accum", None)
        if torch.is_tensor(accum):
            entry["load_accum"] = accum.detach().cpu()
        if m.replicas is not None:
            loads = m.replicas.loads_E
            entry["replica_loads"] = None if loads is None else loads.tolist()
        if entry:
            out[name] = entry
    return out


def replica_entries(model) -> dict:
    """{"replicas.<layer>": {"placement": slot map, "planned": load or None}}."""
    return {f"replicas.{name}": {"placement": placement_plain(m.placement),
                                 "planned": None if m.replicas.planned_loads is None else list(m.replicas.planned_loads)}
            for name, m in named_moe_layers(model) if m.replicas is not None}


def placement_state_from(model, replicas: dict, mine: dict | None, every: list[dict] | None,
                         first_of_stage: bool) -> dict:
    """The ``load_placement_state`` argument for this rank: each replicated layer's saved slot
    map and planned load, with this rank's counted routes (``mine``: its own counters, same
    layout) or, at another layout (``every``: every saved rank's counters), their sum on the
    first rank of the stage and none elsewhere."""
    out = {}
    for name, m in named_moe_layers(model):
        saved = replicas.get(f"replicas.{name}")
        if saved is None or m.replicas is None:
            continue
        if mine is not None:
            loads = mine.get(name, {}).get("replica_loads")
        else:
            lists = [c[name]["replica_loads"] for c in every or () if c.get(name, {}).get("replica_loads") is not None]
            loads = [sum(col) for col in zip(*lists)] if lists and first_of_stage else None
        out[name] = (saved["placement"], loads, saved["planned"])
    return out


def set_load_accum(model, mine: dict) -> None:
    """This rank's routers' route counts (``update_expert_bias``'s) back, same layout."""
    for name, m in named_moe_layers(model):
        saved = mine.get(name, {}).get("load_accum")
        accum = getattr(m.router, "load_accum", None)
        if saved is not None and torch.is_tensor(accum) and accum.shape == saved.shape:
            accum.copy_(saved)

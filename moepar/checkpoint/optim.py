"""Optimizer state in a checkpoint, for any ``torch.optim`` optimizer, by parameter name.

Per parameter, ``optim.<name>.<key>`` for each entry of its state: a tensor shaped like the
parameter is resharded with it; a scalar (``step``) or a tensor of a replicated parameter is
one entry; a tensor of another shape belonging to a sliced parameter (factored statistics)
differs from rank to rank and is saved per rank, ``optim.<name>.<key>@<layout>.rank<R>``
(loadable in that layout only); any other value is packed plain data.

Param groups: one entry per group, ``optim.group.<its first parameter's name>``, holding its
settings, its parameters' names and the optimizer's class name. Each pipeline stage's groups are thus its own entries,
and a load matches each group of the loading optimizer to the saved groups of its
parameters, whatever the layout.

A fresh optimizer has no state (torch creates it in the first ``step``), so loading first
creates it the way torch's own ``torch.distributed.checkpoint.state_dict`` does: one step
with zero gradients and learning rate 0, so that every tensor has the dtype and device the
optimizer wants (``step`` on the device for fused and capturable Adam, ``max_exp_avg_sq``
with AMSGrad, ``momentum_buffer`` for SGD) and DCP fills it in place.
"""
from __future__ import annotations

import torch

from .safe import CheckpointError, pack


def group_entries(optimizer, names: dict) -> dict:
    """{"optim.group.<first parameter>": packed {"settings", "params"}} of every non-empty group."""
    out = {}
    for i, group in enumerate(optimizer.param_groups):
        params = [names[id(p)] for p in group["params"]]
        if params:
            settings = {k: v for k, v in group.items() if k != "params"}
            out[f"optim.group.{params[0]}"] = pack({"settings": settings, "params": params,
                                                    "optimizer": type(optimizer).__name__},
                                                   f"optimizer param group {i} ({params[0]}, ...)")
    return out


def _comparable(v):
    if torch.is_tensor(v):
        return ("tensor", v.tolist())
    if isinstance(v, (list, tuple)):
        return tuple(_comparable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _comparable(x)) for k, x in v.items()))
    return v


def plan_groups(optimizer, names: dict, saved: list[dict], legacy: list | None, path: str) -> list:
    """The settings each group of ``optimizer`` gets (None: none saved for its parameters).
    ``saved``: the checkpoint's group entries; ``legacy``: an earlier moepar's list of every
    group's settings (matched by position, as it was written). CheckpointError when one group
    holds parameters that were saved in groups with different settings."""
    if legacy is not None and not saved:
        return [dict(s) for s in legacy[:len(optimizer.param_groups)]] + \
            [None] * max(0, len(optimizer.param_groups) - len(legacy))
    where = {}
    for entry in saved:
        kind = entry.get("optimizer", type(optimizer).__name__)
        if kind != type(optimizer).__name__:
            raise CheckpointError(f"{path}: its optimizer state is a {kind}'s, this optimizer is a "
                                  f"{type(optimizer).__name__}: load it into a {kind} (or without an optimizer)")
        for pname in entry["params"]:
            where[pname] = entry["settings"]
    out = []
    for i, group in enumerate(optimizer.param_groups):
        found = {}
        for p in group["params"]:
            s = where.get(names[id(p)])
            if s is not None:
                found.setdefault(_comparable(s), (names[id(p)], s))
        if len(found) > 1:
            (a, sa), (b, sb) = list(found.values())[:2]
            differ = sorted(k for k in set(sa) | set(sb) if _comparable(sa.get(k)) != _comparable(sb.get(k)))
            raise CheckpointError(f"{path}: param group {i} of this {type(optimizer).__name__} holds {a} and {b}, "
                                  f"saved in groups with different {differ}: group the parameters as they "
                                  f"were when saved")
        out.append(dict(next(iter(found.values()))[1]) if found else None)
    return out


def create_state(optimizer) -> list:
    """Give every trainable parameter without optimizer state the state its optimizer keeps
    (module docstring); the others' state and every gradient are left as they were. Returns
    the parameters that got state. CheckpointError when the optimizer's step cannot run so
    (one that needs a closure, or sparse gradients)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    fresh = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not fresh:
        return []
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in params:   # only the fresh ones take part in the step
            p.grad = None
        for p in fresh:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
        optimizer.step()
    except Exception as e:
        for p in fresh:
            optimizer.state.pop(p, None)
        raise CheckpointError(f"cannot create the state of this {type(optimizer).__name__} to load into "
                              f"(one step with zero gradients and lr 0 raised {type(e).__name__}: {e})") from e
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
    return fresh

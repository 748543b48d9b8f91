"""The MoE layer's modules, in one room per step of the forward (docs/moe.md, "Reading
order"): ``routing`` (step 1), ``exchange`` (2-7, 9-11), ``experts`` (8), ``replication``
(hot experts' copies); at the top the layer, its config and options, its stats and the
collectives table (``traffic``), and ``cpu``, the one home of CPU-only tricks.

Nothing is imported here: ``moepar.moe.traffic`` and ``moepar.moe.exchange.dedup_policy``
(read by the cost model) import without torch; the other modules are imported on attribute
access (``moepar.moe.cpu.pool_disabled()``). A module's old flat name
(``moepar.moe.router``, ...) still imports, with a DeprecationWarning naming the new one.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from .._lazy import attach as _attach

__getattr__, __dir__ = _attach(__name__, {})

# old module (before the rooms) -> its place now
MOVED = {
    "router": "routing.router", "capacity": "routing.capacity", "recompute": "routing.recompute",
    "dispatcher": "exchange.dispatcher", "dedup": "exchange.dedup", "dedup_policy": "exchange.dedup_policy",
    "padded": "exchange.padded", "fp8": "exchange.fp8", "guard": "exchange.guard",
    "experts_fn": "experts.function", "experts_op": "experts.custom_op", "activations": "experts.activations",
    "replicas": "replication.replicas", "placement": "replication.placement",
    "placement_pack": "replication.placement_pack", "placement_split": "replication.placement_split",
    "rebalance": "replication.rebalance",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``moepar.moe.<old>`` as the module now at ``moepar.moe.<new>``, with a
    DeprecationWarning (a public name is never renamed away)."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname[len(__name__) + 1:] if fullname.startswith(__name__ + ".") else None
        if old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = f"{__name__}.{MOVED[spec.name[len(__name__) + 1:]]}"
        warnings.warn(f"{spec.name} is now {new}; import that (the old name goes in a later release)",
                      DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())

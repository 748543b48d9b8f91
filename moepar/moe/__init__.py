"""The MoE layer's modules. Nothing is imported here: ``moepar.moe.traffic`` and
``moepar.moe.dedup_policy`` (read by the cost model) import without torch; the other
modules are imported on attribute access (``moepar.moe.cpu.pool_disabled()``), as an eager
``import moepar`` used to leave them."""
from .._lazy import attach as _attach

__getattr__, __dir__ = _attach(__name__, {})

"""When dedup dispatch pays, as one number shared by the layer and the cost model.

Torch-free, so ``moepar.cost`` prices the layer's "auto" decision with the very threshold
the layer applies (``moepar.moe.exchange.dedup.group_dedups``) without importing torch.
"""
from __future__ import annotations

# Dedup (one row per token and destination rank) in "auto" mode: when the EP group's rows
# with dedup are at most this fraction of its routes. The break-even measured on the 2-core
# CPU with gloo (docs/benchmarks.md); not measured on NCCL, where moving bytes costs more
# against the local passes and the break-even is likely higher (dedup="on" forces it).
DEDUP_MAX_FRACTION = 0.3

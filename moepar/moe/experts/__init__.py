"""Step 8: the grouped experts (``grouped.GroupedExperts``), the autograd Function over all
local experts and its GEMM paths (``function``), its custom op for torch.compile
(``custom_op``) and the activations."""
from ..._lazy import attach as _attach

# ``from moepar.moe.experts import GroupedExperts`` as before these modules had a room.
__getattr__, __dir__ = _attach(__name__, {"GroupedExperts": ".grouped", "ExpertShard": ".grouped"})

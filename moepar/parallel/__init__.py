"""Process groups and autograd collectives (nothing MoE-specific)."""
from .comm import CommStats, track
from .groups import Layout, ParallelState, get_parallel_state, init_parallel, reset_parallel_state
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              vocab_parallel_cross_entropy)

__all__ = ["CommStats", "track", "Layout", "ParallelState", "get_parallel_state", "init_parallel",
           "reset_parallel_state", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]

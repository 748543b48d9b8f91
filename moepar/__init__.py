"""moepar: an expert-parallel Mixture-of-Experts layer for PyTorch."""
from .parallel import (ColumnParallelLinear, ParallelState, RowParallelLinear, VocabParallelEmbedding,
                       get_parallel_state, init_parallel, vocab_parallel_cross_entropy)

__version__ = "0.1.0"
__all__ = ["ColumnParallelLinear", "ParallelState", "RowParallelLinear", "VocabParallelEmbedding",
           "get_parallel_state", "init_parallel", "vocab_parallel_cross_entropy"]

"""Process groups and autograd collectives (nothing MoE-specific)."""
from .comm import CommStats, peer_wait_timing, track
from .fsdp import fully_shard
from .grads import allreduce_gradients, clip_grad_norm_, expert_param_names, grad_norm
from .groups import Layout, ParallelState, destroy_parallel, get_parallel_state, init_parallel, reset_parallel_state
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              vocab_parallel_cross_entropy)

__all__ = ["CommStats", "track", "peer_wait_timing", "allreduce_gradients", "clip_grad_norm_", "expert_param_names", "grad_norm", "Layout", "ParallelState", "get_parallel_state", "init_parallel",
           "reset_parallel_state", "destroy_parallel", "fully_shard", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]

"""moepar: an expert-parallel Mixture-of-Experts layer for PyTorch.

Public names: ``MoE`` and its options ``MoEConfig`` / ``RouterConfig``, ``aux_loss``,
``load_report`` (the layers' load imbalance), ``TopKRouter``, ``Routing``,
``GroupedExperts``; ``init_parallel`` / ``destroy_parallel`` and the parallel building
blocks; ``fully_shard`` (FSDP2 with expert parallelism); ``release_cpu_buffers`` and
``cpu_buffer_stats`` for the CPU buffer pool (docs/moe.md). ``moepar.checkpoint``,
``moepar.cost`` and ``moepar.hf`` are imported on demand.
"""
from .moe.config import MoEConfig
from .moe.cpu import release as release_cpu_buffers
from .moe.cpu import stats as cpu_buffer_stats
from .moe.experts import GroupedExperts
from .moe.layer import MoE, MoEStats, aux_loss
from .moe.load_report import LoadReport, load_report
from .moe.router import RouterConfig, Routing, TopKRouter
from .parallel import (ColumnParallelLinear, ParallelState, RowParallelLinear, VocabParallelEmbedding,
                       allreduce_gradients, clip_grad_norm_, destroy_parallel, fully_shard, get_parallel_state,
                       grad_norm, init_parallel, vocab_parallel_cross_entropy)

__version__ = "0.1.0"
__all__ = ["MoE", "MoEConfig", "RouterConfig", "MoEStats", "aux_loss", "load_report", "LoadReport", "TopKRouter",
           "Routing", "GroupedExperts", "ColumnParallelLinear", "ParallelState", "RowParallelLinear",
           "VocabParallelEmbedding", "allreduce_gradients", "clip_grad_norm_", "grad_norm", "destroy_parallel", "fully_shard",
           "get_parallel_state", "init_parallel", "vocab_parallel_cross_entropy", "release_cpu_buffers",
           "cpu_buffer_stats"]

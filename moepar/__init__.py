"""moepar: an expert-parallel Mixture-of-Experts layer for PyTorch.

Public names: ``MoE``, ``MoEConfig``, ``RouterConfig``, ``aux_loss``, ``TopKRouter``, ``Routing``, ``GroupedExperts``,
``init_parallel`` and the parallel building blocks; ``release_cpu_buffers`` and
``cpu_buffer_stats`` for the CPU buffer pool (docs/moe.md); ``load_report`` for the
layers' load imbalance. ``moepar.checkpoint`` and
``moepar.cost`` are imported on demand.
"""
from .moe.config import MoEConfig
from .moe.cpu import release as release_cpu_buffers
from .moe.cpu import stats as cpu_buffer_stats
from .moe.experts import GroupedExperts
from .moe.layer import MoE, MoEStats, aux_loss
from .moe.router import RouterConfig, Routing, TopKRouter
# Load imbalance figures (issue 19, part 3).
from .moe.load_report import LoadReport, load_report
from .parallel import (ColumnParallelLinear, ParallelState, RowParallelLinear, VocabParallelEmbedding,
                       allreduce_gradients, clip_grad_norm_, get_parallel_state, init_parallel,
                       vocab_parallel_cross_entropy)

__version__ = "0.1.0"
__all__ = ["MoE", "MoEConfig", "RouterConfig", "MoEStats", "aux_loss", "TopKRouter", "Routing", "GroupedExperts", "ColumnParallelLinear",
           "ParallelState", "RowParallelLinear", "VocabParallelEmbedding", "allreduce_gradients",
           "clip_grad_norm_", "get_parallel_state", "init_parallel", "vocab_parallel_cross_entropy",
           "release_cpu_buffers", "cpu_buffer_stats"]
__all__ += ["load_report", "LoadReport"]

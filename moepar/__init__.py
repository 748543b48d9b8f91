"""moepar: an expert-parallel Mixture-of-Experts layer for PyTorch.

Public names: ``MoE`` and its options ``MoEConfig`` / ``RouterConfig``, ``aux_loss``,
``load_report`` (the layers' load imbalance), ``rebalance`` (re-place replicated experts
from measured load), ``TopKRouter``, ``Routing``,
``GroupedExperts``; ``init_parallel`` / ``destroy_parallel`` and the parallel building
blocks; ``Pipeline`` (pipeline stages on torch's schedules, docs/pipeline.md); ``fully_shard`` (FSDP2 with expert parallelism); ``release_cpu_buffers`` and
``cpu_buffer_stats`` for the CPU buffer pool (docs/moe.md). ``moepar.checkpoint``,
``moepar.cost`` and ``moepar.hf`` are imported on demand.

Each public name is imported on first use (``moepar._lazy``): ``import moepar`` does not
load torch, so the cost model and its command line (``python -m moepar report``) run
without it.
"""
import sys as _sys

from ._lazy import attach as _attach

__version__ = "0.1.0"

# public name -> the module defining it (":attr" where the module calls it otherwise)
_NAMES = {
    "MoE": ".moe.layer", "MoEStats": ".moe.stats", "aux_loss": ".moe.layer",
    "MoEConfig": ".moe.config", "ExchangeConfig": ".moe.config", "HFOptions": ".moe.config",
    "RouterConfig": ".moe.config", "Routing": ".moe.routing.router", "TopKRouter": ".moe.routing.router",
    "GroupedExperts": ".moe.experts.grouped",
    "LoadReport": ".moe.load_report", "load_report": ".moe.load_report",
    **{name: ".moe.replication.rebalance" for name in (
        "rebalance", "Rebalanced", "placement_state", "load_placement_state")},
    "release_cpu_buffers": ".moe.cpu:release", "cpu_buffer_stats": ".moe.cpu:stats",
    **{name: ".parallel" for name in (
        "ColumnParallelLinear", "ParallelState", "RowParallelLinear", "VocabParallelEmbedding",
        "allreduce_gradients", "clip_grad_norm_", "grad_norm", "destroy_parallel", "fully_shard",
        "get_parallel_state", "init_parallel", "vocab_parallel_cross_entropy", "Pipeline")},
    "init_distributed": ".parallel.faults", "CollectiveError": ".parallel.faults",
}
__all__ = ["MoE", "MoEConfig", "RouterConfig", "ExchangeConfig", "HFOptions", "MoEStats", "aux_loss", "load_report", "LoadReport", "rebalance",
           "Rebalanced", "placement_state", "load_placement_state", "TopKRouter",
           "Routing", "GroupedExperts", "ColumnParallelLinear", "ParallelState", "RowParallelLinear",
           "VocabParallelEmbedding", "allreduce_gradients", "clip_grad_norm_", "grad_norm", "destroy_parallel", "fully_shard",
           "get_parallel_state", "init_parallel", "vocab_parallel_cross_entropy", "Pipeline", "release_cpu_buffers",
           "cpu_buffer_stats", "init_distributed", "CollectiveError"]
# The subpackages an eager import used to leave set as attributes (moepar.moe.cpu, ...), and
# those the README calls by attribute (``moepar.checkpoint.save(...)``, ``moepar.cost``,
# ``moepar.hf``), each imported on first use.
__getattr__, __dir__ = _attach(__name__, _NAMES, submodules=("moe", "parallel", "tables", "checkpoint", "cost", "hf"))

if "torch" in _sys.modules:
    # moepar.parallel.groups imports torch.distributed.nn, which must happen before any process
    # group exists (docs/fsdp.md, "A finished job exits cleanly"); the eager package did it on
    # ``import moepar``. With torch already loaded that costs little, so keep doing it then; a
    # torch-free process (the cost command line) skips it, and init_parallel unpins a late import.
    from .parallel import groups as _groups  # noqa: F401

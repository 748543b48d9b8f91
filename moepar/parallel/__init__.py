"""Process groups, autograd collectives and pipeline stages (nothing MoE-specific).

Names are imported on first use (``moepar._lazy``): ``moepar.parallel.layout``, the
torch-free rank arithmetic the cost model builds on, imports without torch.
"""
from .._lazy import attach as _attach

_NAMES = {
    "CommStats": ".comm", "track": ".comm", "peer_wait_timing": ".comm",
    "fully_shard": ".fsdp",
    "allreduce_gradients": ".grads", "clip_grad_norm_": ".grads", "expert_param_names": ".grads",
    "grad_norm": ".grads",
    "Layout": ".layout",
    "Pipeline": ".pipeline", "StageChunks": ".pipeline", "cut_blocks": ".pipeline",
    "check_pipeline": ".pipeline", "stage_ids": ".pipeline",
    "ParallelState": ".groups", "get_parallel_state": ".groups", "init_parallel": ".groups",
    "reset_parallel_state": ".groups", "destroy_parallel": ".groups",
    "ColumnParallelLinear": ".tensor_parallel", "RowParallelLinear": ".tensor_parallel",
    "VocabParallelEmbedding": ".tensor_parallel", "vocab_parallel_cross_entropy": ".tensor_parallel",
}
__all__ = ["CommStats", "track", "peer_wait_timing", "allreduce_gradients", "clip_grad_norm_", "expert_param_names", "grad_norm", "Layout", "Pipeline", "StageChunks", "cut_blocks", "check_pipeline", "stage_ids", "ParallelState", "get_parallel_state", "init_parallel",
           "reset_parallel_state", "destroy_parallel", "fully_shard", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
__getattr__, __dir__ = _attach(__name__, _NAMES)

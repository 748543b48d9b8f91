"""Per-rank training FLOPs and memory of a model on a layout (legend: moepar/cost/model.py).

FLOPs follow the 6·N rule (2 forward + 4 backward per parameter per token) with N the
parameters a token multiplies; a rank's expert FLOPs are 6·R·P_e over the routes it
receives. Memory: weights, gradients, Adam state (ZeRO-sharded) and an estimate of the
activations one micro-batch keeps for backward.
"""
from __future__ import annotations

import dataclasses

from .model import CostLayout, MoESpec, Params, Routes, count_params, routes_per_rank

ADAM_BYTES_PER_PARAM = 12   # fp32 master weights + Adam m and v (ZeRO paper's K = 12)


# ---- FLOPs ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Flops:
    """Training FLOPs (forward + backward) per micro-batch unless named per step."""

    per_token: float             # model FLOPs per token: 6·N_active_matmul (+ attention scores)
    model: float                 # all replicas, one micro-batch: per_token · T · dp
    rank_mean: float             # one rank, balanced routing
    rank_max: float              # the most loaded rank (imbalance, padding)
    rank_expert_max: float
    deepspeed_style: float       # rank_max · mp_size(tp) · dp: DeepSpeed profiler's scaling
    per_step_rank_max: float


def count_flops(spec: MoESpec, layout: CostLayout, params: Params | None = None,
                routes: Routes | None = None) -> Flops:
    p = params or count_params(spec, layout)
    r = routes or routes_per_rank(spec, layout)
    D, n_l, moe_l, T, tp = spec.hidden, spec.layers, spec.moe_layers, spec.tokens, layout.tp
    lm_head = spec.vocab * D if spec.last_stage else 0
    # QK^T and AV, fwd + bwd: 6·seq·H·(qk + v) per token and layer (12·seq·D for plain MHA)
    if spec.kv_lora_rank is not None:
        qk_v = spec.heads * (spec.qk_nope_dim + spec.qk_rope_dim + spec.v_head_dim)
    else:
        qk_v = 2 * spec.heads * spec.hd if spec.heads else 2 * D
    score = 6 * n_l * spec.seq_len * qk_v if spec.seq_len else 0
    dense_blocks = n_l * p.attention + spec.dense_layers * p.dense_ffn
    per_token = 6 * (dense_blocks + moe_l * (p.router + p.shared + spec.topk * p.expert) + lm_head) + score
    # Dense work: every TP rank multiplies the group's T tokens by 1/tp of the weights; the
    # router is replicated, on T tokens (T/tp with sequence parallelism).
    t_router = T // tp if layout.sp else T
    dense = (6 * T * (dense_blocks + moe_l * p.shared + lm_head) / tp + 6 * t_router * moe_l * p.router
             + score * T / tp)
    expert_mean = 6 * r.mean * moe_l * p.expert
    expert_max = 6 * r.max * moe_l * p.expert
    rank_max = dense + expert_max
    return Flops(per_token, per_token * T * layout.dp, dense + expert_mean, rank_max, expert_max,
                 rank_max * tp * layout.dp, rank_max * spec.micro_batches)


# ---- memory ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per rank: weights, gradients, optimizer state (ZeRO-sharded), activations."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    replica_weights: float = 0.0   # remote expert copies, every MoE layer, one micro-batch in flight
    replica_grads: float = 0.0     # their gradient buffers, one MoE layer at a time (backward)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.replica_weights + self.replica_grads


def activation_bytes(spec: MoESpec, layout: CostLayout, routes: Routes | None = None) -> float:
    """Activations kept for backward, one micro-batch, all layers, no recomputation, flash
    attention (no T x T scores). An estimate: it counts the tensors named below."""
    r = routes or routes_per_rank(spec, layout)
    D, T, tp, b = spec.hidden, spec.tokens, layout.tp, spec.b
    t_sp = T // tp if layout.sp else T           # tokens of a replicated [T, D] tensor on this rank
    kv_dim = (spec.kv_heads or spec.heads or 1) * (D // (spec.heads or 1)) if spec.heads else D
    attn = (2 * t_sp * D                          # two norm inputs (residual stream)
            + t_sp * D                            # QKV input
            + T * (D + 2 * kv_dim) // tp          # Q, K, V
            + T * D // tp) * b                    # attention context (o-proj input)
    router = t_sp * spec.experts * 4 * 2          # fp32 logits and probabilities
    # Expert rows: the (all-gathered, with etp) dispatched input etp·R x D; the hidden
    # gate/up outputs and activation (3F gated, 2F plain, sliced F/etp over etp·R rows);
    # the expert outputs R x D, kept for the routing-weight gradient.
    experts = (layout.etp * r.max * D + r.max * spec.mats * spec.ffn + r.max * D) * b
    shared = spec.shared_experts * (t_sp * D + T * spec.mats * spec.fs // tp) * b
    return spec.layers * attn + spec.moe_layers * (router + experts + shared)   # dense FFNs: not listed


def memory_per_rank(spec: MoESpec, layout: CostLayout, params: Params | None = None,
                    routes: Routes | None = None, param_bytes: int | None = None) -> Memory:
    """ZeRO stage 1 shards optimizer state, 2 also gradients, 3 also weights: dense over dp,
    experts over edp (expert-data-parallel replicas)."""
    p = params or count_params(spec, layout)
    pb = spec.b if param_bytes is None else param_bytes
    z = layout.zero
    dense_w = p.dense_rank / (layout.dp if z >= 3 else 1)
    exp_w = p.expert_rank / (layout.edp if z >= 3 else 1)
    dense_g = p.dense_rank / (layout.dp if z >= 2 else 1)
    exp_g = p.expert_rank / (layout.edp if z >= 2 else 1)
    dense_o = p.dense_rank / (layout.dp if z >= 1 else 1)
    exp_o = p.expert_rank / (layout.edp if z >= 1 else 1)
    # Expert replication: the busiest rank's remote slots hold full copies (not ZeRO-sharded),
    # received every forward and kept for the backward, plus their gradients in the backward.
    replica = 0.0
    if spec.redundant_experts:
        from .replication import expert_slice_params, replica_plan
        replica = max(replica_plan(spec, layout).received) * expert_slice_params(spec, layout.etp) * pb
    return Memory((dense_w + exp_w) * pb, (dense_g + exp_g) * pb,
                  (dense_o + exp_o) * ADAM_BYTES_PER_PARAM,
                  activation_bytes(spec, layout, routes), spec.moe_layers * replica, replica)

"""Memory per rank: weights, gradients and optimizer state as ZeRO shards them, and the
activations one micro-batch keeps for its backward, tensor by tensor, with recomputation and
FP8 caching.

Weights and gradients in the model dtype (BF16 under the FP8 recipes), Adam state 12 bytes
per parameter (fp32 master + m + v, the ZeRO paper's K = 12); ZeRO 1 shards the optimizer
state, 2 also gradients, 3 also weights: dense parameters over dp, experts over edp. Expert
replication adds the busiest rank's remote copies (``moepar.cost.replication``).

Legend as ``moepar.cost.model``; ``t`` = T tokens per micro-batch per TP group, ``t_sp`` =
T/tp with sequence parallelism, else T (a replicated [T, D] tensor), ``b`` the activation
bytes (BF16 under the FP8 recipes), R rows this rank's experts process. Flash attention keeps
no T x T scores. Megatron-Core's layer (the recipe of the runs the model is checked against):
the routing probabilities are folded into the experts' activation, so the experts' outputs are
not kept (MCore v0.13, "memory efficient token permutation").

Per block: the residual entering each norm (D·t_sp), each norm's output (D·t_sp: the input of
the QKV projection, and of the router and experts), MLA's compressed q and kv (r + c per token),
q, k and v for flash attention ((H·qk + Hkv·qk + Hkv·v)/tp per token; MLA: H·(2·qk + v)), the
attention output (H·v/tp, the output projection's input). Per MoE block: the router's fp32
logits and probabilities (8E bytes per token), the dispatched rows (etp·R·D), the experts'
gate/up outputs (R·2F gated) and their activation (R·F, the down projection's input); the
shared experts' likewise on T/tp tokens. Per dense block: the FFN's 2Fd and Fd. The last stage:
the final norm's input and the logits (T·V/tp).

**Recomputation** (Megatron's names, as ``MoESpec.recompute``): ``full`` keeps each block's
input only (D·t_sp) and rebuilds one block at a time in the backward; ``layernorm`` drops the
norms' outputs, ``mla_up_proj`` MLA's q, k and v, ``moe_act`` the experts' activation output,
``mlp`` a dense FFN's tensors, ``shared_experts`` the shared experts', ``moe`` everything of
the MoE block but its input; ``core_attn`` frees nothing here (with flash attention it drops
only the softmax statistics). What a block recomputes is rebuilt one block at a time: the
largest block's dropped tensors are added once.

**FP8 caching**: under an FP8 recipe the inputs of FP8 linears are kept in FP8, one byte per
element plus the scales (4 bytes per 128 elements; MXFP8's one byte per 32 is the same),
as Transformer Engine keeps them (Megatron-Core MoE README: "Stores linear layer inputs in
FP8 instead of BF16"): the norms' outputs, the attention output, the dispatched rows, the
experts' activation outputs and the FFNs'.
"""
from __future__ import annotations

import dataclasses

from .model import CostLayout, MoESpec, Params, count_params
from .replication import expert_slice_params, replica_plan
from .routes import Routes, routes_per_rank

ADAM_BYTES_PER_PARAM = 12   # fp32 master weights + Adam m and v (ZeRO paper's K = 12)

FP8_CACHED_BYTES = 1 + 4 / 128    # one FP8 byte plus a 4-byte scale per 128 elements


@dataclasses.dataclass(frozen=True)
class Saved:
    """One kind of saved tensor: bytes per micro-batch for one block, which recompute module
    drops it ("" none; "moe" and "full" are handled apart), and whether an FP8 recipe keeps it
    in FP8 (the input of an FP8 linear)."""

    name: str
    nbytes: float
    dropped_by: str = ""
    fp8_cached: bool = False


def block_tensors(spec: MoESpec, layout: CostLayout, r: Routes, moe: bool) -> list[Saved]:
    """The tensors one block keeps (an MoE block if ``moe``), in full precision ``b``."""
    D, T, tp = spec.hidden, spec.tokens, layout.tp
    b = 2 if spec.fp8 else spec.b
    t_sp = T / tp if layout.sp else T
    H = spec.heads or 1
    out = [Saved("residual into norm 1", D * t_sp * b), Saved("norm 1 output", D * t_sp * b, "layernorm", True)]
    if spec.kv_lora_rank is not None:
        out.append(Saved("MLA compressed q and kv", ((spec.q_lora_rank or 0) + spec.kv_lora_rank) * t_sp * b,
                         "", True))
        qkv = H * (2 * (spec.qk_nope_dim + spec.qk_rope_dim) + spec.v_head_dim)
        out.append(Saved("q, k, v", T * qkv / tp * b, "mla_up_proj"))
        o = H * spec.v_head_dim
    elif spec.heads:
        kv = spec.kv_heads or H
        out.append(Saved("q, k, v", T * (H + 2 * kv) * spec.hd / tp * b))
        o = H * spec.hd
    else:
        out.append(Saved("q, k, v", T * 3 * D / tp * b))
        o = D
    out += [Saved("attention output", T * o / tp * b, "", True), Saved("residual into norm 2", D * t_sp * b),
            Saved("norm 2 output", D * t_sp * b, "layernorm", True)]
    act = 2 if spec.gated else 1
    if not moe:
        Fd = spec.dense_ffn or spec.ffn
        return out + [Saved("FFN gate/up output", T * act * Fd / tp * b, "mlp"),
                      Saved("FFN activation", T * Fd / tp * b, "mlp", True)]
    R, F = r.max, spec.ffn
    out += [Saved("router logits and probabilities", t_sp * spec.experts * 4 * 2, "moe"),
            Saved("dispatched rows", layout.etp * R * D * b, "moe", True),
            Saved("expert gate/up output", R * act * F * b, "moe"),
            Saved("expert activation", R * F * b, "moe_act", True)]
    if spec.shared_experts:
        Fs = spec.fs * spec.shared_experts
        out += [Saved("shared gate/up output", T * act * Fs / tp * b, "shared_experts"),
                Saved("shared activation", T * Fs / tp * b, "shared_experts", True)]
    return out


def _kept(spec: MoESpec, tensors: list[Saved], b: int) -> tuple[float, float]:
    """(bytes kept, bytes dropped) of one block under the spec's recomputation and recipe."""
    mods = spec.recomputed
    kept = dropped = 0.0
    for s in tensors:
        nbytes = s.nbytes * (FP8_CACHED_BYTES / b if spec.fp8 and s.fp8_cached else 1.0)
        moe_part = s.dropped_by in ("moe", "moe_act", "shared_experts")
        if spec.recompute == "full" and s.name != "residual into norm 1":
            dropped += nbytes
        elif s.dropped_by in mods or ("moe" in mods and moe_part):
            dropped += nbytes
        else:
            kept += nbytes
    return kept, dropped


@dataclasses.dataclass(frozen=True)
class Activations:
    """Bytes of one micro-batch's saved activations on this rank."""

    kept: float           # every block's kept tensors
    rebuilt: float        # the largest block's recomputed tensors, alive during its backward
    per_block: dict       # "moe" / "dense" -> (kept, dropped) bytes of one block
    head: float = 0.0     # the last stage's final-norm input and logits (one micro-batch: its
    #                       backward follows its forward at once in every schedule but GPipe)

    @property
    def total(self) -> float:
        return self.kept + self.rebuilt + self.head


def activation_memory(spec: MoESpec, layout: CostLayout, r: Routes) -> Activations:
    """Saved activations of one micro-batch on this rank (module doc)."""
    b = 2 if spec.fp8 else spec.b
    moe_k, moe_d = _kept(spec, block_tensors(spec, layout, r, True), b)
    den_k, den_d = _kept(spec, block_tensors(spec, layout, r, False), b) if spec.dense_layers else (0.0, 0.0)
    mtp = spec.mtp_layers if spec.train_mtp and spec.last_stage else 0
    kept = (spec.moe_layers + mtp) * moe_k + spec.dense_layers * den_k
    head = 0.0
    if spec.vocab and spec.last_stage:   # the final norm's input and the logits (each MTP module's too)
        t_sp = spec.tokens / layout.tp if layout.sp else spec.tokens
        head = (1 + mtp) * (spec.hidden * t_sp + spec.tokens * spec.vocab / layout.tp) * b
    rebuilt = max(moe_d if spec.moe_layers + mtp else 0.0, den_d if spec.dense_layers else 0.0)
    return Activations(kept, rebuilt, {"moe": (moe_k, moe_d), "dense": (den_k, den_d)}, head)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per rank: weights, gradients, optimizer state (ZeRO-sharded), activations (those
    of the micro-batches in flight) and the recomputed block alive in the backward."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    replica_weights: float = 0.0   # remote expert copies, every MoE layer, one micro-batch in flight
    replica_grads: float = 0.0     # their gradient buffers, one MoE layer at a time (backward)
    rebuilt: float = 0.0           # one block's recomputed tensors during its backward
    head: float = 0.0              # the output layer's logits, one micro-batch (the last stage)

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.replica_weights
                + self.replica_grads + self.rebuilt + self.head)


def memory_per_rank(spec: MoESpec, layout: CostLayout, params: Params | None = None,
                    routes: Routes | None = None, param_bytes: int | None = None) -> Memory:
    """ZeRO stage 1 shards optimizer state, 2 also gradients, 3 also weights: dense over dp,
    experts over edp (expert-data-parallel replicas); one micro-batch's activations."""
    p = params or count_params(spec, layout)
    r = routes or routes_per_rank(spec, layout)
    pb = (2 if spec.fp8 else spec.b) if param_bytes is None else param_bytes
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
        replica = max(replica_plan(spec, layout).received) * expert_slice_params(spec, layout.etp) * pb
    act = activation_memory(spec, layout, r)
    return Memory((dense_w + exp_w) * pb, (dense_g + exp_g) * pb, (dense_o + exp_o) * ADAM_BYTES_PER_PARAM,
                  act.kept, spec.moe_layers * replica, replica, act.rebuilt, act.head)

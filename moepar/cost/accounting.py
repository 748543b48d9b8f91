"""One rank's model FLOPs and every collective of a transformer block with an MoE FFN, per
layer and per step (``moepar.cost.step`` adds them up with the compute of
``moepar.cost.compute`` and the memory of ``moepar.cost.memory``).

Legend (as model.py): D hidden, E experts, K top-k, T tokens per micro-batch per TP group,
b activation bytes, R rows this rank dispatches per micro-batch, priced on the most
loaded rank: (T/tp)·K·imbalance dropless; E·C padded to capacity C. Bytes are per rank in
nccl-tests' size convention (all-gather: output, reduce-scatter: input, all-to-all: send
buffer), as ``moepar.parallel.comm`` records them.

FLOPs follow the 6·N rule (2 forward + 4 backward per parameter per token) with N the
parameters a token actually multiplies: attention, router, shared experts, K experts
(not E) and the output projection; the input embedding is a lookup and norms are
negligible. A rank's expert FLOPs are 6·R·P_e: its experts' work on the routes it
*receives*, which under expert parallelism come from other data-parallel replicas. These are
the model FLOPs of MFU; the time is priced on executed FLOPs (``moepar.cost.compute``).

Per MoE layer and micro-batch: the collectives of ``moepar.moe.traffic.layer_collectives``,
the layer's own table (op, group, bytes formula and docs/moe.md step of each; a test
checks it against what the layer records), priced here with R on the most loaded rank.
Per transformer block besides:
  attention (Megatron TP) [tp>1]: all-reduce T·D·b forward and backward (SP: all-gather +
           reduce-scatter each way).
Per step: gradients of dense parameters over dp, of expert parameters over edp: all-reduce
(ZeRO 0), reduce-scatter + all-gather of the updated weights (ZeRO 1), a reduce-scatter
after every micro-batch's backward (ZeRO 2 and 3 keep only their gradient shard, as
DeepSpeed does) + the all-gather of updated weights (2) or an all-gather of weights before
forward and before backward of every micro-batch (3); with sequence parallelism the norms'
gradients are first all-reduced over TP (L·2·D·b).

Dtypes: ``b`` is the activation dtype; ``--dtype fp8`` is the FP8 recipe of DeepSeek-V3
and Megatron (Transformer Engine): FP8 dispatch rows, BF16 combine rows, BF16 activations
on the TP collectives, BF16 weights and gradients. ``dispatch_dtype`` / ``combine_dtype``
override the two all-to-all directions (forward dispatch and backward combine-gradient
carry the expert inputs; forward combine and backward dispatch-gradient the outputs).

With node-limited routing (``max_nodes_per_token``) the MoE all-to-alls of the EP group are
priced as sent once per node over the network and forwarded over NVLink
(``Hardware.node_limited_all_to_all``, ``routes.node_limited_fraction``).

Per micro-batch [vocab, tp>1]: the vocab-parallel embedding's all-reduce T·D·b forward (SP:
reduce-scatter), the output layer's input-gradient all-reduce T·D·b backward (SP: gather +
scatter), the cross-entropy's 3 all-reduces of T·4 forward. Per step: the grad-norm scalars
(8 bytes over tp, ep, etp; ``clip_grad``) and the loss over dp (4 bytes; ``loss_allreduce``).
Attention calls run in every block (``per="layer"``), MoE calls in the MoE blocks
(``"moe_layer"``), a dense FFN's all-reduce each way in the dense ones (``"dense_layer"``).

Pipeline stages (``moepar.cost.pipeline``): a stage is priced as the model of its own blocks
(``price_stage``), with its point-to-point sends and receives of T·D·b per micro-batch
(``per="micro_batch"``; T/tp·D·b with SP) and the schedule's bubble on top of the step; the
grad-norm scalars add an 8-byte all-reduce over the pipeline group, and each step the loss
and the aux loss (2 fp32) are summed over it (``moepar.parallel.pipeline.Pipeline.step``).
"""
from __future__ import annotations

import dataclasses

from ..moe.traffic import LayerShape, aux_group_name, layer_collectives
from .collectives import Hardware, sent_bytes
from .model import DTYPE_BYTES, CostLayout, MoESpec, Params, count_params, wire_bytes
from .routes import Routes, dedup_fraction, node_limited_fraction, routes_per_rank
from .memory import memory_per_rank  # noqa: F401  (the public name's old home)
from .replication import expert_slice_params, replica_plan

INT64 = 8
FP32 = 4
FWD_SHARE, BWD_SHARE = 2 / 6, 4 / 6   # of the 6·N training FLOPs: 2 forward, 4 backward


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


# ---- collectives ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Call:
    """One collective: ``count`` calls per layer and micro-batch (``per="layer"``) or per
    step (``per="step"``); ``nbytes`` per rank (size convention); ``seconds`` per call."""

    name: str
    op: str
    algo: str
    group: str
    group_size: int
    phase: str          # fwd | bwd | step
    nbytes: float
    count: int
    seconds: float
    sent: float         # bytes each rank sends per call
    formula: str
    per: str = "layer"

    @property
    def total_seconds(self) -> float:
        return self.seconds * self.count


def layer_calls(spec: MoESpec, layout: CostLayout, hw: Hardware, routes: Routes | None = None,
                a2a_algo: str = "pairwise", ar_algo: str = "auto") -> list[Call]:
    """Every collective of one transformer block (attention + MoE), one micro-batch."""
    r = routes or routes_per_rank(spec, layout)
    w = wire_bytes(spec)
    D, T, K, E, b = spec.hidden, spec.tokens, spec.topk, spec.experts, w.act
    tp, ep, etp, sp = layout.tp, layout.ep, layout.etp, layout.sp
    R = r.max
    calls: list[Call] = []

    node_limited = node_limited_fraction(spec, layout)

    def add(name, op, group, phase, nbytes, formula, count=1):
        algo = a2a_algo if op == "all_to_all" else ar_algo if op == "all_reduce" else "ring"
        pl = layout.placement(group)
        # the replica all-to-all sends nothing to the rank itself: all its bytes cross links
        wire = nbytes * pl.size / (pl.size - 1) if name.startswith("MoE replica") else nbytes
        algo = hw.resolve_algo(op, pl, wire, algo)
        seconds, sent = hw.collective_time(op, pl, wire, algo), sent_bytes(op, pl, wire, algo)
        if node_limited is not None and op == "all_to_all" and group == "ep" and not name.startswith("MoE replica"):
            algo = "node-limited"   # once per node over the network, then NVLink (routes.node_limited_fraction)
            seconds = hw.node_limited_all_to_all(pl, wire, node_limited)
            sent = wire * ((pl.per_node - 1) / pl.per_node + node_limited)
        calls.append(Call(name, op, algo, group, pl.size, phase, float(nbytes), count, seconds, sent, formula))

    f = dedup_fraction(spec, layout)
    # Expert replication: the busiest EP rank's copies (sent or received) bound the replica
    # all-to-all; every rank is priced as that one (moepar.cost.replication). Without
    # redundant experts the layer issues no replica all-to-all: nothing to plan or size.
    copies, expert_bytes = 0, 0.0
    if spec.redundant_experts:
        copies = replica_plan(spec, layout).busiest_copies
        expert_bytes = expert_slice_params(spec, etp) * w.param
    aux_group = aux_group_name(spec.aux_scope, sp) if spec.aux_loss or spec.z_loss else None
    # The MoE layer's own collectives: the layer's table (moepar.moe.traffic), balanced
    # (every rank sends and receives the busiest rank's R rows; dedup: R·f of them).
    moe = LayerShape(tp=tp, ep=ep, etp=etp, sp=sp, T=T, D=D, K=K, E=E, rows=R * (1.0 if f is None else f),
                     etp_rows=etp * R * (1.0 if f is None else f), b=b, b_dispatch=w.dispatch,
                     b_combine=w.combine, dedup=f is not None, padded=spec.pad_to_capacity,
                     shared=bool(spec.shared_experts), aux_group=aux_group, aux_loss=bool(spec.aux_loss),
                     z_loss=bool(spec.z_loss), fp8_dispatch=w.dispatch == DTYPE_BYTES["fp8"],
                     fp8_combine_grad=spec.combine_grad_dtype == "fp8", redundant_experts=spec.redundant_experts,
                     replica_sent=copies, expert_bytes=expert_bytes)
    sizes = {g: layout.size(g) for g in ("moe", "ep", "etp", "tp", "dp", "world")}
    for phase in ("fwd", "bwd"):
        # attention block, Megatron tensor parallel
        # backward: one all-reduce (SP: reduce-scatter) per column-parallel input linear
        n_in = spec.qkv_linears if phase == "bwd" else 1
        if tp > 1 and not sp:
            add("attention output" if phase == "fwd" else "attention input grad", "all_reduce", "tp", phase,
                T * D * b, "T·D·b", count=n_in)
        elif tp > 1:
            add("attention SP gather", "all_gather", "tp", phase, T * D * b, "T·D·b",
                count=spec.qkv_linears if phase == "fwd" else 1)
            add("attention SP scatter", "reduce_scatter", "tp", phase, T * D * b, "T·D·b", count=n_in)
        for c in layer_collectives(moe, sizes, phases=(phase,)):
            add(c.name, c.op, c.group, phase, c.nbytes, c.formula)
    # Everything but attention runs in the MoE blocks only; the dense blocks' FFN (first-k
    # dense, sparse step) is a Megatron MLP: an all-reduce each way (SP: gather + scatter).
    calls = [c if c.name.startswith("attention") else dataclasses.replace(c, per="moe_layer") for c in calls]
    if spec.dense_layers and tp > 1:
        for phase in ("fwd", "bwd"):
            if sp:
                add("dense FFN SP gather", "all_gather", "tp", phase, T * D * b, "T·D·b")
                add("dense FFN SP scatter", "reduce_scatter", "tp", phase, T * D * b, "T·D·b")
            else:
                add("dense FFN", "all_reduce", "tp", phase, T * D * b, "T·D·b")
        calls = [c if not c.name.startswith("dense FFN") else dataclasses.replace(c, per="dense_layer")
                 for c in calls]
    return calls


def calls_per_step(call: Call, spec: MoESpec) -> int:
    """How many times a step issues ``call``: per (MoE / dense) layer and micro-batch, per
    micro-batch (a stage boundary's send or receive), or per step."""
    layers = {"layer": spec.layers, "moe_layer": spec.moe_layers, "dense_layer": spec.dense_layers,
              "micro_batch": 1, "step": 0}[call.per]
    return call.count * (layers * spec.micro_batches if call.per != "step" else 1)


def step_calls(spec: MoESpec, layout: CostLayout, hw: Hardware, params: Params | None = None,
               ar_algo: str = "auto", grad_bytes: int | None = None) -> list[Call]:
    """Data-parallel gradient (and ZeRO weight) collectives, once per step."""
    p = params or count_params(spec, layout)
    gb = wire_bytes(spec).param if grad_bytes is None else grad_bytes
    out: list[Call] = []

    def once(name, op, group, phase, nbytes, formula, count=1):
        pl = layout.placement(group)
        if pl.size > 1:
            algo = ar_algo if op == "all_reduce" else "ring"
            out.append(Call(name, op, algo, group, pl.size, phase, float(nbytes), count,
                            hw.collective_time(op, pl, nbytes, algo), sent_bytes(op, pl, nbytes, algo),
                            formula, per="step"))
    if layout.sp and layout.tp > 1:
        pl = layout.placement("tp")
        nbytes = spec.layers * p.norms * gb
        algo = hw.resolve_algo("all_reduce", pl, nbytes, ar_algo)
        out.append(Call("SP norm grads", "all_reduce", algo, "tp", pl.size, "step", float(nbytes), 1,
                        hw.collective_time("all_reduce", pl, nbytes, algo),
                        sent_bytes("all_reduce", pl, nbytes, algo), "L·2·D·b", per="step"))
    for group, n_params, label in (("dp", p.dense_rank, "dense"), ("edp", p.expert_rank, "expert")):
        pl = layout.placement(group)
        if pl.size == 1 or n_params == 0:
            continue
        nbytes = n_params * gb
        sym = "N_dense_rank·b" if label == "dense" else "N_expert_rank·b"

        def add(name, op, phase, count, algo="ring"):
            algo = hw.resolve_algo(op, pl, nbytes, algo)
            out.append(Call(name, op, algo, group, pl.size, phase, float(nbytes), count,
                            hw.collective_time(op, pl, nbytes, algo), sent_bytes(op, pl, nbytes, algo),
                            sym, per="step"))
        if layout.zero == 0:
            add(f"{label} grads", "all_reduce", "step", 1, ar_algo)
        elif layout.zero == 1:
            add(f"{label} grads", "reduce_scatter", "step", 1)
            add(f"{label} updated weights", "all_gather", "step", 1)
        else:   # ZeRO 2/3 keep a gradient shard only: reduce-scatter after every micro-batch
            add(f"{label} grads (every micro-batch)", "reduce_scatter", "step", spec.micro_batches)
            if layout.zero == 2:
                add(f"{label} updated weights", "all_gather", "step", 1)
            else:
                add(f"{label} weights (ZeRO-3, fwd+bwd)", "all_gather", "step", 2 * spec.micro_batches)
    # Vocab-parallel embedding, output layer and cross-entropy, once per micro-batch
    T, D, mb = spec.tokens, spec.hidden, spec.micro_batches
    # (with pipeline stages: the embedding on the first stage, the output layer and loss on the last)
    if spec.vocab and spec.first_stage:
        if layout.sp:
            once("embedding SP scatter", "reduce_scatter", "tp", "fwd", T * D * spec.b, "T·D·b", mb)
        else:
            once("embedding", "all_reduce", "tp", "fwd", T * D * spec.b, "T·D·b", mb)
    if spec.vocab and spec.last_stage:
        if layout.sp:
            once("output layer SP gather", "all_gather", "tp", "fwd", T * D * spec.b, "T·D·b", mb)
            once("output layer SP scatter", "reduce_scatter", "tp", "bwd", T * D * spec.b, "T·D·b", mb)
        else:
            once("output layer input grad", "all_reduce", "tp", "bwd", T * D * spec.b, "T·D·b", mb)
        # max, target logit and sum of exponentials over the vocab slices, fp32 per token
        once("cross-entropy", "all_reduce", "tp", "fwd", T * FP32, "T·4", 3 * mb)
    if spec.clip_grad:   # squared norms: fp64 scalars (dense over TP, experts over EP and ETP, all over PP)
        for group in ("tp", "ep", "etp", "pp"):
            once(f"grad norm ({group})", "all_reduce", group, "step", 8, "8")
    if spec.loss_allreduce:
        once("loss", "all_reduce", "dp", "step", FP32, "4")
    # moepar's Pipeline.step: the last stage's loss and every stage's aux loss, 2 fp32 over pp
    once("pipeline loss and aux", "all_reduce", "pp", "step", 2 * FP32, "2·4")
    return out

"""The compute side of a training step on one rank: GEMMs, attention, memory-bound passes,
recomputation and the optimizer step, each priced at a documented rate.

Legend as ``moepar.cost.model`` (D hidden, F expert ffn, Fs shared ffn, Fd dense ffn, E, K,
T tokens per micro-batch per TP group, R rows this rank's experts process, H heads, qk and v
the per-head dims, b activation bytes), plus ``s`` the keys a token attends to.

**Rates.** A GEMM in dtype ``d`` runs at ``peak(d) x EFFICIENCY[generation, d] x g(M)``:
``peak`` the GPU's dense datasheet rate for ``d`` (``Hardware.peak``), ``EFFICIENCY`` one
figure per GPU generation and dtype, the maximum achievable matmul FLOPS of the
generation's SXM part over its datasheet peak as measured and published (S. Bekman,
ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
table", copy of 2026-08-22; torch.matmul, BF16 and float8_e4m3fn), never fitted to a
training run; ``g(M)`` the grouped-GEMM shape factor below (1 for M >= 4096 rows). MXFP8 GEMMs
are priced at the FP8 figure (Blackwell's block-scaled FP8 runs at the FP8 rate; no
separate measurement found). Flash attention runs in BF16 at the BF16 figure.

**Grouped GEMMs.** An expert's GEMM over M rows is slower than a large GEMM: ``g(M)`` is
DeepGEMM's published FP8 throughput on H800 at M rows per group over its throughput at
8,192 (deepseek-ai/DeepGEMM README of 2025-03-25: contiguous layout at M = 4,096 and 8,192,
masked layout at 256-1,024, the dense table at 64-128; the two N x K shapes averaged),
interpolated in log2(M) and applied to every generation (the shape dependence of other GPUs is
assumed alike). M is the rows one local expert processes per micro-batch, balanced.

**Executed FLOPs** (what the time is for; MFU keeps the 6·N model FLOPs): GEMMs 2 per weight
per row forward, 4 backward; attention scores causal (a token attends to s = seq/2 keys on
average, min(window, seq/2) in sliding-window layers), 2·s·H·(qk + v) forward and 2.5x that
backward (flash attention recomputes the scores in its backward: 5 matmuls against the
forward's 2, FlashAttention-2, Dao 2023). The output layer and the router run in BF16.

**Memory-bound passes**, bytes over the HBM bandwidth (datasheet), forward per token: the two
norms (read and write D) and residual adds (read 2D, write D) of every block; per route the
permute (read and write D), the un-permute (read D, and write D per token) and the SwiGLU
(read 2F, write F); the shared experts' and dense FFNs' SwiGLU; under an FP8 recipe a cast
of every FP8 GEMM's input (read 2 bytes, write 1 per element). The backward moves twice the
forward's bytes (each pass reads its saved input and the output gradient and writes the
input gradient). Kernel launches and the host are not priced.

**Recomputation** (Megatron's ``recompute_granularity`` / ``recompute_modules``): ``full``
repeats every layer's forward in the backward; ``selective`` the modules named:
``core_attn`` the attention scores, ``moe_act`` the experts' SwiGLU, ``layernorm`` the two
norms, ``mla_up_proj`` MLA's up-projections, ``mlp`` the dense FFNs, ``moe`` the MoE layer
(its all-to-alls too, priced in ``moepar.cost.accounting``), ``shared_experts`` those.

**Optimizer step** (Adam, mixed precision): per parameter of this rank's optimizer shard,
the fp32 master weight, m and v read and written (24 bytes), its gradient read and its
weight written; and every local gradient read once more for the global norm.
"""
from __future__ import annotations

import dataclasses
import math

from .collectives import Hardware
from .model import CostLayout, MoESpec, Params
from .routes import Routes

# Maximum achievable matmul FLOPS / datasheet dense peak, per generation and dtype, of the
# generation's SXM part (S. Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS
# comparison table"): A100 SXM 271.2/312; H100 SXM 794.5/989 BF16 ("H200 is the same"),
# 1402.6/1979 FP8; B200 SXM 1745/2250, 3432.5/4500; B300 SXM 1769/2250, 3353.3/4500.
EFFICIENCY = {
    ("ampere", "bf16"): 271.2 / 312,
    ("hopper", "bf16"): 794.5 / 989,
    ("hopper", "fp8"): 1402.6 / 1979,
    ("blackwell", "bf16"): 1745.0 / 2250,
    ("blackwell", "fp8"): 3432.5 / 4500,
    ("blackwell-ultra", "bf16"): 1769.0 / 2250,
    ("blackwell-ultra", "fp8"): 3353.3 / 4500,
}
EFFICIENCY_SOURCE = ("maximum achievable matmul FLOPS of the generation's SXM part over its dense peak "
                     "(S. Bekman, ml-engineering, compute/accelerator/README.md, copy of 2026-08-22)")

# DeepGEMM (README of 2025-03-25, H800, FP8): TFLOPS at M rows per group, the two N x K shapes
# of each M averaged, over the contiguous layout's 1,280 at M = 8,192: 64 and 128 from the dense
# table (N x K 4096x7168 and 7168x2048), 256-1,024 from the masked layout, 4,096 and 8,192
# from the contiguous layout.
GROUPED_GEMM_POINTS = ((64, 291.0 / 1280), (128, 521.5 / 1280), (256, 873.5 / 1280), (512, 978.0 / 1280),
                       (1024, 1079.0 / 1280), (4096, 1.0), (8192, 1.0))
ADAM_STATE_BYTES = 24        # fp32 master weight, m and v, each read and written
FLASH_BWD = 2.5              # flash attention's backward FLOPs over its forward's (FlashAttention-2)


def gemm_dtype(spec: MoESpec) -> str:
    """The dtype the model's GEMMs run in: fp8 for both FP8 recipes, else bf16."""
    return "fp8" if spec.fp8 else "bf16"


def gemm_efficiency(hw: Hardware, dtype: str) -> float:
    """EFFICIENCY of ``hw``'s generation for ``dtype`` (FP8 on a GPU without an FP8 rate is
    priced as BF16); 1.0 for a calibrated profile, whose rate is measured."""
    if not hw.generation:
        return 1.0
    key = "fp8" if dtype in ("fp8", "mxfp8") and hw.fp8_flops else "bf16"
    if (hw.generation, key) not in EFFICIENCY:
        raise ValueError(f"no compute efficiency for generation={hw.generation!r}, dtype={key!r}; "
                         f"known: {sorted(EFFICIENCY)}")
    return EFFICIENCY[(hw.generation, key)]


def rows_factor(rows: float) -> float:
    """g(M): a grouped GEMM's throughput at M rows per group over a large GEMM's (module doc)."""
    pts = GROUPED_GEMM_POINTS
    if rows <= pts[0][0]:
        return pts[0][1] * max(rows, 1.0) / pts[0][0]      # below 64 rows: the same time as 64
    if rows >= pts[-1][0]:
        return 1.0
    x = math.log2(rows)
    for (m0, g0), (m1, g1) in zip(pts, pts[1:]):
        if rows <= m1:
            return g0 + (g1 - g0) * (x - math.log2(m0)) / (math.log2(m1) - math.log2(m0))
    return 1.0


@dataclasses.dataclass(frozen=True)
class ComputeTime:
    """Seconds of one micro-batch's forward + backward on one rank, by term."""

    dense_gemm: float      # attention projections, dense FFNs, shared experts, router, output layer
    expert_gemm: float     # the routed experts' grouped GEMMs
    attention: float       # flash attention (scores and values)
    memory: float          # memory-bound passes (norms, residuals, permutes, SwiGLU, FP8 casts)
    recompute: float       # the forward work recomputation repeats
    forward: float         # of the terms above, the forward pass (the rest is the backward)
    rows_per_expert: float
    expert_rows_factor: float

    @property
    def total(self) -> float:
        return self.dense_gemm + self.expert_gemm + self.attention + self.memory + self.recompute

    @property
    def backward(self) -> float:
        return self.total - self.forward


def attention_keys(spec: MoESpec) -> tuple[float, float]:
    """Keys a token attends to on average, causal: (full-attention layers, sliding-window layers)."""
    s = (spec.seq_len or spec.tokens) / 2
    return s, min(float(spec.sliding_window or 0), s)


def _qk_v(spec: MoESpec) -> int:
    """H·(qk + v): the score and value dims of one layer's heads."""
    if spec.kv_lora_rank is not None:
        return spec.heads * (spec.qk_nope_dim + spec.qk_rope_dim + spec.v_head_dim)
    return 2 * spec.heads * spec.hd if spec.heads else 2 * spec.hidden


def _memory_bytes_forward(spec: MoESpec, layout: CostLayout, p: Params, rows: float) -> tuple[float, float]:
    """Bytes the forward's memory-bound passes move on this rank: (all of them, the SwiGLU of
    the routed experts alone)."""
    D, T, tp, b = spec.hidden, spec.tokens, layout.tp, (2 if spec.fp8 else spec.b)
    t_sp = T / tp if layout.sp else T
    F, Fs, Fd = spec.ffn, spec.fs * spec.shared_experts, spec.dense_ffn or spec.ffn
    act = 3 if spec.gated else 2                                       # SwiGLU: read 2F, write F
    per_block = 10 * D * t_sp * b                                      # 2 norms (2D) + 2 residual adds (3D)
    swiglu = rows * act * F * b
    moe = (rows * 2 * D + rows * D + T / tp * D) * b + swiglu + T / tp * act * Fs * b + t_sp * spec.experts * 12
    dense = T / tp * act * Fd * b
    casts = 0.0
    if spec.fp8:   # every FP8 GEMM input cast from BF16: read 2, write 1 byte per element
        attn_in = t_sp * D + T * _qk_v(spec) / 2 / tp
        casts = 3 * (spec.layers * attn_in + spec.moe_layers * (rows * (D + F) + T / tp * (D + Fs) * bool(Fs))
                     + spec.dense_layers * T / tp * (D + Fd))
    total = spec.layers * per_block + spec.moe_layers * moe + spec.dense_layers * dense + casts
    return total, spec.moe_layers * swiglu


def microbatch_compute(spec: MoESpec, layout: CostLayout, hw: Hardware, p: Params, r: Routes,
                       efficiency: float | None = None) -> ComputeTime:
    """One micro-batch's compute on this rank (the most loaded), term by term (module doc).
    ``efficiency`` replaces the generation's large-GEMM figure for every dtype."""
    D, T, tp = spec.hidden, spec.tokens, layout.tp
    dt = gemm_dtype(spec)
    eff_g = efficiency if efficiency is not None else gemm_efficiency(hw, dt)
    eff_b = efficiency if efficiency is not None else gemm_efficiency(hw, "bf16")
    rate_g = hw.peak(dt) * eff_g * rows_factor(T)                      # dense GEMMs: M = T rows
    rate_b = hw.flops * eff_b
    # rows one local expert processes: the rank's R rows (etp·R with expert TP) over its E/ep experts
    per_expert = r.max * layout.etp / max(1, spec.experts // layout.ep)
    g_e = rows_factor(per_expert)
    rate_e = hw.peak(dt) * eff_g * g_e
    lm_head = spec.vocab * D if spec.last_stage else 0
    mtp = spec.mtp_layers if spec.train_mtp and spec.last_stage else 0
    # an MTP module: a block with its MoE FFN, a 2D x D projection, and the shared output layer again
    mtp_dense = mtp * (p.attention + p.shared + 2 * D * D)
    dense_w = spec.layers * p.attention + spec.dense_layers * p.dense_ffn + spec.moe_layers * p.shared + mtp_dense
    t_router = T / tp if layout.sp else T
    moe_l = spec.moe_layers + mtp
    dense_fl = 6 * T * dense_w / tp
    bf16_fl = 6 * T * lm_head * (1 + mtp) / tp + 6 * t_router * moe_l * p.router
    expert_fl = 6 * r.max * moe_l * p.expert
    s_full, s_win = attention_keys(spec)
    full_layers = spec.layers - spec.sliding_layers + mtp
    attn_fwd = 2 * T * _qk_v(spec) / tp * (full_layers * s_full + spec.sliding_layers * s_win)
    attn_fl = attn_fwd * (1 + FLASH_BWD)
    dense_t = dense_fl / rate_g + bf16_fl / rate_b
    expert_t = expert_fl / rate_e
    attn_t = attn_fl / rate_b
    mem_f, swiglu_f = _memory_bytes_forward(spec, layout, p, r.max)
    mem_f *= 1 + mtp / max(1, spec.layers)
    bw = hw.memory_bandwidth or math.inf
    mem_t = 3 * mem_f / bw
    rec = _recompute_seconds(spec, layout, p, dense_t, expert_t, attn_fwd / rate_b, mem_f / bw, swiglu_f / bw,
                             bw, rate_g, rate_e, r)
    forward = dense_t / 3 + expert_t / 3 + attn_fwd / rate_b + mem_f / bw
    return ComputeTime(dense_t, expert_t, attn_t, mem_t, rec, forward, per_expert, g_e)


def _recompute_seconds(spec: MoESpec, layout: CostLayout, p: Params, dense_t: float, expert_t: float,
                       attn_fwd_t: float, mem_fwd_t: float, swiglu_t: float, bw: float, rate_g: float,
                       rate_e: float, r: Routes) -> float:
    """The forward work the backward repeats (module doc), in seconds per micro-batch."""
    if spec.recompute == "full":
        return dense_t / 3 + expert_t / 3 + attn_fwd_t + mem_fwd_t
    mods = spec.recomputed
    T, tp = spec.tokens, layout.tp
    out = 0.0
    if "core_attn" in mods:
        out += attn_fwd_t
    if "moe_act" in mods:
        out += swiglu_t
    if "layernorm" in mods:   # two norms per block, each reading and writing D per token
        t_sp = T / tp if layout.sp else T
        out += spec.layers * 4 * spec.hidden * t_sp * (2 if spec.fp8 else spec.b) / bw
    if "mla_up_proj" in mods and spec.kv_lora_rank is not None:
        H = spec.heads
        up = ((spec.q_lora_rank or 0) * H * (spec.qk_nope_dim + spec.qk_rope_dim)
              + spec.kv_lora_rank * H * (spec.qk_nope_dim + spec.v_head_dim))
        out += 2 * T * spec.layers * up / tp / rate_g
    if "mlp" in mods and spec.dense_layers:
        out += 2 * T * spec.dense_layers * p.dense_ffn / tp / rate_g
    if "moe" in mods:
        out += 2 * r.max * spec.moe_layers * p.expert / rate_e + 2 * T * spec.moe_layers * p.shared / tp / rate_g
    elif "shared_experts" in mods:
        out += 2 * T * spec.moe_layers * p.shared / tp / rate_g
    return out


def optimizer_seconds(layout: CostLayout, hw: Hardware, p: Params, grad_bytes: int, weight_bytes: int) -> float:
    """Adam's step on this rank's shard (module doc): HBM bytes over the HBM bandwidth."""
    if not hw.memory_bandwidth:
        return 0.0
    z = layout.zero
    shard = p.dense_rank / (layout.dp if z >= 1 else 1) + p.expert_rank / (layout.edp if z >= 1 else 1)
    nbytes = shard * (ADAM_STATE_BYTES + grad_bytes + weight_bytes) + p.rank * grad_bytes
    return nbytes / hw.memory_bandwidth

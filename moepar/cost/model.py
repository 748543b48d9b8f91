"""Model and layout specs (and the bytes each dtype puts on the wire), and the EP-aware
per-rank parameters and routes.

Legend (docs/moe.md, plus the model's own): D hidden, F expert ffn, Fs shared-expert ffn, E experts, K top-k, T tokens per
micro-batch at the MoE layer input of each TP group (replicated over its tp ranks; with
sequence parallelism each holds T/tp), n_l layers (moe_l MoE, dense_l dense), b bytes per activation element,
P_e = (3 if gated else 2)·D·F parameters of one expert, R rows (routes) one rank sends
per micro-batch and, balanced, its experts process (the busiest rank's).

Parameters are counted per rank: dense weights (attention, shared experts, embeddings)
are sliced by tp, router and norms replicated; experts: E/ep per rank, each sliced by etp.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from ..checks import int_at_least, positive_ints
from ..parallel.layout import Layout
from .collectives import Placement
from .schedules import check_pipeline

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "mxfp8": 1}
FP8_RECIPES = ("fp8", "mxfp8")   # per-tensor / 1x128-block scaled FP8, and Blackwell's 1x32 MXFP8
# Megatron-Core's selective-recompute modules (TransformerConfig.recompute_modules)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def _positive(**values) -> None:
    positive_ints(**values)


def _non_negative(**values) -> None:
    for name, v in values.items():
        int_at_least(name, v, 0)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """A transformer with an MoE FFN in every layer, and one micro-batch of ``tokens``."""

    hidden: int
    ffn: int
    experts: int
    topk: int
    tokens: int
    dtype: str = "bf16"
    capacity_factor: float | None = None   # None: dropless
    min_capacity: int = 4
    pad_to_capacity: bool = False
    shared_experts: int = 0
    shared_ffn: int | None = None          # default: ffn
    gated: bool = True                     # SwiGLU: 3 matrices per expert, else 2
    layers: int = 1
    heads: int | None = None               # None: 4·D² attention parameters (MHA)
    kv_heads: int | None = None
    vocab: int = 0                         # 0: no embeddings counted
    tie_embeddings: bool = False
    seq_len: int | None = None             # adds 12·n_l·seq·D attention-score FLOPs per token
    imbalance: float = 1.0                 # max/mean routes over EP ranks
    # -- expert replication (moepar.cost.replication): R extra slots per EP group, planned by
    # moepar.moe.replication.placement from per-expert loads (None: uniform); with either, the imbalance
    # is the plan's on each layout's ep, so ``imbalance`` must stay 1 --
    redundant_experts: int = 0
    expert_loads: tuple[float, ...] | None = None
    micro_batches: int = 1
    dedup: str = "auto"                    # one dispatch row per token and EP rank: auto | on | off
    dispatch_dtype: str | None = None      # dispatch all-to-alls' rows (default: fp8 for dtype fp8, else dtype)
    combine_dtype: str | None = None       # combine all-to-alls' rows (default: bf16 for dtype fp8, else dtype)
    combine_grad_dtype: str | None = None  # "fp8": the combine's gradient too (ExchangeConfig.combine_grad_dtype)
    # -- real architectures (moepar.cost.architectures reads them from a HF config.json) --
    dense_layers: int = 0                  # of ``layers``, blocks with a dense FFN (first-k dense, sparse step)
    dense_ffn: int | None = None           # their FFN width (default: ffn)
    head_dim: int | None = None            # default hidden / heads
    q_lora_rank: int | None = None         # MLA (DeepSeek-V2/V3): query down-projection rank (None: full q)
    kv_lora_rank: int | None = None        # MLA when set: the compressed KV rank
    qk_nope_dim: int = 0                   # MLA per-head q/k dims without and with RoPE, value dim
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    attn_bias: str = "none"                # none | qkv (Qwen2, GLM-4.5) | all (q, k, v and output: gpt-oss)
    qk_norm: str = "none"                  # none | head (RMSNorm over head_dim: Qwen3) | full (over H·hd: OLMoE)
    attn_sinks: bool = False               # one learned logit per head (gpt-oss)
    norm_bias: bool = False                # LayerNorm (weight + bias) instead of RMSNorm
    router_bias: bool = False              # E router biases (gpt-oss; DeepSeek-V3's score-correction bias)
    expert_bias: bool = False              # expert FFN biases (gpt-oss)
    mlp_bias: bool = False                 # dense FFN biases
    shared_gate: bool = False              # Qwen2-MoE: a D -> 1 sigmoid gate on the shared expert
    pos_embeddings: int = 0                # learned position table rows (GPT-2 style)
    mtp_layers: int = 0                    # multi-token-prediction modules (counted apart from total)
    train_mtp: bool = False                # the MTP modules train too: their compute and memory on the last stage
    sliding_window: int | None = None      # keys a token attends to in the sliding-window layers (gpt-oss: 128)
    sliding_layers: int = 0                # of ``layers``, those with sliding-window attention
    # -- what a training run does beyond the model: activation recomputation (Megatron's names:
    # none, selective with ``recompute_modules``, full) and node-limited routing (DeepSeek-V3:
    # each token's experts on at most this many nodes) --
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ()
    max_nodes_per_token: int | None = None
    # -- collectives of a training step beyond the blocks (the run report counts them) --
    qkv_linears: int = 1                   # column-parallel input linears of attention (fused QKV: 1)
    aux_loss: bool = True                  # the router's load-balancing statistics (moepar.MoE's defaults)
    z_loss: bool = False
    aux_scope: str = "local"               # local | global (over data parallelism, moepar.MoE's option)
    clip_grad: bool = False                # the global gradient norm: a scalar per group
    loss_allreduce: bool = False           # the step's loss averaged over dp (logging)
    # -- pipeline stages (moepar.cost.pipeline): which blocks are MoE, which ends a stage holds --
    moe_layer_ids: tuple[int, ...] | None = None   # the MoE blocks' indices (None: the dense ones first)
    first_stage: bool = True               # holds the input embedding (and position table)
    last_stage: bool = True                # holds the final norm, the output layer and the loss

    def __post_init__(self) -> None:
        _positive(hidden=self.hidden, ffn=self.ffn, experts=self.experts, topk=self.topk,
                  tokens=self.tokens, layers=self.layers,
                  heads=self.heads, kv_heads=self.kv_heads, micro_batches=self.micro_batches,
                  shared_ffn=self.shared_ffn, seq_len=self.seq_len)
        # min_capacity 0 means no minimum (the layer's rule, TopKRouter)
        _non_negative(min_capacity=self.min_capacity, shared_experts=self.shared_experts, vocab=self.vocab)
        if self.topk > self.experts:
            raise ValueError(f"topk={self.topk} must be <= experts={self.experts}")
        for name in ("dtype", "dispatch_dtype", "combine_dtype"):
            v = getattr(self, name)
            if (v is not None or name == "dtype") and v not in DTYPE_BYTES:
                raise ValueError(f"{name}={v!r} is not known; valid: {', '.join(DTYPE_BYTES)}")
        if self.combine_grad_dtype not in (None, "fp8"):
            raise ValueError(f"combine_grad_dtype={self.combine_grad_dtype!r} must be None or 'fp8' "
                             f"(the layer's combine_grad_dtype options)")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0 (or None: dropless)")
        if not self.imbalance >= 1.0:
            raise ValueError(f"imbalance={self.imbalance} must be >= 1 (max/mean tokens per rank)")
        _non_negative(redundant_experts=self.redundant_experts)
        if self.expert_loads is not None:
            object.__setattr__(self, "expert_loads", tuple(float(x) for x in self.expert_loads))
            loads = self.expert_loads
            if len(loads) != self.experts or not all(math.isfinite(x) and x >= 0 for x in loads) or not sum(loads) > 0:
                raise ValueError(f"expert_loads has {len(loads)} values; it needs experts={self.experts} finite "
                                 f"numbers >= 0 with a positive sum (one load per expert)")
        if self.imbalance != 1.0 and (self.expert_loads is not None or self.redundant_experts):
            what = ("expert_loads" if self.expert_loads is not None
                    else f"redundant_experts={self.redundant_experts} (which needs per-expert loads)")
            raise ValueError(f"imbalance={self.imbalance} cannot be combined with {what}: imbalance is max/mean "
                             f"routes per EP rank and does not say which experts are hot; give the per-expert "
                             f"loads instead (--routing-counts or --zipf), the imbalance follows from them")
        if self.dedup not in ("auto", "on", "off"):
            raise ValueError(f"dedup={self.dedup!r} must be one of auto, on, off")
        _positive(head_dim=self.head_dim, dense_ffn=self.dense_ffn, q_lora_rank=self.q_lora_rank,
                  kv_lora_rank=self.kv_lora_rank, qkv_linears=self.qkv_linears, sliding_window=self.sliding_window,
                  max_nodes_per_token=self.max_nodes_per_token)
        _non_negative(sliding_layers=self.sliding_layers)
        if self.sliding_layers > self.layers or (self.sliding_layers and self.sliding_window is None):
            raise ValueError(f"sliding_layers={self.sliding_layers} must be <= layers={self.layers} and needs "
                             f"sliding_window (given {self.sliding_window})")
        object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute={self.recompute!r} must be one of none, selective, full")
        bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if bad or (self.recompute_modules and self.recompute != "selective"):
            raise ValueError(f"recompute_modules={self.recompute_modules}: "
                             + (f"{', '.join(bad)} not among {', '.join(RECOMPUTE_MODULES)}" if bad
                                else f"modules are for recompute='selective', not {self.recompute!r}"))
        _non_negative(dense_layers=self.dense_layers, qk_nope_dim=self.qk_nope_dim, qk_rope_dim=self.qk_rope_dim,
                      v_head_dim=self.v_head_dim, pos_embeddings=self.pos_embeddings, mtp_layers=self.mtp_layers)
        for name, value, valid in (("attn_bias", self.attn_bias, ("none", "qkv", "all")),
                                   ("qk_norm", self.qk_norm, ("none", "head", "full")),
                                   ("aux_scope", self.aux_scope, ("local", "global"))):
            if value not in valid:
                raise ValueError(f"{name}={value!r} must be one of {', '.join(valid)}")
        if self.dense_layers > self.layers:
            raise ValueError(f"dense_layers={self.dense_layers} must be <= layers={self.layers}")
        if self.kv_lora_rank is not None and (self.heads is None or not self.qk_nope_dim + self.qk_rope_dim
                                              or not self.v_head_dim):
            raise ValueError("MLA (kv_lora_rank set) needs heads, qk_nope_dim + qk_rope_dim > 0 and v_head_dim > 0")
        if (self.heads is not None and self.head_dim is None and self.kv_lora_rank is None
                and self.hidden % self.heads):
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads} (or give head_dim)")
        if self.kv_heads is not None and (self.heads is None or self.heads % self.kv_heads):
            raise ValueError(f"heads={self.heads} must be given and divisible by kv_heads={self.kv_heads}")
        ids = self.moe_layer_ids
        if ids is not None and (len(set(ids)) != self.moe_layers or not all(0 <= i < self.layers for i in ids)):
            raise ValueError(f"moe_layer_ids={ids} must name {self.moe_layers} distinct blocks in "
                             f"0..{self.layers - 1} (layers={self.layers} minus dense_layers={self.dense_layers})")

    def is_moe(self, layer: int) -> bool:
        """Block ``layer`` has an MoE FFN (``moe_layer_ids``, or every block after the dense ones)."""
        if self.moe_layer_ids is not None:
            return layer in self.moe_layer_ids
        return layer >= self.dense_layers

    @property
    def b(self) -> int:
        """Bytes per activation (and weight) element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def fp8(self) -> bool:
        """An FP8 recipe (fp8 or mxfp8): FP8 GEMMs, dispatch rows and cached linear inputs."""
        return self.dtype in FP8_RECIPES

    @property
    def recomputed(self) -> frozenset[str]:
        """The modules recomputed in the backward (Megatron's names; "full": every layer)."""
        if self.recompute == "selective":
            return frozenset(self.recompute_modules or ("core_attn",))   # Megatron's default module
        return frozenset()

    @property
    def fs(self) -> int:
        return self.ffn if self.shared_ffn is None else self.shared_ffn

    @property
    def mats(self) -> int:
        return 3 if self.gated else 2

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def hd(self) -> int:   # head dim of q, k and v (not MLA)
        return self.head_dim or self.hidden // (self.heads or 1)

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    def replace(self, **changes) -> "MoESpec":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class WireBytes:
    """Bytes per element: activations (TP collectives), dispatch rows, combine rows, and
    weights/gradients."""

    act: int
    dispatch: int
    combine: int
    param: int


def wire_bytes(spec: MoESpec) -> WireBytes:
    """``--dtype fp8`` (or mxfp8): FP8 dispatch, BF16 combine, activations, weights and gradients
    (DeepSeek-V3 sec. 3.3, Megatron's FP8 recipe); other dtypes: that dtype everywhere.
    ``dispatch_dtype`` / ``combine_dtype`` override the all-to-all rows."""
    base = DTYPE_BYTES["bf16"] if spec.fp8 else spec.b
    dispatch = DTYPE_BYTES[spec.dispatch_dtype] if spec.dispatch_dtype else spec.b
    combine = DTYPE_BYTES[spec.combine_dtype] if spec.combine_dtype else base
    return WireBytes(base, dispatch, combine, base)


@dataclasses.dataclass(frozen=True)
class CostLayout:
    """How ``gpus`` ranks are used: ``pp`` pipeline stages of consecutive ranks (the pipeline
    outermost, Megatron's order), each stage tp x dp for dense layers and etp x ep x edp for
    experts; ``vp`` stages per rank and the torch ``schedule`` that runs them."""

    gpus: int
    gpus_per_node: int = 8
    tp: int = 1
    ep: int = 1
    etp: int = 1
    sp: bool = False
    zero: int = 0
    pp: int = 1
    vp: int = 1
    schedule: str = "1f1b"
    a2a_overlap: bool = False   # MoE all-to-alls behind another micro-batch's compute (moepar.cost.step)

    def __post_init__(self) -> None:
        _positive(gpus=self.gpus, gpus_per_node=self.gpus_per_node, tp=self.tp, ep=self.ep, etp=self.etp,
                  pp=self.pp, vp=self.vp)
        check_pipeline(self.pp, self.vp, self.schedule)
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero} is not a ZeRO stage; valid: 0, 1, 2, 3")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            part = [d for d in divisors(self.gpus) if d < self.gpus_per_node][-3:][::-1]
            raise ValueError(f"gpus={self.gpus} is not a whole number of nodes of "
                             f"gpus_per_node={self.gpus_per_node}; a node (an NVLink domain) can be used in "
                             f"part: gpus_per_node {', '.join(map(str, part))} would fit")
        if self.gpus % self.pp:
            raise ValueError(f"gpus={self.gpus} is not divisible by pp={self.pp}: every pipeline stage needs "
                             f"the same number of GPUs; valid pp: {', '.join(map(str, divisors(self.gpus)))}")
        n, where = self.gpus // self.pp, ("gpus" if self.pp == 1 else "stage_size (gpus / pp)")
        if n % self.tp:
            raise ValueError(f"{where}={n} is not divisible by tp={self.tp}; "
                             f"valid tp: {', '.join(map(str, divisors(n)))}")
        if n % (self.ep * self.etp):
            valid = [d for d in divisors(n // self.etp) if n % (d * self.etp) == 0]
            hint = (f"valid ep with etp={self.etp}: {', '.join(map(str, valid))}" if n % self.etp == 0
                    else f"etp={self.etp} itself does not divide {where}; valid etp: "
                         f"{', '.join(map(str, divisors(n)))}")
            raise ValueError(f"{where}={n} is not divisible by ep x etp = {self.ep} x {self.etp}; {hint}")

    @property
    def ranks(self) -> Layout:
        """The rank arithmetic of the parallel state itself (``moepar.parallel.layout``),
        built after the checks above so that their messages speak of GPUs."""
        return _layout(self.gpus, self.tp, self.ep, self.etp, self.pp)

    # GPUs of one pipeline stage (all of them when pp = 1), and the data-parallel sizes.
    stage_size = property(lambda self: self.ranks.stage_size)
    dp = property(lambda self: self.ranks.dp)
    edp = property(lambda self: self.ranks.edp)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    def size(self, kind: str) -> int:
        """Ranks of a group of this kind; "world" is the ranks sharing a stage's layers (one
        pipeline stage: every group but the pipeline's lies inside one)."""
        return {"tp": self.tp, "dp": self.dp, "ep": self.ep, "etp": self.etp, "edp": self.edp,
                "moe": math.lcm(self.tp, self.ep * self.etp), "world": self.stage_size, "pp": self.pp}[kind]

    def placement(self, kind: str) -> Placement:
        """Where the first group of this kind sits (``moepar.parallel.layout`` rank order)."""
        if self.size(kind) == 1:
            return Placement(1, 1)
        return _placement(self.gpus, self.gpus_per_node, self.tp, self.ep, self.etp, self.pp, kind)

    def warnings(self) -> list[str]:
        out = []
        for kind in ("tp", "etp"):
            if self.size(kind) > self.gpus_per_node:
                out.append(f"{kind}={self.size(kind)} > gpus_per_node={self.gpus_per_node}: its "
                           f"collectives (every layer, forward and backward) cross the inter-node link")
        return out

    def describe(self) -> str:
        pipe = "" if self.pp == 1 else f" | pp={self.pp} {self.schedule}" + (f" vp={self.vp}" if self.vp > 1 else "")
        pipe += " | a2a overlap" if self.a2a_overlap else ""
        return (f"{self.gpus} GPUs ({self.nodes} node(s) x {min(self.gpus, self.gpus_per_node)}): "
                f"tp={self.tp} dp={self.dp} | ep={self.ep} etp={self.etp} edp={self.edp} | "
                f"sp={'on' if self.sp else 'off'} zero={self.zero}{pipe}")


@functools.lru_cache(maxsize=4096)
def _layout(gpus: int, tp: int, ep: int, etp: int, pp: int) -> Layout:
    return Layout(gpus, tp, ep, etp, pp)


@functools.lru_cache(maxsize=4096)
def _placement(gpus: int, gpus_per_node: int, tp: int, ep: int, etp: int, pp: int, kind: str) -> Placement:
    if kind == "world":
        return Placement.contiguous(gpus // pp, gpus_per_node)
    ranks = _layout(gpus, tp, ep, etp, pp).all_groups()[kind][0]
    return Placement.of_ranks(ranks, gpus_per_node)


def check_fits(spec: MoESpec, layout: CostLayout) -> None:
    """Raise one ValueError listing every size that does not divide, with the valid values."""
    problems = []

    def need(value: int, name: str, by: int, byname: str) -> None:
        if value % by:
            valid = [d for d in divisors(value) if layout.gpus % d == 0]
            problems.append(f"{name}={value} is not divisible by {byname}={by} "
                            f"(valid {byname}: {', '.join(map(str, valid))})")

    need(spec.experts, "experts", layout.ep, "ep")
    need(spec.ffn, "ffn", layout.etp, "etp")
    need(spec.hidden, "hidden", layout.tp, "tp")
    need(spec.tokens, "tokens", layout.tp, "tp")
    if spec.heads is not None:
        need(spec.heads, "heads", layout.tp, "tp")
        if spec.kv_lora_rank is None:
            need(spec.kv_heads or spec.heads, "kv_heads", layout.tp, "tp")
    if spec.dense_layers:
        need(spec.dense_ffn or spec.ffn, "dense_ffn", layout.tp, "tp")
    if spec.shared_experts:
        need(spec.fs, "shared_ffn", layout.tp, "tp")
    if problems:
        raise ValueError(f"layout {layout.describe()} does not fit the model: " + "; ".join(problems))


# ---- parameters -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Params:
    """Parameter counts: per layer pieces, whole model, and this rank's share.

    ``total`` and ``active`` cover the main model, input and output embeddings included
    (as the Mixtral, Qwen and DeepSeek cards count), not the MTP modules (``mtp``).
    ``active``: the parameters one token's forward uses: every non-expert parameter, the
    shared experts and K routed experts per MoE layer, the whole embedding tables."""

    attention: int       # per layer (norms of MLA's low-rank paths and q/k norms included)
    router: int          # per MoE layer (and its bias)
    norms: int           # per layer: the two pre-norms
    expert: int          # one expert
    shared: int          # all shared experts of an MoE layer (and Qwen2's shared gate)
    embeddings: int      # input + output (once if tied) + position table
    final_norm: int
    total: int
    active: int
    dense_rank: int
    expert_rank: int
    dense_ffn: int = 0   # the FFN of one dense layer
    input_embedding: int = 0
    mtp: int = 0         # multi-token-prediction modules (embeddings and head shared)

    @property
    def rank(self) -> int:
        return self.dense_rank + self.expert_rank

    @property
    def active_without_input_embedding(self) -> int:   # as DeepSeek's and OpenAI's cards count
        return self.active - self.input_embedding


def _attention_params(spec: MoESpec) -> tuple[int, int]:
    """(parameters of one attention block, those of them replicated over TP)."""
    D, H = spec.hidden, spec.heads
    if H is None:
        return 4 * D * D, 0
    if spec.kv_lora_rank is not None:   # MLA: low-rank q (optional) and joint kv compression
        qk, r, c = spec.qk_nope_dim + spec.qk_rope_dim, spec.q_lora_rank, spec.kv_lora_rank
        q = D * H * qk if r is None else D * r + r + r * H * qk       # (down, its norm, up)
        kv = D * (c + spec.qk_rope_dim) + c + c * H * (spec.qk_nope_dim + spec.v_head_dim)
        return q + kv + H * spec.v_head_dim * D, 0
    hd, kv_heads = spec.hd, spec.kv_heads or H
    q, kv = H * hd, kv_heads * hd
    n = 2 * D * q + 2 * D * kv                                        # q, o: D x H·hd; k, v: D x Hkv·hd
    replicated = 0
    if spec.attn_bias != "none":
        n += q + 2 * kv
    if spec.attn_bias == "all":
        n += D
        replicated += D                                               # row-parallel output bias
    if spec.qk_norm == "head":
        n += 2 * hd
        replicated += 2 * hd
    elif spec.qk_norm == "full":
        n += q + kv
    return n + (H if spec.attn_sinks else 0), replicated


def count_params(spec: MoESpec, layout: CostLayout) -> Params:
    D, n_l, moe_l, dense_l, tp = spec.hidden, spec.layers, spec.moe_layers, spec.dense_layers, layout.tp
    attention, attn_replicated = _attention_params(spec)
    router = D * spec.experts + (spec.experts if spec.router_bias else 0)
    norm = D * (2 if spec.norm_bias else 1)
    norms = 2 * norm
    up = (2 if spec.gated else 1)                                     # column-parallel outputs per F
    expert = spec.mats * D * spec.ffn + ((up * spec.ffn + D) if spec.expert_bias else 0)
    gate = D if spec.shared_gate else 0
    shared = spec.shared_experts * spec.mats * D * spec.fs + gate
    Fd = spec.dense_ffn or spec.ffn
    dense_ffn = spec.mats * D * Fd + ((up * Fd + D) if spec.mlp_bias else 0)
    dense_ffn_rank = (dense_ffn - D * spec.mlp_bias) // tp + D * spec.mlp_bias   # row bias replicated
    # A pipeline stage holds the input table (and positions) if first, the output layer if
    # last; tied tables are one tensor only where one stage holds both ends.
    input_embedding = spec.vocab * D if spec.first_stage else 0
    pos = spec.pos_embeddings * D if spec.first_stage else 0
    output = spec.vocab * D if spec.last_stage and not (spec.tie_embeddings and spec.first_stage) else 0
    embeddings = input_embedding + output + pos
    final_norm = norm if spec.vocab and spec.last_stage else 0
    blocks = n_l * (attention + norms) + dense_l * dense_ffn
    total = blocks + moe_l * (router + shared + spec.experts * expert) + embeddings + final_norm
    active = blocks + moe_l * (router + shared + spec.topk * expert) + embeddings + final_norm
    # MTP module (DeepSeek-V3): two norms, a 2D x D projection, one MoE block, the head's norm
    mtp = spec.mtp_layers * (3 * norm + 2 * D * D + attention + norms + router + shared + spec.experts * expert)
    attention_rank = (attention - attn_replicated) // tp + attn_replicated
    dense_rank = (n_l * (attention_rank + norms) + dense_l * dense_ffn_rank
                  + moe_l * (router + (shared - gate) // tp + gate)
                  + (embeddings - pos) // tp + pos + final_norm)
    expert_rank = moe_l * (spec.experts // layout.ep) * (expert // layout.etp)
    return Params(attention, router, norms, expert, shared, embeddings, final_norm, total, active,
                  dense_rank, expert_rank, dense_ffn, input_embedding, mtp)

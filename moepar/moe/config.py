"""``MoEConfig`` and the groups it nests (``RouterConfig``, ``ExchangeConfig``, ``HFOptions``):
every option of the MoE layer, validated and documented in one place (the components read
them; nothing validates them again).

``MoE(hidden, num_experts, ep_size, config=None, **options)`` only fills these objects: each
keyword option is routed by name, to ``MoEConfig`` when it is one of its own fields, else to
the nested group that has it (``GROUPS``; the router options' meaning is in
``moepar.moe.routing.router.TopKRouter``), else it is refused with the list of valid names. A new
field of a group therefore works through ``MoE(...)`` with no edit here. A name the layer
and a group both have (``bias``: the experts' FFN biases here, the gate's in the router)
goes to the layer; set the router's through ``MoEConfig(router=RouterConfig(...))``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .. import checks
from .experts.activations import ACTIVATIONS
from .experts.function import GEMM_PATHS
from .exchange.guard import check_receive_capacity_factor
from moepar_kernels import routing as _rk

SCORE_FUNCS = ("softmax", "softmax_after_topk", "sigmoid")
NOISY_GATE_POLICIES = (None, "jitter", "rsample")
DROP_POLICIES = ("probs", "position")
AUX_LOSSES = (None, "switch", "seq")
NONFINITE = ("raise", "propagate")
GROUP_SCORES = ("sum_topn", "max")
AUX_LOSS_CONVENTIONS = ("moepar", "hf")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Every router option, validated once (see ``TopKRouter`` for their meaning)."""
    hidden: int
    num_experts: int
    k: int = 2
    score_func: str = "softmax"
    normalize_weights: Optional[bool] = None
    scaling_factor: float = 1.0
    bias: bool = False
    expert_bias: bool = False
    num_groups: Optional[int] = None
    topk_groups: Optional[int] = None
    group_score: str = "sum_topn"
    group_score_topn: Optional[int] = None
    noisy_gate_policy: Optional[str] = None
    noise_eps: float = 1e-2
    capacity_factor: Optional[float] = None
    eval_capacity_factor: Optional[float] = None
    min_capacity: int = 4
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    expert_capacity: Optional[int] = None
    aux_loss: Optional[str] = "switch"
    aux_loss_coeff: float = 1e-2
    aux_loss_convention: str = "moepar"
    seq_len: Optional[int] = None
    z_loss_coeff: float = 0.0
    nonfinite: str = "raise"
    use_kernel: Optional[bool] = None
    init_seed: Optional[int] = None
    init_std: Optional[float] = None

    def __post_init__(self) -> None:
        checks.positive_int("hidden", self.hidden)
        checks.positive_int("num_experts", self.num_experts)
        E, k = self.num_experts, self.k
        checks.int_at_least("k", k, 1)
        if k > E:
            raise ValueError(f"k={k} must be <= num_experts={E}")
        checks.one_of("score_func", self.score_func, SCORE_FUNCS)
        checks.one_of("normalize_weights", self.normalize_weights, (None, True, False))
        checks.finite("scaling_factor", self.scaling_factor, above=0)
        if (self.num_groups is None) != (self.topk_groups is None):
            raise ValueError(f"num_groups={self.num_groups} and topk_groups={self.topk_groups}: "
                             f"group-limited routing needs both (or neither)")
        if self.num_groups is not None:
            checks.positive_int("num_groups", self.num_groups)
            checks.positive_int("topk_groups", self.topk_groups)
            if E % self.num_groups:
                raise ValueError(f"num_experts={E} is not divisible by num_groups={self.num_groups}")
            if self.topk_groups > self.num_groups:
                raise ValueError(f"topk_groups={self.topk_groups} must be <= num_groups={self.num_groups}")
            reachable = self.topk_groups * (E // self.num_groups)
            if k > reachable:
                raise ValueError(f"k={k} must be <= topk_groups={self.topk_groups} x experts per group "
                                 f"{E // self.num_groups} = {reachable}")
        checks.one_of("group_score", self.group_score, GROUP_SCORES)
        if self.group_score_topn is not None:
            checks.positive_int("group_score_topn", self.group_score_topn)
            if self.group_score == "max":
                raise ValueError(f"group_score_topn={self.group_score_topn} goes with group_score='sum_topn'; "
                                 f"group_score='max' scores a group by its largest affinity")
            if self.num_groups is not None and self.group_score_topn > E // self.num_groups:
                raise ValueError(f"group_score_topn={self.group_score_topn} must be <= experts per group "
                                 f"{E // self.num_groups} (num_experts={E} / num_groups={self.num_groups})")
        checks.one_of("noisy_gate_policy", self.noisy_gate_policy, NOISY_GATE_POLICIES)
        if not (isinstance(self.noise_eps, (int, float)) and 0 < self.noise_eps < 1):
            raise ValueError(f"noise_eps={self.noise_eps!r} must be in (0, 1)")
        for name in ("capacity_factor", "eval_capacity_factor"):
            if getattr(self, name) is not None:
                checks.finite(name, getattr(self, name), above=0)
        checks.int_at_least("min_capacity", self.min_capacity, 0)
        checks.one_of("drop_policy", self.drop_policy, DROP_POLICIES)
        if self.expert_capacity is not None:
            checks.positive_int("expert_capacity", self.expert_capacity)
            if self.capacity_factor is not None or self.eval_capacity_factor is not None:
                raise ValueError(f"expert_capacity={self.expert_capacity} (absolute slots) and capacity_factor="
                                 f"{self.capacity_factor} / eval_capacity_factor={self.eval_capacity_factor} "
                                 f"(relative) are exclusive: set one")
            if self.seq_len is not None:
                checks.positive_int("seq_len", self.seq_len)
        if (self.pad_to_capacity and self.capacity_factor is None and self.eval_capacity_factor is None
                and self.expert_capacity is None):
            raise ValueError("pad_to_capacity=True needs a capacity_factor (or eval_capacity_factor, or "
                             "expert_capacity): dropless routing has no capacity to pad to")
        checks.one_of("aux_loss", self.aux_loss, AUX_LOSSES)
        checks.finite("aux_loss_coeff", self.aux_loss_coeff, at_least=0)
        checks.one_of("aux_loss_convention", self.aux_loss_convention, AUX_LOSS_CONVENTIONS)
        checks.finite("z_loss_coeff", self.z_loss_coeff, at_least=0)
        if self.aux_loss == "seq":
            if self.seq_len is None:
                raise ValueError("aux_loss='seq' needs seq_len (tokens per sequence on this rank)")
            checks.positive_int("seq_len", self.seq_len)
        checks.one_of("nonfinite", self.nonfinite, NONFINITE)
        checks.one_of("use_kernel", self.use_kernel, (None, True, False))
        if self.use_kernel is True:
            reason = self.kernel_gap()
            if reason:
                raise ValueError(f"use_kernel=True but the routing kernel does not cover {reason}")
        if self.init_seed is not None and not checks.is_int(self.init_seed):
            raise ValueError(f"init_seed={self.init_seed!r} must be an integer or None")
        if self.init_std is not None:
            checks.finite("init_std", self.init_std, above=0)

    def kernel_gap(self, training: bool = True) -> str:
        """Why the Triton kernel cannot serve this config ("" when it can); rsample noise
        only matters in training."""
        if _rk.triton is None:
            return "this machine (triton is not installed)"
        if self.num_groups is not None:
            return f"group-limited routing (num_groups={self.num_groups})"
        if self.noisy_gate_policy == "rsample" and training:
            return "noisy_gate_policy='rsample'"
        if self.num_experts > _rk.MAX_EXPERTS:
            return f"num_experts={self.num_experts} > {_rk.MAX_EXPERTS}"
        if self.k > _rk.MAX_K:
            return f"k={self.k} > {_rk.MAX_K}"
        return ""

    def sequences(self, num_tokens: int) -> int:
        """Sequences of ``seq_len`` among ``num_tokens`` (1 without seq_len); ValueError if
        the tokens are not a whole number of sequences."""
        if self.seq_len is None:
            return 1
        if num_tokens % self.seq_len:
            raise ValueError(f"{num_tokens} tokens are not a whole number of sequences of seq_len={self.seq_len}")
        return num_tokens // self.seq_len


DEDUP_MODES = ("off", "auto", "on")   # in this order: the counts row's codes 0, 1, 2 (dispatcher)
WIRE_DTYPES = (None, "fp8")
AUX_LOSS_SCOPES = ("local", "global")
# Old keyword names that still work: name -> field.
ALIASES = {"use_kernels": "use_kernel"}
# RouterConfig fields that the MoE layer sets itself (from its own fields of the same name).
_ROUTER_OWNED = ("hidden", "num_experts", "init_seed", "init_std")


@dataclasses.dataclass(frozen=True)
class ExchangeConfig:
    """How routes travel between ranks, and what the exchange does about load imbalance
    (``MoEConfig.exchange``; the dispatcher's options).

    dedup: "off" | "auto" | "on": one token row per destination EP rank instead of one per
        route (``moepar.moe.exchange.dedup``); "auto" uses it when the EP group's rows are at most
        ``DEDUP_MAX_FRACTION`` of its routes (measured there).
    cpu_source_major: opt-in, for CPU training over gloo: leave the received token rows
        source-major instead of regrouping them by expert (``moepar.moe.cpu``; the EP group
        uses it only if every rank allows it). No effect on CUDA tensors.
    check_finite: refuse non-finite inputs: every rank of the layer's block raises (the count
        of non-finite values travels in the counts exchange; a layer with no exchange, one
        rank or padded capacity mode, reads it back on its own: one host read).
    overlap_shared_experts: compute the shared experts while the dispatch all-to-all is in
        flight (False: after the combine; the same numbers either way).
    dispatch_dtype: None (the rows cross the dispatch all-to-all in the compute dtype) or
        "fp8": float8_e4m3fn with one fp32 scale per 128 channels, dequantized on arrival;
        the combine and the backward stay in the compute dtype (``moepar.moe.exchange.fp8``).
    combine_grad_dtype: None (the backward's gradient of the combined rows goes back to the
        experts' ranks in the compute dtype) or "fp8": quantized as the dispatch's rows are,
        as DeepSeek-V3 does for the gradient entering the down-projection's backward.
    receive_capacity_factor: None (no guard) or a finite f >= 1: no EP rank processes more
        than cap = ceil(f x mean) received rows, mean = the EP group's routes / ep. An
        over-full rank's cap is shared over its (sender, local expert) cells in proportion to
        their routes (largest remainder, ties to the lower sender, then expert), and each
        sender drops, per cell, its lowest-weight routes past the share (ties: the later in
        slot-major order). Every rank computes the same quotas from the counts exchange (no
        extra collective); the dropped routes weigh 0 and are counted in ``moe.stats``
        (``moepar.moe.exchange.guard``). Dropless mode only; dedup is used only in steps where the
        guard cuts nothing.
    redundant_experts: R extra expert slots per EP group (default 0), R/ep per rank, holding
        copies of the hottest experts (``moepar.moe.replication.replicas``): the routes to a replicated
        expert are split among its copies as the placement planned, the copies' weights come
        from the expert's owner each forward and their gradients go back to it, so the layer
        computes what the unreplicated one does. The slot map starts uniform;
        ``moepar.rebalance(model)`` re-plans it from the measured load. R must be divisible
        by ep and at most E x (ep - 1) (one copy of an expert per rank); dropless mode only.
    """

    dedup: str = "auto"
    cpu_source_major: bool = False
    check_finite: bool = False
    overlap_shared_experts: bool = True
    dispatch_dtype: Optional[str] = None
    combine_grad_dtype: Optional[str] = None
    receive_capacity_factor: Optional[float] = None
    redundant_experts: int = 0

    def __post_init__(self) -> None:
        checks.one_of("dedup", self.dedup, DEDUP_MODES)
        checks.one_of("dispatch_dtype", self.dispatch_dtype, WIRE_DTYPES)
        checks.one_of("combine_grad_dtype", self.combine_grad_dtype, WIRE_DTYPES)
        for name in ("cpu_source_major", "check_finite", "overlap_shared_experts"):
            checks.boolean(name, getattr(self, name))
        check_receive_capacity_factor(self.receive_capacity_factor)
        checks.int_at_least("redundant_experts", self.redundant_experts, 0)


@dataclasses.dataclass(frozen=True)
class HFOptions:
    """Options that Hugging Face MoE families need (``MoEConfig.hf``; ``moepar.hf``, docs/hf.md).

    shared_expert_gate: Qwen2-MoE's gate: the shared experts' output scaled per token by
        sigmoid(x . w_gate), w_gate [1, D] at ``moe.shared.gate.weight``; needs
        num_shared_experts >= 1.
    router_bias: a trainable bias on the router's logits (``RouterConfig.bias``, which the
        keyword ``bias`` cannot reach: that one is the experts'); either turns it on.
    score_before_experts: Llama 4: each route's input row is scaled by its routing weight
        before the expert FFN and the outputs are summed with weight 1,
        y_t = sum_k expert_k(w_tk * x_t); the weights still get their gradient through the
        scaling. Every route then travels as its own row ([T*K, D] scaled rows; no dedup
        gain; without sequence parallelism the TP all-gathers of the outputs and of dX carry
        T*K rows instead of T).
    activation_limit, activation_alpha: "clamped_swiglu" (GPT-OSS):
        a = (clamp(h3, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(h1, max=limit),
        h1 = x w1 + b1 (gate), h3 = x w3 + b3 (up); finite numbers > 0. Routed experts only:
        shared experts take every other activation.
    """

    shared_expert_gate: bool = False
    router_bias: bool = False
    score_before_experts: bool = False
    activation_limit: float = 7.0
    activation_alpha: float = 1.702

    def __post_init__(self) -> None:
        for name in ("shared_expert_gate", "router_bias", "score_before_experts"):
            checks.boolean(name, getattr(self, name))
        for name in ("activation_limit", "activation_alpha"):
            checks.finite(name, getattr(self, name), above=0)


# MoEConfig's nested groups: field name -> its config class (the keyword options' routing).
GROUPS = {"router": RouterConfig, "exchange": ExchangeConfig, "hf": HFOptions}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Options of one MoE layer (frozen; build a changed copy with ``dataclasses.replace``),
    in groups: the layer's own fields below, then ``router`` (``RouterConfig``: k,
    score_func, capacity_factor, aux_loss, ...; its ``hidden``/``num_experts``/``init_seed``/
    ``init_std`` are the layer's), ``exchange`` (``ExchangeConfig``: dedup, FP8 rows,
    receive guard, redundant experts, ...) and ``hf`` (``HFOptions``: the Hugging Face
    families' variants). Each group validates its own fields; this class the rules that
    span groups.

    Layer shape and layout:
        hidden, num_experts: D and E. ep_size: expert-parallel group size (must match the
        parallel state). expert_tensor_parallel_size: each expert's FFN sliced over this
        many ranks (must match the parallel state).
        ffn_hidden: the experts' F (default 4 * hidden). activation: "gelu" | "swiglu" |
        "relu" | "clamped_swiglu", or one of transformers' elementwise functions by name,
        plain ("gelu_new", "quick_gelu", ...) or gated as "glu_<name>" (``ACTIVATIONS``,
        ``moepar.moe.experts.activations``). bias: biases in the expert FFNs.
        num_shared_experts, shared_ffn_hidden: a dense FFN every token passes through
        (width shared_ffn_hidden, default ffn_hidden * num_shared_experts), TP-sliced.
        sequence_parallel: x holds this TP rank's own slice of the tokens (otherwise x is
        replicated over the TP group and each TP rank dispatches a 1/tp share).
    Losses:
        aux_loss_scope: "local" (statistics over this replica's batch, DeepSpeed's) or
        "global" (over the whole global batch across data parallelism).
    Computation:
        gemm_path: "auto" | "grouped_mm" | "loop" | "bmm" (``moepar.moe.experts.function``).
        recompute_experts: recompute the expert FFNs in backward.
        dtype: expert parameter dtype (default: torch's default dtype).
        init_seed, init_std: weight init (seed drawn from the default RNG when None, the
        same on every rank since init_parallel seeds it alike; also the router's).
    """

    hidden: int
    num_experts: int
    ep_size: int = 1
    router: Optional[RouterConfig] = None
    exchange: ExchangeConfig = dataclasses.field(default_factory=ExchangeConfig)
    hf: HFOptions = dataclasses.field(default_factory=HFOptions)
    ffn_hidden: Optional[int] = None
    activation: str = "gelu"
    bias: bool = False
    num_shared_experts: int = 0
    shared_ffn_hidden: Optional[int] = None
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    aux_loss_scope: str = "local"
    gemm_path: str = "auto"
    recompute_experts: bool = False
    dtype: Optional[torch.dtype] = None
    init_seed: Optional[int] = None
    init_std: Optional[float] = None

    def __post_init__(self) -> None:
        for name, lo in (("hidden", 1), ("num_experts", 1), ("ep_size", 1), ("expert_tensor_parallel_size", 1),
                         ("num_shared_experts", 0)):
            checks.int_at_least(name, getattr(self, name), lo)
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}")
        for name in ("ffn_hidden", "shared_ffn_hidden"):
            if getattr(self, name) is not None:
                checks.int_at_least(name, getattr(self, name), 1)
        if self.ffn % self.expert_tensor_parallel_size:
            raise ValueError(f"ffn_hidden={self.ffn} is not divisible by "
                             f"expert_tensor_parallel_size={self.expert_tensor_parallel_size}")
        for name, allowed in (("activation", ACTIVATIONS), ("aux_loss_scope", AUX_LOSS_SCOPES),
                              ("gemm_path", GEMM_PATHS)):
            checks.one_of(name, getattr(self, name), allowed)
        for name in ("bias", "sequence_parallel", "recompute_experts"):
            checks.boolean(name, getattr(self, name))
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"dtype={self.dtype!r} must be None or a floating-point torch.dtype")
        if self.init_std is not None and not (isinstance(self.init_std, (int, float)) and self.init_std > 0):
            raise ValueError(f"init_std={self.init_std!r} must be None or > 0")
        if self.init_seed is not None:
            checks.int_at_least("init_seed", self.init_seed, 0)
        for name in ("exchange", "hf"):
            if not isinstance(getattr(self, name), GROUPS[name]):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a {GROUPS[name].__name__}")
        router = self.router
        if router is None:   # the layer handles non-finite inputs itself (check_finite)
            router = RouterConfig(self.hidden, self.num_experts, nonfinite="propagate")
        if not isinstance(router, RouterConfig):
            raise ValueError(f"router={router!r} must be a RouterConfig")
        if (router.hidden, router.num_experts) != (self.hidden, self.num_experts):
            raise ValueError(f"router has hidden={router.hidden}, num_experts={router.num_experts} but the "
                             f"layer hidden={self.hidden}, num_experts={self.num_experts}")
        self._check_across_groups(router)
        object.__setattr__(self, "router", dataclasses.replace(router, init_seed=self.init_seed,
                                                               init_std=self.init_std,
                                                               bias=router.bias or self.hf.router_bias))

    def _check_across_groups(self, router: RouterConfig) -> None:
        x, hf = self.exchange, self.hf
        if x.receive_capacity_factor is not None and router.pad_to_capacity:
            raise ValueError(f"receive_capacity_factor={x.receive_capacity_factor!r} needs dropless dispatch: "
                             f"pad_to_capacity=True already gives every rank the same rows")
        R, E, ep = x.redundant_experts, self.num_experts, self.ep_size
        if R % ep:
            raise ValueError(f"redundant_experts={R} is not divisible by ep_size={ep} "
                             "(every EP rank holds the same number of extra slots)")
        if R > E * (ep - 1):
            raise ValueError(f"redundant_experts={R} > num_experts x (ep_size - 1) = {E} x {ep - 1}: an expert "
                             f"has at most one copy per EP rank, so at most {E * (ep - 1)} extra copies fit")
        if R and router.pad_to_capacity:
            raise ValueError(f"redundant_experts={R} needs dropless dispatch: pad_to_capacity=True sizes "
                             "every expert's rows by the router's capacity, which copies would split")
        if hf.shared_expert_gate and not self.num_shared_experts:
            raise ValueError(f"shared_expert_gate=True needs num_shared_experts >= 1 (it gates their output), "
                             f"got num_shared_experts={self.num_shared_experts}")
        if self.num_shared_experts and self.activation == "clamped_swiglu":
            raise ValueError(f"activation='clamped_swiglu' is for the routed experts only, but "
                             f"num_shared_experts={self.num_shared_experts}; shared experts take any other "
                             f"activation (e.g. 'swiglu')")

    @property
    def ffn(self) -> int:
        """The experts' FFN width F (ffn_hidden, default 4 * hidden)."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def shared_ffn(self) -> int:
        """The shared experts' FFN width."""
        return self.shared_ffn_hidden or self.ffn * self.num_shared_experts


def option_names() -> dict[str, list[str]]:
    """The keyword options ``MoE(...)`` accepts, by where they go: "layer" (``MoEConfig``'s
    own fields), then each group of ``GROUPS``. A name the layer and a group share (``bias``)
    is the layer's; the router's fields the layer sets itself are not options."""
    layer = [f.name for f in dataclasses.fields(MoEConfig) if f.name not in ("hidden", "num_experts", *GROUPS)]
    names = {"layer": layer}
    for group, cls in GROUPS.items():
        names[group] = [f.name for f in dataclasses.fields(cls) if f.name not in _ROUTER_OWNED and f.name not in layer]
    return names


def make_config(hidden: int, num_experts: int, ep_size: int = 1, config: MoEConfig | None = None,
                **options) -> MoEConfig:
    """A ``MoEConfig`` from ``config`` (or the defaults) with ``options`` applied, each routed
    by field name to the layer or to the group that has it; an unknown name raises ValueError."""
    names = option_names()
    where = {name: group for group, fields in names.items() for name in fields}
    kw: dict[str, dict[str, Any]] = {group: {} for group in names}
    for given, value in options.items():
        name = ALIASES.get(given, given)
        if name not in where:
            raise ValueError(f"unknown MoE option {given!r}; valid options: {sorted(where)}")
        kw[where[name]][name] = value
    layer_kw = kw.pop("layer")
    if config is None:
        kw["router"] = {"nonfinite": "propagate", **kw["router"]}
        groups = {"router": RouterConfig(hidden, num_experts, **kw["router"]),
                  **{g: GROUPS[g](**kw[g]) for g in ("exchange", "hf")}}
        return MoEConfig(hidden, num_experts, ep_size, **groups, **layer_kw)
    if not isinstance(config, MoEConfig):
        raise ValueError(f"config={config!r} must be a MoEConfig")
    if (config.hidden, config.num_experts, config.ep_size) != (hidden, num_experts, ep_size):
        raise ValueError(f"MoE(hidden={hidden}, num_experts={num_experts}, ep_size={ep_size}) disagrees with "
                         f"config (hidden={config.hidden}, num_experts={config.num_experts}, "
                         f"ep_size={config.ep_size})")
    for group, fields in kw.items():
        if fields:
            layer_kw[group] = dataclasses.replace(getattr(config, group), **fields)
    return dataclasses.replace(config, **layer_kw) if layer_kw else config

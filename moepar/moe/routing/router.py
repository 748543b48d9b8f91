"""The MoE gate: ``TopKRouter(x_TD) -> Routing``.

Legend: T tokens, D hidden, E experts, K routes per token (top-k), N = T*K routes,
B sequences (per-sequence aux loss), G expert groups.

The gate linear runs in fp32 whatever the input dtype. Scores, top-k, weight
normalisation and the route histogram come from ``moepar_kernels.routing`` (one Triton
launch on CUDA, its torch reference elsewhere); the aux / z losses are computed here in
torch, capacity drops (an option) in ``capacity.py``. Capacity and drops always use this
rank's tokens only; the aux and z statistics cover this rank's tokens, or the union over
``stats_group`` when given.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from fractions import Fraction
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moepar import checks
from moepar.parallel import comm, regions
from moepar_kernels import routing as _rk

from ...parallel.fsdp import copy_local   # a DTensor (FSDP2) keeps its own shard
from .capacity import drop_beyond_capacity
from ..config import RouterConfig
from .recompute import Record, rng_replayed, rng_state


@dataclasses.dataclass(frozen=True)
class Routing:
    """One routing decision for T tokens (see the module legend)."""
    expert_ids: torch.Tensor          # [T, K] int64, each row K distinct valid ids in [0, E)
    weights: torch.Tensor             # [T, K] fp32 combine weights, 0.0 where dropped; differentiable
    dropped_TK: Optional[torch.Tensor]   # [T, K] bool, None when dropless (``dropped`` makes it)
    tokens_per_expert: torch.Tensor   # [E] int64, kept routes per expert (after drops)
    aux_loss: torch.Tensor            # scalar fp32 in the graph, already x aux_loss_coeff (0 if off)
    z_loss: torch.Tensor              # scalar fp32 in the graph, already x z_loss_coeff
    logits: torch.Tensor              # [T, E] fp32 logits (``scores`` applies the score function)
    capacity: Optional[int]           # per-expert capacity used, None when dropless
    # nonfinite="raise" with the check deferred to the caller (``defer_checks``): the number
    # of tokens with non-finite logits, a device scalar the caller raises on; else None.
    nonfinite: Optional[torch.Tensor] = None
    # The generator state the noisy gate drew from (training with a noisy_gate_policy), kept
    # so that a recompute redraws the same noise (moepar.moe.routing.recompute); else None.
    noise_rng: Optional[torch.Tensor] = None
    score_func: str = "softmax"

    # Made on first use and kept in the instance's dict (not functools.cached_property: it
    # takes a lock on Python 3.11, which torch.compile cannot trace).
    @property
    def dropped(self) -> torch.Tensor:
        """[T, K] bool: the routes dropped over capacity (all False when dropless; made on
        first use, so that a dropless forward issues no op for it)."""
        if self.dropped_TK is not None:
            return self.dropped_TK
        if "_dropped" not in self.__dict__:
            self.__dict__["_dropped"] = torch.zeros_like(self.expert_ids, dtype=torch.bool)
        return self.__dict__["_dropped"]

    @property
    def scores(self) -> torch.Tensor:
        """[T, E] fp32 raw scores: softmax or sigmoid of the logits, no bias (made on first use)."""
        if "_scores" not in self.__dict__:
            self.__dict__["_scores"] = (torch.sigmoid(self.logits) if self.score_func == "sigmoid"
                                        else torch.softmax(self.logits, -1))
        return self.__dict__["_scores"]


def normalizes(cfg: RouterConfig) -> bool:
    """Renormalise the k weights: ``normalize_weights`` when set, else on for sigmoid with k > 1."""
    if cfg.normalize_weights is not None:
        return cfg.normalize_weights
    return cfg.score_func == "sigmoid" and cfg.k > 1


def group_topn(cfg: RouterConfig) -> Optional[int]:
    """How many of a group's best affinities sum to its score: 1 for "max", else
    ``group_score_topn`` (None: the routing reference's max(1, k // topk_groups))."""
    return 1 if cfg.group_score == "max" else cfg.group_score_topn


def capacity_of(cfg: RouterConfig, num_tokens: int, training: bool) -> Optional[int]:
    """max(ceil(T*K/E * factor), min_capacity) for this rank's T tokens; None = dropless.
    With ``expert_capacity`` (absolute, per sequence of ``seq_len`` tokens when set):
    that times the number of sequences, the most routes an expert can keep here."""
    if cfg.expert_capacity is not None:
        return cfg.expert_capacity * cfg.sequences(num_tokens)
    factor = cfg.capacity_factor if training or cfg.eval_capacity_factor is None else cfg.eval_capacity_factor
    if factor is None:
        return None
    # Exact rational arithmetic (6*2/4*0.5 must be 1.5, not 1.5000000000000002), in integers
    # of the factor's decimal fraction, so that torch.compile traces it (ceil of a / b).
    num, den = _ratio(factor)
    return max(-(-(num_tokens * cfg.k * num) // (cfg.num_experts * den)), cfg.min_capacity)


@torch.compiler.assume_constant_result   # a function of a config constant: traced as its value
def _ratio(factor: float) -> tuple[int, int]:
    """(numerator, denominator) of the decimal ``repr`` of ``factor``: 1.25 -> (5, 4)."""
    return _decimal_ratio(factor)


@functools.lru_cache(maxsize=None)
def _decimal_ratio(factor: float) -> tuple[int, int]:
    r = Fraction(repr(float(factor)))
    return r.numerator, r.denominator


def input_error(cfg: RouterConfig, num_tokens: int) -> Optional[str]:
    """What is wrong with routing ``num_tokens`` tokens under ``cfg`` (None: fine), for a
    caller to raise on every rank before any collective."""
    if cfg.seq_len is not None and (cfg.aux_loss == "seq" or cfg.expert_capacity is not None):
        if num_tokens % cfg.seq_len:
            return f"{num_tokens} tokens are not a whole number of sequences of seq_len={cfg.seq_len}"
    return None


def _raise_nonfinite(logits_TE: torch.Tensor, bad, bad_T) -> None:
    bad_T = _rk.nonfinite_rows(logits_TE) if bad_T is None else bad_T
    raise ValueError(f"router logits are NaN or inf for {int(bad)} of {logits_TE.shape[0]} tokens "
                     f"(first: token {int(bad_T.nonzero()[0, 0])}); nonfinite='propagate' turns them "
                     f"into NaN outputs")


class TopKRouter(nn.Module):
    """Top-k gate: fp32 linear ``[E, D]`` (+ optional bias), scores, top-k, drops, losses.

    Options (all validated by ``RouterConfig``, errors name the values):
      score_func: "softmax" (softmax then top-k), "softmax_after_topk" (top-k on the
        logits, softmax over the k) or "sigmoid" (DeepSeek-V3). normalize_weights:
        renormalise the k weights to sum 1 (None: on for sigmoid with k > 1).
        scaling_factor multiplies the weights.
      expert_bias: a non-trainable per-expert bias (buffer) added to the scores for
        selection only; ``update_expert_bias(rate)`` moves it from the load.
      num_groups / topk_groups: pick the best groups first, then top-k inside them.
        group_score: how a group is scored from its experts' selection affinities:
        "sum_topn" (sum of its top ``group_score_topn``; None = max(1, k // topk_groups),
        Megatron's rule; DeepSeek-V3/GLM-4-MoE in transformers use 2) or "max" (its best
        expert, DeepSeek-V2's group_limited_greedy).
      noisy_gate_policy: "jitter" (input x U(1-eps, 1+eps)) or "rsample" (Gumbel noise on
        the logits used for selection); training only.
      capacity_factor / eval_capacity_factor / min_capacity / drop_policy / pad_to_capacity:
        None is dropless; else capacity = max(ceil(T*K/E*factor), min_capacity) over this
        rank's tokens; pad_to_capacity asks the dispatcher for fixed ``capacity`` rows.
        expert_capacity: absolute slots per expert instead of a factor (exclusive with it),
        counted per sequence of ``seq_len`` tokens when seq_len is set (Switch
        Transformers' expert_capacity), else over this rank's tokens.
      aux_loss: "switch", "seq" (per sequence of ``seq_len`` tokens) or None; aux_loss_coeff;
        z_loss_coeff (mean logsumexp^2). Both come back already scaled.
        aux_loss_convention: "moepar" ((E/K) * sum_e f_e * P_e, 1.0 when balanced) or "hf"
        (transformers' load_balancing_loss_func, E * sum_e f_e * P_e: K times moepar's).
      nonfinite: "raise" (ValueError on NaN/inf logits) or "propagate" (NaN weights).
      use_kernel: None = Triton on CUDA when it covers the options; True/False forces.
      init_seed / init_std: weights from ``Generator().manual_seed(init_seed)``;
        U(+-1/sqrt(D)) (nn.Linear) or N(0, init_std).

    ``TopKRouter(config)`` takes a ``RouterConfig`` as it is (the MoE layer passes its own);
    ``TopKRouter(hidden, num_experts, k, **options)`` is the shortcut that builds one.
    """

    def __init__(self, hidden: int | RouterConfig, num_experts: int | None = None, k: int = 2,
                 **options) -> None:
        super().__init__()
        if isinstance(hidden, RouterConfig):
            if num_experts is not None or options:
                raise ValueError("TopKRouter(config) takes no other arguments: put the options in the RouterConfig")
            cfg = hidden
        else:
            if num_experts is None:
                raise ValueError(f"TopKRouter(hidden={hidden!r}) needs num_experts (or pass a RouterConfig)")
            cfg = RouterConfig(hidden, num_experts, k, **options)
        self.config = cfg
        self._zeros: dict = {}
        # Why the Triton kernel cannot route this config, in eval and in training ("": it can),
        # decided once: the forward only looks it up.
        self._kernel_gaps = (cfg.kernel_gap(training=False), cfg.kernel_gap(training=True))
        num_experts, hidden = cfg.num_experts, cfg.hidden
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32)) if cfg.bias else None
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
            # Routes per expert over training forwards since the last update_expert_bias().
            self.register_buffer("load_accum", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        else:
            self.expert_bias = None
        self.reset_parameters()

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    @property
    def k(self) -> int:
        return self.config.k

    @property
    def pad_to_capacity(self) -> bool:
        return self.config.pad_to_capacity

    def reset_parameters(self) -> None:
        """Weight (and bias) from ``init_seed``; ``expert_bias`` and the load count zeroed."""
        cfg = self.config
        gen = torch.Generator().manual_seed(cfg.init_seed) if cfg.init_seed is not None else None
        w = torch.empty(cfg.num_experts, cfg.hidden, dtype=torch.float32)
        bound = 1.0 / math.sqrt(cfg.hidden)
        if cfg.init_std is None:
            w.uniform_(-bound, bound, generator=gen)
        else:
            w.normal_(0.0, cfg.init_std, generator=gen)
        with torch.no_grad():
            copy_local(self.weight, w)
            if self.bias is not None:
                b = torch.zeros(cfg.num_experts)
                if cfg.init_std is None:
                    b.uniform_(-bound, bound, generator=gen)
                copy_local(self.bias, b)
            if self.expert_bias is not None:
                self.expert_bias.zero_()
                self.load_accum.zero_()

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden={c.hidden}, num_experts={c.num_experts}, k={c.k}, score_func={c.score_func!r}, "
                f"capacity_factor={c.capacity_factor}, aux_loss={c.aux_loss!r}")

    def forward(self, x_TD: torch.Tensor, *, stats_group=None, defer_checks: bool = False,
                replay: Optional[Record] = None, count: bool = True, comm_stats=None) -> Routing:
        """Route ``x_TD`` [T, D]; ``stats_group`` sums the aux/z statistics over a group.
        ``defer_checks``: with nonfinite="raise", count the non-finite tokens on the device
        (``Routing.nonfinite``) instead of reading them here: the MoE layer sends the count in
        its counts exchange, so that every rank raises together, with no host read of its own.
        ``replay``: a recompute's record of its forward (moepar.moe.routing.recompute): the same ids
        and drops, the noise redrawn from the same state. ``count``: add this forward's
        routes to ``load_accum`` (False in a recompute). ``comm_stats``: receives the events of
        the aux/z statistics' collectives over ``stats_group``."""
        if x_TD.dim() != 2 or x_TD.shape[1] != self.config.hidden:
            raise ValueError(f"router input must be [T, hidden={self.config.hidden}], got {tuple(x_TD.shape)}")
        noisy = self.training and self.config.noisy_gate_policy is not None
        noise_rng = None
        if noisy and replay is not None and replay.noise_rng is not None:
            draws = rng_replayed(x_TD.device, replay.noise_rng)
        else:
            draws = contextlib.nullcontext()
            noise_rng = rng_state(x_TD.device) if noisy else None
        with draws:
            x = x_TD.float()
            if noisy and self.config.noisy_gate_policy == "jitter":
                eps = self.config.noise_eps
                x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
            bias = None if self.bias is None else self.bias.float()
            logits_TE = F.linear(x, self.weight.float(), bias)
            routing = self._route(logits_TE, stats_group, defer_checks, replay, count, comm_stats)
        return dataclasses.replace(routing, noise_rng=noise_rng) if noise_rng is not None else routing

    def route_logits(self, logits_TE: torch.Tensor, *, stats_group=None) -> Routing:
        """Route precomputed logits [T, E] (cast to fp32); no gate linear, no jitter."""
        if logits_TE.dim() != 2 or logits_TE.shape[1] != self.config.num_experts:
            raise ValueError(f"logits must be [T, num_experts={self.config.num_experts}], "
                             f"got {tuple(logits_TE.shape)}")
        return self._route(logits_TE.float(), stats_group, False, None, True, None)

    def _use_kernel(self, logits_TE: torch.Tensor) -> bool:
        cfg = self.config
        if cfg.use_kernel is not None:
            return cfg.use_kernel   # True was checked against kernel_gap() at construction
        return logits_TE.is_cuda and not self._kernel_gaps[self.training]

    def _route(self, logits_TE: torch.Tensor, stats_group, defer_checks: bool, replay, count: bool,
               comm_stats=None) -> Routing:
        cfg = self.config
        T = logits_TE.shape[0]
        noisy = self.training and cfg.noisy_gate_policy == "rsample"
        if not noisy and replay is None and self._use_kernel(logits_TE):
            ids_TK, w_TK, hist_E, bad, aux, bad_T, scores_TE = self._kernel_routes(logits_TE, stats_group)
        else:
            ids_TK, w_TK, hist_E, bad, aux, bad_T, scores_TE = self._reference_routes(logits_TE, replay, noisy)
        nonfinite = bad if cfg.nonfinite == "raise" and defer_checks else None
        if cfg.nonfinite == "raise" and not defer_checks and bool(bad):
            _raise_nonfinite(logits_TE, bad, bad_T)
        capacity = capacity_of(cfg, T, self.training)
        dropped_TK, kept_E = None, hist_E
        if capacity is not None:   # an option: the drops live in capacity.py
            bad_T = _rk.nonfinite_rows(logits_TE) if bad_T is None else bad_T
            dropped_TK, w_TK, kept_E = drop_beyond_capacity(cfg, ids_TK, w_TK, bad_T, capacity,
                                                            None if replay is None else replay.dropped_TK)
        aux, z = self._losses(logits_TE, scores_TE, ids_TK, hist_E, stats_group, comm_stats, aux)
        if self.training and cfg.expert_bias and count:
            with torch.no_grad():
                self.load_accum += hist_E
        return Routing(ids_TK, w_TK, dropped_TK, kept_E, aux, z, logits_TE, capacity, nonfinite,
                       score_func=cfg.score_func)

    def _kernel_routes(self, logits_TE: torch.Tensor, stats_group):
        """One launch: the routes, the rows with a non-finite logit and, where it covers only
        this rank's tokens, the load-balancing loss (no [T, E] scores kept here)."""
        cfg = self.config
        ids_TK, w_TK, hist_E, bad, aux = _rk.routing_full(
            logits_TE, cfg.k, cfg.score_func, self.expert_bias, normalizes(cfg), cfg.scaling_factor,
            self._fused_aux_scale(logits_TE.shape[0], stats_group))
        return ids_TK, w_TK, hist_E, bad, aux, None, None

    def _reference_routes(self, logits_TE: torch.Tensor, replay, noisy: bool):
        """The torch rule: it reuses the scores (one softmax, one backward through it) and the
        non-finite rows; a replay gives it the forward's ids instead of selecting."""
        cfg = self.config
        noise_TE = None
        if noisy:   # Gumbel(0, 1) on the logits used for selection: sampling without replacement
            u = torch.rand_like(logits_TE).clamp_min(torch.finfo(torch.float32).tiny)
            noise_TE = -torch.log(-torch.log(u))
        bad_T = _rk.nonfinite_rows(logits_TE)
        scores_TE = None
        if cfg.score_func != "softmax_after_topk":
            scores_TE = torch.sigmoid(logits_TE) if cfg.score_func == "sigmoid" else torch.softmax(logits_TE, -1)
        ids_TK, w_TK, hist_E = _rk.routing_reference(
            logits_TE, cfg.k, cfg.score_func, self.expert_bias, normalizes(cfg), cfg.scaling_factor,
            num_groups=cfg.num_groups, topk_groups=cfg.topk_groups, group_topn=group_topn(cfg),
            selection_noise_TE=noise_TE, scores_TE=scores_TE, bad_T=bad_T,
            ids_TK=None if replay is None else replay.ids_TK, checked=True)
        bad = bad_T.sum() if cfg.nonfinite == "raise" else None
        return ids_TK, w_TK, hist_E, bad, None, bad_T, scores_TE

    def _fused_aux_scale(self, tokens: int, stats_group) -> float:
        """The routing launch's ``aux_scale`` when it can compute the aux loss (the Switch loss
        over this rank's tokens), else 0: coeff x E / (K x T^2) (x K in transformers'
        convention), so that the launch's sum_e P_e x scale x routes_e is the loss."""
        cfg = self.config
        if cfg.aux_loss != "switch" or comm.group_size(stats_group) > 1 or tokens == 0:
            return 0.0
        scale = cfg.aux_loss_coeff * cfg.num_experts / (cfg.k * tokens * tokens)
        return scale * cfg.k if cfg.aux_loss_convention == "hf" else scale

    def _losses(self, logits_TE, scores_TE, ids_TK, hist_E, group, comm_stats=None, fused_aux=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Aux and z losses from sums that add over ranks, so ``stats_group`` gives the
        loss of the union of the group's tokens: counts are all-reduced; score and
        logsumexp^2 sums go through reduce_from_region (identity backward: each rank
        back-propagates its own tokens, the layer sums the weight grads over the group)."""
        cfg = self.config
        T, E = logits_TE.shape
        K = cfg.k
        zero = self._zero(logits_TE.device)
        aux_on, z_on = cfg.aux_loss is not None and fused_aux is None, cfg.z_loss_coeff > 0
        if not aux_on and not z_on:   # the launch's loss, or none
            return (zero if fused_aux is None else fused_aux), zero
        if aux_on and scores_TE is None:
            scores_TE = torch.sigmoid(logits_TE) if cfg.score_func == "sigmoid" else torch.softmax(logits_TE, -1)
        diff, counts = [], []
        if aux_on:
            # P_e uses per-token scores summing to 1 (sigmoid scores are renormalised).
            p_TE = scores_TE if cfg.score_func != "sigmoid" else scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)
            if cfg.aux_loss == "switch":
                diff.append(p_TE.sum(0))
                counts.append(hist_E)
            else:
                L = cfg.seq_len
                if T % L:
                    raise ValueError(f"aux_loss='seq': {T} tokens are not a whole number of sequences "
                                     f"of seq_len={L}")
                B = T // L
                diff.append(p_TE.view(B, L, E).sum(1).reshape(-1))
                ones = torch.ones(B, L * K, dtype=torch.int64, device=ids_TK.device)
                counts.append(torch.zeros(B, E, dtype=torch.int64, device=ids_TK.device)
                              .scatter_add_(1, ids_TK.reshape(B, L * K), ones).reshape(-1))
        if z_on:
            diff.append((torch.logsumexp(logits_TE, dim=-1) ** 2).sum().reshape(1))
        if comm.group_size(group) > 1:   # one message each for the sums and the counts
            counts.append(logits_TE.new_full((1,), T, dtype=torch.int64))   # a fill: no host data copied
            diff_sum = regions.reduce_from_region(torch.cat(diff), group, stats=comm_stats)  # 4 * len (E, or B*E, +1)
            count_sum = comm.all_reduce_(torch.cat(counts), group, stats=comm_stats)       # 8 * len
            tokens = count_sum[-1].clamp_min(1).float()
        else:   # this rank's tokens alone: T is known, and no concatenation (each op a launch on a GPU)
            diff_sum = diff[0] if len(diff) == 1 else torch.cat(diff)
            count_sum = counts[0] if counts else None
            tokens = float(max(T, 1))
        aux = zero if fused_aux is None else fused_aux
        z = zero
        if z_on:
            z = cfg.z_loss_coeff * diff_sum[-1] / tokens
        if aux_on:
            if cfg.aux_loss == "switch":
                f_E, P_E = count_sum[:E].float() / tokens, diff_sum[:E] / tokens
                aux = (E / K) * (f_E * P_E).sum()
                if cfg.aux_loss_convention == "hf":   # transformers' load_balancing_loss_func: E * sum f*P
                    aux = aux * K
            else:
                B = T // cfg.seq_len
                per_seq = tokens / max(B, 1)   # global tokens of each sequence
                f_BE = count_sum[:B * E].view(B, E).float() / per_seq
                P_BE = diff_sum[:B * E].view(B, E) / per_seq
                aux = (E / K) * (f_BE * P_BE).sum(-1).mean() if B else zero
                if cfg.aux_loss_convention == "hf":
                    aux = aux * K
            aux = cfg.aux_loss_coeff * aux
        return aux, z

    def _zero(self, device, dtype=torch.float32) -> torch.Tensor:
        """A 0 (a loss that is off, no dropped route) on ``device``, made once (each op a
        launch on a GPU)."""
        zero = self._zeros.get((device, dtype))
        if zero is None:
            zero = self._zeros[(device, dtype)] = torch.zeros((), device=device, dtype=dtype)
        return zero

    @torch.no_grad()
    def update_expert_bias(self, rate: float, group=None) -> torch.Tensor:
        """DeepSeek-V3 aux-loss-free balancing: ``bias_e += rate * sign(mean_load - load_e)``
        from the routes counted in training forwards since the last call (summed over
        ``group`` first), then reset the count. Returns the load used [E] (int64)."""
        if not self.config.expert_bias:
            raise ValueError("update_expert_bias needs a router built with expert_bias=True")
        checks.finite("rate", rate, at_least=0)
        load_E = comm.all_reduce_(self.load_accum.clone(), group)
        load = load_E.double()
        self.expert_bias += (rate * torch.sign(load.mean() - load)).to(self.expert_bias.dtype)
        self.load_accum.zero_()
        return load_E

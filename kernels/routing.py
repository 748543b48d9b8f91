"""Fused top-k routing: scores, top-k selection, weight normalisation and the per-expert
route histogram in one launch, plus its torch reference (the path off CUDA).

Legend (docs/moe.md): T tokens, E experts, K routes per token (top-k), G expert groups.

Semantics (kernel and reference alike):

* ``score_func``: ``"softmax"`` (softmax over E, top-k, weight = score), ``"sigmoid"``
  (weight = sigmoid(logit)) or ``"softmax_after_topk"`` (top-k on the logits, the k
  weights are a softmax over the k selected logits; always sums to 1).
* Selection key: the logits themselves when there is no ``expert_bias_E`` (softmax and
  sigmoid are monotone, so this is top-k of the scores without the rounding ties that
  saturated sigmoids or underflowed softmax values would add); with a bias it is
  ``score + bias`` (``logit + bias`` for softmax_after_topk). The bias never enters the
  weights. Equal keys break toward the lower expert index.
* ``normalize`` divides the k weights by their sum (+1e-20); then ``scaling_factor``.
* A row with any non-finite logit gets experts 0..K-1 (distinct and valid) with NaN
  weights: its output turns NaN downstream instead of silently routing to expert 0.
* The histogram counts every selected route (capacity drops are the router's business).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import interpreter
from .eager import both
from .routing_backward import routing_backward, routing_backward_reference  # noqa: F401 (the module's API)

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is Linux-only; the reference still works without it
    triton = None
    tl = None

SCORE_FUNCS = ("softmax", "sigmoid", "softmax_after_topk")
MAX_EXPERTS = 512   # the kernel keeps a row of next_pow2(E) scores in registers
MAX_K = 16
_NORM_EPS = 1e-20   # guards a k-sum of sigmoids that all underflowed to 0
_FLT_MAX = 3.4028234663852886e38

if triton is not None:
    # jit code may only read constexpr globals.
    _NEG_FLT_MAX_C = tl.constexpr(-_FLT_MAX)
    _NORM_EPS_C = tl.constexpr(_NORM_EPS)

    @triton.jit
    def _routing_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, hist_ptr, stats_ptr,
                        T, E, stride_t, scaling, aux_scale,
                        K: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        NORMALIZE: tl.constexpr, AUX: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        # SCORE: 0 softmax, 1 sigmoid, 2 softmax_after_topk. Each program walks row blocks
        # pid, pid + nprog, ... and keeps its own expert histogram and count of rows with a
        # non-finite logit, written once at the end into hist_ptr[pid, :E + 1] (no atomics:
        # summed by the launcher, deterministic). AUX: also each expert's summed score (the
        # load-balancing loss's P, a per-token distribution: sigmoid scores renormalised)
        # and aux_scale x its route count, into stats_ptr[pid, :2E].
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_E)
        kcols = tl.arange(0, BLOCK_K)
        col_ok = cols < E
        k_ok = kcols < K
        if HAS_BIAS:
            bias_E = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        hist_E = tl.zeros([BLOCK_E], dtype=tl.int32)
        n_bad = tl.zeros([BLOCK_T], dtype=tl.int32)
        if AUX:
            p_sum_E = tl.zeros([BLOCK_E], dtype=tl.float32)
        nblocks = tl.cdiv(T, BLOCK_T)
        for blk in range(pid, nblocks, nprog):
            rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
            row_ok = rows < T
            row_off = rows.to(tl.int64) * stride_t
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(logits_ptr + row_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            bad_TE = (x != x) | (x == float("inf")) | (x == float("-inf"))
            bad_T = tl.max(bad_TE.to(tl.int32), axis=1) > 0
            # Bad rows become all-zero logits: every key ties, so they pick experts 0..K-1.
            x = tl.where(bad_T[:, None], 0.0, x)
            x = tl.where(col_ok[None, :], x, float("-inf"))
            n_bad += (bad_T & row_ok).to(tl.int32)
            if SCORE == 0 or (AUX and SCORE == 2):
                row_max = tl.max(x, axis=1)
                ex = tl.exp(x - row_max[:, None])       # padding columns: exp(-inf) = 0
                row_sum = tl.sum(ex, axis=1)
            if AUX:   # bad rows make the loss NaN (as their scores would); padding rows add 0
                if SCORE == 1:
                    sg = tl.sigmoid(x)                  # padding columns: sigmoid(-inf) = 0
                    p = sg / (tl.sum(sg, axis=1)[:, None] + _NORM_EPS_C)
                else:
                    p = ex / row_sum[:, None]
                p = tl.where(bad_T[:, None], float("nan"), p)
                p_sum_E += tl.sum(tl.where(row_ok[:, None], p, 0.0), axis=0)
            if HAS_BIAS:
                if SCORE == 0:
                    key = ex / row_sum[:, None] + bias_E[None, :]
                elif SCORE == 1:
                    key = tl.sigmoid(x) + bias_E[None, :]
                else:
                    key = x + bias_E[None, :]
                key = tl.where(bad_T[:, None], 0.0, key)
            else:
                key = x
            # Valid keys are clamped to >= -FLT_MAX (a NaN or -inf bias must neither win
            # nor tie with a taken column); taken and padding columns hold -inf.
            key = tl.where((key != key) | (key == float("-inf")), _NEG_FLT_MAX_C, key)
            key = tl.where(col_ok[None, :], key, float("-inf"))
            ids_TK = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
            val_TK = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
            for j in tl.static_range(K):
                # One reduction gives the max and its lowest column index (tie-break left).
                best, idx = tl.max(key, axis=1, return_indices=True, return_indices_tie_break_left=True)
                if HAS_BIAS:
                    # The key is score+bias: re-read the selected logit (an L1 hit).
                    val = tl.load(logits_ptr + row_off + idx, mask=row_ok, other=0.0).to(tl.float32)
                    val = tl.where(bad_T, 0.0, val)       # bad rows: weights become NaN below
                else:
                    val = best                            # the key is the logit itself
                key = tl.where(cols[None, :] == idx[:, None], float("-inf"), key)
                ids_TK = tl.where(kcols[None, :] == j, idx[:, None], ids_TK)
                val_TK = tl.where(kcols[None, :] == j, val[:, None], val_TK)
            taken = (key == float("-inf")) & mask
            hist_E += tl.sum(taken.to(tl.int32), axis=0)
            if SCORE == 2:
                top = tl.max(tl.where(k_ok[None, :], val_TK, float("-inf")), axis=1)
                ew = tl.where(k_ok[None, :], tl.exp(val_TK - top[:, None]), 0.0)
                w = ew / tl.sum(ew, axis=1)[:, None]
            else:
                if SCORE == 0:
                    w = tl.exp(val_TK - row_max[:, None]) / row_sum[:, None]
                else:
                    w = tl.sigmoid(val_TK)
                w = tl.where(k_ok[None, :], w, 0.0)
                if NORMALIZE:
                    w = w / (tl.sum(w, axis=1)[:, None] + _NORM_EPS_C)
            w = w * scaling
            w = tl.where(bad_T[:, None], float("nan"), w)
            out = rows.to(tl.int64)[:, None] * K + kcols[None, :]
            omask = row_ok[:, None] & k_ok[None, :]
            tl.store(ids_ptr + out, ids_TK.to(tl.int64), mask=omask)
            tl.store(weights_ptr + out, w, mask=omask)
        tl.store(hist_ptr + pid.to(tl.int64) * (E + 1) + cols, hist_E, mask=col_ok)
        tl.store(hist_ptr + pid.to(tl.int64) * (E + 1) + E, tl.sum(n_bad, axis=0))
        if AUX:
            tl.store(stats_ptr + pid.to(tl.int64) * (2 * E) + cols, p_sum_E, mask=col_ok)
            tl.store(stats_ptr + pid.to(tl.int64) * (2 * E) + E + cols, hist_E.to(tl.float32) * aux_scale,
                     mask=col_ok)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _check(logits_TE: torch.Tensor, k: int, score_func: str, expert_bias_E: Optional[torch.Tensor],
           max_experts: int | None = None, max_k: int | None = None) -> None:
    if logits_TE.dim() != 2:
        raise ValueError(f"logits must be 2-D [T, E], got shape {tuple(logits_TE.shape)}")
    E = logits_TE.shape[1]
    if not logits_TE.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits_TE.dtype}")
    if E < 1:
        raise ValueError(f"num_experts={E} (logits.shape[1]) must be >= 1")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k > E:
        raise ValueError(f"k={k!r} must be an integer with 1 <= k <= num_experts={E}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r} must be one of {SCORE_FUNCS}")
    if max_experts is not None and E > max_experts:
        raise ValueError(f"num_experts={E} exceeds the routing kernel's limit of {max_experts}")
    if max_k is not None and k > max_k:
        raise ValueError(f"k={k} exceeds the routing kernel's limit of {max_k}")
    if expert_bias_E is not None:
        if tuple(expert_bias_E.shape) != (E,):
            raise ValueError(f"expert_bias must have shape [{E}], got {tuple(expert_bias_E.shape)}")
        if expert_bias_E.device != logits_TE.device:
            raise ValueError(f"expert_bias is on {expert_bias_E.device} but logits are on {logits_TE.device}")


def _block_t(E: int) -> int:
    block_e = _next_pow2(E)
    if interpreter.ACTIVE:   # the interpreter pays per op, not per element: big tiles
        return max(1, min(4096, (1 << 20) // block_e))
    return max(1, min(128, 4096 // block_e))   # ~4k fp32 per tile in registers


def _launch(logits_TE: torch.Tensor, k: int, score_func: str, expert_bias_E: Optional[torch.Tensor],
            normalize: bool, scaling_factor: float, aux_scale: float, block_t: int, num_warps: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, E = logits_TE.shape
    dev = logits_TE.device
    aux = aux_scale != 0.0
    ids_TK = torch.empty((T, k), dtype=torch.int64, device=dev)
    weights_TK = torch.empty((T, k), dtype=torch.float32, device=dev)
    if T == 0:   # no token: no route, no bad row, a loss of 0
        return (ids_TK, weights_TK, torch.zeros(E + 1, dtype=torch.int64, device=dev),
                torch.zeros((), device=dev) if aux else weights_TK.new_empty(0), weights_TK.new_empty(0))
    logits_TE = logits_TE if logits_TE.stride(1) == 1 else logits_TE.contiguous()
    bias = expert_bias_E.contiguous() if expert_bias_E is not None else logits_TE  # dummy ptr
    block_t = block_t if block_t > 0 else _block_t(E)
    block_e = _next_pow2(E)
    nblocks = triton.cdiv(T, block_t)
    if dev.type == "cuda":
        grid = min(nblocks, 8 * _sm_count(dev.index if dev.index is not None else torch.cuda.current_device()))
    else:
        grid = min(nblocks, 4)   # interpreter: a few programs still exercise the block loop
    hist_per_program = torch.empty((grid, E + 1), dtype=torch.int32, device=dev)
    stats_per_program = torch.empty((grid, 2 * E) if aux else (0,), dtype=torch.float32, device=dev)
    _routing_kernel[(grid,)](
        logits_TE, bias, ids_TK, weights_TK, hist_per_program, stats_per_program, T, E, logits_TE.stride(0),
        float(scaling_factor), float(aux_scale),
        K=k, SCORE=SCORE_FUNCS.index(score_func), HAS_BIAS=expert_bias_E is not None,
        NORMALIZE=bool(normalize), AUX=aux, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=_next_pow2(k),
        num_warps=num_warps if num_warps > 0 else 4)   # untuned default: see the bench's --tune
    counts = hist_per_program.sum(0, dtype=torch.int64)
    if not aux:
        return ids_TK, weights_TK, counts, weights_TK.new_empty(0), weights_TK.new_empty(0)
    stats = stats_per_program.sum(0)   # [P_E summed over tokens, aux_scale x routes_E]
    return ids_TK, weights_TK, counts, torch.dot(stats[:E], stats[E:]), stats


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    """The device's multiprocessors, read once (a properties query on every launch is host time)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _routing_impl(logits_TE: torch.Tensor, k: int, score_func: str, expert_bias_E: Optional[torch.Tensor],
                  normalize: bool, scaling_factor: float, aux_scale: float, block_t: int, num_warps: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch(logits_TE, k, score_func, expert_bias_E, normalize, scaling_factor, aux_scale, block_t,
                   num_warps)


_routing_op = torch.library.custom_op("moepar::routing", mutates_args=())(_routing_impl)


@_routing_op.register_fake
def _(logits_TE, k, score_func, expert_bias_E, normalize, scaling_factor, aux_scale, block_t, num_warps):
    T, E = logits_TE.shape
    aux = aux_scale != 0.0
    return (logits_TE.new_empty((T, k), dtype=torch.int64), logits_TE.new_empty((T, k), dtype=torch.float32),
            logits_TE.new_empty((E + 1,), dtype=torch.int64),
            logits_TE.new_empty(() if aux else (0,), dtype=torch.float32),
            logits_TE.new_empty((2 * E if aux and T else 0,), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    logits_TE, k, score_func, expert_bias_E, normalize, scaling_factor, aux_scale, block_t, num_warps = inputs
    ctx.save_for_backward(logits_TE, output[0], output[4] if output[4].numel() else None)
    ctx.score_func, ctx.normalize, ctx.scaling = score_func, normalize, scaling_factor
    ctx.mark_non_differentiable(output[0], output[2], output[4])
    ctx.set_materialize_grads(False)   # unused outputs' gradients stay None: no zeros made


def _backward(ctx, grad_ids, grad_weights_TK, grad_counts, grad_aux, grad_stats):
    logits_TE, ids_TK, stats = ctx.saved_tensors
    aux_grad_E = None
    if grad_aux is not None and stats is not None:
        # d loss / d P_e: aux = P . (aux_scale x routes), so the scaled routes times its gradient
        aux_grad_E = stats[stats.shape[0] // 2:] * grad_aux
    if grad_weights_TK is None and aux_grad_E is None:
        return None, None, None, None, None, None, None, None, None
    grad = routing_backward(logits_TE, ids_TK, grad_weights_TK, ctx.score_func, ctx.normalize, ctx.scaling,
                            aux_grad_E)
    return grad, None, None, None, None, None, None, None, None


_routing_op.register_autograd(_backward, setup_context=_setup_context)
_routing_call = both(_routing_op, _routing_impl, _setup_context, _backward)


def _check_launch(block_t: int | None, num_warps: int | None) -> None:
    if triton is None:
        raise ValueError("the routing kernel needs triton; use routing_reference instead")
    interpreter.check()
    if block_t is not None and (block_t < 1 or block_t & (block_t - 1)):
        raise ValueError(f"block_t={block_t} must be a positive power of two")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps={num_warps} must be one of 1, 2, 4, 8, 16")


def routing(logits_TE: torch.Tensor, k: int, score_func: str = "softmax",
            expert_bias_E: Optional[torch.Tensor] = None, normalize: bool = False,
            scaling_factor: float = 1.0, *, block_t: int | None = None, num_warps: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused routing on CUDA (or CPU under ``TRITON_INTERPRET=1``).

    Returns ``(expert_ids_TK int64, weights_TK fp32, tokens_per_expert_E int64)``;
    differentiable w.r.t. ``logits_TE`` through the weights (``moepar::routing`` custom
    op, traceable by ``torch.compile``). ``block_t`` (rows per tile) and ``num_warps``
    override the launch heuristics (tuning only). ``routing_full`` also returns the rows
    with a non-finite logit and the load-balancing loss.
    """
    _check(logits_TE, k, score_func, expert_bias_E, MAX_EXPERTS, MAX_K)
    if logits_TE.device.type != "cuda" and not interpreter.ACTIVE:
        raise ValueError(f"the routing kernel needs CUDA tensors (got {logits_TE.device}) "
                         f"or TRITON_INTERPRET=1 set before import; use routing_reference")
    _check_launch(block_t, num_warps)
    if expert_bias_E is not None:
        expert_bias_E = expert_bias_E.float()
    ids, w, counts, _, _ = _routing_call(logits_TE, k, score_func, expert_bias_E, bool(normalize),
                                         float(scaling_factor), 0.0, int(block_t or 0), int(num_warps or 0))
    return ids, w, counts[:-1]


def routing_full(logits_TE: torch.Tensor, k: int, score_func: str, expert_bias_E: Optional[torch.Tensor],
                 normalize: bool, scaling_factor: float, aux_scale: float = 0.0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``routing`` and its statistics in the same launch: ``(expert_ids_TK, weights_TK,
    tokens_per_expert_E, nonfinite_rows, aux)`` with ``nonfinite_rows`` the count of rows
    holding a NaN or an infinity (a 0-dim int64 on the device) and, for ``aux_scale`` != 0,
    ``aux = sum_e P_e x aux_scale x routes_e`` (``P_e`` the scores summed over the tokens,
    sigmoid scores renormalised per token; the Switch load-balancing loss for
    ``aux_scale = coeff x E / (K x T^2)``), differentiable w.r.t. the logits; else None.
    For callers that validated their arguments once (the router): nothing is checked here
    (``routing`` checks every call)."""
    ids, w, counts, aux, _ = _routing_call(logits_TE, k, score_func, expert_bias_E, normalize, scaling_factor,
                                           aux_scale, 0, 0)
    return ids, w, counts[:-1], counts[-1], (aux if aux_scale != 0.0 else None)


def _scores(x_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    return torch.sigmoid(x_TE) if score_func == "sigmoid" else torch.softmax(x_TE, dim=-1)


def _sanitize(key_TE: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(key_TE) | (key_TE == float("-inf")),
                       torch.full_like(key_TE, -_FLT_MAX), key_TE)


def _compiling() -> bool:
    """Inside torch.compile's tracing: take the branch-free paths (no host reads, no
    data-dependent shapes), which give the same results."""
    return torch.compiler.is_compiling()


def _topk_lowest_index(key_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k ids in descending key order, equal keys broken toward the lower index.

    One ``torch.topk`` of k+1 columns; its order among equal keys is unspecified, so the
    rows where two of the k+1 largest keys are equal (the only rows where ties can change
    the selection or its order) are redone with a stable descending sort, which keeps
    index order among equal keys. Keys are never NaN (callers sanitise them)."""
    T, E = key_TE.shape
    vals, ids = torch.topk(key_TE, min(k + 1, E), dim=-1)
    ids = ids[:, :k]
    if vals.shape[1] < 2 or T == 0:
        return ids
    tie_T = (vals[:, 1:] == vals[:, :-1]).any(dim=-1)
    if key_TE.device.type == "cpu" and not _compiling():   # host reads are free here: redo only the tied rows
        rows = tie_T.nonzero().flatten()
        if rows.numel():
            ids[rows] = torch.sort(key_TE[rows], dim=-1, descending=True, stable=True).indices[:, :k]
        return ids
    stable = torch.sort(key_TE, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.where(tie_T[:, None], stable, ids)


def nonfinite_rows(x_TE: torch.Tensor) -> torch.Tensor:
    """[T] bool: rows holding a NaN or an infinity. On the CPU a row sum flags candidate
    rows in one pass (a non-finite element makes the sum non-finite; a finite row whose sum
    overflows is re-checked exactly), instead of the three passes of ``isfinite().all()``."""
    if x_TE.device.type != "cpu" or _compiling():
        # x - x is 0 for a finite x and NaN for an infinity or a NaN: three ops where
        # ``~isfinite(x).all(-1)`` issues six (each a launch on a GPU)
        return (x_TE - x_TE).ne(0).any(dim=-1)
    bad_T = ~torch.isfinite(x_TE.sum(dim=-1))
    rows = bad_T.nonzero().flatten()
    if rows.numel():
        bad_T[rows] = ~torch.isfinite(x_TE[rows]).all(dim=-1)
    return bad_T


def _group_mask(aff_TE: torch.Tensor, k: int, num_groups: int, topk_groups: int,
                group_topn: int | None = None) -> torch.Tensor:
    """[T, E] bool: experts of each token's ``topk_groups`` best groups. A group's score
    is the sum of its top ``group_topn`` affinities; None: ``max(1, k // topk_groups)``
    (Megatron's rule; DeepSeek-V3: k=8, 4 of 8 groups, top-2 sum), capped at the group size.
    ``group_topn=1`` scores a group by its max (DeepSeek-V2's group_limited_greedy).
    Ties pick the lower group."""
    T, E = aff_TE.shape
    per = E // num_groups
    top = min(per, max(1, k // topk_groups) if group_topn is None else group_topn)
    g_TG = aff_TE.view(T, num_groups, per).topk(top, dim=-1).values.sum(-1)
    best_groups = torch.sort(g_TG, dim=-1, descending=True, stable=True).indices[:, :topk_groups]
    keep_TG = torch.zeros(T, num_groups, dtype=torch.bool, device=aff_TE.device).scatter(1, best_groups, True)
    return keep_TG.repeat_interleave(per, dim=1)


def routing_reference(logits_TE: torch.Tensor, k: int, score_func: str = "softmax",
                      expert_bias_E: Optional[torch.Tensor] = None, normalize: bool = False,
                      scaling_factor: float = 1.0, *, num_groups: int | None = None,
                      topk_groups: int | None = None, group_topn: int | None = None,
                      selection_noise_TE: Optional[torch.Tensor] = None,
                      scores_TE: Optional[torch.Tensor] = None, bad_T: Optional[torch.Tensor] = None,
                      ids_TK: Optional[torch.Tensor] = None, checked: bool = False,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch routing with the kernel's semantics (autograd through the weights).

    Reference-only extras (the router's CPU path): group-limited selection
    (``num_groups``/``topk_groups``, a group scored by its top ``group_topn`` affinities)
    and ``selection_noise_TE`` added to the logits used
    for selection only (Gumbel "rsample" noise); the weights use the clean logits.
    A caller that already has them may pass ``scores_TE`` (softmax or sigmoid of the fp32
    logits, in the autograd graph; not for softmax_after_topk) and ``bad_T`` (the rows with a
    non-finite logit) to save recomputing them. ``ids_TK`` [T, k]: the selection, given (a
    recompute replaying its forward's routing): only the weights are computed. ``checked``:
    the caller validated the arguments once (the router, at construction).
    """
    if not checked:   # the router validated its options once, at construction
        _check(logits_TE, k, score_func, expert_bias_E)
    x = logits_TE.float()
    T, E = x.shape
    bad_T = nonfinite_rows(x) if bad_T is None else bad_T
    # On the CPU the host knows for free whether any row is bad; elsewhere assume some are.
    any_bad = x.device.type != "cpu" or _compiling() or bool(bad_T.any())
    xs = x if selection_noise_TE is None else x + selection_noise_TE.float()
    if scores_TE is None and score_func != "softmax_after_topk":
        scores_TE = _scores(x, score_func)
    if ids_TK is not None:
        if ids_TK.shape != (T, k):
            raise ValueError(f"replayed ids_TK has shape {tuple(ids_TK.shape)}, expected ({T}, {k})")
    elif expert_bias_E is not None or num_groups is not None:
        aff = xs if score_func == "softmax_after_topk" else (
            scores_TE if selection_noise_TE is None else _scores(xs, score_func))
        aff = aff.detach()
        if expert_bias_E is not None:
            aff = aff + expert_bias_E.float()
        aff = _sanitize(torch.where(bad_T[:, None], torch.zeros_like(aff), aff) if any_bad else aff)
    if ids_TK is None:
        # Bad rows: all keys equal, so they take experts 0..K-1 (their weights become NaN).
        if expert_bias_E is None:
            key = torch.where(bad_T[:, None], torch.zeros_like(xs), xs) if any_bad else xs
        else:
            key = aff
        if num_groups is not None:
            keep = _group_mask(aff, k, num_groups, topk_groups if topk_groups is not None else num_groups,
                               group_topn)
            key = torch.where(keep, key, torch.full_like(key, float("-inf")))
        ids_TK = _topk_lowest_index(key.detach(), k)
    if score_func == "softmax_after_topk":
        w = torch.softmax(x.gather(1, ids_TK), dim=-1)
    else:
        w = scores_TE.gather(1, ids_TK)
        if normalize:
            w = w / (w.sum(-1, keepdim=True) + _NORM_EPS)
    w = w * scaling_factor
    if any_bad:
        w = torch.where(bad_T[:, None], torch.full_like(w, float("nan")), w)
    if _compiling() or x.device.type != "cpu":   # bincount: a graph break, a host read on CUDA
        hist_E = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(
            0, ids_TK.reshape(-1), torch.ones(T * k, dtype=torch.int64, device=x.device))
    else:
        hist_E = torch.bincount(ids_TK.reshape(-1), minlength=E)
    return ids_TK, w, hist_E

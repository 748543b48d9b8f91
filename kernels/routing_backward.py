"""The routing op's backward: the gradient of the logits from the gradients of the k
weights and of the load-balancing loss, in one launch, plus its torch reference.

Legend (docs/moe.md): T tokens, E experts, K routes per token (top-k).

What it differentiates (``routing.py``'s forward): the weights ``w = scaling x f(sel)``
where ``sel`` are the selected experts' scores (softmax or sigmoid of the logits; for
``softmax_after_topk`` a softmax over the k selected logits), optionally renormalised to
sum 1; and, when the op computed the load-balancing loss, ``aux = sum_e P_e x r_e`` with
``P_e = sum_t p_te`` (``p`` the scores as a per-token distribution: softmax, or sigmoid
renormalised) and ``r_e`` the scaled route counts (constants): ``d aux / d p_te = r_e``,
so the loss's gradient arrives as one vector ``aux_grad_E = r_E x d loss / d aux``.
A row holding a non-finite logit gets NaN gradients (its weights were NaN).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import interpreter
from .eager import tracing

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is Linux-only; the reference works without it
    triton = None
    tl = None

_NORM_EPS = 1e-20   # the forward's guard of a k-sum (and of a row of sigmoids) that underflowed

if triton is not None:
    _NORM_EPS_C = tl.constexpr(_NORM_EPS)

    @triton.jit
    def _routing_bwd_kernel(logits_ptr, ids_ptr, gw_ptr, aux_ptr, gx_ptr, T, E, stride_t, scaling,
                            K: tl.constexpr, SCORE: tl.constexpr, NORMALIZE: tl.constexpr,
                            HAS_GW: tl.constexpr, HAS_AUX: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        # SCORE as the forward's: 0 softmax, 1 sigmoid, 2 softmax_after_topk.
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        kcols = tl.arange(0, BLOCK_K)
        row_ok = rows < T
        col_ok = cols < E
        k_ok = kcols < K
        mask = row_ok[:, None] & col_ok[None, :]
        kmask = row_ok[:, None] & k_ok[None, :]
        row_off = rows.to(tl.int64) * stride_t
        x = tl.load(logits_ptr + row_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        bad_T = tl.max(((x != x) | (x == float("inf")) | (x == float("-inf"))).to(tl.int32), axis=1) > 0
        x = tl.where(col_ok[None, :], tl.where(bad_T[:, None], 0.0, x), float("-inf"))
        kofs = rows.to(tl.int64)[:, None] * K + kcols[None, :]
        ids = tl.load(ids_ptr + kofs, mask=kmask, other=-1).to(tl.int32)
        if HAS_GW:
            gw = tl.load(gw_ptr + kofs, mask=kmask, other=0.0).to(tl.float32) * scaling
        else:
            gw = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        if HAS_AUX:
            a_E = tl.load(aux_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if SCORE == 1:
            s = tl.sigmoid(x)                           # padding columns: 0
        else:
            row_max = tl.max(x, axis=1)
            ex = tl.exp(x - row_max[:, None])
            s = ex / tl.sum(ex, axis=1)[:, None]        # the full softmax (padding columns: 0)
        if SCORE == 2:
            # the weights: a softmax over the k selected logits
            sel = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
            for j in tl.static_range(K):
                pick = cols[None, :] == tl.sum(tl.where(kcols[None, :] == j, ids, 0), axis=1)[:, None]
                sel = tl.where(kcols[None, :] == j, tl.sum(tl.where(pick, x, 0.0), axis=1)[:, None], sel)
            sel = tl.where(k_ok[None, :], sel, float("-inf"))
            ek = tl.exp(sel - tl.max(sel, axis=1)[:, None])
            pk = ek / tl.sum(ek, axis=1)[:, None]
            g_sel = pk * (gw - tl.sum(gw * pk, axis=1)[:, None])
            g_x = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
            for j in tl.static_range(K):
                pick = cols[None, :] == tl.sum(tl.where(kcols[None, :] == j, ids, 0), axis=1)[:, None]
                g_x += tl.where(pick, tl.sum(tl.where(kcols[None, :] == j, g_sel, 0.0), axis=1)[:, None], 0.0)
            if HAS_AUX:   # P of the full softmax
                g_x += s * (a_E[None, :] - tl.sum(a_E[None, :] * s, axis=1)[:, None])
        else:
            sel = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
            for j in tl.static_range(K):
                pick = cols[None, :] == tl.sum(tl.where(kcols[None, :] == j, ids, 0), axis=1)[:, None]
                sel = tl.where(kcols[None, :] == j, tl.sum(tl.where(pick, s, 0.0), axis=1)[:, None], sel)
            if NORMALIZE:   # w_j = sel_j / S:  dL/dsel_i = (g_i - sum_j g_j sel_j / S) / S
                denom = tl.sum(tl.where(k_ok[None, :], sel, 0.0), axis=1)[:, None] + _NORM_EPS_C
                gw = (gw - tl.sum(gw * sel, axis=1)[:, None] / denom) / denom
            g_s = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
            for j in tl.static_range(K):
                pick = cols[None, :] == tl.sum(tl.where(kcols[None, :] == j, ids, 0), axis=1)[:, None]
                g_s += tl.where(pick, tl.sum(tl.where(kcols[None, :] == j, gw, 0.0), axis=1)[:, None], 0.0)
            if HAS_AUX:
                if SCORE == 0:
                    g_s += a_E[None, :]
                else:   # p = s / S with S the row's sum of sigmoids
                    S = tl.sum(s, axis=1)[:, None] + _NORM_EPS_C
                    g_s += (a_E[None, :] - tl.sum(a_E[None, :] * s, axis=1)[:, None] / S) / S
            if SCORE == 0:
                g_x = s * (g_s - tl.sum(g_s * s, axis=1)[:, None])
            else:
                g_x = g_s * s * (1.0 - s)
        g_x = tl.where(bad_T[:, None], float("nan"), g_x)
        tl.store(gx_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], g_x, mask=mask)


def _block_t(E: int) -> int:
    block_e = 1 << max(0, (int(E) - 1).bit_length())
    if interpreter.ACTIVE:
        return max(1, min(4096, (1 << 20) // block_e))
    return max(1, min(64, 4096 // block_e))   # a few [T, E] fp32 tiles live at once


def routing_backward_reference(logits_TE: torch.Tensor, ids_TK: torch.Tensor, grad_weights_TK: Optional[torch.Tensor],
                               score_func: str, normalize: bool, scaling_factor: float,
                               aux_grad_E: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient of the logits [T, E] fp32, in plain torch (the kernel's rule)."""
    x = logits_TE.float()
    bad_T = ~torch.isfinite(x).all(-1)
    x = torch.where(bad_T[:, None], torch.zeros_like(x), x)
    gw = (torch.zeros(ids_TK.shape, device=x.device) if grad_weights_TK is None
          else grad_weights_TK.float()) * scaling_factor
    s = torch.sigmoid(x) if score_func == "sigmoid" else torch.softmax(x, dim=-1)
    if score_func == "softmax_after_topk":
        p = torch.softmax(x.gather(1, ids_TK), dim=-1)
        g_x = torch.zeros_like(x).scatter(1, ids_TK, p * (gw - (gw * p).sum(-1, keepdim=True)))
        if aux_grad_E is not None:
            g_x = g_x + s * (aux_grad_E - (aux_grad_E * s).sum(-1, keepdim=True))
        return torch.where(bad_T[:, None], float("nan"), g_x)
    sel = s.gather(1, ids_TK)
    if normalize:
        denom = sel.sum(-1, keepdim=True) + _NORM_EPS
        gw = (gw - (gw * sel).sum(-1, keepdim=True) / denom) / denom
    g_s = torch.zeros_like(s).scatter(1, ids_TK, gw)
    if aux_grad_E is not None:
        if score_func == "softmax":
            g_s = g_s + aux_grad_E
        else:
            S = s.sum(-1, keepdim=True) + _NORM_EPS
            g_s = g_s + (aux_grad_E - (aux_grad_E * s).sum(-1, keepdim=True) / S) / S
    if score_func == "softmax":
        g_x = s * (g_s - (g_s * s).sum(-1, keepdim=True))
    else:
        g_x = g_s * s * (1 - s)
    return torch.where(bad_T[:, None], float("nan"), g_x)


def _launch(logits_TE: torch.Tensor, ids_TK: torch.Tensor, grad_weights_TK: Optional[torch.Tensor],
            score_func: str, normalize: bool, scaling_factor: float,
            aux_grad_E: Optional[torch.Tensor]) -> torch.Tensor:
    T, E = logits_TE.shape
    K = ids_TK.shape[1]
    gx = torch.empty((T, E), dtype=torch.float32, device=logits_TE.device)
    if T == 0:
        return gx.to(logits_TE.dtype)
    logits_TE = logits_TE if logits_TE.stride(1) == 1 else logits_TE.contiguous()
    gw = grad_weights_TK.contiguous() if grad_weights_TK is not None else gx
    aux = aux_grad_E.contiguous() if aux_grad_E is not None else gx
    block_t = _block_t(E)
    _routing_bwd_kernel[(triton.cdiv(T, block_t),)](
        logits_TE, ids_TK.contiguous(), gw, aux, gx, T, E, logits_TE.stride(0), float(scaling_factor),
        K=K, SCORE=("softmax", "sigmoid", "softmax_after_topk").index(score_func), NORMALIZE=bool(normalize),
        HAS_GW=grad_weights_TK is not None, HAS_AUX=aux_grad_E is not None, BLOCK_T=block_t,
        BLOCK_E=1 << max(0, (E - 1).bit_length()), BLOCK_K=1 << max(0, (K - 1).bit_length()), num_warps=4)
    return gx if logits_TE.dtype == torch.float32 else gx.to(logits_TE.dtype)


# The launch as an op, for a backward that torch.compile traces (a Triton launch on fake
# tensors cannot be traced); eager backwards call ``_launch`` directly.
_routing_bwd_op = torch.library.custom_op("moepar::routing_backward", mutates_args=())(_launch)


@_routing_bwd_op.register_fake
def _(logits_TE, ids_TK, grad_weights_TK, score_func, normalize, scaling_factor, aux_grad_E):
    return logits_TE.new_empty(logits_TE.shape)


def routing_backward(logits_TE: torch.Tensor, ids_TK: torch.Tensor, grad_weights_TK: Optional[torch.Tensor],
                     score_func: str, normalize: bool, scaling_factor: float,
                     aux_grad_E: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient of the logits [T, E] (in the logits' dtype): one launch where Triton runs
    (the forward's kernel ran there), the torch reference elsewhere."""
    if triton is None or (logits_TE.device.type != "cuda" and not interpreter.ACTIVE):
        return routing_backward_reference(logits_TE, ids_TK, grad_weights_TK, score_func, normalize,
                                          scaling_factor, aux_grad_E).to(logits_TE.dtype)
    args = (logits_TE, ids_TK, grad_weights_TK, score_func, bool(normalize), float(scaling_factor), aux_grad_E)
    return _routing_bwd_op(*args) if tracing() else _launch(*args)

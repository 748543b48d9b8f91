"""Token permutation for the experts: ``permute`` gathers each kept route's token row into
an expert-major buffer, ``unpermute`` sums each token's expert rows back, weighted.

Legend: T tokens, D hidden, E experts, K routes per token (top-k), N rows of the permuted
buffer (kept routes, or E*C when padded to a capacity C), R = T*K routes.

Layout. Rows are expert-major and, inside an expert, in token order (then k order).
``row_map_TK[t, k]`` is the row of route (t, k) = flat route t*K + k, -1 where it was
dropped; ``route_N[n]`` (internal) is its inverse, the route of row n or -1 for a padding
row. Both come from ``permute_index`` (``route_index``, ``inverse_row_map``, re-exported
here), in torch on the ids' device, with no host read when the caller passes ``num_rows``.

Kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``): one program per block of rows,
vectorised over D with an inner loop over D chunks, int64 offsets, fp32 arithmetic.

* ``_gather_rows_kernel``: dst[n] = scale[route] * src[route // K] (zero where route < 0),
  optionally dot[route] = <other[n], src[route // K]>. It is the permute forward
  (no scale) and the unpermute backward (scale = the routing weight, dot = its gradient).
* ``_combine_rows_kernel``: dst[t] = sum_k w[t, k] * src[row_map[t, k]] over kept
  routes, fp32 accumulation. It is the unpermute forward and (w = 1) the permute backward.

``permute``/``unpermute`` are ``torch.library.custom_op``s (namespace ``moepar``) with fake
and autograd registrations for ``torch.compile`` (checked with ``torch.library.opcheck``); in
eager mode the same functions run as autograd Functions (``eager.py``: less host time per
call). ``impl="auto"`` runs the
kernels on CUDA and the torch reference elsewhere; ``impl="triton"`` forces the kernels
(tests, under the interpreter), ``impl="reference"`` forces torch.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import interpreter
from .eager import both
from .permute_index import check_permute_args, check_unpermute_args, inverse_row_map, route_index

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is Linux-only; the reference path works without it
    triton = None
    tl = None

IMPLS = ("auto", "triton", "reference")

# fn(shape, dtype, device) for the reference path's large CPU outputs (the dense permute
# gather, the unpermute backward's grad_y); moepar.moe.cpu installs its buffer pool here,
# since this package does not import moepar. CUDA tensors never reach it. None: torch.empty.
_cpu_empty: Optional[Callable] = None


def set_cpu_allocator(fn: Optional[Callable]) -> None:
    global _cpu_empty
    _cpu_empty = fn


def _empty_rows(like: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    if _cpu_empty is not None and like.device.type == "cpu":
        return _cpu_empty((rows, cols), dtype, like.device)
    return torch.empty((rows, cols), dtype=dtype, device=like.device)

if triton is not None:

    @triton.jit
    def _gather_rows_kernel(src_ptr, route_ptr, scale_ptr, other_ptr, dot_ptr, dst_ptr,
                            num_rows, D, K, stride_src, stride_other, stride_dst,
                            HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < num_rows
        route = tl.load(route_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        valid = route >= 0
        tok = tl.where(valid, route // K, 0)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + route, mask=valid, other=0.0).to(tl.float32)
        if HAS_DOT:
            dot = tl.zeros([BLOCK_N], dtype=tl.float32)
        cols = tl.arange(0, BLOCK_D)
        src_row = src_ptr + tok * stride_src
        dst_row = dst_ptr + rows * stride_dst
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            c_ok = c < D
            m_src = valid[:, None] & c_ok[None, :]
            v = tl.load(src_row[:, None] + c[None, :], mask=m_src, other=0.0)
            if HAS_DOT:
                o = tl.load(other_ptr + rows[:, None] * stride_other + c[None, :], mask=m_src, other=0.0)
                dot += tl.sum(v.to(tl.float32) * o.to(tl.float32), axis=1)
            if HAS_SCALE:
                v = v.to(tl.float32) * scale[:, None]
            # Padding rows (route < 0) get the zeros the masked load produced.
            tl.store(dst_row[:, None] + c[None, :], v.to(dst_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & c_ok[None, :])
        if HAS_DOT:
            tl.store(dot_ptr + route, dot, mask=valid)

    @triton.jit
    def _combine_rows_kernel(src_ptr, row_map_ptr, w_ptr, dst_ptr, T, D, K, stride_src, stride_dst,
                             HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        toks = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        tok_ok = toks < T
        cols = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            c_ok = c < D
            acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for k in range(0, K):
                # row_map/w reloads per D chunk hit L1; the rows themselves are read once.
                row = tl.load(row_map_ptr + toks * K + k, mask=tok_ok, other=-1).to(tl.int64)
                valid = row >= 0
                v = tl.load(src_ptr + row[:, None] * stride_src + c[None, :],
                            mask=valid[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
                if HAS_WEIGHTS:
                    w = tl.load(w_ptr + toks * K + k, mask=valid, other=0.0).to(tl.float32)
                    v = v * w[:, None]
                acc += v
            tl.store(dst_ptr + toks[:, None] * stride_dst + c[None, :], acc.to(dst_ptr.dtype.element_ty),
                     mask=tok_ok[:, None] & c_ok[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _blocks(num_rows: int, D: int) -> tuple[int, int, int]:
    """(rows per program, D chunk, warps). ~4-8k elements a tile on a GPU; the
    interpreter pays per program and per op, not per element, so it gets big tiles."""
    block_d = min(_next_pow2(max(D, 1)), 4096 if interpreter.ACTIVE else 1024)
    tile = 65536 if interpreter.ACTIVE else (8192 if block_d >= 1024 else 4096)
    block_n = max(1, min(tile // block_d, _next_pow2(max(num_rows, 1))))
    return block_n, block_d, 8 if block_d >= 1024 else 4


def _use_triton(t: torch.Tensor, impl: str) -> bool:
    if impl == "reference":
        return False
    if impl == "triton":
        if triton is None:
            raise ValueError("impl='triton' needs the triton package")
        if t.device.type != "cuda" and not interpreter.ACTIVE:
            raise ValueError(f"impl='triton' needs CUDA tensors (got {t.device}) or TRITON_INTERPRET=1 "
                             f"set before import; use impl='auto' or 'reference'")
        interpreter.check()
        return True
    return triton is not None and t.device.type == "cuda"


# ---- references (plain torch; the path off CUDA) ----------------------------------------

def _gather_reference(x_TD: torch.Tensor, route_N: torch.Tensor, K: int, dense: bool) -> torch.Tensor:
    if dense:  # every row has a route (dropless): one gather
        out = _empty_rows(x_TD, route_N.shape[0], x_TD.shape[1], x_TD.dtype)
        return torch.index_select(x_TD, 0, route_N // K, out=out)
    if x_TD.shape[0] == 0:   # no tokens: every row is padding
        return x_TD.new_zeros(route_N.shape[0], x_TD.shape[1])
    rows = x_TD.index_select(0, route_N.clamp(min=0) // K)
    return torch.where((route_N >= 0)[:, None], rows, 0)


def _combine_reference(src_ND: torch.Tensor, row_map_TK: torch.Tensor, weights_TK: Optional[torch.Tensor],
                       num_tokens: int) -> torch.Tensor:
    """sum_k w[t, k] * src[row_map[t, k]] over kept routes, accumulated in fp32.

    fp32: one ``embedding_bag`` (mode "sum", per-sample weights): a single pass with no
    [T, K, D] temporary; a token's bag holds its kept routes only. Other dtypes: a K-step
    loop of gathers into an fp32 accumulator (T x D temporaries)."""
    T, K = row_map_TK.shape
    D = src_ND.shape[1]
    if T == 0 or src_ND.shape[0] == 0 or D == 0:
        return src_ND.new_zeros(T, D)
    kept_TK = row_map_TK >= 0
    # The dense fast path needs a host read of the mask: only where that read is free.
    any_dropped = src_ND.device.type != "cpu" or not bool(kept_TK.all())
    if src_ND.dtype == torch.float32:
        w = None if weights_TK is None else weights_TK.to(torch.float32)
        if not any_dropped:
            return F.embedding_bag(row_map_TK, src_ND, mode="sum", per_sample_weights=w)
        per_tok = kept_TK.sum(1)
        offsets = torch.cumsum(per_tok, 0) - per_tok
        return F.embedding_bag(row_map_TK[kept_TK], src_ND, offsets, mode="sum",
                               per_sample_weights=None if w is None else w[kept_TK])
    acc = torch.zeros(T, D, dtype=torch.float32, device=src_ND.device)
    w = None if weights_TK is None else weights_TK.to(torch.float32)
    for k in range(K):
        v = src_ND.index_select(0, row_map_TK[:, k].clamp(min=0))
        if any_dropped:  # zero, not 0 * value: a dropped route must not leak inf/nan
            v.masked_fill_(~kept_TK[:, k, None], 0)
        if w is None:
            acc.add_(v)
        else:
            acc.addcmul_(v, w[:, k, None])
    return acc.to(src_ND.dtype)


_BWD_CHUNK_ELEMS = 1 << 19   # elements per row chunk of the unpermute backward: 2 MB fp32, L2-sized


def _unpermute_backward_reference(grad_TD: torch.Tensor, y_ND: Optional[torch.Tensor], route_N: torch.Tensor,
                                  weights_TK: Optional[torch.Tensor], K: int, dtype: torch.dtype
                                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Row order, in cache-sized chunks of rows n: G = grad[t(n)] gathered straight into
    grad_y, grad_w[route(n)] = <y[n], G> (fp32), then grad_y = w[route(n)] * G in place.
    One write of grad_y and one read of y: no [N, D] temporaries."""
    N = route_N.shape[0]
    T, D = grad_TD.shape
    if T == 0:   # no tokens: every row is capacity padding, its gradient zero; no weights to touch
        return (grad_TD.new_zeros(N, D, dtype=dtype),
                None if y_ND is None else torch.zeros(0, K, dtype=torch.float32, device=grad_TD.device))
    valid = route_N >= 0
    any_pad = N > 0 and (grad_TD.device.type != "cpu" or not bool(valid.all()))
    route = route_N.clamp(min=0)
    tok = route // K
    src = grad_TD.to(dtype)
    grad_y = _empty_rows(grad_TD, N, D, dtype)
    dot_N = None if y_ND is None else torch.empty(N, dtype=torch.float32, device=grad_TD.device)
    w_N = weights_TK.reshape(-1).to(torch.float32).index_select(0, route) if weights_TK is not None else None
    step = max(1, _BWD_CHUNK_ELEMS // max(D, 1))
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        G = torch.index_select(src, 0, tok[n0:n1], out=grad_y[n0:n1])
        if any_pad:
            G.masked_fill_(~valid[n0:n1, None], 0)
        if dot_N is not None:
            y_c = y_ND[n0:n1]     # fp32 dots; low precision is upcast a chunk at a time
            torch.linalg.vecdot(y_c.float(), G.float(), out=dot_N[n0:n1])
        if w_N is not None:
            G.mul_(w_N[n0:n1, None])
    grad_w = None
    if dot_N is not None:
        grad_w = torch.zeros(T * K, dtype=torch.float32, device=grad_TD.device)
        grad_w.index_add_(0, route, dot_N.masked_fill_(~valid, 0) if any_pad else dot_N)
        grad_w = grad_w.view(T, K)
    return grad_y, grad_w


def permute_reference(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, dropped_TK: Optional[torch.Tensor],
                      num_experts: int, *, capacity: Optional[int] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``permute`` in plain torch (same contract, differentiable through torch autograd)."""
    check_permute_args(x_TD, expert_ids_TK, dropped_TK, num_experts, capacity)
    K = expert_ids_TK.shape[1]
    counts_E, row_map_TK, route_N = route_index(expert_ids_TK, dropped_TK, num_experts, capacity, None)
    tok_N = (route_N.clamp(min=0) // K)
    x_ND = x_TD.index_select(0, tok_N)
    if capacity is not None:
        x_ND = torch.where((route_N >= 0)[:, None], x_ND, 0)
    return x_ND, counts_E, row_map_TK


def unpermute_reference(y_ND: torch.Tensor, row_map_TK: torch.Tensor, weights_TK: Optional[torch.Tensor],
                        num_tokens: int) -> torch.Tensor:
    """``unpermute`` in plain torch (differentiable through torch autograd): a gather of
    [T, K, D] rows and an fp32 weighted sum."""
    check_unpermute_args(y_ND, row_map_TK, weights_TK, num_tokens)
    T, K = row_map_TK.shape
    kept = (row_map_TK >= 0)
    if y_ND.shape[0] == 0:  # nothing kept; stay in the graph so y_ND gets its (empty) grad
        return y_ND.new_zeros(T, y_ND.shape[1]) + y_ND.sum()
    rows = y_ND.float().index_select(0, row_map_TK.clamp(min=0).reshape(-1))
    w = kept.float() if weights_TK is None else torch.where(kept, weights_TK.float(), 0.0)
    rows = torch.where(kept.reshape(-1, 1), rows, 0.0)
    return (rows.view(T, K, -1) * w[:, :, None]).sum(1).to(y_ND.dtype)


# ---- launchers ----------------------------------------------------------------------------

def _gather(src: torch.Tensor, route_N: torch.Tensor, K: int, out_dtype: torch.dtype,
            scale_R: Optional[torch.Tensor] = None, other_ND: Optional[torch.Tensor] = None,
            dot_R: Optional[torch.Tensor] = None) -> torch.Tensor:
    N, D = route_N.shape[0], src.shape[1]
    dst = torch.empty(N, D, dtype=out_dtype, device=src.device)
    if N == 0 or D == 0:
        return dst
    src = src if src.stride(1) == 1 else src.contiguous()
    if other_ND is not None and other_ND.stride(1) != 1:
        other_ND = other_ND.contiguous()
    block_n, block_d, warps = _blocks(N, D)
    _gather_rows_kernel[(triton.cdiv(N, block_n),)](
        src, route_N, scale_R if scale_R is not None else src, other_ND if other_ND is not None else src,
        dot_R if dot_R is not None else dst, dst, N, D, K, src.stride(0),
        other_ND.stride(0) if other_ND is not None else 0, dst.stride(0),
        HAS_SCALE=scale_R is not None, HAS_DOT=dot_R is not None, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=warps)
    return dst


def _combine(src_ND: torch.Tensor, row_map_TK: torch.Tensor, weights_TK: Optional[torch.Tensor]) -> torch.Tensor:
    T, K = row_map_TK.shape
    D = src_ND.shape[1]
    dst = torch.empty(T, D, dtype=src_ND.dtype, device=src_ND.device)
    if T == 0 or D == 0:
        return dst
    if src_ND.shape[0] == 0:
        return dst.zero_()
    src_ND = src_ND if src_ND.stride(1) == 1 else src_ND.contiguous()
    row_map_TK = row_map_TK.contiguous()
    w = weights_TK.contiguous() if weights_TK is not None else row_map_TK
    block_t, block_d, warps = _blocks(T, D)
    _combine_rows_kernel[(triton.cdiv(T, block_t),)](
        src_ND, row_map_TK, w, dst, T, D, K, src_ND.stride(0), dst.stride(0),
        HAS_WEIGHTS=weights_TK is not None, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps)
    return dst


# ---- custom ops -----------------------------------------------------------------------------

def _permute_impl(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, dropped_TK: Optional[torch.Tensor],
                  num_experts: int, capacity: Optional[int], num_rows: Optional[int], impl: str,
                  need_counts: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    K = expert_ids_TK.shape[1]
    counts_E, row_map_TK, route_N = route_index(expert_ids_TK, dropped_TK, num_experts, capacity, num_rows,
                                                need_counts)
    if _use_triton(x_TD, impl):
        x_ND = _gather(x_TD, route_N, K, x_TD.dtype)
    else:
        x_ND = _gather_reference(x_TD, route_N, K, dense=capacity is None)
    if counts_E is None:   # the caller has them: an empty placeholder (an op output may not alias)
        counts_E = row_map_TK.new_empty(0)
    return x_ND, counts_E, row_map_TK, route_N


_permute_op = torch.library.custom_op("moepar::permute", mutates_args=())(_permute_impl)


@_permute_op.register_fake
def _(x_TD, expert_ids_TK, dropped_TK, num_experts, capacity, num_rows, impl, need_counts=True):
    T, K = expert_ids_TK.shape
    if capacity is not None:
        n = num_experts * capacity
    elif num_rows is not None:
        n = num_rows
    elif dropped_TK is None:  # dropless with nothing dropped: every route is a row (static)
        n = T * K
    else:
        n = torch.library.get_ctx().new_dynamic_size()
    skip = not need_counts and capacity is None and num_rows is not None
    return (x_TD.new_empty(n, x_TD.shape[1]), x_TD.new_empty(0 if skip else num_experts, dtype=torch.int64),
            x_TD.new_empty(T, K, dtype=torch.int64), x_TD.new_empty(n, dtype=torch.int64))


def _permute_setup(ctx, inputs, output):
    ctx.num_tokens, ctx.impl = inputs[0].shape[0], inputs[6]
    ctx.save_for_backward(output[2], output[3])
    ctx.set_materialize_grads(False)


def _permute_backward(ctx, grad_x_ND, grad_counts, grad_row_map, grad_route_N):
    row_map_TK, route_N = ctx.saved_tensors
    grad_x = None
    if grad_x_ND is not None:
        unpermute = _unpermute_call if getattr(ctx, "eager", False) else _unpermute_op
        grad_x = unpermute(grad_x_ND, row_map_TK, None, ctx.num_tokens, ctx.impl, route_N)
    return grad_x, None, None, None, None, None, None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)
_permute_call = both(_permute_op, _permute_impl, _permute_setup, _permute_backward)


def _unpermute_impl(y_ND: torch.Tensor, row_map_TK: torch.Tensor, weights_TK: Optional[torch.Tensor],
                    num_tokens: int, impl: str, route_N: Optional[torch.Tensor] = None) -> torch.Tensor:
    if _use_triton(y_ND, impl):
        return _combine(y_ND, row_map_TK, weights_TK)
    return _combine_reference(y_ND, row_map_TK, weights_TK, num_tokens)


_unpermute_op = torch.library.custom_op("moepar::unpermute", mutates_args=())(_unpermute_impl)


@_unpermute_op.register_fake
def _(y_ND, row_map_TK, weights_TK, num_tokens, impl, route_N=None):
    return y_ND.new_empty(num_tokens, y_ND.shape[1])


def _unpermute_setup(ctx, inputs, output):
    y_ND, row_map_TK, weights_TK, num_tokens, impl, route_N = inputs
    ctx.impl, ctx.num_rows, ctx.dtype = impl, y_ND.shape[0], y_ND.dtype
    ctx.has_weights = weights_TK is not None
    need_w = weights_TK is not None and weights_TK.requires_grad
    ctx.save_for_backward(row_map_TK, weights_TK, y_ND if need_w else None, route_N)


def _unpermute_backward(ctx, grad_TD):
    row_map_TK, weights_TK, y_ND, route_N = ctx.saved_tensors
    backward = _unpermute_bwd_call if getattr(ctx, "eager", False) else _unpermute_bwd_op
    grad_y, grad_w = backward(grad_TD.contiguous(), y_ND, row_map_TK, weights_TK,
                              ctx.num_rows, ctx.dtype, ctx.impl, route_N)
    grad_w = grad_w.to(weights_TK.dtype) if (y_ND is not None and ctx.has_weights) else None
    return grad_y, None, grad_w, None, None, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)
_unpermute_call = both(_unpermute_op, _unpermute_impl, _unpermute_setup, _unpermute_backward, grad_args=(0, 2))


def _unpermute_bwd_impl(grad_TD: torch.Tensor, y_ND: Optional[torch.Tensor], row_map_TK: torch.Tensor,
                        weights_TK: Optional[torch.Tensor], num_rows: int, dtype: torch.dtype, impl: str,
                        route_N: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_y_ND, grad_weights_TK fp32; empty when y_ND is None). ``route_N``: the permute's
    own inverse of ``row_map_TK`` where the caller kept it (else rebuilt here)."""
    T, K = row_map_TK.shape
    if route_N is None:
        route_N = inverse_row_map(row_map_TK, num_rows)
    if _use_triton(grad_TD, impl):
        grad_w = torch.zeros(T * K, dtype=torch.float32, device=grad_TD.device) if y_ND is not None else None
        scale = weights_TK.reshape(-1).contiguous() if weights_TK is not None else None
        grad_y = _gather(grad_TD, route_N, K, dtype, scale, y_ND, grad_w)
        grad_w = grad_w.view(T, K) if grad_w is not None else None
    else:
        grad_y, grad_w = _unpermute_backward_reference(grad_TD, y_ND, route_N, weights_TK, K, dtype)
    if grad_w is None:
        grad_w = grad_TD.new_empty(0, dtype=torch.float32)
    return grad_y, grad_w


_unpermute_bwd_op = torch.library.custom_op("moepar::unpermute_backward", mutates_args=())(_unpermute_bwd_impl)
_unpermute_bwd_call = both(_unpermute_bwd_op, _unpermute_bwd_impl)


@_unpermute_bwd_op.register_fake
def _(grad_TD, y_ND, row_map_TK, weights_TK, num_rows, dtype, impl, route_N=None):
    T, K = row_map_TK.shape
    gw = grad_TD.new_empty(T, K, dtype=torch.float32) if y_ND is not None else grad_TD.new_empty(0, dtype=torch.float32)
    return grad_TD.new_empty(num_rows, grad_TD.shape[1], dtype=dtype), gw


# ---- public API -------------------------------------------------------------------------------

def permute(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, dropped_TK: Optional[torch.Tensor],
            num_experts: int, *, capacity: Optional[int] = None, num_rows: Optional[int] = None,
            impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather each kept route's token row, expert-major: ``(x_ND, tokens_per_expert_E, row_map_TK)``.

    Dropless (``capacity=None``): N = kept routes; expert e's rows follow expert e-1's, in
    token order (then k order). ``capacity=C``: x_ND has E*C rows, expert e's at
    ``[e*C, e*C + count_e)``, zero rows after; a kept route beyond C is an error.
    ``tokens_per_expert_E`` (int64, on x's device) counts kept routes in both modes.
    ``row_map_TK[t, k]`` is the row of route (t, k), -1 where dropped. ``dropped_TK`` may
    be None. Differentiable w.r.t. ``x_TD``. ``impl``: "auto" (Triton on CUDA, torch
    elsewhere), "triton" or "reference". Raises ``ValueError`` on ids outside
    ``[0, num_experts)``, non-integer ids or mismatched shapes.

    ``num_rows``: x_ND's rows when the caller already knows them (dropless: the kept routes;
    with a capacity: E*C). Then nothing is read back to the host (no wait on CUDA, a static
    shape under torch.compile) and the caller vouches for what that read would check: ids in
    range, no expert over its capacity. Without it the permute reads the route histogram once.
    """
    return permute_routes(x_TD, expert_ids_TK, dropped_TK, num_experts, capacity=capacity, num_rows=num_rows,
                          impl=impl)[:3]


def permute_routes(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, dropped_TK: Optional[torch.Tensor],
                   num_experts: int, *, capacity: Optional[int] = None, num_rows: Optional[int] = None,
                   impl: str = "auto", counts_E: Optional[torch.Tensor] = None, want_counts: bool = True,
                   checked: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``permute`` and ``route_N`` (the route of each row, -1 padding), which ``unpermute``
    takes to skip rebuilding it in its backward. Dropless with ``num_rows``, no histogram is
    made where the caller has the routes per expert (``counts_E``, returned as given) or
    does not want them (``want_counts=False``: None returned). ``checked``: the caller ran
    ``check_permute_args`` itself (once, before a collective)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    if not checked:
        check_permute_args(x_TD, expert_ids_TK, dropped_TK, num_experts, capacity, num_rows)
    need = capacity is not None or num_rows is None or (want_counts and counts_E is None)
    x_ND, counts, row_map_TK, route_N = _permute_call(x_TD, expert_ids_TK, dropped_TK, int(num_experts), capacity,
                                                      num_rows, impl, need)
    return x_ND, counts if need else counts_E, row_map_TK, route_N


def unpermute(y_ND: torch.Tensor, row_map_TK: torch.Tensor, weights_TK: Optional[torch.Tensor],
              num_tokens: int, *, impl: str = "auto", route_N: Optional[torch.Tensor] = None,
              checked: bool = False) -> torch.Tensor:
    """Weighted sum of each token's expert rows: ``y_TD[t] = sum_k w[t,k] * y_ND[row_map[t,k]]``.

    fp32 accumulation, result in y_ND's dtype; routes with ``row_map -1`` contribute
    nothing, rows no route maps to (capacity padding) are ignored. ``weights_TK=None``
    means weight 1. Differentiable w.r.t. ``y_ND`` and ``weights_TK`` (grad in its dtype).
    ``route_N``: the route of each row, as ``permute_routes`` returned it: the backward then
    needs no inverse of ``row_map_TK``. ``checked``: the arguments come from ``permute`` and
    the caller's own exchange (the MoE layer's combine), valid by construction: not checked.
    """
    if not checked:
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
        check_unpermute_args(y_ND, row_map_TK, weights_TK, num_tokens)
    return _unpermute_call(y_ND, row_map_TK, weights_TK, int(num_tokens), impl, route_N)

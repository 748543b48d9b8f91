"""FP8 token dispatch (``ExchangeConfig.dispatch_dtype="fp8"``), as DeepSeek-V3 trains.

Legend (docs/moe.md): T tokens, N rows, D hidden, K routes per token, Q = ceil(D / 128) scale
blocks per row, V = D + 4·Q bytes of one packed FP8 row.

Before the dispatch all-to-all each row is quantized to ``float8_e4m3fn`` with one fp32
scale per block of 128 channels (DeepSeek-V3's 1x128 activation tiles). The rule lives
with its kernel in ``moepar_kernels.permute_fp8`` (scale = max(amax / 448, 2^-126) in fp32,
a block of zeros scale 1, a block holding a NaN or an infinity scale NaN and values 0 so
that it comes back all NaN; values clamped to [-448, 448], rounded to nearest even). The
scales travel in the same exchange as the rows: each row is sent as D + 4·Q bytes
(``row_bytes``), so the all-to-all carries (D + 4·D/128) / (2·D) = 0.52x the bytes of
bf16 rows. After the exchange the rows are dequantized to the compute dtype and the
experts compute as before. The gradient passes the quantization straight through (the
quantized rows' gradient is the rows' gradient), as in DeepSeek-V3's recipe.

The exchange is issued without waiting (``all_to_all_start``), so the shared experts run
while it is in flight, as in the compute-dtype dispatch; the rows are dequantized when it
is waited on. Row-per-route dispatch (the default dropless form) permutes and quantizes in
one pass (``permute_all_to_all_start``: one Triton kernel on CUDA writes the FP8 rows and their scales in
expert-major order; the torch reference elsewhere, bit for bit the same); the other
exchange forms quantize their already permuted rows (``all_to_all``).

``ExchangeConfig.combine_grad_dtype="fp8"``: in backward, the gradient of the combine's rows,
which goes back to the experts' ranks (the expert outputs' gradient, DeepSeek-V3 sends it
in FP8 before the down-projection's backward), crosses the same way (``combine_all_to_all``).

Rows are sent as bytes (uint8), which every backend carries (gloo has no float8 type); on
CUDA the quantization runs where the rows are, with no host read.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from moepar_kernels.permute import route_index, unpermute
from moepar_kernels.permute_index import check_permute_args
from moepar_kernels.permute_fp8 import (BLOCK as KERNEL_BLOCK, E4M3_MAX, FP8, pack, permute_quantize,
                                        quantize_reference as quantize, unpack_dequantize)

from ...parallel import comm
from ..traffic import FP8_BLOCK as BLOCK, fp8_row_bytes

if KERNEL_BLOCK != BLOCK:   # the cost model's bytes and the kernel's blocks must agree
    raise ImportError(f"moepar_kernels.permute_fp8.BLOCK={KERNEL_BLOCK} != traffic.FP8_BLOCK={BLOCK}")

__all__ = ["E4M3_MAX", "FP8", "quantize", "dequantize", "pack", "unpack", "fake_quantize", "row_bytes",
           "all_to_all_start", "permute_all_to_all_start", "combine_all_to_all"]


row_bytes = fp8_row_bytes   # bytes one row takes on the wire: D fp8 values and Q fp32 scales


def dequantize(q_ND: torch.Tensor, scale_NQ: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale per block, in ``dtype``."""
    N, D = q_ND.shape
    Q = scale_NQ.shape[1]
    x = q_ND.float()
    if Q * BLOCK != D:
        x = F.pad(x, (0, Q * BLOCK - D))
    return (x.view(N, Q, BLOCK) * scale_NQ[..., None]).view(N, Q * BLOCK)[:, :D].to(dtype)


def unpack(packed: torch.Tensor, D: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The rows ``pack`` sent, dequantized to ``dtype`` (into ``out`` when given), in one
    pass with no fp32 copy of them (``moepar_kernels.permute_fp8.unpack_dequantize``)."""
    return unpack_dequantize(packed, D, dtype, out=out)


def fake_quantize(x_ND: torch.Tensor) -> torch.Tensor:
    """What the receiver gets for ``x_ND``: dequantize(quantize(x)) in x's dtype (no grad)."""
    return dequantize(*quantize(x_ND), x_ND.dtype)


def _splits(sizes: Sequence[int] | None):
    return None if sizes is None else tuple(int(s) for s in sizes)


class _ReceivedRows(torch.autograd.Function):
    """The received rows in the compute dtype: a buffer that the exchange's ``Pending`` fills
    (dequantizing the received bytes) when it is waited on. Backward: the reverse all-to-all
    of the gradient in the compute dtype (straight through the quantization), then the
    permute's backward when the rows were permuted in the same pass (``row_map_TK``)."""

    @staticmethod
    def forward(ctx, x, row_map_TK, group, out_splits, in_splits, stats, num_rows):
        ctx.group, ctx.out_s, ctx.in_s, ctx.stats, ctx.T = group, out_splits, in_splits, stats, x.shape[0]
        ctx.permuted = row_map_TK is not None
        if ctx.permuted:
            ctx.save_for_backward(row_map_TK)
        return x.new_empty(num_rows, x.shape[1])

    @staticmethod
    def backward(ctx, g):
        g = comm.all_to_all_rows(g, ctx.group, ctx.in_s, ctx.out_s, backward=True, stats=ctx.stats)
        if ctx.permuted:
            (row_map_TK,) = ctx.saved_tensors
            g = unpermute(g, row_map_TK, None, ctx.T)
        return g, None, None, None, None, None, None


def _start(x, packed, row_map_TK, group, output_split_sizes, input_split_sizes, stats):
    out_s, in_s = _splits(output_split_sizes), _splits(input_split_sizes)
    num_rows = packed.shape[0] if out_s is None else sum(out_s)
    recv, pending = comm.all_to_all_start(packed, group, out_s, in_s, stats=stats)
    rows = _ReceivedRows.apply(x, row_map_TK, group, out_s, in_s, stats, num_rows)
    D = x.shape[1]
    pending.then(lambda: unpack(recv, D, rows.dtype, out=rows))
    return rows, pending


def all_to_all_start(x_ND: torch.Tensor, group, output_split_sizes: Sequence[int] | None,
                     input_split_sizes: Sequence[int] | None, stats: comm.CommStats | None = None
                     ) -> tuple[torch.Tensor, comm.Pending]:
    """The dispatch all-to-all with FP8 rows, issued without waiting: (rows, pending), the
    rows usable after ``comm.wait_for(rows, pending)`` (work queued before it overlaps the
    transfer). A group of one rank moves nothing: x itself."""
    if comm.group_size(group) == 1:
        return x_ND, comm.Pending()
    return _start(x_ND, pack(*quantize(x_ND)), None, group, output_split_sizes, input_split_sizes, stats)


def permute_all_to_all_start(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
                             num_experts: int, num_rows: int, group, output_split_sizes: Sequence[int],
                             input_split_sizes: Sequence[int], stats: comm.CommStats | None = None
                             ) -> tuple[torch.Tensor, comm.Pending, torch.Tensor]:
    """The row-per-route dispatch with FP8 rows: ``permute`` and ``all_to_all_start`` in one,
    the quantization fused into the permute (``moepar_kernels.permute_fp8``). Returns the
    received rows (dequantized once ``pending`` is waited on; differentiable w.r.t. ``x_TD``),
    the pending exchange, ``row_map_TK`` and its inverse ``route_N``. ``num_rows``: the kept routes (the dispatcher
    knows them from its counts exchange; no host read). The group has more than one rank."""
    check_permute_args(x_TD, expert_ids_TK, dropped_TK, num_experts, None, num_rows)
    _, row_map_TK, route_N = route_index(expert_ids_TK, dropped_TK, num_experts, None, num_rows, False)
    packed_NV = permute_quantize(x_TD, route_N, expert_ids_TK.shape[1])
    rows, pending = _start(x_TD, packed_NV, row_map_TK, group, output_split_sizes, input_split_sizes, stats)
    return rows, pending, row_map_TK, route_N


class _FP8GradAllToAll(torch.autograd.Function):
    """Forward: the combine all-to-all in the compute dtype; backward: the gradient quantized,
    all-to-all'd as bytes to the experts' ranks and dequantized there."""

    @staticmethod
    def forward(ctx, y_ND, group, out_splits, in_splits, stats):
        ctx.group, ctx.out_s, ctx.in_s, ctx.stats = group, out_splits, in_splits, stats
        return comm.all_to_all_rows(y_ND, group, out_splits, in_splits, stats=stats)

    @staticmethod
    def backward(ctx, g):
        packed = comm.all_to_all_rows(pack(*quantize(g)), ctx.group, ctx.in_s, ctx.out_s, backward=True,
                                      stats=ctx.stats)
        return unpack(packed, g.shape[1], g.dtype), None, None, None, None


def combine_all_to_all(y_ND: torch.Tensor, group, output_split_sizes: Sequence[int] | None,
                       input_split_sizes: Sequence[int] | None, stats: comm.CommStats | None = None) -> torch.Tensor:
    """The combine all-to-all whose backward sends the gradient in FP8 (``combine_grad_dtype``)."""
    if comm.group_size(group) == 1:
        return y_ND
    return _FP8GradAllToAll.apply(y_ND, group, _splits(output_split_sizes), _splits(input_split_sizes), stats)

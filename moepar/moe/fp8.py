"""FP8 token dispatch (``MoEConfig.dispatch_dtype="fp8"``), as DeepSeek-V3 trains.

Legend (docs/moe.md): N rows, D hidden, B = ceil(D / 128) scale blocks per row.

Before the dispatch all-to-all each row is quantized to ``float8_e4m3fn`` with one fp32
scale per block of 128 channels (DeepSeek-V3's 1x128 activation tiles): scale = amax / 448
(448 is e4m3's largest finite value), exact in fp32 with no rounding to a power of two; a
block of zeros takes scale 1 (its values stay 0); a block holding a NaN or an infinity
takes a NaN scale and comes back all NaN (the layer's ``check_finite`` refuses such inputs
before the dispatch). The values are ``x / scale`` clamped to [-448, 448] and rounded to
nearest (torch's cast). The scales travel in the same exchange as the rows: each row is
sent as D + 4·B bytes (``row_bytes``), so the all-to-all carries (D + 4·D/128) / (2·D) =
0.52x the bytes of bf16 rows. After the exchange the rows are dequantized to the compute
dtype, and the experts compute as before. The combine all-to-all and every backward
all-to-all stay in the compute dtype; the gradient passes the quantization straight
through (the quantized rows' gradient is the rows' gradient), as in DeepSeek-V3's recipe.

Rows are sent as bytes (uint8), which every backend carries (gloo has no float8 type); on
CUDA the quantization runs where the rows are, with no host read.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..parallel import comm
from .traffic import FP8_BLOCK as BLOCK, fp8_row_bytes

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn


def scale_blocks(D: int) -> int:
    """B: scale blocks per row of D channels (the last one may be partial)."""
    return -(-D // BLOCK)


row_bytes = fp8_row_bytes   # bytes one row takes on the wire: D fp8 values and B fp32 scales


def quantize(x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_ND float8_e4m3fn, scale_NB fp32): x ~ q * scale per 128-channel block."""
    N, D = x_ND.shape
    B = scale_blocks(D)
    x = x_ND.detach().float()
    if B * BLOCK != D:
        x = F.pad(x, (0, B * BLOCK - D))
    blocks = x.view(N, B, BLOCK)
    amax = blocks.abs().amax(-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))
    q = (blocks / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(N, B * BLOCK)[:, :D], scale


def dequantize(q_ND: torch.Tensor, scale_NB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale per block, in ``dtype``."""
    N, D = q_ND.shape
    B = scale_NB.shape[1]
    x = q_ND.float()
    if B * BLOCK != D:
        x = F.pad(x, (0, B * BLOCK - D))
    return (x.view(N, B, BLOCK) * scale_NB[..., None]).view(N, B * BLOCK)[:, :D].to(dtype)


def pack(q_ND: torch.Tensor, scale_NB: torch.Tensor) -> torch.Tensor:
    """[N, D + 4B] uint8: each row's fp8 values, then its fp32 scales' bytes."""
    N = q_ND.shape[0]
    return torch.cat([q_ND.contiguous().view(torch.uint8), scale_NB.contiguous().view(torch.uint8).view(N, -1)], 1)


def unpack(packed: torch.Tensor, D: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``pack`` sent, dequantized to ``dtype``."""
    q = packed[:, :D].contiguous().view(FP8)
    scale = packed[:, D:].contiguous().view(torch.float32)
    return dequantize(q, scale, dtype)


def fake_quantize(x_ND: torch.Tensor) -> torch.Tensor:
    """What the receiver gets for ``x_ND``: dequantize(quantize(x)) in x's dtype (no grad)."""
    return dequantize(*quantize(x_ND), x_ND.dtype)


class _FP8AllToAll(torch.autograd.Function):
    """Forward: the rows quantized, packed and all-to-all'd as bytes, dequantized on arrival;
    backward: the reverse all-to-all of the gradient in the compute dtype (straight through)."""

    @staticmethod
    def forward(ctx, x_ND, group, out_splits, in_splits, stats):
        ctx.group, ctx.out_s, ctx.in_s, ctx.stats = group, out_splits, in_splits, stats
        packed = comm.all_to_all_rows(pack(*quantize(x_ND)), group, out_splits, in_splits, stats=stats)
        return unpack(packed, x_ND.shape[1], x_ND.dtype)

    @staticmethod
    def backward(ctx, g):
        return (comm.all_to_all_rows(g, ctx.group, ctx.in_s, ctx.out_s, backward=True, stats=ctx.stats),
                None, None, None, None)


def all_to_all(x_ND: torch.Tensor, group, output_split_sizes: Sequence[int] | None,
               input_split_sizes: Sequence[int] | None, stats: comm.CommStats | None = None) -> torch.Tensor:
    """The dispatch all-to-all with FP8 rows (a group of one rank moves nothing: x itself)."""
    if comm.group_size(group) == 1:
        return x_ND
    out_s = None if output_split_sizes is None else tuple(int(s) for s in output_split_sizes)
    in_s = None if input_split_sizes is None else tuple(int(s) for s in input_split_sizes)
    return _FP8AllToAll.apply(x_ND, group, out_s, in_s, stats)

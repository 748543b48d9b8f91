"""Permute and quantize in one pass: the send buffer of the FP8 dispatch.

Legend (``permute.py``): T tokens, D hidden, K routes per token, N rows, ``route_N[n]`` the
route of row n (its token is ``route_N[n] // K``, -1 a padding row); Q = ceil(D / 128)
scale blocks per row, V = D + 4·Q bytes per packed row.

``permute_quantize(x_TD, route_N, K)`` returns ``packed_NV`` (uint8): row n holds the
float8_e4m3fn values of token ``route_N[n] // K``, then the Q fp32 scales' bytes
(little-endian), the wire format ``moepar.moe.exchange.fp8`` sends and unpacks. One kernel pass
reads each routed token row once and writes its FP8 row and scales in expert-major order;
the unquantized permuted rows are never materialized.

The rule, per block of 128 channels (the last may be partial), identical in the kernel and
the reference (tests compare the bytes):

* amax = max |x| over the block; scale = max(amax / 448, 2^-126) in fp32, rounded to
  nearest (448 is e4m3's largest finite value; the floor keeps the scale a normal number,
  so x / scale never overflows on a block of denormals);
* a block of zeros (and a padding row): scale 1, values 0;
* a block holding a NaN or an infinity: scale NaN, values 0, so it comes back all NaN (the
  MoE layer's ``check_finite`` refuses such inputs before the dispatch);
* q = clamp(x / scale, -448, 448) rounded to nearest even in e4m3 (division rounded to
  nearest: ``div_rn`` in the kernel, IEEE division in torch). The kernel rounds to e4m3
  with integer arithmetic on the fp32 bits (``_e4m3_bits``), not with a float8 cast: the
  result is the same on every backend, and the Triton interpreter's own float8 cast does
  not round to nearest even (it can lose the carry into the exponent).

The receiver's side, ``unpack_dequantize(packed_NV, D, dtype, out=)``: one kernel pass
from the received bytes to the rows in the compute dtype (q x scale in fp32, rounded once
to ``dtype``), written into ``out``: no fp32 copy of the received rows (at 64k rows of
7168 channels that would be 1.8 GB).

``impl="auto"`` runs the kernel on CUDA and the reference elsewhere; "triton" forces the
kernel (tests, under ``TRITON_INTERPRET=1``), "reference" forces torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .permute import _blocks, _use_triton, IMPLS

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is Linux-only; the reference path works without it
    triton = None
    tl = None

BLOCK = 128                  # channels per scale (DeepSeek-V3's 1x128 activation tiles)
E4M3_MAX = 448.0             # e4m3's largest finite value
MIN_SCALE = 2.0 ** -126      # the smallest normal fp32: the scale's floor
FP8 = torch.float8_e4m3fn


def scale_blocks(D: int) -> int:
    """Q: scale blocks per row of D channels."""
    return -(-D // BLOCK)


def packed_width(D: int) -> int:
    """V: bytes of one packed row, D FP8 values then Q fp32 scales."""
    return D + 4 * scale_blocks(D)


if triton is not None:
    # The kernel's copies of the two limits: compiled Triton reads only constexpr globals.
    _E4M3_MAX_C = tl.constexpr(E4M3_MAX)
    _MIN_SCALE_C = tl.constexpr(MIN_SCALE)

    @triton.jit
    def _e4m3_bits(y):
        """float8_e4m3fn codes (int32, 0..255) of finite fp32 ``y`` with |y| <= 448, rounded
        to nearest even: the normal range by rounding the fp32 bits to 3 mantissa bits (the
        carry runs into the exponent) and rebiasing 127 -> 7; below 2^-6 the subnormal
        multiple k of 2^-9, rounded from the 24-bit significand."""
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 31) & 1
        mag = bits & 0x7FFFFFFF
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
        exp = mag >> 23                                   # biased fp32 exponent
        m = (mag & 0x7FFFFF) | 0x800000                   # significand with its leading 1
        shift = tl.minimum(tl.maximum(-exp + 141, 1), 30)  # y = m * 2^-shift units of 2^-9
        k = m >> shift
        rem = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        k = k + ((rem > half) | ((rem == half) & ((k & 1) == 1))).to(tl.int32)
        k = tl.where(exp >= 1, k, 0)                      # fp32 denormals round to 0
        code = tl.where(exp >= 121, normal, k)            # 121 - 127 = -6: e4m3's first normal
        return code | (sign << 7)

    @triton.jit
    def _permute_quantize_kernel(src_ptr, route_ptr, bytes_ptr, num_rows, D, K, stride_src, stride_out,
                                 BF16_BITS: tl.constexpr, BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr):
        # grid: (row tiles, scale blocks); one program quantizes BLOCK_N rows' scale block ``block``.
        pid = tl.program_id(0)
        block = tl.program_id(1)
        rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < num_rows
        route = tl.load(route_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        valid = route >= 0
        tok = tl.where(valid, route // K, 0)
        c = block * QBLOCK + tl.arange(0, QBLOCK)
        c_ok = c < D
        x = tl.load(src_ptr + tok[:, None] * stride_src + c[None, :], mask=valid[:, None] & c_ok[None, :], other=0)
        if BF16_BITS:   # bf16 rows read as int16: fp32 = the bits shifted up (denormals kept)
            x = ((x.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            x = x.to(tl.float32)
        ax = tl.abs(x)
        bad = (x != x) | (ax == float("inf"))
        n_bad = tl.sum(bad.to(tl.int32), axis=1)
        amax = tl.max(tl.where(bad, 0.0, ax), axis=1)
        scale = tl.maximum(tl.math.div_rn(amax, _E4M3_MAX_C), _MIN_SCALE_C)
        scale = tl.where(amax > 0, scale, 1.0)
        scale = tl.where(n_bad > 0, float("nan"), scale)
        y = tl.math.div_rn(x, scale[:, None])
        y = tl.minimum(tl.maximum(y, -_E4M3_MAX_C), _E4M3_MAX_C)
        y = tl.where(n_bad[:, None] > 0, 0.0, y)
        out = rows[:, None] * stride_out + c[None, :]
        tl.store(bytes_ptr + out, _e4m3_bits(y).to(tl.uint8), mask=row_ok[:, None] & c_ok[None, :])
        bits = tl.where(n_bad > 0, 0x7FC00000, scale.to(tl.int32, bitcast=True))   # torch's NaN, not the GPU's
        at = bytes_ptr + rows * stride_out + D + 4 * block
        for j in tl.static_range(4):
            tl.store(at + j, ((bits >> (8 * j)) & 0xFF).to(tl.uint8), mask=row_ok)


    @triton.jit
    def _e4m3_value(b):
        """fp32 values of float8_e4m3fn codes ``b`` (int32, 0..255): exact."""
        sign = (b >> 7) & 1
        e = (b >> 3) & 0xF
        m = b & 7
        normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125 * (1.0 - 2.0 * sign.to(tl.float32))   # m x 2^-9
        v = tl.where(e == 0, sub, normal)
        return tl.where((b & 0x7F) == 0x7F, float("nan"), v)

    @triton.jit
    def _unpack_dequantize_kernel(bytes_ptr, out_ptr, N, D, stride_in, stride_out,
                                  OUT_BF16: tl.constexpr, BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr):
        pid = tl.program_id(0)
        block = tl.program_id(1)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        c = block * QBLOCK + tl.arange(0, QBLOCK)
        ok = row_ok[:, None] & (c < D)[None, :]
        b = tl.load(bytes_ptr + rows[:, None] * stride_in + c[None, :], mask=ok, other=0).to(tl.int32)
        at = bytes_ptr + rows * stride_in + D + 4 * block
        bits = tl.zeros([BLOCK_N], dtype=tl.int32)
        for j in tl.static_range(4):   # the block's fp32 scale, little-endian
            bits = bits | (tl.load(at + j, mask=row_ok, other=0).to(tl.int32) << (8 * j))
        x = _e4m3_value(b) * bits.to(tl.float32, bitcast=True)[:, None]
        dst = out_ptr + rows[:, None] * stride_out + c[None, :]
        if OUT_BF16:   # round to nearest even on the bits (torch's rule; NaN as 0x7FC0)
            xb = x.to(tl.int32, bitcast=True)
            mag = xb & 0x7FFFFFFF
            r = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
            r = tl.where(mag > 0x7F800000, 0x7FC0, r | ((xb >> 16) & 0x8000))
            tl.store(dst, r.to(tl.int16), mask=ok)
        else:
            tl.store(dst, x.to(out_ptr.dtype.element_ty), mask=ok)


def quantize_reference(x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_ND float8_e4m3fn, scale_NQ fp32) by the rule above, in plain torch."""
    N, D = x_ND.shape
    Q = scale_blocks(D)
    x = x_ND.detach().float()
    if Q * BLOCK != D:
        x = F.pad(x, (0, Q * BLOCK - D))
    blocks = x.view(N, Q, BLOCK)
    bad = ~torch.isfinite(blocks).all(-1)
    amax = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(-1)
    # a tensor divisor: CUDA computes ``tensor / python_float`` as a product with the
    # reciprocal, which is not the kernel's correctly rounded quotient
    scale = torch.where(amax > 0, (amax / torch.full_like(amax, E4M3_MAX)).clamp(min=MIN_SCALE), 1.0)
    scale = torch.where(bad, float("nan"), scale)
    y = (blocks / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = torch.where(bad[..., None], 0.0, y).to(FP8)
    return q.view(N, Q * BLOCK)[:, :D], scale


def pack(q_ND: torch.Tensor, scale_NQ: torch.Tensor) -> torch.Tensor:
    """[N, V] uint8: each row's FP8 values, then its fp32 scales' bytes."""
    N = q_ND.shape[0]
    if N == 0:   # an empty tensor's strides are arbitrary: viewing it as bytes may fail
        return torch.empty(0, q_ND.shape[1] + 4 * scale_NQ.shape[1], dtype=torch.uint8, device=q_ND.device)
    return torch.cat([q_ND.contiguous().view(torch.uint8),
                      scale_NQ.contiguous().view(torch.uint8).view(N, -1)], 1)


def permute_quantize_reference(x_TD: torch.Tensor, route_N: torch.Tensor, K: int) -> torch.Tensor:
    """The packed rows in plain torch: gather, then ``quantize_reference`` and ``pack``."""
    rows = x_TD.index_select(0, route_N.clamp(min=0) // K)
    rows = torch.where((route_N >= 0)[:, None], rows, 0)
    return pack(*quantize_reference(rows))


def _permute_quantize(x_TD: torch.Tensor, route_N: torch.Tensor, K: int) -> torch.Tensor:
    N, D = route_N.shape[0], x_TD.shape[1]
    packed = torch.empty(N, packed_width(D), dtype=torch.uint8, device=x_TD.device)
    if N == 0 or D == 0:
        return packed
    x_TD = x_TD if x_TD.stride(1) == 1 else x_TD.contiguous()
    bf16 = x_TD.dtype == torch.bfloat16
    block_n = _blocks(N, BLOCK)[0]
    _permute_quantize_kernel[(triton.cdiv(N, block_n), scale_blocks(D))](
        x_TD.view(torch.int16) if bf16 else x_TD, route_N, packed, N, D, K, x_TD.stride(0), packed.stride(0),
        BF16_BITS=bf16, BLOCK_N=block_n, QBLOCK=BLOCK, num_warps=4)
    return packed


def permute_quantize(x_TD: torch.Tensor, route_N: torch.Tensor, K: int, *, impl: str = "auto") -> torch.Tensor:
    """``packed_NV`` (uint8, on x's device): row n the FP8 row and scales of token
    ``route_N[n] // K`` (zeros and scale 1 where ``route_N[n] < 0``). Not differentiable:
    the FP8 dispatch passes the gradient straight through (``moepar.moe.exchange.fp8``)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    if x_TD.dim() != 2 or route_N.dim() != 1:
        raise ValueError(f"x_TD must be [T, D] and route_N [N]; got {tuple(x_TD.shape)} and "
                         f"{tuple(route_N.shape)}")
    if not x_TD.is_floating_point() or route_N.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"x_TD must be floating point and route_N int32/int64; got {x_TD.dtype} "
                         f"and {route_N.dtype}")
    if K < 1:
        raise ValueError(f"K={K} must be >= 1 (routes per token)")
    x_TD = x_TD.detach()
    if _use_triton(x_TD, impl):
        return _permute_quantize(x_TD, route_N, int(K))
    return permute_quantize_reference(x_TD, route_N, int(K))


def unpack_dequantize_reference(packed_NV: torch.Tensor, D: int, out: torch.Tensor) -> torch.Tensor:
    """``unpack_dequantize`` in plain torch, a bounded number of rows at a time (its fp32
    temporaries stay small whatever N is)."""
    Q = scale_blocks(D)
    step = max(1, (1 << 16) // max(Q * BLOCK, 1))
    for r0 in range(0, packed_NV.shape[0], step):
        part = packed_NV[r0:r0 + step]
        n = part.shape[0]
        x = part[:, :D].contiguous().view(FP8).float()
        scale = part[:, D:].contiguous().view(torch.float32).view(n, Q)
        if Q * BLOCK != D:
            x = F.pad(x, (0, Q * BLOCK - D))
        out[r0:r0 + n] = (x.view(n, Q, BLOCK) * scale[..., None]).view(n, Q * BLOCK)[:, :D]
    return out


def _unpack_dequantize(packed_NV: torch.Tensor, D: int, out: torch.Tensor) -> torch.Tensor:
    N = packed_NV.shape[0]
    if N == 0 or D == 0:
        return out
    bf16 = out.dtype == torch.bfloat16
    block_n = _blocks(N, BLOCK)[0]
    _unpack_dequantize_kernel[(triton.cdiv(N, block_n), scale_blocks(D))](
        packed_NV, out.view(torch.int16) if bf16 else out, N, D, packed_NV.stride(0), out.stride(0),
        OUT_BF16=bf16, BLOCK_N=block_n, QBLOCK=BLOCK, num_warps=4)
    return out


def unpack_dequantize(packed_NV: torch.Tensor, D: int, dtype: torch.dtype, *, out: torch.Tensor | None = None,
                      impl: str = "auto") -> torch.Tensor:
    """The rows ``pack`` / ``permute_quantize`` sent, q x scale in fp32 rounded once to
    ``dtype`` ([N, D], written into ``out`` when given: no other [N, D] buffer)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    N = packed_NV.shape[0]
    if packed_NV.dim() != 2 or packed_NV.dtype != torch.uint8 or packed_NV.shape[1] != packed_width(D):
        raise ValueError(f"packed_NV must be [N, {packed_width(D)}] uint8 for D={D}; got "
                         f"{packed_NV.dtype} {tuple(packed_NV.shape)}")
    if out is None:
        out = torch.empty(N, D, dtype=dtype, device=packed_NV.device)
    elif out.shape != (N, D) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a [{N}, {D}] {dtype} tensor with unit column stride; got "
                         f"{out.dtype} {tuple(out.shape)}")
    packed_NV = packed_NV if packed_NV.stride(1) == 1 else packed_NV.contiguous()
    if _use_triton(packed_NV, impl):
        return _unpack_dequantize(packed_NV, D, out)
    return unpack_dequantize_reference(packed_NV, D, out)

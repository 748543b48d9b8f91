"""The fused permute-and-quantize kernel (``moepar_kernels.permute_fp8``) against its torch
reference, byte for byte, under the Triton interpreter; the quantization's round-trip error
within e4m3's bound per block; rows of zeros, denormals, huge values and non-finite values."""
import pytest
import torch

from moepar.moe.exchange import fp8
from moepar_kernels import permute_fp8 as pq
from moepar_kernels.permute import route_index


E4M3_CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _both(x_TD, route_N, K):
    a = pq.permute_quantize(x_TD, route_N, K, impl="triton")
    b = pq.permute_quantize(x_TD, route_N, K, impl="reference")
    return a, b


def _special_rows(T, D, gen):
    x = torch.randn(T, D, generator=gen) * torch.logspace(-3, 3, T)[:, None]
    x[1] = 0.0                                   # zeros: scale 1, zeros back
    x[2] = -0.0                                  # negative zeros keep their sign bit
    x[3] = 1e-40 * torch.randn(D, generator=gen)  # fp32 denormals: the scale's floor 2^-126
    x[4] = 3e38 * torch.rand(D, generator=gen)   # near fp32's largest: scale amax/448, no overflow
    x[5, 0] = float("nan")                       # a NaN: scale NaN, values 0
    x[6, -1] = float("-inf")                     # an infinity in the last (maybe partial) block
    x[7, :3] = torch.tensor([1e-44, -3e-42, 2e-39])   # denormals beside zeros
    return x


@pytest.mark.parametrize("D", [8, 128, 200, 384])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_reference_byte_for_byte(D, dtype):
    gen = torch.Generator().manual_seed(D)
    T, K = 19, 2
    x = _special_rows(T, D, gen).to(dtype)
    route_N = torch.randperm(T * K, generator=gen)[:30]
    route_N[4] = -1                              # a padding row: zeros, scale 1
    a, b = _both(x, route_N, K)
    assert a.shape == (30, pq.packed_width(D)) and a.dtype == torch.uint8
    assert torch.equal(a, b), (a != b).nonzero()[:8].tolist()


def test_kernel_rounds_every_e4m3_value_and_midpoint_to_nearest_even():
    """Scale 1 (every block's amax is 448): the values themselves are rounded. Every finite
    e4m3 value, the midpoints between neighbours (ties to even) and their fp32 neighbours."""
    vals = torch.sort(E4M3_CODES[torch.isfinite(E4M3_CODES)].unique()).values
    mids = (vals[:-1] + vals[1:]) / 2
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    sweep = torch.cat([vals, mids, up, down, torch.linspace(-448, 448, 20001)])
    rows = -(-sweep.numel() // 127)
    x = torch.zeros(rows * 127)
    x[:sweep.numel()] = sweep
    x = torch.cat([torch.full((rows, 1), 448.0), x.view(rows, 127)], 1)
    a, b = _both(x, torch.arange(rows), 1)
    assert torch.equal(a, b)
    assert torch.equal(b[:, 128:].contiguous().view(torch.float32), torch.ones(rows, 1))
    # and the reference is torch's own cast, rounding to nearest even
    assert torch.equal(b[:, :128].contiguous().view(torch.float8_e4m3fn).float(),
                       x.to(torch.float8_e4m3fn).float())


def test_fused_permute_matches_permute_then_quantize():
    """The packed rows are the ``permute`` rows, quantized: same order (expert-major), same bytes."""
    gen = torch.Generator().manual_seed(3)
    T, K, E, D = 23, 2, 4, 136
    x = torch.randn(T, D, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    dropped = torch.rand(T, K, generator=gen) < 0.2
    counts, row_map, route_N = route_index(ids, dropped, E, None, None)
    from moepar_kernels.permute import permute
    rows, counts2, row_map2 = permute(x, ids, dropped, E)
    assert torch.equal(counts, counts2) and torch.equal(row_map, row_map2)
    a = pq.permute_quantize(x, route_N, K, impl="triton")
    assert torch.equal(a, fp8.pack(*fp8.quantize(rows)))


def test_round_trip_error_within_e4m3_bound_per_block():
    """|x - deq(q(x))| <= 2^-4·|x| in e4m3's normal range (3 mantissa bits: half an ulp) and
    <= 2^-10·scale below it (half the subnormal step 2^-9), per 128-channel block; zeros,
    denormal and huge rows included."""
    gen = torch.Generator().manual_seed(0)
    x = _special_rows(16, 300, gen)
    x = x[torch.isfinite(x).all(1)]
    q, s = fp8.quantize(x)
    back = fp8.dequantize(q, s, torch.float32)
    B = s.shape[1]
    for b in range(B):
        blk, got, scale = x[:, b * 128:(b + 1) * 128], back[:, b * 128:(b + 1) * 128], s[:, b:b + 1]
        err = (got.double() - blk.double()).abs()
        normal = blk.abs() / scale >= 2.0 ** -6
        bound = torch.where(normal, 2.0 ** -4 * blk.abs().double(), 2.0 ** -10 * scale.double().expand_as(blk))
        assert bool((err <= bound).all()), float((err - bound).max())
    assert torch.equal(back[1], torch.zeros(300)) and torch.equal(s[1], torch.ones(B))
    assert (s >= 2.0 ** -126).all() and torch.isfinite(back).all()


def test_non_finite_block_comes_back_nan_and_nothing_else_does():
    x = torch.randn(3, 256)
    x[0, 5] = float("nan")
    x[2, 200] = float("inf")
    q, s = fp8.quantize(x)
    back = fp8.dequantize(q, s, torch.float32)
    assert torch.isnan(back[0, :128]).all() and torch.isfinite(back[0, 128:]).all()
    assert torch.isfinite(back[1]).all()
    assert torch.isnan(back[2, 128:]).all() and torch.isfinite(back[2, :128]).all()
    assert torch.equal(q[0, :128].view(torch.uint8), torch.zeros(128, dtype=torch.uint8))


def test_bad_arguments_name_the_value():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="impl='cuda'"):
        pq.permute_quantize(x, torch.arange(4), 1, impl="cuda")
    with pytest.raises(ValueError, match="K=0"):
        pq.permute_quantize(x, torch.arange(4), 0)
    with pytest.raises(ValueError, match="int32/int64"):
        pq.permute_quantize(x, torch.arange(4).float(), 1)
    with pytest.raises(ValueError, match=r"\[T, D\]"):
        pq.permute_quantize(x[0], torch.arange(4), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 3])
def test_no_rows_pack_and_unpack_to_no_rows(T, dtype):
    """A rank with no routed row (an empty batch, or tokens routed elsewhere): the launcher,
    the reference, ``pack`` and ``unpack`` all give 0 rows of the right width (``pack`` of 0
    rows used to raise "stride(-1) must be 1 to view Float as Byte")."""
    D = 200
    x = torch.randn(T, D, dtype=dtype)
    route_N = torch.empty(0, dtype=torch.int64)
    for impl in ("triton", "reference"):
        packed = pq.permute_quantize(x, route_N, 2, impl=impl)
        assert packed.shape == (0, pq.packed_width(D)) and packed.dtype == torch.uint8
        back = fp8.unpack(packed, D, dtype)
        assert back.shape == (0, D) and back.dtype == dtype
    q, scale = fp8.quantize(x[:0])
    assert fp8.pack(q, scale.expand(0, scale.shape[1])).shape == (0, pq.packed_width(D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [8, 130, 256])
def test_unpack_dequantize_kernel_equals_the_reference_and_the_rule(D, dtype):
    """The receiver's one pass (bytes -> rows in the compute dtype, into ``out``): bitwise the
    torch reference, which is ``dequantize`` (q x scale in fp32, rounded once), on every
    e4m3 code, partial blocks, a NaN block and denormal scales."""
    gen = torch.Generator().manual_seed(D)
    x = _special_rows(9, D, gen)
    x[3] = float("nan")
    packed = pq.permute_quantize(x, torch.arange(x.shape[0]), 1, impl="reference")
    codes = torch.randint(0, 256, (5, D), generator=gen, dtype=torch.uint8)
    scales = torch.tensor([2.0 ** -126, 1.0, 3.7e-3, 5.5, 448.0])[:, None].expand(5, pq.scale_blocks(D))
    packed = torch.cat([packed, pq.pack(codes.view(pq.FP8), scales.contiguous())])
    want = fp8.dequantize(packed[:, :D].contiguous().view(pq.FP8),
                          packed[:, D:].contiguous().view(torch.float32), dtype)
    for impl in ("triton", "reference"):
        out = torch.full((packed.shape[0], D), 7.0, dtype=dtype)
        got = pq.unpack_dequantize(packed, D, dtype, out=out, impl=impl)
        assert got.data_ptr() == out.data_ptr()
        same = (got == want) | (got.isnan() & want.isnan())
        assert bool(same.all()), (impl, (got.float() - want.float()).abs().nan_to_num().max())

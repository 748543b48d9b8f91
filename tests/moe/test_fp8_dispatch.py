"""FP8 token dispatch (``dispatch_dtype="fp8"``): the quantization against a slow per-block
reference bit for bit, the layer exact against the same layer whose experts see the
quantize-dequantize of their rows (gradients straight through), the bytes on the wire, and
the accuracy against the compute-dtype dispatch."""
import pytest
import torch

from moepar.moe.exchange import rows as exchange, fp8
from moepar.parallel import init_parallel

from ..helpers import moe_ref
from ..helpers.multiproc import run_ranks


def _slow_quantize(x_ND):
    """The documented rule, one 128-channel block at a time."""
    N, D = x_ND.shape
    B = -(-D // 128)
    q = torch.empty(N, D, dtype=fp8.FP8)
    scale = torch.empty(N, B)
    for n in range(N):
        for b in range(B):
            blk = x_ND[n, b * 128:(b + 1) * 128].float()
            if not torch.isfinite(blk).all():   # NaN scale, values 0: the block comes back NaN
                scale[n, b] = float("nan")
                q[n, b * 128:(b + 1) * 128] = torch.zeros(blk.shape).to(fp8.FP8)
                continue
            amax = blk.abs().max()
            s = max(amax / 448.0, torch.tensor(2.0 ** -126)) if amax > 0 else torch.tensor(1.0)
            scale[n, b] = s
            q[n, b * 128:(b + 1) * 128] = (blk / s).clamp(-448, 448).to(fp8.FP8)
    return q, scale


@pytest.mark.parametrize("D", [8, 128, 200, 384])
def test_quantize_matches_the_slow_rule_and_packs_losslessly(D):
    gen = torch.Generator().manual_seed(D)
    x = torch.randn(7, D, generator=gen) * torch.logspace(-3, 3, 7)[:, None]
    x[2] = 0.0                                   # a row of zeros: scale 1, zeros back
    x[4, 5] = float("nan")                       # a NaN: its block comes back NaN
    x[5, -1] = float("inf")                      # an infinity: its (last) block NaN
    q, s = fp8.quantize(x)
    q_ref, s_ref = _slow_quantize(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.allclose(s, s_ref, equal_nan=True, rtol=0, atol=0)
    packed = fp8.pack(q, s)
    assert packed.dtype == torch.uint8 and packed.shape == (7, fp8.row_bytes(D))
    back = fp8.unpack(packed, D, torch.float32)
    assert torch.allclose(back, fp8.dequantize(q, s, torch.float32), equal_nan=True, rtol=0, atol=0)
    assert torch.equal(back[2], torch.zeros(D))
    assert torch.isnan(back[4, :min(D, 128)]).all() and torch.isnan(back[5, (D - 1) // 128 * 128:]).all()
    ok = torch.isfinite(back).all(1)
    err = (back[ok] - x[ok]).abs().amax(1) / x[ok].abs().amax(1).clamp_min(1e-30)
    assert float(err.max()) <= 2 ** -4   # e4m3: 3 mantissa bits, half an ulp of the block's max


def _fq_straight_through(module, args):
    x = args[0]
    return (x + (fp8.fake_quantize(x) - x).detach(),) + tuple(args[1:])


def _combine_with_quantized_gradient(combine_rows):
    """The combine all-to-all in the compute dtype, whose input rows get the quantize-dequantize
    of their gradient (row-wise: the same rows as quantizing before the reverse all-to-all)."""
    def run(call, y, send, recv):
        y = y.view_as(y)
        if y.requires_grad:
            y.register_hook(fp8.fake_quantize)
        return combine_rows(call, y, send, recv)
    return run


def _layer_pair(tp, ep, etp, kw, dtype, grad_fp8=False, empty_rank=None):
    state = init_parallel(tp, ep, etp, verbose=False)
    out = {}
    for mode in ("fp8", "reference", "plain"):
        extra = dict(combine_grad_dtype="fp8") if grad_fp8 and mode == "fp8" else {}
        moe = moe_ref.build(state, k=2, dispatch_dtype="fp8" if mode == "fp8" else None, **kw, **extra)
        if mode == "reference":   # the experts see the quantize-dequantize of their rows
            moe.experts.register_forward_pre_hook(_fq_straight_through)
        x, g = moe_ref.replica_input(state.dp_rank, 6)
        if state.rank == empty_rank:   # the last short batch of an epoch: nothing on this rank
            x, g = x[:0], g[:0]
        x = x.clone().requires_grad_()
        combine_rows = exchange.combine_rows
        if mode == "reference" and grad_fp8:
            exchange.combine_rows = _combine_with_quantized_gradient(combine_rows)
        try:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                y = moe(x)
            (y.float() * g).sum().backward()
        finally:
            exchange.combine_rows = combine_rows
        ev = [(e.nbytes, e.backward) for e in moe.stats.comm.events if e.op == "all_to_all"]
        out[mode] = (y.detach().float(), x.grad.clone(), [p.grad.clone() for p in moe.parameters()], ev,
                     moe.stats.exchange_form)
    return out


LAYOUTS = [((1, 2, 1), {}), ((2, 2, 1), dict(num_shared_experts=1)), ((1, 2, 2), dict(bias=True)),
           ((2, 2, 1), dict(sequence_parallel=True, num_shared_experts=1)),
           ((1, 4, 1), dict(capacity_factor=2.0, min_capacity=1, pad_to_capacity=True)),
           ((1, 2, 1), dict(num_experts=8, dedup="on"))]


def _same_numbers(r):
    """The FP8 layer's output and every gradient equal the reference's; its events back."""
    y8, dx8, g8, ev8, form = r["fp8"]
    yr, dxr, gr, evr, _ = r["reference"]
    torch.testing.assert_close(y8, yr, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dx8, dxr, atol=1e-6, rtol=1e-6)
    for a, b in zip(g8, gr):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    return ev8, evr, form


@pytest.mark.parametrize("layout,kw", LAYOUTS)
def test_fp8_layer_equals_experts_on_quantized_rows(layout, kw):
    for r in run_ranks(_layer_pair, 4, *layout, kw, torch.float32):
        ev8, evr, form = _same_numbers(r)
        # the dispatch all-to-all: D + 4 bytes a row (one scale block) where fp32 sends 4·D
        fwd8, fwdr = [n for n, bwd in ev8 if not bwd], [n for n, bwd in evr if not bwd]
        D = moe_ref.D
        assert fwd8[0] * 4 * D == fwdr[0] * fp8.row_bytes(D), (fwd8, fwdr, form)
        assert fwd8[1:] == fwdr[1:] and [e for e in ev8 if e[1]] == [e for e in evr if e[1]]


@pytest.mark.parametrize("layout,kw", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[2], LAYOUTS[4]])
def test_fp8_combine_gradient_equals_experts_on_quantized_gradient(layout, kw):
    """``combine_grad_dtype="fp8"``: the gradient reaching the experts is the quantize-dequantize
    of the combined rows' gradient; the combine's backward all-to-all carries FP8 rows."""
    for r in run_ranks(_layer_pair, 4, *layout, kw, torch.float32, True):
        ev8, evr, form = _same_numbers(r)
        bwd8, bwdr = [n for n, bwd in ev8 if bwd], [n for n, bwd in evr if bwd]
        D = moe_ref.D
        assert bwd8[0] * 4 * D == bwdr[0] * fp8.row_bytes(D), (bwd8, bwdr, form)   # the combine's grad
        assert bwd8[1:] == bwdr[1:]


def test_fp8_accuracy_and_bytes_under_bf16_autocast():
    """bf16 autocast: the rows are cast to bf16, then quantized: (D + 4) / (2·D) of the bf16
    bytes on the wire; the output stays within a few percent of the bf16 dispatch's."""
    for r in run_ranks(_layer_pair, 2, 1, 2, 1, {}, torch.bfloat16):
        y8, _, _, ev8, _ = r["fp8"]
        yp, _, _, evp, _ = r["plain"]
        D = moe_ref.D
        assert ev8[0][0] * 2 * D == evp[0][0] * fp8.row_bytes(D)
        rel = float((y8 - yp).norm() / yp.norm())
        assert rel < 0.05, rel


@pytest.mark.parametrize("kw,grad_fp8", [({}, False), ({}, True), (dict(num_experts=8, dedup="on"), False)],
                         ids=["rows", "rows-fp8-grad", "dedup"])
def test_fp8_dispatch_with_an_empty_rank(kw, grad_fp8):
    """Rank 1 routes no token (before: ``pack`` of its 0 rows raised "stride(-1) must be 1"
    on that rank and its peer ended in a CollectiveError): both ranks equal the reference
    (the quantized-gradient reference, as above, covers the row form)."""
    for r in run_ranks(_layer_pair, 2, 1, 2, 1, kw, torch.float32, grad_fp8, 1):
        _same_numbers(r)

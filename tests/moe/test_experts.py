"""GroupedExperts against a per-expert loop written here (outputs and every gradient), on
every GEMM path, activation and bias setting; init determinism across ep/etp layouts;
expert tensor parallel slices summing to the whole expert; bad inputs."""
import math

import pytest
import torch
import torch.nn.functional as F

from moepar.moe.experts.grouped import GroupedExperts
from moepar.moe.experts.function import choose_gemm_path

PATHS = ("loop", "grouped_mm", "bmm")
# torch.nn.functional.grouped_mm is missing from older torch releases (2.8, 2.9): there an
# explicit gemm_path="grouped_mm" must raise a clear error, and "auto" never picks it.
HAS_GROUPED_MM = hasattr(F, "grouped_mm")
NO_GROUPED_MM = "has no torch.nn.functional.grouped_mm"


def loop_reference(m: GroupedExperts, x_ND, counts, include_b2=True):
    """Each expert's rows through its own FFN, one expert at a time, in float64."""
    p = {n: (t.double() if t is not None else None) for n, t in
         (("w1", m.w1), ("w2", m.w2), ("w3", m.w3), ("b1", m.b1), ("b2", m.b2), ("b3", m.b3))}
    outs, s = [], 0
    for e, c in enumerate(counts):
        x = x_ND[s:s + c].double()
        s += c
        h = x @ p["w1"][e] + (p["b1"][e] if m.bias else 0)
        if m.activation == "swiglu":
            a = F.silu(h) * (x @ p["w3"][e] + (p["b3"][e] if m.bias else 0))
        elif m.activation == "gelu":
            a = F.gelu(h)
        else:
            a = F.relu(h)
        y = a @ p["w2"][e]
        if m.bias and include_b2:
            y = y + p["b2"][e]
        outs.append(y)
    return torch.cat(outs) if outs else x_ND.new_zeros(0, m.hidden).double()


def all_grads(out, inputs, g):
    res = torch.autograd.grad(out, inputs, g, allow_unused=True)
    return [torch.zeros_like(i) if r is None else r for r, i in zip(res, inputs)]


def check_against_loop(m: GroupedExperts, counts, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = sum(counts)
    x = torch.randn(N, m.hidden, generator=gen).to(dtype).requires_grad_(True)
    g = torch.randn(N, m.hidden, generator=gen).to(dtype)
    params = [p for p in m.parameters()]
    if m.gemm_path == "grouped_mm" and not HAS_GROUPED_MM:
        with pytest.raises(ValueError, match=NO_GROUPED_MM):
            m(x, counts)
        return
    y = m(x, counts)
    assert y.shape == (N, m.hidden) and y.dtype == dtype
    got = all_grads(y, [x] + params, g)
    # The reference runs on float64 copies of the same (rounded) values.
    x64 = x.detach().double().requires_grad_(True)
    ref_m = GroupedExperts(m.num_local_experts, m.hidden, m.ffn_hidden, m.activation, m.bias, dtype=torch.float64)
    ref_m.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    y_ref = loop_reference(ref_m, x64, counts)
    want = all_grads(y_ref, [x64] + list(ref_m.parameters()), g.double())
    names = ["y", "x"] + [n for n, _ in m.named_parameters()]
    for name, a, b in zip(names, [y] + got, [y_ref] + want):
        if dtype == torch.float32:
            torch.testing.assert_close(a.double(), b.detach(), rtol=1e-4, atol=1e-5, msg=name)
        else:  # bf16: within 1e-2 relative (norm-wise) of the exact result
            err = (a.double() - b).norm() / b.norm().clamp_min(1e-12)
            assert err < 1e-2, f"{name}: relative error {float(err):.3g}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_per_expert_loop_fp32(path, activation, bias):
    m = GroupedExperts(5, 16, 24, activation, bias, init_seed=3, gemm_path=path)
    check_against_loop(m, [7, 0, 1, 12, 3])          # an empty expert and a single row


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_matches_per_expert_loop_bf16(path, activation):
    m = GroupedExperts(4, 32, 48, activation, bias=True, init_seed=4, dtype=torch.bfloat16, gemm_path=path)
    check_against_loop(m, [40, 0, 25, 63], dtype=torch.bfloat16)


@pytest.mark.parametrize("path", PATHS)
def test_degenerate_counts(path):
    m = GroupedExperts(3, 8, 16, "swiglu", True, gemm_path=path)
    check_against_loop(m, [0, 9, 0])      # every row on one expert
    check_against_loop(m, [4, 4, 4])      # equal blocks (bmm needs no padding)
    m2 = GroupedExperts(3, 8, 16, "gelu", True, gemm_path=path)
    x = torch.zeros(0, 8, requires_grad=True)
    if path == "grouped_mm" and not HAS_GROUPED_MM:
        with pytest.raises(ValueError, match=NO_GROUPED_MM):
            m2(x, torch.zeros(3, dtype=torch.int64))
        return
    y = m2(x, torch.zeros(3, dtype=torch.int64))
    assert y.shape == (0, 8)
    grads = torch.autograd.grad(y, [x, m2.w1, m2.b1], torch.zeros(0, 8), allow_unused=True)
    assert all(g is None or torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("activation,bias", [("gelu", False), ("swiglu", True), ("relu", True)])
@pytest.mark.parametrize("segment_bytes", [None, 64])
def test_segment_experts_blocks_in_any_order(activation, bias, segment_bytes, monkeypatch):
    """Rows in blocks of any order (source-rank-major: experts repeat, a block may be empty,
    expert 3 gets no rows at all): each block through its expert, every gradient equal to
    the float64 per-block reference, untouched experts' weight gradients zero. With a tiny
    SEGMENT_BYTES every block is its own GEMM group, so the per-expert weight gradients
    accumulate across groups."""
    from moepar.moe import cpu as experts_mod
    if segment_bytes is not None:
        monkeypatch.setattr(experts_mod, "SEGMENT_BYTES", segment_bytes)
    m = GroupedExperts(4, 8, 12, activation, bias, init_seed=7)
    seg = [0, 1, 2, 0, 1, 2, 1]
    counts = [3, 0, 2, 4, 1, 5, 2]
    gen = torch.Generator().manual_seed(1)
    N = sum(counts)
    x = torch.randn(N, 8, generator=gen, requires_grad=True)
    g = torch.randn(N, 8, generator=gen)
    params = list(m.parameters())
    y = m(x, counts, seg)
    got = all_grads(y, [x] + params, g)
    ref_m = GroupedExperts(4, 8, 12, activation, bias, dtype=torch.float64)
    ref_m.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    x64 = x.detach().double().requires_grad_(True)
    outs, r = [], 0
    for e, c in zip(seg, counts):
        one_hot = [c if i == e else 0 for i in range(4)]
        outs.append(loop_reference(ref_m, x64[r:r + c], one_hot))
        r += c
    y_ref = torch.cat(outs)
    want = all_grads(y_ref, [x64] + list(ref_m.parameters()), g.double())
    names = ["y", "x"] + [n for n, _ in m.named_parameters()]
    for name, a, b in zip(names, [y] + got, [y_ref] + want):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-4, atol=1e-5, msg=name)
    assert torch.equal(got[1 + names.index("w1") - 2][3], torch.zeros_like(m.w1[3]))
    with pytest.raises(ValueError, match="segment_experts"):
        m(x, counts, [0, 1, 2, 0, 1, 2, 4])
    with pytest.raises(ValueError, match="entries"):
        m(x, counts[:-1], seg)


def test_paths_agree_and_odd_sizes_fall_back():
    m = GroupedExperts(4, 13, 7, "gelu", True, gemm_path="loop")   # rows of 52 / 28 bytes
    x = torch.randn(20, 13)
    counts = [5, 0, 9, 6]
    y_loop = m(x, counts)
    m.gemm_path = "bmm"
    torch.testing.assert_close(m(x, counts), y_loop)
    m.gemm_path = "grouped_mm"
    with pytest.raises(ValueError, match="multiple of 16 bytes" if HAS_GROUPED_MM else NO_GROUPED_MM):
        m(x, counts)
    m.gemm_path = "auto"
    assert m.resolve_gemm_path(x, counts) in ("loop", "bmm")
    torch.testing.assert_close(m(x, counts), y_loop)


def test_auto_path_table_on_cpu():
    """The measured CPU rule (docs/local.md): one bmm for equal or small balanced blocks,
    grouped_mm for many experts, a loop of mm for few large ones."""
    cpu, f32 = torch.device("cpu"), torch.float32
    assert choose_gemm_path(cpu, f32, [512] * 8, 256, 256) == "bmm"          # capacity layout
    assert choose_gemm_path(cpu, f32, [60, 70, 64, 66], 256, 256) == "bmm"
    assert choose_gemm_path(cpu, f32, [1000, 1100, 900], 512, 2048) == "loop"
    assert choose_gemm_path(cpu, f32, [10, 200, 5, 1], 256, 256) == "loop"  # padding would dominate
    assert choose_gemm_path(cpu, f32, [500, 520] * 32, 256, 256) == (     # many experts
        "grouped_mm" if HAS_GROUPED_MM else "loop")
    assert choose_gemm_path(cpu, f32, [500, 520] * 32, 13, 256) == "loop"          # unaligned rows
    assert choose_gemm_path(cpu, f32, [0, 0], 256, 256) == "loop"


def test_init_identical_across_layouts():
    kw = dict(hidden=8, ffn_hidden=12, activation="swiglu", bias=True, init_seed=11)
    full = GroupedExperts(4, **kw)
    for ep in (2, 4):
        L = 4 // ep
        for r in range(ep):
            part = GroupedExperts(L, first_expert=r * L, **kw)
            for (n, p), (_, q) in zip(part.named_parameters(), full.named_parameters()):
                assert torch.equal(p, q[r * L:(r + 1) * L]), n
    # Different seeds and different experts differ.
    other = GroupedExperts(4, **{**kw, "init_seed": 12})
    assert not torch.equal(other.w1, full.w1)
    assert not torch.equal(full.w1[0], full.w1[1])
    g = GroupedExperts.global_expert_init(2, 8, 12, "swiglu", True, 11, None)
    assert torch.equal(g["w1"], full.w1[2]) and torch.equal(g["b2"], full.b2[2])


def test_init_distributions():
    m = GroupedExperts(2, 64, 256, "gelu", True, init_seed=5)
    assert m.w1.abs().max() <= 1 / math.sqrt(64) and m.w1.abs().max() > 0.9 / math.sqrt(64)
    assert m.w2.abs().max() <= 1 / math.sqrt(256) and m.b2.abs().max() <= 1 / math.sqrt(256)
    n = GroupedExperts(2, 64, 256, "gelu", True, init_seed=5, init_std=0.02)
    assert abs(float(n.w1.detach().std()) - 0.02) < 0.002 and torch.equal(n.b1, torch.zeros_like(n.b1))
    assert m.w1.dtype == torch.get_default_dtype()
    assert GroupedExperts(2, 8, 8, dtype=torch.bfloat16).w2.dtype == torch.bfloat16


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_expert_tensor_parallel_slices_sum_to_the_expert(activation):
    kw = dict(num_local_experts=3, hidden=8, ffn_hidden=16, activation=activation, bias=True, init_seed=9)
    whole = GroupedExperts(**kw)
    ranks = [GroupedExperts(**kw, etp_size=2, etp_rank=r) for r in range(2)]
    for r, part in enumerate(ranks):
        assert part.w1.shape == (3, 8, 8) and part.w2.shape == (3, 8, 8)
        assert torch.equal(part.w1, whole.w1[:, :, 8 * r:8 * (r + 1)])
        assert torch.equal(part.w2, whole.w2[:, 8 * r:8 * (r + 1)])
        assert torch.equal(part.b1, whole.b1[:, 8 * r:8 * (r + 1)]) and torch.equal(part.b2, whole.b2)
        dims = {n: p.moepar_expert_partition_dim for n, p in part.named_parameters()}
        assert dims["w1"] == 2 and dims["w2"] == 1 and dims["b1"] == 1 and dims["b2"] is None
        assert all(p.moepar_expert for p in part.parameters())
    counts = [4, 0, 6]
    x = torch.randn(10, 8, requires_grad=True)
    g = torch.randn(10, 8)
    y = whole(x, counts)
    # the caller's all-reduce of the partial sums: b2 comes in once, from expert-TP rank 0
    y_etp = ranks[0](x, counts) + ranks[1](x, counts)
    torch.testing.assert_close(y_etp, y)
    gx, gw1, gb2 = torch.autograd.grad(y, [x, whole.w1, whole.b2], g)
    gx_etp, gw1_0, gw1_1, gb2_0 = torch.autograd.grad(y_etp, [x, ranks[0].w1, ranks[1].w1, ranks[0].b2], g)
    torch.testing.assert_close(gx_etp, gx)
    torch.testing.assert_close(torch.cat([gw1_0, gw1_1], dim=2), gw1)
    torch.testing.assert_close(gb2_0, gb2)


def test_bad_inputs_raise_clear_errors():
    m = GroupedExperts(2, 8, 16)
    x = torch.randn(5, 8)
    with pytest.raises(ValueError, match="D=7 but the experts have hidden=8"):
        m(torch.randn(5, 7), [2, 3])
    with pytest.raises(ValueError, match="dtype"):
        m(x.double(), [2, 3])
    with pytest.raises(ValueError, match="sums to 4 but x_ND has 5 rows"):
        m(x, [2, 2])
    with pytest.raises(ValueError, match="3 entries but num_local_experts=2"):
        m(x, [2, 2, 1])
    with pytest.raises(ValueError, match=">= 0"):
        m(x, [6, -1])
    with pytest.raises(ValueError, match="integer tensor"):
        m(x, torch.tensor([2.0, 3.0]))
    with pytest.raises(ValueError, match="2-D"):
        m(x[0], [1, 0])
    with pytest.raises(ValueError, match="activation='softsign'"):
        GroupedExperts(2, 8, 16, "softsign")
    with pytest.raises(ValueError, match="ffn_hidden=15 is not divisible by etp_size=2"):
        GroupedExperts(2, 8, 15, etp_size=2)
    with pytest.raises(ValueError, match="etp_rank=2 must be < etp_size=2"):
        GroupedExperts(2, 8, 16, etp_size=2, etp_rank=2)
    with pytest.raises(ValueError, match="gemm_path='cutlass'"):
        GroupedExperts(2, 8, 16, gemm_path="cutlass")
    with pytest.raises(ValueError, match="num_local_experts=0"):
        GroupedExperts(0, 8, 16)


def test_meta_build_then_to_empty_keeps_the_expert_markers():
    """``to_empty`` replaces the parameter objects; reset_parameters() marks the new ones
    (allreduce_gradients and fully_shard tell experts from dense weights by the marker)."""
    kw = dict(num_local_experts=2, hidden=8, ffn_hidden=16, activation="swiglu", bias=True, init_seed=3,
              etp_size=2, etp_rank=1)
    with torch.device("meta"):
        m = GroupedExperts(**kw)
    m.to_empty(device="cpu")
    assert not any(getattr(p, "moepar_expert", False) for p in m.parameters())
    m.reset_parameters()
    direct = GroupedExperts(**kw)
    for (n, p), q in zip(m.named_parameters(), direct.parameters()):
        assert torch.equal(p, q), n
        assert p.moepar_expert and p.moepar_expert_partition_dim == q.moepar_expert_partition_dim, n

"""permute / unpermute: the Triton kernels (under TRITON_INTERPRET=1) and the torch
reference path against a slow per-route Python reference, outputs and every gradient.

Shapes: a pairwise (L9 orthogonal array) selection of T in {1, 5, 1000}, D in {8, 100, 256},
E in {1, 4, 64}, K in {1, 2, 8}, each with three routings (random with drops, nothing
dropped, every route on one expert); experts without tokens come with E=64 and small T.
"""
import pytest
import torch

from moepar_kernels.permute import permute, permute_reference, unpermute, unpermute_reference

# L9(3^4): every pair of levels of every two axes appears in some row.
_L9 = [(0, 0, 0, 0), (0, 1, 1, 1), (0, 2, 2, 2), (1, 0, 1, 2), (1, 1, 2, 0), (1, 2, 0, 1),
       (2, 0, 2, 1), (2, 1, 0, 2), (2, 2, 1, 0)]
_TS, _DS, _ES, _KS = (1, 5, 1000), (8, 100, 256), (1, 4, 64), (1, 2, 8)
SHAPES = [(_TS[a], _DS[b], _ES[c], _KS[d]) for a, b, c, d in _L9]
MODES = ("drops", "no_drops", "one_expert")


def make_routes(T, E, K, mode, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if mode == "one_expert":
        ids = torch.full((T, K), E - 1, dtype=torch.int64)
    elif K <= E:  # distinct experts per token, as a router gives
        ids = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    else:         # K > E: repeats are allowed by permute (each route is its own row)
        ids = torch.randint(0, E, (T, K), generator=gen)
    dropped = torch.rand(T, K, generator=gen) < 0.3 if mode == "drops" else None
    w = torch.rand(T, K, generator=gen)
    return ids, dropped, w


def slow_layout(ids, dropped, E, capacity=None):
    """Rows of every kept route, expert by expert, token order then k order: Python loops."""
    T, K = ids.shape
    ids_l = ids.tolist()
    drop_l = dropped.tolist() if dropped is not None else [[False] * K for _ in range(T)]
    per_expert = [[] for _ in range(E)]
    for t in range(T):
        for k in range(K):
            if not drop_l[t][k]:
                per_expert[ids_l[t][k]].append((t, k))
    row_map = torch.full((T, K), -1, dtype=torch.int64)
    routes = []
    for e in range(E):
        for i, (t, k) in enumerate(per_expert[e]):
            row = len(routes) if capacity is None else e * capacity + i
            row_map[t, k] = row
            routes.append((row, t, k))
    counts = torch.tensor([len(r) for r in per_expert], dtype=torch.int64)
    return routes, counts, row_map


def slow_permute(x, routes, num_rows):
    """Row r of the result is x[t] of the route (r, t, k); rows without a route are zero."""
    out = x.new_zeros(num_rows, x.shape[1])
    if routes:
        rows, toks, _ = zip(*routes)
        out = out.index_put((torch.tensor(rows),), x[list(toks)])
    else:   # stay in the graph (zero gradient)
        out = out + 0 * x.sum()
    return out


def slow_unpermute(y, routes, w, T):
    """out[t] = sum over t's kept routes (row, t, k) of w[t, k] * y[row]."""
    out = y.new_zeros(T, y.shape[1])
    if routes:
        rows, toks, ks = (list(v) for v in zip(*routes))
        out = out.index_add(0, torch.tensor(toks), w[toks, ks][:, None] * y[rows])
    else:   # stay in the graph (zero gradients)
        out = out + 0 * (y.sum() + w.sum())
    return out


def grads(out, inputs, g):
    res = torch.autograd.grad(out, inputs, g, allow_unused=True)
    return [torch.zeros_like(i) if r is None else r for r, i in zip(res, inputs)]


def check_round_trip(T, D, E, K, mode, impl, dtype=torch.float32, capacity=None, seed=0):
    """permute and unpermute (outputs and grads to x, y_ND and the weights) vs the slow
    reference in float64 on the same (rounded) inputs."""
    ids, dropped, w = make_routes(T, E, K, mode, seed)
    routes, counts, row_map = slow_layout(ids, dropped, E, capacity)
    num_rows = len(routes) if capacity is None else E * capacity
    x = torch.randn(T, D, dtype=dtype, requires_grad=True)
    x_ND, counts_E, rm = permute(x, ids, dropped, E, capacity=capacity, impl=impl)
    assert x_ND.shape == (num_rows, D) and x_ND.dtype == dtype
    assert torch.equal(counts_E, counts) and counts_E.dtype == torch.int64
    assert torch.equal(rm, row_map)
    # A permutation: every kept route has exactly one row, no row has two routes.
    kept = rm[rm >= 0]
    assert kept.numel() == len(routes) == kept.unique().numel()
    if capacity is None:
        assert torch.equal(kept.sort().values, torch.arange(len(routes)))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    x64 = x.detach().double().requires_grad_(True)
    xN_ref = slow_permute(x64, routes, num_rows)
    assert torch.equal(x_ND.double(), xN_ref.detach())             # a gather is exact
    g_ND = torch.randn(num_rows, D, dtype=dtype)
    (gx,) = grads(x_ND, [x], g_ND)
    (gx_ref,) = grads(xN_ref, [x64], g_ND.double())
    torch.testing.assert_close(gx.double(), gx_ref, **tol)

    y = torch.randn(num_rows, D, dtype=dtype, requires_grad=True)
    w = w.requires_grad_(True)
    out = unpermute(y, rm, w, T, impl=impl)
    assert out.shape == (T, D) and out.dtype == dtype
    y64, w64 = y.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    out_ref = slow_unpermute(y64, routes, w64, T)
    torch.testing.assert_close(out.double(), out_ref.detach(), **tol)
    g = torch.randn(T, D, dtype=dtype)
    gy, gw = grads(out, [y, w], g)
    gy_ref, gw_ref = grads(out_ref, [y64, w64], g.double())
    assert gw.dtype == torch.float32
    torch.testing.assert_close(gy.double(), gy_ref, **tol)
    torch.testing.assert_close(gw.double(), gw_ref, rtol=1e-4, atol=1e-4)   # fp32 dots either way


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T,D,E,K", SHAPES)
def test_round_trip_matches_slow_reference(T, D, E, K, mode, impl):
    check_round_trip(T, D, E, K, mode, impl)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_accumulates_in_fp32(dtype, impl):
    check_round_trip(300, 40, 8, 8, "drops", impl, dtype=dtype)
    # Routes that cancel: a bf16 accumulator rounds 256 + 1 to 256 (or 258) and ends at 0 (or 2).
    T, K, D = 1, 8, 16
    ids = torch.arange(K)[None]
    y = torch.tensor([256.0, 1.0, -256.0, 0, 0, 0, 0, 0], dtype=dtype)[:, None].expand(K, D).contiguous()
    out = unpermute(y, ids.clone(), torch.ones(T, K), T, impl=impl)
    assert torch.all(out == 1.0)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_zero_token_experts_and_all_dropped(impl):
    check_round_trip(3, 8, 64, 2, "drops", impl, seed=3)      # 61+ of 64 experts empty
    T, K, E, D = 4, 2, 4, 8
    ids = torch.zeros(T, K, dtype=torch.int64)
    x = torch.randn(T, D, requires_grad=True)
    x_ND, counts, rm = permute(x, ids, torch.ones(T, K, dtype=torch.bool), E, impl=impl)
    assert x_ND.shape == (0, D) and counts.tolist() == [0] * E and bool((rm == -1).all())
    y = unpermute(x_ND, rm, torch.rand(T, K), T, impl=impl)
    assert torch.equal(y, torch.zeros(T, D))
    (gx,) = torch.autograd.grad(y, [x], torch.randn(T, D))
    assert torch.equal(gx, torch.zeros(T, D))


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("capacity", [None, 3])
def test_no_tokens(impl, capacity):
    # A rank with no tokens: with capacity every row is padding (E*C zero rows, no routes),
    # and the backward gives empty gradients to x and the weights, zeros to the padding rows
    # (the reference's backward used to gather weight 0 of an empty tensor here).
    check_round_trip(0, 8, 4, 2, "drops", impl, capacity=capacity)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_capacity_layout(impl):
    T, D, E, K, C = 50, 12, 4, 2, 40
    check_round_trip(T, D, E, K, "drops", impl, capacity=C)
    ids, dropped, _ = make_routes(T, E, K, "drops")
    x = torch.randn(T, D)
    x_ND, counts, rm = permute(x, ids, dropped, E, capacity=C, impl=impl)
    x_ECD = x_ND.view(E, C, D)
    for e in range(E):
        c = int(counts[e])
        assert torch.equal(x_ECD[e, c:], torch.zeros(C - c, D))          # zero padding slots
        toks = [t for t in range(T) for k in range(K) if ids[t, k] == e and not dropped[t, k]]
        assert torch.equal(x_ECD[e, :c], x[toks])                           # token order
    with pytest.raises(ValueError, match="capacity=3"):
        permute(x, ids, dropped, E, capacity=3, impl=impl)


def test_reference_functions_match_ops():
    ids, dropped, w = make_routes(40, 6, 3, "drops")
    x = torch.randn(40, 10)
    a = permute(x, ids, dropped, 6, impl="reference")
    b = permute_reference(x, ids, dropped, 6)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    torch.testing.assert_close(unpermute(a[0], a[2], w, 40), unpermute_reference(b[0], b[2], w, 40))


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) and autograd registrations agree with the real ops."""
    from moepar_kernels import permute as pk
    ids, dropped, w = make_routes(6, 4, 2, "drops")
    x = torch.randn(6, 8, requires_grad=True)
    for impl in ("triton", "reference"):
        kept = int((~dropped).sum())
        torch.library.opcheck(pk._permute_op, (x, ids, dropped, 4, None, None, impl))
        torch.library.opcheck(pk._permute_op, (x, ids, dropped, 4, None, kept, impl))
        torch.library.opcheck(pk._permute_op, (x, ids, dropped, 4, 12, None, impl))
        torch.library.opcheck(pk._permute_op, (x, ids, dropped, 4, 12, 48, impl))
        x_ND, _, rm = pk.permute(x.detach(), ids, dropped, 4, impl=impl)
        y = torch.randn(x_ND.shape[0], 8, requires_grad=True)
        torch.library.opcheck(pk._unpermute_op, (y, rm, w.clone().requires_grad_(True), 6, impl))


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("capacity", [None, 18])
def test_a_known_row_count_gives_the_same_rows_without_a_host_read(impl, capacity):
    # The dispatcher passes num_rows (it knows them from its counts exchange): the index
    # computation then reads nothing back (tests/parallel/test_gpu_discipline.py counts it on fake
    # CUDA); here the results must equal the counted path's, drops and capacity included.
    ids, dropped, _ = make_routes(9, 4, 2, "drops")
    x = torch.randn(9, 8)
    n = int((~dropped).sum()) if capacity is None else 4 * capacity
    a = permute(x, ids, dropped, 4, capacity=capacity, impl=impl)
    b = permute(x, ids, dropped, 4, capacity=capacity, num_rows=n, impl=impl)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    with pytest.raises(ValueError, match="num_rows=7 but capacity=5 gives"):
        permute(x, ids, dropped, 4, capacity=5, num_rows=7)
    with pytest.raises(ValueError, match="num_rows=19 is more than the 18 routes"):
        permute(x, ids, None, 4, num_rows=19)


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 8)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    with pytest.raises(ValueError, match=r"expert id 4 out of range.*num_experts=4"):
        permute(x, ids + 1, None, 4)
    with pytest.raises(ValueError, match=r"expert id -1 out of range"):
        permute(x, ids - 1, None, 4)
    with pytest.raises(ValueError, match="int64 or int32"):
        permute(x, ids.float(), None, 4)
    with pytest.raises(ValueError, match=r"\[T=4, K\]"):
        permute(x, ids[:3], None, 4)
    with pytest.raises(ValueError, match="2-D"):
        permute(x[0], ids, None, 4)
    with pytest.raises(ValueError, match="dropped_TK has shape"):
        permute(x, ids, torch.zeros(4, 3, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="bool"):
        permute(x, ids, torch.zeros(4, 2), 4)
    with pytest.raises(ValueError, match="num_experts=0"):
        permute(x, ids, None, 0)
    with pytest.raises(ValueError, match="impl="):
        permute(x, ids, None, 4, impl="cuda")
    x_ND, _, rm = permute(x, ids, None, 4)
    with pytest.raises(ValueError, match="weights_TK has shape"):
        unpermute(x_ND, rm, torch.rand(4, 3), 4)
    with pytest.raises(ValueError, match="num_tokens=5"):
        unpermute(x_ND, rm, torch.rand(4, 2), 5)
    with pytest.raises(ValueError, match="int64"):
        unpermute(x_ND, rm.int(), torch.rand(4, 2), 4)
    with pytest.raises(ValueError, match="floating point"):
        unpermute(x_ND, rm, torch.ones(4, 2, dtype=torch.int64), 4)


@pytest.mark.parametrize("capacity", [None, 60])
def test_kernels_with_small_tiles(monkeypatch, capacity):
    """GPU-like tiling under the interpreter: many programs, a partial last row block and
    several D chunks with a partial last one (the interpreter default is one big tile)."""
    from moepar_kernels import permute as pk
    monkeypatch.setattr(pk, "_blocks", lambda num_rows, D: (4, 16, 4))
    check_round_trip(50, 100, 4, 3, "drops", "triton", capacity=capacity)
    check_round_trip(7, 33, 64, 8, "no_drops", "triton", dtype=torch.bfloat16)

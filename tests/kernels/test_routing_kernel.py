"""moepar_kernels.routing: the Triton kernel (TRITON_INTERPRET=1 on CPU) against its torch
reference, and the reference against a per-row Python sort. Legend: T tokens, E experts, K."""
import pytest
import torch

from moepar_kernels import routing as rk

SCORES = ("softmax", "sigmoid", "softmax_after_topk")


def planted_logits(T: int, E: int, seed: int) -> torch.Tensor:
    """Random rows, rows of few distinct values (many exact ties, also at the top-k
    boundary), all-equal rows and rows whose maximum appears twice."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, E, generator=g)
    kind = torch.arange(T) % 4
    x[kind == 1] = torch.randint(-2, 3, (int((kind == 1).sum()), E), generator=g).float() / 2
    x[kind == 2] = 0.25
    dup = kind == 3
    if E > 1 and dup.any():
        x[dup, E - 1] = x[dup].max(dim=1).values
    return x


def planted_bias(E: int, seed: int) -> torch.Tensor:
    # Two distinct values only: equal logits with equal bias still tie.
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, 2, (E,), generator=g).float() * 0.125


def python_topk(key_row: list[float], k: int) -> list[int]:
    return sorted(range(len(key_row)), key=lambda e: (-key_row[e], e))[:k]


@pytest.mark.parametrize("E", [4, 8, 60, 64, 128, 256])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_kernel_matches_reference(score_func, with_bias, E):
    bias = planted_bias(E, E) if with_bias else None
    for k in (1, 2, 6, 8):
        if k > E:
            continue
        for T in (1, 7, 4096):
            x = planted_logits(T, E, seed=T * 1000 + E + k)
            ids, w, hist = rk.routing(x, k, score_func, bias)
            r_ids, r_w, r_hist = rk.routing_reference(x, k, score_func, bias)
            where = f"E={E} k={k} T={T}"
            assert torch.equal(ids, r_ids), where
            torch.testing.assert_close(w, r_w, atol=1e-6, rtol=0, msg=where)
            assert torch.equal(hist, r_hist), where
            assert ids.dtype == torch.int64 and w.dtype == torch.float32 and hist.dtype == torch.int64
            assert int(hist.sum()) == T * k
            # Each row: k distinct valid ids, and the all-equal rows pick 0..k-1.
            assert bool((ids.sort(dim=1).values.diff(dim=1) > 0).all()) and int(ids.max()) < E
            if T >= 3 and not with_bias:
                assert ids[2].tolist() == list(range(k))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("score_func", SCORES)
def test_kernel_options_small_tiles(score_func, with_bias):
    """normalize, scaling, softmax_after_topk, several row blocks per program (block_t=4,
    4 programs), E not a power of two, bf16 and strided logits."""
    E, k, T = 60, 6, 37
    bias = planted_bias(E, 3) if with_bias else None
    wide = planted_logits(T, E + 5, seed=7)
    for x in (wide[:, :E], wide[:, :E].to(torch.bfloat16)):   # strided rows, then bf16
        for normalize in (False, True):
            got = rk.routing(x, k, score_func, bias, normalize, 2.5, block_t=4, num_warps=2)
            ref = rk.routing_reference(x, k, score_func, bias, normalize, 2.5)
            assert torch.equal(got[0], ref[0])
            torch.testing.assert_close(got[1], ref[1], atol=3e-6, rtol=0)
            assert torch.equal(got[2], ref[2])
            if normalize or score_func == "softmax_after_topk":
                torch.testing.assert_close(got[1].sum(1), torch.full((T,), 2.5), atol=1e-5, rtol=0)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("score_func", SCORES)
def test_reference_selection_is_python_sort(score_func, with_bias):
    """The selection key and its tie rule, written out per row."""
    E, k, T = 12, 3, 40
    x = planted_logits(T, E, seed=11)
    bias = planted_bias(E, 5) if with_bias else None
    ids, w, _ = rk.routing_reference(x, k, score_func, bias)
    for t in range(T):
        row = x[t]
        if bias is None:
            key = row
        elif score_func == "softmax_after_topk":
            key = row + bias
        else:
            key = (torch.softmax(row, 0) if score_func == "softmax" else torch.sigmoid(row)) + bias
        expect = python_topk(key.tolist(), k)
        assert ids[t].tolist() == expect, t
        if score_func == "softmax_after_topk":
            torch.testing.assert_close(w[t], torch.softmax(row[expect], 0), atol=1e-6, rtol=0)
        else:
            s = torch.softmax(row, 0) if score_func == "softmax" else torch.sigmoid(row)
            torch.testing.assert_close(w[t], s[expect], atol=1e-6, rtol=0)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("score_func", SCORES)
def test_nonfinite_rows_get_distinct_ids_and_nan_weights(score_func, with_bias):
    E, k, T = 10, 3, 9
    x = planted_logits(T, E, seed=2)
    bad = [1, 4, 8]
    x[1, 3] = float("nan")
    x[4, 0] = float("inf")
    x[8, 9] = float("-inf")
    bias = planted_bias(E, 1) if with_bias else None
    good = [t for t in range(T) if t not in bad]
    alone = rk.routing_reference(x[good], k, score_func, bias, True)
    for fn in (rk.routing, rk.routing_reference):
        ids, w, hist = fn(x, k, score_func, bias, True)
        assert ids[bad].tolist() == [list(range(k))] * len(bad)     # distinct, valid
        assert bool(torch.isnan(w[bad]).all())                      # never a finite route
        assert torch.equal(ids[good], alone[0])                     # others untouched
        torch.testing.assert_close(w[good], alone[1], atol=1e-6, rtol=0)
        assert int(hist.sum()) == T * k and torch.equal(hist[k:], alone[2][k:])


def _grad_case(score_func, normalize, with_bias):
    E, k, T = 9, 3, 13
    x = planted_logits(T, E, seed=5) + 0.01 * torch.randn(T, E)   # no exact ties: clean grads
    bias = planted_bias(E, 2) if with_bias else None
    upstream = torch.randn(T, k)
    grads = []
    for fn in (rk.routing, rk.routing_reference):
        xx = x.clone().requires_grad_()
        ids, w, _ = fn(xx, k, score_func, bias, normalize, 1.5)
        (w * upstream).sum().backward()
        grads.append((ids, xx.grad))
    return grads


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("score_func", SCORES)
def test_backward_matches_reference_autograd(score_func, normalize, with_bias):
    (ids, g), (r_ids, r_g) = _grad_case(score_func, normalize, with_bias)
    assert torch.equal(ids, r_ids)
    assert g.abs().sum() > 0
    torch.testing.assert_close(g, r_g, atol=1e-6, rtol=1e-5)


def test_compile_fullgraph_through_the_custom_op():
    x = planted_logits(33, 16, seed=9) + 0.01 * torch.randn(33, 16)
    bias = planted_bias(16, 9)

    def f(z):
        ids, w, hist = rk.routing(z, 4, "sigmoid", bias, True, 2.0)
        return ids, (w * w).sum(), hist

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    outs = []
    for fn in (f, compiled):
        z = x.clone().requires_grad_()
        ids, loss, hist = fn(z)
        loss.backward()
        outs.append((ids, loss.detach(), hist, z.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_opcheck_registrations():
    x = torch.randn(7, 8)
    for aux_scale in (0.0, 0.5):
        torch.library.opcheck(rk._routing_op, (x, 2, "softmax", None, True, 1.0, aux_scale, 0, 0),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_empty_batch():
    ids, w, hist = rk.routing(torch.zeros(0, 8), 2)
    assert ids.shape == (0, 2) and w.shape == (0, 2) and hist.tolist() == [0] * 8
    r = rk.routing_reference(torch.zeros(0, 8), 2)
    assert r[0].shape == (0, 2) and r[2].tolist() == [0] * 8


@pytest.mark.parametrize("args, kwargs, match", [
    ((torch.zeros(3, 4), 5), {}, r"k=5 must be an integer with 1 <= k <= num_experts=4"),
    ((torch.zeros(3, 4), 0), {}, r"k=0 must be"),
    ((torch.zeros(3, 32), 17), {}, r"k=17 exceeds the routing kernel's limit of 16"),
    ((torch.zeros(3, 513), 2), {}, r"num_experts=513 exceeds the routing kernel's limit of 512"),
    ((torch.zeros(4), 1), {}, r"logits must be 2-D"),
    ((torch.zeros(3, 4, dtype=torch.int32), 1), {}, r"floating point"),
    ((torch.zeros(3, 4), 2, "relu"), {}, r"score_func='relu' must be one of"),
    ((torch.zeros(3, 4), 2, "softmax", torch.zeros(5)), {}, r"expert_bias must have shape \[4\]"),
    ((torch.zeros(3, 4), 2), {"block_t": 3}, r"block_t=3 must be a positive power of two"),
    ((torch.zeros(3, 4), 2), {"num_warps": 3}, r"num_warps=3 must be one of"),
])
def test_launcher_rejects_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rk.routing(*args, **kwargs)


def test_bench_cpu_mode_and_gpu_check_logic(capsys):
    from moepar.bench import routing as bench
    assert bench.main(["--tokens", "64", "--experts", "8", "--k", "2", "--device", "cpu", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "the Triton kernel needs CUDA for timing" in out and "softmax" in out
    # The CUDA mode's correctness check, run here through the interpreter.
    x = planted_logits(64, 16, seed=4)
    for bias in (None, planted_bias(16, 4)):
        check = bench.verify(x, 4, "sigmoid", bias, True)
        assert check["ok"] and check["ids_mismatch_rows"] == 0 and check["hist_diff"] == 0
    assert bench.route_bytes(65536, 256, 8) == 65536 * 256 * 4 + 65536 * 8 * 12 + 256 * 8


def test_interpreter_version_check(monkeypatch):
    """Triton < 3.7's interpreter with NumPy >= 2.4 fails deep inside a launch; the launchers
    name the pair and the fix instead, before any kernel runs."""
    from moepar_kernels import interpreter
    from moepar_kernels.permute import permute
    assert interpreter.incompatibility("3.5.1", "2.4.6") is not None
    assert "numpy<2.4" in interpreter.incompatibility("3.4.0", "2.4.0")
    assert interpreter.incompatibility("3.5.1", "2.3.5") is None
    assert interpreter.incompatibility("3.7.0", "2.4.6") is None
    assert interpreter.incompatibility("3.9.0+git1234", "2.4.6") is None
    monkeypatch.setattr(interpreter, "_checked", False)
    monkeypatch.setattr(interpreter, "incompatibility", lambda t, n: f"triton {t} with numpy {n}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="triton .* with numpy"):
        rk.routing(logits, 2)
    with pytest.raises(RuntimeError, match="triton .* with numpy"):
        permute(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int64), None, 8, impl="triton")


def _aux_reference(x, k, score_func, bias, normalize, scale, aux_scale):
    """routing_reference, then the load-balancing loss in plain torch: P_e = sum_t p_te (the
    scores as a per-token distribution) times aux_scale x routes_e."""
    ids, w, hist = rk.routing_reference(x, k, score_func, bias, normalize, scale)
    s = torch.sigmoid(x) if score_func == "sigmoid" else torch.softmax(x, -1)
    p = s / (s.sum(-1, keepdim=True) + 1e-20) if score_func == "sigmoid" else s
    return ids, w, hist, (p.sum(0) * hist.float() * aux_scale).sum()


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("score_func", SCORES)
def test_full_routing_statistics_and_gradients_equal_the_reference(score_func, with_bias, normalize):
    """One launch gives the routes, the non-finite rows and the load-balancing loss; its
    backward (one launch) gives the logits the gradient of weights and loss together."""
    for E, k, T in ((8, 2, 1), (60, 6, 37), (256, 8, 300)):
        x = planted_logits(T, E, seed=E + k) + 0.01 * torch.randn(T, E, generator=torch.Generator().manual_seed(k))
        bias = planted_bias(E, E) if with_bias else None
        g = torch.randn(T, k, generator=torch.Generator().manual_seed(T))
        aux_scale = 0.01 * E / (k * T * T)
        got, want = [], []
        for fn, out in ((rk.routing_full, got), (_aux_reference, want)):
            leaf = x.clone().requires_grad_()
            res = fn(leaf, k, score_func, bias, normalize, 1.5, aux_scale)
            ids, w, hist, aux = res[0], res[1], res[2], res[-1]
            ((w * g).sum() + 100 * aux).backward()
            out += [ids, w.detach(), hist, aux.detach(), leaf.grad]
        where = f"E={E} k={k} T={T}"
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), where
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=0, msg=where)
        torch.testing.assert_close(got[3], want[3], atol=1e-7, rtol=1e-5, msg=where)
        torch.testing.assert_close(got[4], want[4], atol=1e-6, rtol=1e-5, msg=where)


def test_nonfinite_rows_are_counted_in_the_launch_and_get_nan_gradients():
    x = torch.randn(9, 16)
    x[2, 3], x[5, 0], x[5, 7], x[7, 15] = float("nan"), float("inf"), float("-inf"), float("-inf")
    ids, w, hist, bad, aux = rk.routing_full(x, 2, "softmax", None, False, 1.0, 0.25)
    assert int(bad) == 3 and bool(torch.isnan(aux))
    assert bool(torch.isnan(w[[2, 5, 7]]).all()) and bool(torch.isfinite(w[[0, 1, 3, 4, 6, 8]]).all())
    for score_func in SCORES:
        g = torch.ones(9, 2)
        got = rk.routing_backward(x, ids, g, score_func, True, 1.0, torch.ones(16))
        want = rk.routing_backward_reference(x, ids, g, score_func, True, 1.0, torch.ones(16))
        assert bool(torch.isnan(got[[2, 5, 7]]).all()) and bool(torch.isnan(want[[2, 5, 7]]).all())
        ok = [0, 1, 3, 4, 6, 8]
        torch.testing.assert_close(got[ok], want[ok], atol=1e-6, rtol=1e-5)

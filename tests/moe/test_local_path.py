"""permute -> GroupedExperts -> unpermute against a per-token dense reference (each token
through its k experts, weighted), forward and backward, on random routings with drops;
dropless and capacity layouts, kernels (interpreter) and the torch path; and a smoke run
of ``python -m moepar bench local``."""
import json

import pytest
import torch
import torch.nn.functional as F

from moepar.moe.experts.grouped import GroupedExperts
from moepar_kernels.permute import permute, unpermute


def dense_reference(m: GroupedExperts, x_TD, ids, dropped, w_TK):
    """y[t] = sum over kept k of w[t, k] * FFN_{ids[t, k]}(x[t]), token by token."""
    out = []
    for t in range(x_TD.shape[0]):
        acc = x_TD.new_zeros(m.hidden)
        for k in range(ids.shape[1]):
            if dropped is not None and bool(dropped[t, k]):
                continue
            e = int(ids[t, k])
            h = x_TD[t] @ m.w1[e] + (m.b1[e] if m.bias else 0)
            if m.activation == "swiglu":
                a = F.silu(h) * (x_TD[t] @ m.w3[e] + (m.b3[e] if m.bias else 0))
            else:
                a = F.gelu(h) if m.activation == "gelu" else F.relu(h)
            acc = acc + w_TK[t, k] * (a @ m.w2[e] + (m.b2[e] if m.bias else 0))
        out.append(acc)
    return torch.stack(out)


def routes(T, E, K, seed, drop=0.25):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    dropped = torch.rand(T, K, generator=gen) < drop
    w = torch.softmax(torch.randn(T, K, generator=gen), -1)
    return ids, dropped, w


def run_local(m, x, ids, dropped, w, E, impl, capacity=None):
    x_ND, counts, row_map = permute(x, ids, dropped, E, capacity=capacity, impl=impl)
    counts = [capacity] * E if capacity is not None else counts
    return unpermute(m(x_ND, counts), row_map, w, x.shape[0], impl=impl)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("activation,bias,path,T,E,K,capacity", [
    ("gelu", False, "auto", 37, 6, 2, None),
    ("swiglu", True, "loop", 20, 8, 3, None),
    ("relu", True, "loop", 16, 4, 1, None),
    ("gelu", True, "bmm", 25, 5, 2, 16),        # fixed-shape [E, C, D] rows
    ("swiglu", False, "auto", 1, 64, 8, None),  # one token, most experts empty
])
def test_local_path_equals_dense_reference(impl, activation, bias, path, T, E, K, capacity):
    m = GroupedExperts(E, 16, 32, activation, bias, init_seed=T, dtype=torch.float64, gemm_path=path)
    ids, dropped, w = routes(T, E, K, seed=T)
    x = torch.randn(T, 16, dtype=torch.float64, requires_grad=True)
    w = w.double().requires_grad_(True)
    params = list(m.parameters())
    y = run_local(m, x, ids, dropped, w, E, impl, capacity)
    y_ref = dense_reference(m, x, ids, dropped, w)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    g = torch.randn(T, 16, dtype=torch.float64)
    got = torch.autograd.grad(y, [x, w] + params, g, allow_unused=True)
    want = torch.autograd.grad(y_ref, [x, w] + params, g, allow_unused=True)
    names = ["x", "weights"] + [n for n, _ in m.named_parameters()]
    for name, a, b in zip(names, got, want):
        if b is None:  # e.g. all of a parameter's experts unused: grad must be zero
            assert a is None or not a.any(), name
            continue
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_local_path_fp32_kernel_matches_torch_path():
    m = GroupedExperts(8, 24, 40, "gelu", init_seed=2)
    ids, dropped, w = routes(200, 8, 2, seed=5)
    x = torch.randn(200, 24)
    a = run_local(m, x, ids, dropped, w, 8, "triton")
    b = run_local(m, x, ids, dropped, w, 8, "reference")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bench_local_smoke(capsys):
    from moepar.bench import local
    assert local.main(["--configs", "32:16:32:4:2", "--rounds", "1", "--warmup", "0", "--no-matmul",
                       "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (cfg,) = out["configs"]
    assert cfg["N"] == 64 and cfg["ratio"] > 0 and cfg["floor_impl"] != "local path (auto)"
    assert {r["impl"] for r in cfg["rows"]} >= {"experts[loop]", "local path (auto)"}
    assert abs(cfg["gflop"] - 12 * 64 * 16 * 32 / 1e9) < 1e-12


def test_local_path_grouped_mm_fp32():
    m = GroupedExperts(4, 16, 32, "relu", True, init_seed=1, gemm_path="grouped_mm")
    ids, dropped, w = routes(16, 4, 1, seed=1)
    x = torch.randn(16, 16, requires_grad=True)
    if not hasattr(F, "grouped_mm"):   # older torch (2.8, 2.9): a clear error, not a fallback
        with pytest.raises(ValueError, match="has no torch.nn.functional.grouped_mm"):
            run_local(m, x, ids, dropped, w, 4, "reference")
        return
    y = run_local(m, x, ids, dropped, w, 4, "reference")
    y_ref = dense_reference(m, x, ids, dropped, w)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(16, 16)
    for a, b in zip(torch.autograd.grad(y, [x, m.w1, m.b2], g), torch.autograd.grad(y_ref, [x, m.w1, m.b2], g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bench_bandwidth_check_runs_under_the_interpreter():
    """The CUDA bandwidth check's code path (kernels forced, tiny sizes, CPU interpreter)."""
    from moepar.bench import local
    out = local.bench_bandwidth(64, 32, 2, 8, torch.float32, rounds=1, device="cpu")
    names = [r["impl"] for r in out["rows"]]
    assert names[0] == "copy N*D" and len(names) == 4 and all(r["GB/s"] > 0 for r in out["rows"])

"""torchtitan's MoE as a benchmark peer (moepar.bench.peers.TorchTitanMoE): it holds moepar's
weights and computes moepar's function where the routing rules coincide; the layer bench
puts it beside moepar; the Python-call counter behind ``bench ops`` counts what it claims.
Where torchtitan is not installed, the tests check that the benches say why instead."""
import functools
import os
import sys

import pytest
import torch

from moepar.bench import layer as bench_layer
from moepar.bench.peers import TorchTitanMoE, compare_with_moepar, torchtitan_gap, torchtitan_status
from moepar.moe.layer import MoE
from moepar.parallel.groups import ParallelState
from tests.helpers.multiproc import run_ranks

HAVE, WHY = torchtitan_status()


def _moe(dtype=torch.bfloat16, **kw):
    kw.setdefault("activation", "swiglu")
    return MoE(32, 8, k=kw.pop("k", 2), ffn_hidden=48, init_seed=5, dtype=dtype, state=ParallelState.single(), **kw)


def test_gap_names_what_the_adapter_cannot_hold():
    assert torchtitan_gap(_moe()) is None
    assert torchtitan_gap(_moe(score_func="sigmoid", expert_bias=True)) is None
    assert "activation='gelu'" in torchtitan_gap(_moe(activation="gelu"))
    assert "capacity" in torchtitan_gap(_moe(capacity_factor=1.0))
    assert "softmax_after_topk" in torchtitan_gap(_moe(score_func="softmax_after_topk"))
    assert "shared experts" in torchtitan_gap(_moe(num_shared_experts=1))


@pytest.mark.parametrize("dtype,kw", [
    (torch.bfloat16, {}),
    (torch.float32, {"k": 3}),
    (torch.bfloat16, {"score_func": "sigmoid", "expert_bias": True}),   # normalised, bias for selection
])
def test_torchtitan_computes_moepars_function(dtype, kw):
    moe = _moe(dtype, **kw)
    if not HAVE:   # not installed: the adapter says why
        assert WHY.startswith("not importable")
        with pytest.raises(ImportError, match="torchtitan"):
            TorchTitanMoE(moe)
        return
    if moe.router.expert_bias is not None:
        moe.router.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(2)) * 0.1)
    peer = TorchTitanMoE(moe)
    gen = torch.Generator().manual_seed(3)
    # bf16-representable inputs: both routers see the same fp32 logits
    x = torch.randn(2, 37, 32, generator=gen).to(torch.bfloat16).to(dtype)
    g = torch.randn(2, 37, 32, generator=gen).to(dtype)
    c = compare_with_moepar(moe, peer, x, g)
    assert c["same_experts"] == c["tokens"] == 74, c
    # torchtitan's experts run in bf16 whatever the dtype: bf16's rounding, here and in fp32
    assert c["rel_err_y"] <= 1e-2 and c["rel_err_dx"] <= 1e-2, c
    # every weight's gradient, in moepar's layouts
    xa = x.clone().requires_grad_()
    mine = torch.autograd.grad(moe(xa), [moe.router.weight, moe.experts.w1, moe.experts.w3, moe.experts.w2], g)
    inner = peer.inner
    ex = inner.routed_experts.inner_experts
    theirs = torch.autograd.grad(peer(x.clone().requires_grad_()),
                                 [inner.router.gate.weight, ex.w1_EFD, ex.w3_EFD, ex.w2_EDF], g)
    for name, a, b in zip(("router", "w1", "w3", "w2"), mine, theirs):
        b = b if name == "router" else b.transpose(1, 2)
        err = float((b.double() - a.double()).norm() / a.double().norm())
        assert err <= 1e-2, (name, err)


def test_layer_bench_puts_torchtitan_beside_moepar():
    base = ["--configs", "40:16:24:4:2", "--rounds", "1", "--warmup", "0", "--no-matmul", "--no-memory",
            "--no-reference"]
    out = bench_layer.run(bench_layer.parse_args(base))
    assert out["torchtitan"] == WHY
    (c,) = out["configs"]
    rows = {r["impl"]: r for r in c["rows"]}
    if not HAVE:
        assert bench_layer.TORCHTITAN not in rows and c["torchtitan_check"] is None
        return
    # GELU config: torchtitan is timed against moepar's SwiGLU twin, and only compared with it
    titan, twin = rows[bench_layer.TORCHTITAN], rows[bench_layer.MOEPAR_SWIGLU]
    assert titan["x torchtitan"] == 1.0 and twin["x torchtitan"] > 0 and twin["ms"] > 0
    assert rows[bench_layer.MOEPAR]["x torchtitan"] != rows[bench_layer.MOEPAR]["x torchtitan"]   # nan
    checks = {ch["check"]: ch["ok"] for ch in out["checks"][c["config"]]}
    assert any(t.startswith("torchtitan computes moepar's function") and ok for t, ok in checks.items()), checks
    # SwiGLU config: no twin, moepar's own row is the one compared
    out = bench_layer.run(bench_layer.parse_args(base + ["--activation", "swiglu"]))
    rows = {r["impl"]: r for r in out["configs"][0]["rows"]}
    assert bench_layer.MOEPAR_SWIGLU not in rows and rows[bench_layer.MOEPAR]["x torchtitan"] > 0
    assert rows[bench_layer.MOEPAR]["x floor"] > 0


def _counted():
    """Python calls the counter sees for a plain function, a device op (the instrument's
    dispatch is not counted) and a Triton launch (the interpreter's frames are not)."""
    from moepar.bench.ops import PythonCalls
    from moepar_kernels import routing as rk
    from tests.helpers import fake_cuda

    def three():
        return [abs(i) for i in range(3)] and _one() + _one() + _one()
    out = {}
    with fake_cuda.session(strict=True) as rec:
        x = fake_cuda.to_cuda(torch.randn(64, 8))
        rk.routing(x, 2)   # first call: compile/caches
        for name, fn in (("three", three), ("op", functools.partial(torch.add, x, 1)),
                         ("routing", functools.partial(rk.routing, x, 2))):
            calls = PythonCalls(os.path.dirname(fake_cuda.__file__))
            calls.install()
            with rec.phase(name):
                calls.start(name)
                fn()
                calls.stop()
            sys.setprofile(None)
            out[name] = (calls.counts[name], len(rec.device_ops(name)), len(rec.launches(name)))
    return out


def _one():
    return 1


def test_python_call_counter_leaves_out_the_instrument_and_triton():
    got = run_ranks(_counted, 1, fake_cuda=True)[0]
    assert got["three"][0] == 5, got          # three, its list comprehension, _one x 3
    assert got["op"] == (0, 1, 0), got        # one device op, no Python of the layer's
    calls, ops, launches = got["routing"]
    assert launches == 1 and 5 <= calls <= 150, got   # the launcher's Python; the interpreted kernel's is not

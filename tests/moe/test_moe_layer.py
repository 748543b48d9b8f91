"""The MoE layer in one process against a slow per-token dense reference."""
import pytest
import torch
import torch.nn.functional as F

import moepar
from moepar.moe.layer import MoE, aux_loss
from moepar.parallel.groups import ParallelState

D, FF, E = 8, 12, 4


def _layer(**kw):
    kw.setdefault("init_seed", 5)
    kw.setdefault("ffn_hidden", FF)
    return MoE(D, kw.pop("num_experts", E), k=kw.pop("k", 2), state=ParallelState.single(), **kw)


def _act(h, h3, activation):
    if activation == "swiglu":
        return F.silu(h) * h3
    return F.gelu(h) if activation == "gelu" else F.relu(h)


def _dense_reference(moe, x_TD):
    """Each token through each of its routes' experts, one at a time, weighted."""
    r = moe.router(x_TD)
    ex = moe.experts
    out = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros(D, dtype=x_TD.dtype)
        for j in range(r.expert_ids.shape[1]):
            if r.dropped[t, j]:
                continue
            e = int(r.expert_ids[t, j])
            h = x_TD[t] @ ex.w1[e] + (ex.b1[e] if ex.b1 is not None else 0)
            h3 = x_TD[t] @ ex.w3[e] + (ex.b3[e] if ex.b3 is not None else 0) if ex.w3 is not None else None
            y = _act(h, h3, ex.activation) @ ex.w2[e] + (ex.b2[e] if ex.b2 is not None else 0)
            acc = acc + r.weights[t, j] * y
        out.append(acc)
    y = torch.stack(out) if out else x_TD.new_zeros(0, D)
    if moe.shared is not None:
        y = y + moe.shared(x_TD)
    return y


@pytest.mark.parametrize("activation,bias,shared,k,cf", [
    ("gelu", False, 0, 2, None), ("swiglu", True, 0, 1, None), ("relu", True, 1, 2, None),
    ("gelu", True, 0, 2, 0.5), ("swiglu", False, 1, 3, None)])
def test_layer_equals_per_token_reference_forward_and_backward(activation, bias, shared, k, cf):
    torch.manual_seed(0)
    moe = _layer(activation=activation, bias=bias, num_shared_experts=shared, k=k, capacity_factor=cf,
                 min_capacity=1)
    x = torch.randn(2, 7, D, requires_grad=True)  # any leading shape
    g = torch.randn(2, 7, D)
    y = moe(x)
    assert y.shape == x.shape
    (y * g).sum().backward()
    got = {n: p.grad.clone() for n, p in moe.named_parameters()}
    gx = x.grad.clone()
    moe.zero_grad()
    x.grad = None
    y_ref = _dense_reference(moe, x.reshape(-1, D)).reshape(x.shape)
    (y_ref * g).sum().backward()
    assert torch.allclose(y, y_ref, atol=1e-5)
    assert torch.allclose(gx, x.grad, atol=1e-5)
    for n, p in moe.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-5), n
    if cf is not None:
        assert moe.stats.dropped_fraction > 0


def test_stats_and_aux_loss_of_several_layers():
    a, b = _layer(init_seed=1), _layer(init_seed=2, z_loss_coeff=0.1)
    model = torch.nn.Sequential(a, b)
    x = torch.randn(9, D)
    model(x)
    total = aux_loss(model)
    assert torch.allclose(total, a.aux_loss + a.z_loss + b.aux_loss + b.z_loss)
    assert b.z_loss > 0 and a.aux_loss > 0
    assert int(a.stats.tokens_per_expert.sum()) == 9 * 2 and a.stats.dropped_fraction == 0.0
    assert a.stats.comm.events == []  # one process: no collectives at all
    assert float(moepar.aux_loss(torch.nn.Linear(2, 2))) == 0.0


def test_single_token_and_empty_batch():
    moe = _layer()
    for shape in [(1, D), (0, D), (3, 0, D)]:
        x = torch.randn(*shape, requires_grad=True)
        y = moe(x)
        assert y.shape == x.shape
        y.sum().backward()


def test_recompute_experts_gives_the_same_gradients():
    x = torch.randn(11, D)
    grads = []
    for ckpt in (False, True):
        moe = _layer(recompute_experts=ckpt, bias=True)
        xx = x.clone().requires_grad_()
        (moe(xx) ** 2).sum().backward()
        grads.append([xx.grad] + [p.grad for p in moe.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_bf16_layer():
    moe = _layer(dtype=torch.bfloat16)
    x = torch.randn(16, D)
    y = moe(x.bfloat16())
    assert y.dtype == torch.bfloat16
    ref = _layer()
    ref.load_state_dict({k: v.float() for k, v in moe.state_dict().items()})
    assert torch.allclose(y.float(), ref(x), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("kw", [dict(bias=True), dict(activation="swiglu", num_shared_experts=1)])
def test_torch_compile_forward_backward_matches_eager_without_graph_breaks(kw):
    moe = _layer(**kw)
    x = torch.randn(10, D)
    xe = x.clone().requires_grad_()
    ye = moe(xe)
    (ye.sum() + moe.aux_loss).backward()
    ge = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    # Single process: one graph (the experts' host read of their row counts sits inside
    # a custom op); with ep > 1 the breaks are at the collectives (docs/moe.md).
    explained = torch._dynamo.explain(lambda t: moe(t).sum() + moe.aux_loss)(x.clone().requires_grad_())
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(moe, backend="aot_eager")
    xc = x.clone().requires_grad_()
    yc = compiled(xc)
    (yc.sum() + moe.aux_loss).backward()
    assert torch.allclose(ye, yc, atol=1e-6) and torch.allclose(xe.grad, xc.grad, atol=1e-6)
    for a, p in zip(ge, moe.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6)


def test_experts_custom_op_passes_opcheck_and_rejects_bad_counts():
    from moepar.moe.experts.custom_op import experts_fwd
    from moepar.moe.experts.grouped import GroupedExperts
    ex = GroupedExperts(3, 8, 16, activation="swiglu", bias=True, init_seed=5)
    x = torch.randn(7, 8, requires_grad=True)
    counts = torch.tensor([3, 0, 4])
    args = (x, ex.w1, ex.w2, ex.w3, ex.b1, ex.b2, ex.b3, counts, "auto", "swiglu")
    torch.library.opcheck(experts_fwd, args)
    y = experts_fwd(*args)
    assert torch.allclose(y, ex(x, counts), atol=1e-6)
    with pytest.raises(ValueError, match="sums to 6 but x_ND has 7 rows"):
        experts_fwd(x, ex.w1, ex.w2, ex.w3, ex.b1, ex.b2, ex.b3, torch.tensor([3, 0, 3]), "auto", "swiglu")


def test_bad_inputs_single_process():
    with pytest.raises(ValueError, match="k=5"):
        _layer(k=5)
    with pytest.raises(ValueError, match="ep_size=2 does not match"):
        MoE(D, 4, 2, state=ParallelState.single())
    moe = _layer()
    with pytest.raises(ValueError, match="hidden=8"):
        moe(torch.randn(3, 5))
    with pytest.raises(ValueError, match="floating-point"):
        moe(torch.ones(3, D, dtype=torch.long))
    with pytest.raises(ValueError, match="aux_loss_scope"):
        _layer(aux_loss_scope="everywhere")


def test_config_and_keyword_options_build_the_same_layer():
    # Keyword options fill MoEConfig (layer fields) or its RouterConfig (router fields), by
    # name; a config passed whole gives the same layer and the same numbers.
    kw = dict(k=2, ffn_hidden=FF, activation="swiglu", capacity_factor=2.0, z_loss_coeff=1e-3,
              dedup="off", init_seed=5)
    a = MoE(D, E, 1, state=ParallelState.single(), **kw)
    cfg = moepar.MoEConfig(D, E, 1, ffn_hidden=FF, activation="swiglu", exchange=moepar.ExchangeConfig(dedup="off"),
                           init_seed=5,
                           router=moepar.RouterConfig(D, E, k=2, capacity_factor=2.0, z_loss_coeff=1e-3,
                                                      nonfinite="propagate"))
    b = MoE(D, E, 1, config=cfg, state=ParallelState.single())
    assert a.config == b.config
    assert a.config.router.capacity_factor == 2.0 and a.config.router.k == 2 and a.config.exchange.dedup == "off"
    x = torch.randn(7, D)
    assert torch.equal(a(x), b(x))
    # A router field MoE never spelt out (noise_eps) works through MoE(...) as well, and a
    # keyword given with a config replaces that field only.
    c = MoE(D, E, 1, config=cfg, noise_eps=0.05, activation="gelu", state=ParallelState.single())
    assert c.config.router.noise_eps == 0.05 and c.config.router.capacity_factor == 2.0
    assert c.config.activation == "gelu" and c.config.exchange.dedup == "off"
    assert MoE(D, E, 1, use_kernels=False, state=ParallelState.single()).config.router.use_kernel is False
    with pytest.raises(Exception):   # frozen
        cfg.gemm_path = "loop"


def test_config_errors_name_the_option_and_the_rule():
    single = ParallelState.single()
    with pytest.raises(ValueError, match=r"unknown MoE option 'capacity'; valid options: \[.*'capacity_factor'"):
        MoE(D, E, 1, capacity=1.0, state=single)
    with pytest.raises(ValueError, match=r"dedup='yes' must be one of \('off', 'auto', 'on'\)"):
        MoE(D, E, 1, dedup="yes", state=single)
    with pytest.raises(ValueError, match="num_experts=5 is not divisible by ep_size=2"):
        moepar.MoEConfig(D, 5, 2)
    with pytest.raises(ValueError, match=r"ffn_hidden=10 is not divisible by expert_tensor_parallel_size=4"):
        moepar.MoEConfig(D, E, 1, ffn_hidden=10, expert_tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"router has hidden=16, num_experts=4 but the layer hidden=8"):
        moepar.MoEConfig(D, E, router=moepar.RouterConfig(16, E))
    with pytest.raises(ValueError, match=r"disagrees with config \(hidden=8, num_experts=4, ep_size=1\)"):
        MoE(D, 8, 1, config=moepar.MoEConfig(D, E), state=single)
    with pytest.raises(ValueError, match="check_finite=1 must be True or False"):
        moepar.ExchangeConfig(check_finite=1)


def test_check_finite_raises_on_one_process_too():
    moe = _layer(check_finite=True)
    x = torch.randn(3, D)
    x[1, 2] = float("inf")
    with pytest.raises(ValueError, match="check_finite=True: non-finite values in the MoE layer input"):
        moe(x)
    assert torch.isinf(_layer()(x)[1]).any() or torch.isnan(_layer()(x)[1]).any()


def test_the_flat_module_names_still_import_with_a_deprecation_warning():
    """The modules moved into rooms by step (routing/, exchange/, experts/, replication/);
    their old names are the same modules, each import warning with the new name."""
    import importlib
    import sys
    import warnings
    from moepar import moe
    for old, new in moe.MOVED.items():
        sys.modules.pop(f"moepar.moe.{old}", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(f"moepar.moe.{old}")
        assert module is importlib.import_module(f"moepar.moe.{new}"), old
        assert any(issubclass(w.category, DeprecationWarning) and f"moepar.moe.{new}" in str(w.message)
                   for w in caught), (old, [str(w.message) for w in caught])
    from moepar.moe.experts import GroupedExperts   # the package keeps the class's old import
    assert GroupedExperts is moepar.GroupedExperts


def test_the_public_names_import_from_their_new_homes_without_a_warning():
    """``moepar.<name>`` reads each public name from where it lives now, not through an old
    flat name (which would warn every user on first use), in a fresh process."""
    import subprocess
    import sys
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning); import moepar; "
            "[getattr(moepar, n) for n in moepar.__all__]; moepar.cost.report; moepar.hf.__name__")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

"""A swapped model (moepar.hf.replace_moe_blocks) behaves as transformers' own, per family:
built on the meta device, swapped, ``to_empty`` and ``init_weights()`` it has transformers'
initialisation (exact buffers, the same weight distributions) and trains; gated experts
with any activation transformers allows match its block; ``output_router_logits`` gives
transformers' router logits and aux loss; the state dict has transformers' names, layouts
and values, and save/load round-trips with and without moepar."""
import math

import pytest
import torch

from ..helpers import hf_cases

hf_cases.import_transformers()


def model_class(tr, family):
    return tr.AutoModelForSeq2SeqLM if family == "switch_transformers" else tr.AutoModelForCausalLM


def _meta_model(family, swap: bool):
    tr = hf_cases.import_transformers()
    from moepar.hf import replace_moe_blocks
    cfg = hf_cases.config(family)
    with torch.device("meta"):
        model = model_class(tr, family).from_config(cfg)
    if swap:
        assert replace_moe_blocks(model) >= 2
    model.to_empty(device="cpu")
    with torch.no_grad():   # what to_empty may leave behind, made visible
        for t in list(model.parameters()) + list(model.buffers()):
            t.fill_(123.0)
    torch.manual_seed(0)
    model.init_weights()
    return model


def _blocks(model, family):
    cls = hf_cases._CLASS[family].rsplit(".", 1)[1]
    return {n: m for n, m in model.named_modules() if type(m).__name__ in (cls, "HFMoEBlock")}


def _close_to_normal(t: torch.Tensor, std: float) -> bool:
    """``t``'s sample mean and std fit N(0, std^2) (5 standard errors; n >= 16 here)."""
    n = t.numel()
    t = t.double()
    return abs(float(t.mean())) <= 5 * std / math.sqrt(n) and abs(float(t.std()) / std - 1) <= 5 / math.sqrt(2 * n)


@pytest.mark.parametrize("family", hf_cases.FAMILIES)
def test_meta_init_matches_transformers(family):
    from moepar.hf import family_of, hf_state_dict
    from moepar.hf.init import init_spec
    ref = _meta_model(family, swap=False)
    model = _meta_model(family, swap=True)
    ref_blocks, blocks = _blocks(ref, family), _blocks(model, family)
    assert sorted(ref_blocks) == sorted(blocks)
    cfg = hf_cases.config(family)
    spec = init_spec(cfg)
    fam = family_of(cfg)
    for name, blk in blocks.items():
        r = blk.moe.router
        if r.expert_bias is not None:   # every buffer: transformers' exactly
            assert torch.equal(r.expert_bias, ref_blocks[name].state_dict()[fam.expert_bias_key])
            assert not r.load_accum.any()
        mine, theirs = hf_state_dict(blk.moe, cfg), ref_blocks[name].state_dict()
        assert sorted(mine) == sorted(theirs)
        for key, t in theirs.items():
            if not t.any():
                assert not mine[key].any(), key
                continue
            # transformers' own draw fits the spec moepar uses, and moepar's does too
            std = _spec_std(fam, spec, key)
            assert _close_to_normal(t, std), (key, float(t.std()), std)
            assert _close_to_normal(mine[key], std), (key, float(mine[key].std()), std)
    inputs = hf_cases.model_inputs(family)   # a training step, then the loss again
    out = model(**inputs)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.isfinite(model(**inputs).loss)


def test_meta_init_is_layout_free_on_4_ranks():
    # tp2 x ep2 (shared experts TP-sliced) and ep4: the gathered weights equal one process's
    from ..helpers.multiproc import run_ranks
    for tp, ep in ((2, 2), (1, 4)):
        for per_family in run_ranks(hf_cases.meta_init_worker, 4, tp, ep, ["qwen2_moe", "gpt_oss"]):
            assert all(v == 0.0 for v in per_family.values()), (tp, ep, per_family)


def _spec_std(fam, spec, key):
    """The spec's std for the HF key ``key`` of the block (via the canonical names)."""
    if key.startswith("experts."):
        return spec["w1"]   # every expert weight has the same std in every family
    from moepar.hf.families import dense_keys
    return spec[{hf_key: name for name, hf_key in dense_keys(fam, router_bias=True).items()}[key]]


# Gated experts: transformers' act_fn(gate) * up with any activation it names; Switch's
# plain experts with any dense_act_fn. Output, input and weight gradients within 1e-5.
ACTS = ["gelu", "gelu_pytorch_tanh", "relu", "gelu_new", "quick_gelu"]
GATED_FAMILIES = [f for f in hf_cases.FAMILIES if f not in ("switch_transformers", "gpt_oss")]


def _assert_parity(r, where):
    tol = {k: 1e-5 * max(1.0, r.get("gscale:" + k[5:], 1.0)) for k in r}
    bad = {k: v for k, v in r.items() if not k.endswith("scale") and not k.startswith("gscale:")
           and k not in ("roundtrip", "keys_differ") and not v <= tol[k]}
    assert not bad, (where, bad)


@pytest.mark.parametrize("family", GATED_FAMILIES)
def test_gated_activations_match_transformers(family):
    acts = ACTS if family in ("mixtral", "qwen2_moe", "llama4_text") else ACTS[:3]
    for act in acts:
        _assert_parity(hf_cases.compare(family, hidden_act=act), (family, act))


@pytest.mark.parametrize("act", ["gelu_new", "silu", "relu2"])
def test_switch_dense_activations_match_transformers(act):
    _assert_parity(hf_cases.compare("switch_transformers", dense_act_fn=act), act)


def test_mixtral_input_jitter_draws_as_transformers():
    # training mode, router_jitter_noise > 0: the block's input scaled by the same draw
    from moepar.hf import HFMoEBlock, convert_block, family_of
    cfg, blk = hf_cases.block("mixtral", router_jitter_noise=0.2)
    blk.train()
    x, g = hf_cases.inputs("mixtral")

    def run(module):   # transformers scales the input in place: feed it a non-leaf
        torch.manual_seed(5)
        leaf = x.clone().requires_grad_()
        y = module(leaf * 1.0)
        (y * g).sum().backward()
        return y.detach(), leaf.grad
    y_ref, dx_ref = run(blk)
    y, dx = run(HFMoEBlock(convert_block(blk, cfg), family_of(cfg), cfg).train())
    assert float((y - y_ref).abs().max()) <= 1e-5 and float((dx - dx_ref).abs().max()) <= 1e-5


# Router logits where transformers looks for them (output_router_logits), and the model's
# own aux loss from them.
def _compare_outputs(a: dict, b: dict, where):
    assert sorted(a) == sorted(b), (where, sorted(a), sorted(b))
    for k in a:
        x, y = (a[k], b[k]) if isinstance(a[k], tuple) else ((a[k],), (b[k],))
        assert len(x) == len(y), (where, k)
        for s, t in zip(x, y):
            assert s.shape == t.shape and s.dtype == t.dtype, (where, k, s.shape, t.shape, s.dtype, t.dtype)
            tol = 1e-5 if k == "logits" else 1e-6
            assert float((s - t).abs().max()) <= tol, (where, k, float((s - t).abs().max()))


@pytest.mark.parametrize("family", hf_cases.FAMILIES)
def test_router_logits_and_aux_loss_match_transformers(family):
    import copy
    from moepar.hf import replace_moe_blocks
    ref = hf_cases.model(family, output_router_logits=True)
    swapped = copy.deepcopy(ref)
    assert replace_moe_blocks(swapped) == 2
    inputs = hf_cases.model_inputs(family)
    with torch.no_grad():
        want = hf_cases.router_outputs(ref(**inputs, output_router_logits=True))
        got = hf_cases.router_outputs(swapped(**inputs, output_router_logits=True))
        assert any("router_logits" in k for k in want), sorted(want)
        _compare_outputs(got, want, (family, "call"))
        # the config's flag alone (Switch reads only the call's), and off: as transformers
        for flag in (True, False):
            ref.config.output_router_logits = swapped.config.output_router_logits = flag
            a, b = hf_cases.router_outputs(ref(**inputs)), hf_cases.router_outputs(swapped(**inputs))
            _compare_outputs(b, a, (family, "config", flag))


def test_aux_loss_and_state_dict_under_tp2_ep2_and_ep4():
    # aux loss as one process on the rank's tokens; state_dict() of this rank's shards under
    # transformers' keys; load_state_dict of the full HF state dict on every rank
    from ..helpers.multiproc import run_ranks
    families = ["mixtral", "qwen2_moe", "gpt_oss", "switch_transformers"]   # with an aux loss; shared, bias, per-expert
    for tp, ep in ((2, 2), (1, 4)):
        for rank, per_family in enumerate(run_ranks(hf_cases.dropin_worker, 4, tp, ep, families)):
            for family, (got, want, reloaded, names_ok) in per_family.items():
                assert abs(got - want) <= 1e-6, (tp, ep, rank, family, got, want)
                assert reloaded <= 1e-5 and names_ok, (tp, ep, rank, family, reloaded, names_ok)


# transformers' names and layouts: state_dict, save_pretrained / from_pretrained both ways,
# load_state_dict, and the names transformers keys on (tp_plan, _keep_in_fp32_modules).
def _matches(pattern: str, keys) -> set:
    import re
    rx = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
    return {k for k in keys if rx.fullmatch(k) or rx.fullmatch(k.rsplit(".", 1)[0]) or k.startswith(pattern + ".")}


@pytest.mark.parametrize("family", hf_cases.FAMILIES)
def test_state_dict_and_save_load_both_ways(family, tmp_path):
    import copy
    from moepar.hf import replace_moe_blocks
    ref = hf_cases.model(family)
    swapped = copy.deepcopy(ref)
    assert replace_moe_blocks(swapped) == 2
    swapped.init_weights()   # built normally: transformers' flags leave every tensor as it is
    want, got = ref.state_dict(), swapped.state_dict()
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].shape == t.shape and got[k].dtype == t.dtype and torch.equal(got[k], t), k
    for named in ("named_parameters", "named_buffers"):   # the tensors themselves carry the names
        theirs, mine = dict(getattr(ref, named)()), dict(getattr(swapped, named)())
        assert sorted(mine) == sorted(theirs), named
        assert all(mine[k].shape == t.shape and mine[k].dtype == t.dtype for k, t in theirs.items()), named
    names = set(want)
    for pattern in (getattr(ref, "_tp_plan", None) or {}):
        assert _matches(pattern, got) == _matches(pattern, names), pattern
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        for name in getattr(ref, attr, None) or []:
            assert {k for k in got if name in k} == {k for k in names if name in k}, (attr, name)
    inputs = hf_cases.model_inputs(family)
    with torch.no_grad():
        y = ref(**inputs).logits
        swapped.save_pretrained(tmp_path / "swapped")   # -> the plain class
        back, info = type(ref).from_pretrained(tmp_path / "swapped", output_loading_info=True)
        assert not any(info.values()), info
        assert torch.equal(back.float().eval()(**inputs).logits, y)
        ref.save_pretrained(tmp_path / "plain")          # plain checkpoint -> swapped
        plain = type(ref).from_pretrained(tmp_path / "plain").float().eval()
        replace_moe_blocks(plain)
        assert float((plain(**inputs).logits - y).abs().max()) <= 1e-5
        for p in swapped.parameters():                   # load_state_dict of transformers' keys
            p.zero_()
        swapped.load_state_dict(want)
        assert float((swapped(**inputs).logits - y).abs().max()) <= 1e-5


@pytest.mark.parametrize("family", hf_cases.FAMILIES)
def test_from_pretrained_into_a_model_swapped_at_construction(family, tmp_path, monkeypatch):
    # A class whose blocks are swapped in __init__ (post_init), as a test suite patching
    # transformers would: transformers' loader sets every tensor through the submodule paths
    # (``...mlp.experts`` + ``gate_up_proj``), which the swapped block has.
    from transformers import PreTrainedModel
    from moepar.hf import HFMoEBlock, replace_moe_blocks
    from moepar.hf.convert import text_config
    ref = hf_cases.model(family)
    ref.save_pretrained(tmp_path)
    inputs = hf_cases.model_inputs(family)
    with torch.no_grad():
        want = ref(**inputs).logits
    original = PreTrainedModel.post_init

    def post_init(self):
        original(self)
        if getattr(text_config(self), "model_type", None) == family:
            replace_moe_blocks(self)
    monkeypatch.setattr(PreTrainedModel, "post_init", post_init)
    model, info = type(ref).from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    assert len(blocks) == 2
    for blk in blocks:   # moepar's markers survive the loader's Parameter replacement
        ex = [p for n, p in blk.named_parameters() if n.startswith("experts.")]
        assert ex and all(p.moepar_expert and hasattr(p, "moepar_expert_partition_dim") for p in ex)
    with torch.no_grad():
        got = model.float().eval()(**inputs).logits
    assert float((got - want).abs().max()) <= 1e-5
    # and back: its save_pretrained loads into the plain class
    monkeypatch.setattr(PreTrainedModel, "post_init", original)
    model.save_pretrained(tmp_path / "back")
    back, info = type(ref).from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert torch.equal(back.float().eval()(**inputs).logits, want)   # the same tensors as ref's


def test_fsdp2_and_dcp_checkpoint_of_swapped_models(tmp_path):
    # The HF-named tensors carry moepar's markers: moepar.fully_shard shards them (ep2 x edp1
    # over 2 ranks, the experts' views read from the unsharded tensors), and moepar.checkpoint
    # saves them with their global shapes: ep2 -> ep2 and ep2 -> ep1 (2 replicas).
    from ..helpers.multiproc import run_ranks
    families = ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "llama4_text"]   # shared, bias, layouts
    for rank in run_ranks(hf_cases.fsdp_dcp_worker, 2, families, 2, str(tmp_path), "fsdp"):
        for family, (diff, grads) in rank.items():
            assert diff <= 1e-5 and grads, (family, diff, grads)
    run_ranks(hf_cases.fsdp_dcp_worker, 2, families, 2, str(tmp_path), "save")
    for ep in (2, 1):
        for rank in run_ranks(hf_cases.fsdp_dcp_worker, 2, families, ep, str(tmp_path), "load"):
            assert all(v <= 1e-5 for v in rank.values()), (ep, rank)


def test_update_expert_bias_moves_transformers_buffer():
    # DeepSeek-V3's selection bias is transformers' buffer; moepar's aux-loss-free update moves it
    from moepar.hf import HFMoEBlock, replace_moe_blocks
    model = hf_cases.model("deepseek_v3")
    replace_moe_blocks(model)
    model.train()
    model(**hf_cases.model_inputs("deepseek_v3"))
    blk = next(m for m in model.modules() if isinstance(m, HFMoEBlock))
    assert blk.moe.router.expert_bias is blk.gate.e_score_correction_bias
    assert "gate.load_accum" not in dict(blk.named_buffers()) and blk.moe.router.load_accum.sum() > 0
    before = blk.gate.e_score_correction_bias.clone()
    blk.moe.update_expert_bias(0.01)
    assert float((blk.gate.e_score_correction_bias - before).abs().max()) == pytest.approx(0.01)
    assert not blk.moe.router.load_accum.any()

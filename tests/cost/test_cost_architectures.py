"""Real architectures from Hugging Face config.json files (tests/data, written by hand from
the public configs): parameter totals against the model cards, each architectural feature
against a weight-by-weight reference, the presets, and ``report --hf-config``."""
import json
import math
import os

import pytest

from moepar.cost import cli
from moepar.cost.accounting import count_flops
from moepar.cost.architectures import MODELS, PRESET_CONFIGS, spec_fields, spec_fields_from_file
from moepar.cost.model import CostLayout, MoESpec, count_params

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")   # tests/data


def params(name_or_fields, layout=CostLayout(1), **kw):
    fields = (spec_fields_from_file(os.path.join(DATA, f"{name_or_fields}.json"))
              if isinstance(name_or_fields, str) else name_or_fields)
    return count_params(MoESpec(tokens=8, **{**fields, **kw}), layout)


# (total, active) from the model cards, in billions; "active" as the card counts it:
# with both embedding tables (Mixtral, Qwen), or without the input lookup (DeepSeek, OpenAI).
CARDS = {
    "deepseek-v3": (671.0, 36.6, "no_input"),        # 36.6 B activated incl. the 0.9 B head
    "qwen3-30b-a3b": (30.5, 3.3, "all"),
    "qwen3-235b-a22b": (235.0, 22.0, "all"),
    "mixtral-8x22b": (140.6, 39.2, "all"),
    "mixtral-8x7b": (46.7, 12.9, "all"),
    "olmoe-1b-7b": (6.9, 1.3, "all"),
    "gpt-oss-120b": (116.83, 5.13, "no_input"),
    "qwen1.5-moe-a2.7b": (14.3, 2.7, "all"),
    "deepseek-v2-lite": (15.7, None, "no_input"),   # card: 2.4 B activated; we count 2.45 B (see docs)
}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_totals_match_the_model_cards(name):
    total, active, convention = CARDS[name]
    p = params(name)
    assert p.total / 1e9 == pytest.approx(total, rel=0.005)
    got = p.active if convention == "all" else p.active_without_input_embedding
    if active is not None:
        assert got / 1e9 == pytest.approx(active, rel=0.02)


def test_the_issue_worked_examples():
    for name, total, active in (("deepseek-v3", 671.0, 37.5), ("qwen3-30b-a3b", 30.5, 3.35),
                                ("mixtral-8x22b", 140.6, 39.2)):
        p = params(name)
        assert round(p.total / 1e9, 1) == total
        assert p.active / 1e9 == pytest.approx(active, rel=0.005)
    # DeepSeek-V3's MTP module: 11.5 B unique parameters (embedding and head shared), apart
    mtp = params("deepseek-v3").mtp
    assert mtp / 1e9 == pytest.approx(11.5, rel=0.02)


@pytest.mark.parametrize("name", sorted(PRESET_CONFIGS))
def test_presets_are_the_config_files(name):
    assert MODELS[name] == spec_fields_from_file(os.path.join(DATA, f"{name}.json"))


# ---- a weight-by-weight reference: the tensors of each family's checkpoint ------------

def reference_tensors(cfg: dict) -> dict[str, int]:
    """numel of every tensor a checkpoint of this tiny config holds (one layer per kind)."""
    mt, D, H, V = cfg["model_type"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    kv = cfg.get("num_key_value_heads", H)
    hd = cfg.get("head_dim") or D // H
    E = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    t = {"embed": V * D, "norm": D}
    if not cfg.get("tie_word_embeddings"):
        t["lm_head"] = V * D
    for i in range(cfg["num_hidden_layers"]):
        p = f"l{i}."
        t[p + "in_norm"] = t[p + "post_norm"] = D
        if "kv_lora_rank" in cfg:
            r, c = cfg["q_lora_rank"], cfg["kv_lora_rank"]
            nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            if r:
                t[p + "q_a"], t[p + "q_a_norm"], t[p + "q_b"] = D * r, r, r * H * (nope + rope)
            else:
                t[p + "q"] = D * H * (nope + rope)
            t[p + "kv_a"], t[p + "kv_a_norm"], t[p + "kv_b"] = D * (c + rope), c, c * H * (nope + vd)
            t[p + "o"] = H * vd * D
        else:
            t[p + "q"], t[p + "k"], t[p + "v"], t[p + "o"] = D * H * hd, D * kv * hd, D * kv * hd, H * hd * D
            if mt == "qwen2_moe" or (mt == "glm4_moe" and cfg.get("attention_bias")):
                t[p + "q.b"], t[p + "k.b"], t[p + "v.b"] = H * hd, kv * hd, kv * hd
            if mt == "gpt_oss":
                t[p + "q.b"], t[p + "k.b"], t[p + "v.b"], t[p + "o.b"] = H * hd, kv * hd, kv * hd, D
                t[p + "sinks"] = H
            if mt == "qwen3_moe":
                t[p + "q_norm"] = t[p + "k_norm"] = hd
            if mt == "olmoe":
                t[p + "q_norm"], t[p + "k_norm"] = H * hd, kv * hd
        dense = (i < cfg.get("first_k_dense_replace", 0) or i in cfg.get("mlp_only_layers", [])
                 or (i + 1) % cfg.get("decoder_sparse_step", 1))
        if dense:
            t[p + "mlp"] = 3 * D * cfg["intermediate_size"]
            continue
        F = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        t[p + "router"] = E * D
        for e in range(E):
            t[p + f"e{e}.gate"] = t[p + f"e{e}.up"] = t[p + f"e{e}.down"] = D * F
            if mt == "gpt_oss":
                t[p + f"e{e}.gate_up.b"], t[p + f"e{e}.down.b"] = 2 * F, D
        if mt == "gpt_oss":
            t[p + "router.b"] = E
        if mt in ("deepseek_v3", "glm4_moe"):
            t[p + "e_score_correction_bias"] = E
        if cfg.get("n_shared_experts"):
            t[p + "shared"] = 3 * D * F * cfg["n_shared_experts"]
        if cfg.get("shared_expert_intermediate_size"):
            t[p + "shared"] = 3 * D * cfg["shared_expert_intermediate_size"]
            t[p + "shared_gate"] = D
    return t


TINY = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, vocab_size=97, num_hidden_layers=4,
            num_experts_per_tok=2)
TINY_CONFIGS = {
    "mixtral": dict(num_local_experts=4, intermediate_size=40),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=24, intermediate_size=64,
                      shared_expert_intermediate_size=56, decoder_sparse_step=2),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=24, intermediate_size=64, head_dim=20,
                      mlp_only_layers=[0, 3]),
    "deepseek_v2": dict(n_routed_experts=4, n_shared_experts=2, moe_intermediate_size=24, intermediate_size=64,
                        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=6),
    "deepseek_v3": dict(n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=24, intermediate_size=64,
                        first_k_dense_replace=2, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=6),
    "olmoe": dict(num_experts=4, intermediate_size=24),
    "glm4_moe": dict(n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=24, intermediate_size=64,
                     first_k_dense_replace=1, head_dim=16, attention_bias=True),
    "gpt_oss": dict(num_local_experts=4, intermediate_size=24, head_dim=16, attention_bias=True),
}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mt", sorted(TINY_CONFIGS))
def test_every_family_counts_every_tensor(mt, tied):
    cfg = {**TINY, **TINY_CONFIGS[mt], "model_type": mt, "tie_word_embeddings": tied}
    ref = reference_tensors(cfg)
    p = params(spec_fields(cfg))
    assert p.total == sum(ref.values())
    # active: everything but the routed experts beyond K per MoE layer
    E, K = 4, 2
    F = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    one_expert = 3 * 48 * F + (2 * F + 48 if mt == "gpt_oss" else 0)
    moe_layers = sum(1 for k in ref if k.endswith(".router"))
    assert p.active == p.total - moe_layers * (E - K) * one_expert


def test_dense_layers_mla_and_shared_gate_change_the_count():
    base = {**TINY, **TINY_CONFIGS["deepseek_v3"], "model_type": "deepseek_v3"}
    f = spec_fields(base)
    assert (f["dense_layers"], f["dense_ffn"], f["q_lora_rank"]) == (2, 64, 12)
    assert spec_fields({**base, "first_k_dense_replace": 0})["dense_layers"] == 0
    q = spec_fields({**TINY, **TINY_CONFIGS["qwen2_moe"], "model_type": "qwen2_moe"})
    assert (q["dense_layers"], q["shared_gate"], q["shared_ffn"], q["attn_bias"]) == (2, True, 56, "qkv")
    # FLOPs follow the layer kinds: a dense layer costs 6·3·D·Fd per token, an MoE layer its K experts
    spec = MoESpec(tokens=8, **f)
    fl = count_flops(spec, CostLayout(1))
    p = count_params(spec, CostLayout(1))
    per = 6 * (4 * p.attention + 2 * p.dense_ffn + 2 * (p.router + p.shared + 2 * p.expert) + 97 * 48)
    assert fl.per_token == per


def test_unsupported_model_type_and_missing_keys_are_named():
    with pytest.raises(ValueError, match="model_type='llama' is not supported; supported: mixtral"):
        spec_fields({"model_type": "llama"})
    with pytest.raises(ValueError, match="has no num_local_experts or num_experts or n_routed_experts"):
        spec_fields({**TINY, "model_type": "mixtral", "intermediate_size": 8})


def test_report_hf_config_json_keeps_numeric_totals(tmp_path, capsys):
    out = tmp_path / "r.json"
    path = os.path.join(DATA, "qwen3-30b-a3b.json")
    assert cli.report_main(["--hf-config", path, "--gpus", "8", "--ep", "8", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert isinstance(rep["params"]["total"], int) and isinstance(rep["params"]["active"], int)
    assert rep["params"]["total"] == params("qwen3-30b-a3b").total
    assert math.isclose(rep["params"]["active"] / 1e9, 3.35, rel_tol=0.005)
    capsys.readouterr()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.report_main(["--hf-config", str(bad), "--gpus", "8"]) == 2
    assert "is not JSON" in capsys.readouterr().err
    assert cli.report_main(["--hf-config", str(tmp_path / "none.json"), "--gpus", "8"]) == 2
    assert "cannot be read" in capsys.readouterr().err
    assert cli.report_main(["--hf-config", path, "--model", "mixtral-8x7b", "--gpus", "8"]) == 2
    assert "not both" in capsys.readouterr().err


def test_one_family_table_for_the_layer_and_the_cost_model():
    """moepar.hf converts the families of moepar.hf.catalog; the cost model prices each of them
    or names why not, from the same table, and reads it without torch."""
    import subprocess
    import sys

    from moepar.cost.architectures import MODEL_TYPES, spec_fields
    from moepar.hf.catalog import FAMILIES
    assert set(MODEL_TYPES) | {mt for mt, f in FAMILIES.items() if f.unpriced} == set(FAMILIES)
    assert len(MODEL_TYPES) >= 9 and "granitemoe" in MODEL_TYPES
    granite = dict(model_type="granitemoe", hidden_size=64, intermediate_size=32, num_local_experts=4,
                   num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                   vocab_size=100)
    f = spec_fields(granite)
    assert (f["hidden"], f["ffn"], f["experts"], f["topk"], f["kv_heads"], f["dense_layers"]) == (64, 32, 4, 2, 2, 0)
    with pytest.raises(ValueError, match="switch_transformers.*encoder-decoder"):
        spec_fields(dict(model_type="switch_transformers"))
    code = "import sys, moepar.hf; moepar.hf.FAMILIES; import moepar.hf.catalog; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

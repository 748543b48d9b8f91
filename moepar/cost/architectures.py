"""Real architectures: a Hugging Face ``config.json`` -> ``MoESpec`` fields.

``spec_fields(config)`` reads the keys each ``model_type`` names its shapes with and
returns keyword arguments of ``moepar.cost.MoESpec`` (the model only, no ``tokens`` or
layout). The families and how each reads are one table, ``moepar.hf.catalog`` (shared with
the layer conversion of ``moepar.hf``); the cost model prices those whose ``unpriced`` is
None (``PRICED``) and names the reason for the others; ``--model``'s presets (``MODELS``) are
public config.json fields read the same way. What each reads:

- dense layers: DeepSeek/GLM ``first_k_dense_replace`` and ``moe_layer_freq`` (layer i is
  MoE when i >= k and i % freq == 0); Qwen ``decoder_sparse_step`` and ``mlp_only_layers``
  (MoE when i is not listed and (i+1) % step == 0); their FFN is ``intermediate_size``.
- attention: GQA with ``head_dim`` where given; MLA (``kv_lora_rank``, ``q_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``); q/k biases and norms as
  each family builds them (Qwen2 q/k/v bias, Qwen3 per-head RMSNorm, OLMoE RMSNorm over
  all heads, GLM ``attention_bias`` on q/k/v and ``use_qk_norm``, gpt-oss biases on all
  four projections and one sink logit per head).
- sliding-window attention: ``sliding_window`` in the layers ``layer_types`` names
  "sliding_attention" (gpt-oss: every other layer, 128 keys).
- experts: routed experts of ``moe_intermediate_size`` (Mixtral, OLMoE and gpt-oss:
  ``intermediate_size``), shared experts (DeepSeek/GLM ``n_shared_experts`` x
  ``moe_intermediate_size``; Qwen2 one of ``shared_expert_intermediate_size`` with its
  sigmoid gate), router biases (DeepSeek-V3/GLM score-correction bias, gpt-oss), gpt-oss
  expert biases; ``tie_word_embeddings``; ``num_nextn_predict_layers`` MTP modules.
"""
from __future__ import annotations

import json

from ..hf.catalog import FAMILIES, PRICED

MODEL_TYPES = PRICED


def _get(config: dict, *keys, default=None):
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return default


def _need(config: dict, *keys):
    v = _get(config, *keys)
    if v is None:
        raise ValueError(f"config.json of model_type={config.get('model_type')!r} has no {' or '.join(keys)}")
    return v


def _moe_layer_flags(config: dict, rule: str | None, layers: int) -> list[bool]:
    """Which of the ``layers`` blocks have an MoE FFN (the rest a dense one)."""
    if rule == "first_k":
        k, freq = int(_get(config, "first_k_dense_replace", default=0)), int(_get(config, "moe_layer_freq", default=1))
        return [i >= k and i % freq == 0 for i in range(layers)]
    if rule == "sparse_step":
        step, dense = int(_get(config, "decoder_sparse_step", default=1)), set(_get(config, "mlp_only_layers", default=[]))
        return [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    return [True] * layers


def spec_fields(config: dict) -> dict:
    """``MoESpec`` keyword arguments for a Hugging Face config (a parsed config.json)."""
    mt = config.get("model_type")
    if mt not in MODEL_TYPES:
        why = f" ({FAMILIES[mt].unpriced})" if mt in FAMILIES else ""
        raise ValueError(f"model_type={mt!r} is not supported{why}; supported: {', '.join(MODEL_TYPES)}")
    fam = FAMILIES[mt]
    layers = int(_need(config, "num_hidden_layers"))
    heads = int(_need(config, "num_attention_heads"))
    f: dict = dict(hidden=int(_need(config, "hidden_size")), layers=layers, heads=heads,
                   vocab=int(_need(config, "vocab_size")), gated=True,
                   tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    f["experts"] = int(_need(config, "num_local_experts", "num_experts", "n_routed_experts"))
    f["topk"] = int(_need(config, "num_experts_per_tok", "experts_per_token"))
    f["ffn"] = int(_need(config, fam.expert_ffn_key))
    moe = _moe_layer_flags(config, fam.dense_rule, layers)
    f["dense_layers"] = moe.count(False)
    if f["dense_layers"]:
        f["dense_ffn"] = int(_need(config, "intermediate_size"))
    if fam.attention == "mla":   # no separate k/v heads
        f.update(kv_lora_rank=int(_need(config, "kv_lora_rank")), q_lora_rank=_get(config, "q_lora_rank"),
                 qk_nope_dim=int(_need(config, "qk_nope_head_dim")), qk_rope_dim=int(_need(config, "qk_rope_head_dim")),
                 v_head_dim=int(_need(config, "v_head_dim")))
        if f["q_lora_rank"] is not None:
            f["q_lora_rank"] = int(f["q_lora_rank"])
    else:
        kv = int(_get(config, "num_key_value_heads", default=heads))
        f["kv_heads"] = kv
        hd = _get(config, "head_dim")
        if hd is not None and (int(hd) != f["hidden"] // heads or f["hidden"] % heads):
            f["head_dim"] = int(hd)
    flag = bool(config.get("attention_bias", False))
    if fam.attn_bias == "qkv" or (fam.attn_bias == "qkv?" and flag):
        f["attn_bias"] = "qkv"
    elif fam.attn_bias == "all?" and flag:
        f["attn_bias"] = "all"
    if fam.qk_norm == "head" or (fam.qk_norm == "head?" and config.get("use_qk_norm")):
        f["qk_norm"] = "head"
    elif fam.qk_norm == "full":
        f["qk_norm"] = "full"
    if fam.shared_gate and _get(config, "shared_expert_intermediate_size", default=0):   # Qwen2: one, gated
        f.update(shared_experts=1, shared_ffn=int(config["shared_expert_intermediate_size"]), shared_gate=True)
    elif fam.shared and _get(config, "n_shared_experts", default=0):   # DeepSeek/GLM: n of the expert FFN
        f["shared_experts"] = int(config["n_shared_experts"])
    if fam.attn_sinks:
        f["attn_sinks"] = True
    if fam.router_bias or fam.expert_bias_key:   # a router bias, or DeepSeek-V3's score-correction bias
        f["router_bias"] = True
    if fam.expert_biases:
        f["expert_bias"] = True
    if fam.mtp:
        f["mtp_layers"] = int(_get(config, "num_nextn_predict_layers", default=0))
    # sliding-window attention where the config names the layers that use it (gpt-oss's layer_types)
    sliding = sum(1 for t in config.get("layer_types") or () if t == "sliding_attention")
    if sliding and config.get("sliding_window"):
        f.update(sliding_window=int(config["sliding_window"]), sliding_layers=sliding)
    return f


def load_config(path: str) -> dict:
    """Parse a config.json (a model's text config under ``text_config`` is taken as is)."""
    try:
        with open(path) as fh:
            config = json.load(fh)
    except OSError as e:
        raise ValueError(f"--hf-config {path!r} cannot be read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--hf-config {path!r} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--hf-config {path!r} holds no JSON object")
    return config


def spec_fields_from_file(path: str) -> dict:
    return spec_fields(load_config(path))


# The fields of the public config.json files that shape each preset (tests/data has them in
# full; a test keeps both in step). Sources: each model's Hugging Face repository.
PRESET_CONFIGS = {
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000),
    "mixtral-8x22b": dict(model_type="mixtral", hidden_size=6144, intermediate_size=16384, num_local_experts=8,
                          num_experts_per_tok=2, num_hidden_layers=56, num_attention_heads=48,
                          num_key_value_heads=8, vocab_size=32000),
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                        num_experts_per_tok=8, num_hidden_layers=61, first_k_dense_replace=3,
                        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, num_nextn_predict_layers=1),
    "deepseek-v2-lite": dict(model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
                             moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
                             num_experts_per_tok=6, num_hidden_layers=27, first_k_dense_replace=1,
                             num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, moe_intermediate_size=1536, num_experts=128,
                            num_experts_per_tok=8, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, vocab_size=151936),
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_experts=64,
                        num_experts_per_tok=8, num_hidden_layers=16, num_attention_heads=16,
                        num_key_value_heads=16, vocab_size=50304),
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=128,
                         num_experts_per_tok=4, num_hidden_layers=36, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=64, vocab_size=201088, attention_bias=True,
                         sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 18),
}


def presets() -> dict[str, dict]:
    """``--model`` name -> ``MoESpec`` fields."""
    return {name: spec_fields(cfg) for name, cfg in PRESET_CONFIGS.items()}


MODELS = presets()   # public model shapes for ``--model``, from their config.json fields

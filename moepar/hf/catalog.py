"""The Hugging Face MoE families moepar knows: one table for the layer conversion
(``moepar.hf``: block class, where the weights live) and the cost model's ``--hf-config``
(which config.json keys give the shapes). Torch-free: ``python -m moepar report
--hf-config`` reads it without loading torch.

Expert layouts (``Family.layout``) are described in ``moepar.hf.families``. The cost
model's columns say how a config.json reads (``moepar.cost.architectures``):

- ``expert_ffn_key``: the routed experts' F (``moe_intermediate_size`` or ``intermediate_size``);
- ``dense_rule``: which blocks keep a dense FFN (of ``intermediate_size``): "first_k"
  (``first_k_dense_replace`` and ``moe_layer_freq``: MoE when i >= k and i % freq == 0),
  "sparse_step" (``decoder_sparse_step`` and ``mlp_only_layers``: MoE when i is not listed
  and (i + 1) % step == 0), None (every block MoE);
- ``attention``: "gqa" (``num_key_value_heads``, ``head_dim``) or "mla" (DeepSeek's
  latent attention: ``kv_lora_rank``, ``q_lora_rank``, ``qk_nope_head_dim``, ...);
- ``attn_bias``: "qkv" always, "qkv?" / "all?" when ``attention_bias`` is set, None;
- ``qk_norm``: "head" (per-head RMSNorm), "head?" (when ``use_qk_norm``), "full" (over all heads), None;
- ``attn_sinks``, ``expert_biases``: gpt-oss's sink logit per head and biased experts;
- ``mtp``: ``num_nextn_predict_layers`` multi-token-prediction modules;
- ``unpriced``: None when the cost model prices the family, else why it does not.
"""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF MoE family: its block class, key layout and MoE options, and how its config.json
    gives the shapes the cost model prices."""

    model_type: str
    block_class: str                 # transformers' sparse-MoE block class name
    router: str                      # router module prefix inside the block
    layout: str                      # expert layout (moepar.hf.families)
    shared: Optional[str] = None     # shared-expert module prefix (gate/up/down_proj)
    shared_gate: Optional[str] = None
    router_bias: bool = False
    expert_bias_key: Optional[str] = None   # e.g. "gate.e_score_correction_bias"
    returns: str = "tensor"          # "tensor" | "tuple_weights" (GPT-OSS) | "tuple_logits" (Llama 4)
    # the cost model's reading of config.json (module docstring)
    expert_ffn_key: str = "moe_intermediate_size"
    dense_rule: Optional[str] = None
    attention: str = "gqa"
    attn_bias: Optional[str] = None
    qk_norm: Optional[str] = None
    attn_sinks: bool = False
    expert_biases: bool = False
    mtp: bool = False
    unpriced: Optional[str] = None


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("mixtral", "MixtralSparseMoeBlock", "gate", "fused_chunk", expert_ffn_key="intermediate_size"),
    Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", "gate", "fused_chunk", shared="shared_expert",
           shared_gate="shared_expert_gate", dense_rule="sparse_step", attn_bias="qkv"),
    Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate", "fused_chunk", dense_rule="sparse_step",
           attn_bias="all?", qk_norm="head"),
    Family("deepseek_v3", "DeepseekV3MoE", "gate", "fused_chunk", shared="shared_experts",
           expert_bias_key="gate.e_score_correction_bias", dense_rule="first_k", attention="mla", mtp=True),
    Family("glm4_moe", "Glm4MoeMoE", "gate", "fused_chunk", shared="shared_experts",
           expert_bias_key="gate.e_score_correction_bias", dense_rule="first_k", attn_bias="qkv?",
           qk_norm="head?", mtp=True),
    Family("deepseek_v2", "DeepseekV2Moe", "gate", "fused_chunk", shared="shared_experts", dense_rule="first_k",
           attention="mla"),
    Family("olmoe", "OlmoeSparseMoeBlock", "gate", "fused_chunk", expert_ffn_key="intermediate_size",
           attn_bias="all?", qk_norm="full"),
    Family("granitemoe", "GraniteMoeMoE", "router", "fused_chunk", expert_ffn_key="intermediate_size"),
    Family("switch_transformers", "SwitchTransformersSparseMLP", "router.classifier", "per_expert",
           unpriced="an encoder-decoder (T5) stack: the cost model prices decoder-only blocks"),
    Family("gpt_oss", "GptOssMLP", "router", "interleaved", router_bias=True, returns="tuple_weights",
           expert_ffn_key="intermediate_size", attn_bias="all?", attn_sinks=True, expert_biases=True),
    Family("llama4_text", "Llama4TextMoe", "router", "chunk_in_out", shared="shared_expert",
           returns="tuple_logits", unpriced="MoE every interleave_moe_layer_step blocks with dense FFNs of "
           "intermediate_size_mlp between, and chunked attention: not read by the cost model yet"),
)}
FAMILIES["llama4"] = dataclasses.replace(FAMILIES["llama4_text"], model_type="llama4")

PRICED = tuple(mt for mt, f in FAMILIES.items() if f.unpriced is None)

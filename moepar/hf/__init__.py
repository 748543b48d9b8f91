"""Hugging Face interop (optional extra ``moepar[hf]``): MoE blocks of transformers'
families to moepar ``MoE`` layers and back. The moepar core never imports this package.

  convert_block(block, config, state=None) -> MoE
  replace_moe_blocks(model, state=None) -> int        (in place; decoders keep working)
  hf_state_dict(moe, config) / hf_model_state_dict(model)   (the way back, gathered)
  save_hf_checkpoint(model, path)                     (config + model.safetensors)
  SafetensorsCheckpoint(path), load_pretrained(path, state)   (each rank reads its experts)

A swapped model keeps transformers' state-dict names and layouts (``names``; ``moepar_names()``
for moepar's own), records router logits where transformers collects them (``block``), and
is initialised by transformers' ``init_weights()`` as its own blocks are (``init``).

Families (by ``config.model_type``): see ``FAMILIES`` and docs/hf.md.
"""
from .checkpoint import SafetensorsCheckpoint, load_pretrained, params_on_meta, save_hf_checkpoint
from .convert import (HFMoEBlock, check_source, convert_block, hf_model_state_dict, hf_state_dict,
                      moe_block_names, replace_moe_blocks)
from .families import FAMILIES, HF_ACTIVATIONS, family_of, moe_options
from .init import init_block, init_spec
from .names import moepar_names

__all__ = ["FAMILIES", "HF_ACTIVATIONS", "HFMoEBlock", "SafetensorsCheckpoint", "check_source", "convert_block",
           "family_of",
           "hf_model_state_dict", "hf_state_dict", "init_block", "init_spec", "load_pretrained", "moe_block_names",
           "moe_options", "moepar_names", "params_on_meta", "replace_moe_blocks", "save_hf_checkpoint"]

"""Hugging Face interop (optional extra ``moepar[hf]``): MoE blocks of transformers'
families to moepar ``MoE`` layers and back. The moepar core never imports this package.

  convert_block(block, config, state=None) -> MoE
  replace_moe_blocks(model, state=None) -> int        (in place; decoders keep working)
  hf_state_dict(moe, config) / hf_model_state_dict(model)   (the way back, gathered)
  save_hf_checkpoint(model, path)                     (config + model.safetensors)
  SafetensorsCheckpoint(path), load_pretrained(path, state)   (each rank reads its experts)

A swapped block holds its parameters and buffers under transformers' names and layouts
(``modules``: ``named_parameters()``, ``state_dict()`` and ``from_pretrained`` are
transformers'), records router logits where transformers collects them (``block``), and
is initialised by transformers' ``init_weights()`` as its own blocks are (``init``).

Families (by ``config.model_type``): see ``FAMILIES`` and docs/hf.md.
"""
from .._lazy import attach as _attach

# public name -> the module defining it; imported on first use, so that the torch-free
# family table (``moepar.hf.catalog``, read by the cost model) loads without torch.
_NAMES = {
    **{n: ".safetensors_io" for n in ("SafetensorsCheckpoint", "load_pretrained", "params_on_meta", "save_hf_checkpoint")},
    **{n: ".convert" for n in ("HFMoEBlock", "check_source", "convert_block", "hf_model_state_dict", "hf_state_dict",
                               "moe_block_names", "replace_moe_blocks")},
    "FAMILIES": ".catalog", "Family": ".catalog",
    **{n: ".families" for n in ("HF_ACTIVATIONS", "family_of", "moe_options")},
    **{n: ".init" for n in ("init_block", "init_spec")},
    **{n: ".modules" for n in ("HFExperts", "HFRouter", "HFSharedExperts")},
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = _attach(__name__, _NAMES)

"""Tiny random transformers MoE blocks, one per family, and the parity comparison that the
single-process and the multi-rank tests share."""
from __future__ import annotations

import os
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def import_transformers():
    """``import transformers`` with the repository root off sys.path meanwhile: pytest puts
    it there, and transformers would then take the repo's ``kernels/`` folder (installed as
    ``moepar_kernels``) for the PyPI package ``kernels`` it probes (the probe is cached)."""
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _ROOT]
    try:
        import transformers
        from transformers.utils import import_utils
        import_utils.is_kernels_available()
    finally:
        sys.path[:] = saved
    return transformers

D = 16
B, S = 2, 6


def config(family: str):
    """A tiny config of ``family`` (hidden 16, 4-8 experts) whose options differ from
    moepar's defaults where the family allows (norm_topk_prob, group scores, biases)."""
    tr = import_transformers()
    small = dict(hidden_size=D, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
                 vocab_size=64, max_position_embeddings=64)
    if family == "mixtral":
        return tr.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **small)
    if family == "qwen2_moe":
        return tr.Qwen2MoeConfig(moe_intermediate_size=24, shared_expert_intermediate_size=20, num_experts=4,
                                 num_experts_per_tok=2, norm_topk_prob=False, intermediate_size=32, **small)
    if family == "qwen3_moe":
        return tr.Qwen3MoeConfig(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                 norm_topk_prob=True, intermediate_size=32, **small)
    if family == "deepseek_v3":   # k=3 != 2 * topk_group: HF's top-2 group score, not k // topk_groups
        return tr.DeepseekV3Config(moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                   topk_group=2, n_shared_experts=1, norm_topk_prob=True,
                                   routed_scaling_factor=2.5, intermediate_size=32, first_k_dense_replace=0,
                                   q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                                   v_head_dim=8, **small)
    if family == "glm4_moe":
        return tr.Glm4MoeConfig(moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                topk_group=1, n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.5,
                                intermediate_size=32, first_k_dense_replace=0, head_dim=8, **small)
    if family == "deepseek_v2":
        return tr.DeepseekV2Config(moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2,
                                   topk_method="group_limited_greedy", n_group=4, topk_group=2, n_shared_experts=2,
                                   routed_scaling_factor=1.5, intermediate_size=32, first_k_dense_replace=0,
                                   q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                                   v_head_dim=8, **small)
    if family == "olmoe":
        return tr.OlmoeConfig(intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                              **small)
    if family == "granitemoe":
        return tr.GraniteMoeConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **small)
    if family == "switch_transformers":   # 2 slots per expert and sequence: some tokens are dropped
        # one sparse layer of 2 in the encoder and the decoder (transformers adds their aux and z
        # losses only where sparse layers alternate with dense ones)
        return tr.SwitchTransformersConfig(d_model=D, d_ff=24, num_experts=4, expert_capacity=2, dropout_rate=0.0,
                                           router_bias=True, num_heads=2, d_kv=8, num_layers=2,
                                           num_decoder_layers=2, num_sparse_encoder_layers=1,
                                           num_sparse_decoder_layers=1, vocab_size=64)
    if family == "gpt_oss":
        return tr.GptOssConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=7.0,
                               head_dim=8, **small)
    if family == "llama4_text":
        return tr.Llama4TextConfig(intermediate_size=24, intermediate_size_mlp=32, num_local_experts=4,
                                   num_experts_per_tok=2, head_dim=8, **small)
    raise KeyError(family)


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "deepseek_v2", "olmoe",
            "granitemoe", "switch_transformers", "gpt_oss", "llama4_text"]
_CLASS = {"mixtral": "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
          "qwen2_moe": "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
          "qwen3_moe": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
          "deepseek_v3": "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
          "glm4_moe": "glm4_moe.modeling_glm4_moe.Glm4MoeMoE",
          "deepseek_v2": "deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe",
          "olmoe": "olmoe.modeling_olmoe.OlmoeSparseMoeBlock",
          "granitemoe": "granitemoe.modeling_granitemoe.GraniteMoeMoE",
          "switch_transformers": "switch_transformers.modeling_switch_transformers.SwitchTransformersSparseMLP",
          "gpt_oss": "gpt_oss.modeling_gpt_oss.GptOssMLP",
          "llama4_text": "llama4.modeling_llama4.Llama4TextMoe"}


def block(family: str, seed: int = 0, **overrides):
    """(config, HF block in eval mode, fp32, every tensor drawn from N(0, 0.3^2));
    ``overrides``: config fields set first (e.g. hidden_act)."""
    import importlib
    import_transformers()
    mod, cls = _CLASS[family].rsplit(".", 1)
    cfg = config(family)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    blk = getattr(importlib.import_module("transformers.models." + mod), cls)(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in sorted(list(blk.named_parameters()) + list(blk.named_buffers())):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
        if family == "gpt_oss":   # small outputs, so that 1e-5 is fp32-tight; the gate/up still reach +-7
            blk.experts.down_proj.mul_(0.05)
            blk.experts.down_proj_bias.mul_(0.05)
    return cfg, blk


def inputs(family: str, seed: int = 1, batch: int = B):
    gen = torch.Generator().manual_seed(seed)
    scale = 2.5 if family == "gpt_oss" else 1.0   # GPT-OSS: ~1-2% of gate/up entries beyond its +-7 clamps
    x = torch.randn(batch, S, D, generator=gen) * scale
    g = torch.randn(batch, S, D, generator=gen)
    return x, g


def run(module, x, g):
    """(y, dx) and the loss sum(y * g) back-propagated."""
    x = x.clone().requires_grad_()
    y = module(x)
    y = (y[0] if isinstance(y, tuple) else y).view(x.shape)   # Llama 4 returns [T, D]
    (y * g).sum().backward()
    return y.detach(), x.grad


def compare(family: str, state=None, **overrides) -> dict[str, float]:
    """Max abs differences between the HF block and its moepar conversion: output, input
    gradient and every HF weight's gradient (gathered), and the way back's round trip.

    With a parallel ``state``, the HF block runs the whole batch of ``dp_size`` sequences
    and data-parallel replica d the sequence d (its TP ranks share it); the moepar
    gradients are summed over the replicas (``allreduce_gradients``, op="sum") before
    they are compared with the HF block's. A collective then: call on every rank.
    ``overrides``: config fields of the block (``block``)."""
    from moepar.hf import HFMoEBlock, convert_block, hf_state_dict
    from moepar.hf.families import family_of
    from moepar.parallel import allreduce_gradients
    cfg, blk = block(family, **overrides)
    batch = B if state is None else state.dp_size
    x, g = inputs(family, batch=batch)
    y_ref, dx_ref = run(blk, x, g)
    rows = slice(0, batch) if state is None else slice(state.dp_rank, state.dp_rank + 1)
    moe = convert_block(blk, cfg, state)
    wrapped = HFMoEBlock(moe, family_of(cfg), cfg).train(blk.training)
    y, dx = run(wrapped, x[rows], g[rows])
    if state is not None:   # the block holds the tensors (moe's modules are its children)
        allreduce_gradients(wrapped, state, op="sum")
    out = {"y": float((y - y_ref[rows]).abs().max()), "dx": float((dx - dx_ref[rows]).abs().max()),
           "scale": float(y_ref.abs().max())}
    grads = hf_state_dict(moe, cfg, grads=True)
    for k, p in blk.named_parameters():
        ref_grad = p.grad if p.grad is not None else torch.zeros_like(p)   # an expert with no tokens
        out["grad:" + k] = float((grads[k] - ref_grad).abs().max()) if k in grads else float("inf")
        out["gscale:" + k] = float(ref_grad.abs().max())
    weights = hf_state_dict(moe, cfg)
    out["roundtrip"] = max(float((weights[k] - v).abs().max()) for k, v in blk.state_dict().items())
    out["keys_differ"] = float(set(weights) != set(blk.state_dict()))
    return out


def compare_layout(tp: int, ep: int, etp: int, families: list[str]) -> dict[str, dict[str, float]]:
    """``compare`` for each family on this rank of a (tp, ep, etp) layout (run_ranks target)."""
    from moepar.parallel import init_parallel
    state = init_parallel(tp, ep, etp, verbose=False)
    return {f: compare(f, state) for f in families}


def bad_checkpoint_error(tp: int, ep: int) -> str:
    """The ValueError every rank raises for a block with a misshapen expert tensor."""
    from moepar.hf import convert_block
    from moepar.parallel import init_parallel
    state = init_parallel(tp, ep, verbose=False)
    cfg, blk = block("qwen3_moe")
    blk.experts.down_proj = torch.nn.Parameter(blk.experts.down_proj.detach()[:, :, :-1].clone())
    try:
        convert_block(blk, cfg, state)
    except ValueError as e:
        return str(e)
    return ""


def sharded_worker(path: str, ids: torch.Tensor):
    """This rank's model from the sharded checkpoint (ep=2): its logits, and what it read."""
    import_transformers()
    from moepar.hf import load_pretrained
    from moepar.hf.safetensors_io import SafetensorsCheckpoint
    from moepar.parallel import init_parallel
    state = init_parallel(1, 2, verbose=False)
    reads = []
    orig = SafetensorsCheckpoint.get

    def spy(self, key, rows=None):
        reads.append((key, None if rows is None else (rows.start, rows.stop)))
        return orig(self, key, rows)
    SafetensorsCheckpoint.get = spy
    try:
        model, n = load_pretrained(path, state)
    finally:
        SafetensorsCheckpoint.get = orig
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return n, logits, [r for r in reads if ".experts." in r[0]], state.ep_rank


def model(family: str, seed: int = 0, **overrides):
    """A tiny transformers model of ``family`` (causal LM; Switch: seq2seq), fp32, eval
    mode, every parameter N(0, 0.2^2) (and the selection biases N(0, 0.1^2));
    ``overrides``: config fields set first."""
    tr = import_transformers()
    cfg = config(family)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    cls = tr.AutoModelForSeq2SeqLM if family == "switch_transformers" else tr.AutoModelForCausalLM
    torch.manual_seed(seed)
    m = cls.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in sorted(m.named_parameters()):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.2)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return m


def model_inputs(family: str, batch: int = 2, seq: int = 6, seed: int = 3):
    """Token ids (and Switch's decoder ids) with labels, for ``model``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (batch, seq), generator=gen)
    if family == "switch_transformers":
        return dict(input_ids=ids, decoder_input_ids=ids.flip(1), labels=ids)
    return dict(input_ids=ids, labels=ids)


def router_outputs(out) -> dict:
    """The router-related fields of a model output, and its loss and logits (tensors, or
    tuples of per-layer tensors)."""
    keys = ("loss", "logits", "aux_loss", "router_logits", "encoder_router_logits", "decoder_router_logits",
            "encoder_z_loss", "encoder_aux_loss", "decoder_z_loss", "decoder_aux_loss")
    return {k: getattr(out, k, None) for k in keys if getattr(out, k, None) is not None}


def dropin_worker(tp: int, ep: int, families: list[str]):
    """Per family, on this rank of a (tp, ep) layout, for the swapped model on its
    data-parallel replica's sequence and the one-process transformers model on it:
    (aux loss, transformers' aux loss) (Switch: its loss, which holds them), the largest
    logits difference after ``load_state_dict`` of transformers' full state dict and of the
    rank's own ``state_dict()``, and
    whether ``state_dict()`` and ``named_parameters()`` have transformers' keys with this
    rank's shards' shapes."""
    from moepar.hf import HFMoEBlock, replace_moe_blocks
    from moepar.parallel import init_parallel
    state = init_parallel(tp, ep, verbose=False)
    out = {}
    for family in families:
        ref = model(family, output_router_logits=True)
        plain = {k: v.clone() for k, v in ref.state_dict().items()}
        inputs = {k: v[state.dp_rank:state.dp_rank + 1] for k, v in model_inputs(family, batch=state.dp_size).items()}
        with torch.no_grad():
            want = ref(**inputs, output_router_logits=True)
            replace_moe_blocks(ref, state)
            got = ref(**inputs, output_router_logits=True)
            sd = {k: v.clone() for k, v in ref.state_dict().items()}
            blocks = {n: m for n, m in ref.named_modules() if isinstance(m, HFMoEBlock)}
            names = set(sd) | {n for n, _ in ref.named_parameters()}
            shards_ok = len(blocks) == 2 and names == set(sd) and all(
                tuple(sd[n + "." + k].shape) == v for n, m in blocks.items() for k, v in _shard_shapes(m).items())
            dense_ok = all(torch.equal(sd[k], t) for k, t in plain.items()
                           if not any(k.startswith(n + ".") for n in blocks))
            # the same keys as transformers', but Switch's other ranks' experts
            shapes_ok = {k for k in sd if ".expert_" not in k} == {k for k in plain if ".expert_" not in k}
            reloaded = []
            for source in (plain, sd):   # the full tensors, and this rank's own shards
                for p in ref.parameters():
                    p.zero_()
                ref.load_state_dict(source)
                reloaded.append(float((ref(**inputs).logits - want.logits).abs().max()))
        key = "loss" if family == "switch_transformers" else "aux_loss"
        out[family] = (float(getattr(got, key)), float(getattr(want, key)), max(reloaded),
                       shards_ok and dense_ok and shapes_ok)
    return out


def meta_init_state_dict(family: str, state=None) -> dict:
    """The gathered HF state dict of ``family``'s model built on meta, swapped (under
    ``state``'s layout), ``to_empty`` and initialised by transformers' ``init_weights()``
    from seed 0 (a collective under a parallel state)."""
    from moepar.hf import hf_model_state_dict, replace_moe_blocks
    tr = import_transformers()
    cls = tr.AutoModelForSeq2SeqLM if family == "switch_transformers" else tr.AutoModelForCausalLM
    with torch.device("meta"):
        m = cls.from_config(config(family))
    replace_moe_blocks(m, state)
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.init_weights()
    return hf_model_state_dict(m)


def meta_init_worker(tp: int, ep: int, families: list[str]):
    """Per family, the largest difference between this rank's gathered meta-init state dict
    and the one-process one: the init is layout-free."""
    from moepar.parallel import ParallelState, init_parallel
    state = init_parallel(tp, ep, verbose=False)
    out = {}
    for family in families:
        one = meta_init_state_dict(family, ParallelState.single())
        mine = meta_init_state_dict(family, state)
        assert sorted(one) == sorted(mine)
        out[family] = max(float((one[k] - mine[k]).abs().max()) for k in one)
    return out


def _shard_shapes(block) -> dict:
    """HF key -> this rank's shard's shape: its experts [L, ...] (Switch's by global index),
    its ffn columns (expert TP), its rows / columns of the shared experts (TP)."""
    from moepar.hf.families import block_dims, expected_shapes
    moe, fam = block.moe, block.family
    D, E, Fh, S, _ = block_dims(block.hf_config)
    ex, st = moe.experts, moe.state
    L, Fl = ex.num_local_experts, ex.ffn_local
    out = expected_shapes(fam, L, D, Fl, S // st.tp_size if S else 0, moe.router.bias is not None)
    for key, shape in expected_shapes(fam, E, D, Fh, S, moe.router.bias is not None).items():
        if key.startswith(fam.router):   # the router is replicated
            out[key] = shape
    if fam.layout == "per_expert":
        out = {k: v for k, v in out.items() if not k.startswith("experts.")}
        out.update({f"experts.expert_{ex.first_expert + e}.{n}.weight": s for e in range(L)
                    for n, s in (("wi", (Fl, D)), ("wo", (D, Fl)))})
    return out


def fsdp_dcp_worker(families: list[str], ep: int, path: str, phase: str) -> dict:
    """Per family on this rank of an ep layout, swapped: phase "fsdp": (largest logits
    difference to transformers' on the replica's sequence after ``moepar.fully_shard``,
    every parameter got a gradient); "save": ``moepar.checkpoint.save`` to path/family;
    "load": the largest logits difference after zeroing and ``moepar.checkpoint.load``."""
    import moepar
    from moepar import checkpoint
    from moepar.hf import replace_moe_blocks
    from moepar.parallel import init_parallel
    state = init_parallel(1, ep, verbose=False)
    out = {}
    for family in families:
        ref = model(family)
        inputs = model_inputs(family)
        if phase == "fsdp":
            inputs = {k: v[state.dp_rank:state.dp_rank + 1] for k, v in model_inputs(family, batch=state.dp_size).items()}
        with torch.no_grad():
            want = ref(**inputs).logits
        replace_moe_blocks(ref, state)
        if phase == "fsdp":
            moepar.fully_shard(ref, state)
            got = ref(**inputs)
            got.loss.backward()
            out[family] = (float((got.logits.detach() - want).abs().max()),
                           all(p.grad is not None for p in ref.parameters()))
        elif phase == "save":
            checkpoint.save(os.path.join(path, family), ref, state=state)
        else:
            with torch.no_grad():
                for p in ref.parameters():
                    p.zero_()
            checkpoint.load(os.path.join(path, family), ref, state=state)
            with torch.no_grad():
                out[family] = float((ref(**inputs).logits - want).abs().max())
    return out

"""What each Hugging Face MoE family is in moepar's terms: its MoE options, and where its
weights live in the block's state dict. Torch only; transformers is never imported here.

Legend (docs/moe.md): E experts, D hidden, F expert ffn hidden (full), Fl = F/etp the slice one
expert-TP rank holds, Fs the shared experts' ffn hidden, L local experts.

Canonical (full, unsliced) tensors every family reads into and writes from:
  router_weight [E, D], router_bias [E], expert_bias [E] (selection-only bias),
  w1 / w3 [E, D, F] (gate / up, ``x @ w``), w2 [E, F, D], b1 / b3 [E, F], b2 [E, D],
  shared_w1 / shared_w3 [Fs, D], shared_w2 [D, Fs] (nn.Linear layout), shared_gate [1, D].

Expert layouts of transformers (5.x) blocks, per expert e:
  "fused_chunk"   experts.gate_up_proj [E, 2F, D]: rows :F the gate, F: the up; down_proj [E, D, F]
                  (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4-MoE, OLMoE, GraniteMoE)
  "interleaved"   experts.gate_up_proj [E, D, 2F]: columns 0::2 the gate, 1::2 the up, plus
                  gate_up_proj_bias [E, 2F] alike; down_proj [E, F, D] + down_proj_bias (GPT-OSS)
  "chunk_in_out"  experts.gate_up_proj [E, D, 2F]: columns :F the gate, F: the up;
                  down_proj [E, F, D] (Llama 4)
  "per_expert"    experts.expert_{e}.wi.weight [F, D], .wo.weight [D, F] (Switch Transformers)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from .catalog import FAMILIES, Family  # noqa: F401  (the one family table, torch-free)

if TYPE_CHECKING:
    from moepar.moe.layer import MoE

# get(key, rows) -> tensor: ``rows`` (a slice of dim 0) or None for the whole tensor.
Getter = Callable[[str, Optional[slice]], torch.Tensor]


def family_of(config) -> Family:
    """The family of an HF config (by ``model_type``); ValueError naming the known ones."""
    mt = getattr(config, "model_type", None)
    if mt not in FAMILIES:
        raise ValueError(f"model_type={mt!r} is not a Hugging Face MoE family moepar converts; "
                         f"known: {sorted(FAMILIES)}")
    return FAMILIES[mt]


def _need(config, name):
    if not hasattr(config, name) or getattr(config, name) is None:
        raise ValueError(f"{config.model_type} config has no {name!r}, which moepar needs to convert the block")
    return getattr(config, name)


# transformers' activation names (ACT2FN) -> moepar's elementwise function of the same formula
# (moepar.moe.experts.activations.ELEMENTWISE). prelu and xielu are left out: they hold learnable
# parameters, which moepar's experts do not have.
HF_ACTIVATIONS = {
    "silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_python": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_new", "gelu_new": "gelu_new", "gelu_accurate": "gelu_new", "gelu_fast": "gelu_fast",
    "gelu_10": "gelu_clip10", "quick_gelu": "quick_gelu", "relu": "relu", "relu2": "relu2", "relu6": "relu6",
    "leaky_relu": "leaky_relu", "hardswish": "hardswish", "sigmoid": "sigmoid", "tanh": "tanh", "mish": "mish",
    "linear": "identity", "laplace": "laplace", "sqrtsoftplus": "sqrt_softplus",
}


def _activation(config, name: str, gated: bool, default: str) -> str:
    """moepar's activation for the HF config's ``name`` (hidden_act, dense_act_fn):
    "swiglu" / "glu_<fn>" for gated experts, "<fn>" (gelu, relu, gelu_tanh...) otherwise."""
    act = getattr(config, name, None) or default
    if act not in HF_ACTIVATIONS:
        raise ValueError(f"{config.model_type}: {name}={act!r} cannot be expressed: moepar's experts take "
                         f"{sorted(HF_ACTIVATIONS)} (prelu and xielu hold learnable parameters)")
    fn = HF_ACTIVATIONS[act]
    if not gated:
        return fn
    return "swiglu" if fn == "silu" else "glu_" + fn


def _gated(config) -> str:
    return _activation(config, "hidden_act", True, "silu")


def _check_groups(mt: str, E: int, k: int, groups: int, topk_groups: int) -> None:
    """transformers picks among experts masked to -inf (zero scores) when k exceeds the
    experts of the kept groups: an order no one can reproduce; refused."""
    if groups and topk_groups and k > topk_groups * (E // groups):
        raise ValueError(f"{mt}: num_experts_per_tok={k} exceeds the {topk_groups * (E // groups)} experts of the "
                         f"topk_group={topk_groups} kept groups ({E} experts in n_group={groups}); transformers "
                         f"then picks among masked experts, an order that is not well defined")


def moe_options(config) -> tuple[int, int, int, dict]:
    """(hidden, num_experts, ffn_hidden, MoE keyword options) for ``config``'s family.
    ValueError for an option moepar cannot express."""
    fam = family_of(config)
    mt = fam.model_type
    D = _need(config, "hidden_size" if mt != "switch_transformers" else "d_model")
    k = 1 if mt == "switch_transformers" else _need(config, "num_experts_per_tok")
    opts: dict = dict(k=k, aux_loss=None)
    if getattr(config, "output_router_logits", False):
        # transformers adds router_aux_loss_coef * load_balancing_loss (E * sum f*P, K x moepar's)
        opts.update(aux_loss="switch", aux_loss_coeff=float(getattr(config, "router_aux_loss_coef", 0.0)),
                    aux_loss_convention="hf")
    if mt in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        E = _need(config, "num_local_experts" if mt == "mixtral" else "num_experts")
        F = _need(config, "intermediate_size" if mt in ("mixtral", "olmoe") else "moe_intermediate_size")
        # router_jitter_noise: Mixtral's block scales its whole input by the noise in training
        # (HFMoEBlock does the same); Qwen2/3-MoE and OLMoE blocks ignore it, as here.
        norm = True if mt == "mixtral" else bool(_need(config, "norm_topk_prob"))
        opts.update(activation=_gated(config), score_func="softmax", normalize_weights=norm)
        if mt == "qwen2_moe":
            opts.update(num_shared_experts=1, shared_ffn_hidden=_need(config, "shared_expert_intermediate_size"),
                        shared_expert_gate=True)
    elif mt in ("deepseek_v3", "glm4_moe", "deepseek_v2"):
        E = _need(config, "n_routed_experts")
        F = _need(config, "moe_intermediate_size")
        opts.update(activation=_gated(config), scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)))
        n_shared = getattr(config, "n_shared_experts", 0) or 0
        if n_shared:
            opts.update(num_shared_experts=1, shared_ffn_hidden=F * n_shared)
        groups, topk_groups = getattr(config, "n_group", None), getattr(config, "topk_group", None)
        if mt == "deepseek_v2":
            method = getattr(config, "topk_method", "greedy")
            opts.update(score_func="softmax", normalize_weights=False)
            if method == "group_limited_greedy":
                _check_groups(mt, E, k, _need(config, "n_group"), _need(config, "topk_group"))
                opts.update(num_groups=_need(config, "n_group"), topk_groups=_need(config, "topk_group"),
                            group_score="max")
            elif method != "greedy":
                raise ValueError(f"deepseek_v2: topk_method={method!r} cannot be expressed "
                                 f"(moepar maps 'greedy' and 'group_limited_greedy')")
        else:
            if groups is None or topk_groups is None:
                raise ValueError(f"{mt}: n_group={groups} and topk_group={topk_groups} must both be set")
            _check_groups(mt, E, k, groups, topk_groups)
            if E // groups < 2:
                raise ValueError(f"{mt}: {E} experts in n_group={groups} groups leave fewer than 2 per group; "
                                 f"transformers' group score sums each group's top 2")
            opts.update(score_func="sigmoid", normalize_weights=bool(getattr(config, "norm_topk_prob", False)),
                        expert_bias=True, num_groups=groups, topk_groups=topk_groups, group_score_topn=2)
    elif mt == "granitemoe":
        E, F = _need(config, "num_local_experts"), _need(config, "intermediate_size")
        opts.update(activation=_gated(config), score_func="softmax_after_topk")
    elif mt == "switch_transformers":
        E, F = _need(config, "num_experts"), _need(config, "d_ff")
        act = _activation(config, "dense_act_fn", False, "relu")
        if getattr(config, "router_dtype", "float32") != "float32":
            raise ValueError(f"switch_transformers: router_dtype={config.router_dtype!r} cannot be expressed: "
                             f"moepar's router runs in float32")
        jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
        opts.update(activation=act, score_func="softmax", normalize_weights=False,
                    expert_capacity=_need(config, "expert_capacity"), drop_policy="position",
                    router_bias=bool(getattr(config, "router_bias", False)))
        if jitter > 0:
            opts.update(noisy_gate_policy="jitter", noise_eps=float(jitter))
    elif mt == "gpt_oss":
        E, F = _need(config, "num_local_experts"), _need(config, "intermediate_size")
        opts.update(activation="clamped_swiglu", activation_limit=float(_need(config, "swiglu_limit")),
                    activation_alpha=float(_need(config, "swiglu_alpha")), bias=True, router_bias=True,
                    score_func="softmax_after_topk")
    else:  # llama4 / llama4_text
        E, F = _need(config, "num_local_experts"), _need(config, "intermediate_size")
        opts.update(activation=_gated(config), score_func="sigmoid", normalize_weights=False,
                    score_before_experts=True, num_shared_experts=1, shared_ffn_hidden=F)
    return D, E, F, opts


# ---- weights: HF keys (relative to the block) <-> canonical tensors ----------------------

def expert_keys(fam: Family, E: int) -> list[str]:
    """The HF keys holding the experts (for a safetensors checkpoint check and the way back)."""
    if fam.layout == "per_expert":
        return [f"experts.expert_{e}.{n}.weight" for e in range(E) for n in ("wi", "wo")]
    keys = ["experts.gate_up_proj", "experts.down_proj"]
    if fam.layout == "interleaved":
        keys += ["experts.gate_up_proj_bias", "experts.down_proj_bias"]
    return keys


def read_experts(fam: Family, get: Getter, lo: int, hi: int, F: int) -> dict[str, torch.Tensor]:
    """Canonical w1/w3/w2 (and b1/b3/b2) of experts lo..hi-1, reading only those experts.
    ``F``: the source's expert ffn width (``Fl`` when it holds one expert-TP rank's columns)."""
    rows = slice(lo, hi)
    if fam.layout == "per_expert":
        wi = torch.stack([get(f"experts.expert_{e}.wi.weight", None) for e in range(lo, hi)])   # [L, F, D]
        wo = torch.stack([get(f"experts.expert_{e}.wo.weight", None) for e in range(lo, hi)])   # [L, D, F]
        return {"w1": wi.transpose(1, 2), "w2": wo.transpose(1, 2)}
    gu, down = get("experts.gate_up_proj", rows), get("experts.down_proj", rows)
    if fam.layout == "fused_chunk":                       # [L, 2F, D], [L, D, F]
        return {"w1": gu[:, :F].transpose(1, 2), "w3": gu[:, F:].transpose(1, 2), "w2": down.transpose(1, 2)}
    if fam.layout == "chunk_in_out":                      # [L, D, 2F], [L, F, D]
        return {"w1": gu[..., :F], "w3": gu[..., F:], "w2": down}
    gub = get("experts.gate_up_proj_bias", rows)          # interleaved: [L, D, 2F], [L, 2F]
    return {"w1": gu[..., 0::2], "w3": gu[..., 1::2], "w2": down,
            "b1": gub[:, 0::2], "b3": gub[:, 1::2], "b2": get("experts.down_proj_bias", rows)}


def write_experts(fam: Family, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF expert keys from canonical full tensors (the inverse of ``read_experts``)."""
    w1, w2 = full["w1"], full["w2"]
    if fam.layout == "per_expert":
        out = {}
        for e in range(w1.shape[0]):
            out[f"experts.expert_{e}.wi.weight"] = w1[e].t().contiguous()
            out[f"experts.expert_{e}.wo.weight"] = w2[e].t().contiguous()
        return out
    w3 = full["w3"]
    if fam.layout == "fused_chunk":
        return {"experts.gate_up_proj": torch.cat([w1, w3], dim=2).transpose(1, 2).contiguous(),
                "experts.down_proj": w2.transpose(1, 2).contiguous()}
    if fam.layout == "chunk_in_out":
        return {"experts.gate_up_proj": torch.cat([w1, w3], dim=2).contiguous(), "experts.down_proj": w2.contiguous()}
    E, D, F = w1.shape
    gu = torch.stack([w1, w3], dim=-1).reshape(E, D, 2 * F)
    gub = torch.stack([full["b1"], full["b3"]], dim=-1).reshape(E, 2 * F)
    return {"experts.gate_up_proj": gu.contiguous(), "experts.gate_up_proj_bias": gub.contiguous(),
            "experts.down_proj": w2.contiguous(), "experts.down_proj_bias": full["b2"].contiguous()}


def dense_keys(fam: Family, router_bias: bool = False) -> dict[str, str]:
    """canonical name -> HF key of the block's non-expert tensors (``router_bias``: the
    router has a bias, always for GPT-OSS, per config for Switch)."""
    out = {"router_weight": f"{fam.router}.weight"}
    if fam.router_bias or router_bias:
        out["router_bias"] = f"{fam.router}.bias"
    if fam.expert_bias_key:
        out["expert_bias"] = fam.expert_bias_key
    if fam.shared:
        out.update(shared_w1=f"{fam.shared}.gate_proj.weight", shared_w3=f"{fam.shared}.up_proj.weight",
                   shared_w2=f"{fam.shared}.down_proj.weight")
    if fam.shared_gate:
        out["shared_gate"] = f"{fam.shared_gate}.weight"
    return out


def expected_shapes(fam: Family, E: int, D: int, F: int, Fs: int, router_bias: bool) -> dict[str, tuple]:
    """HF key -> full shape, for every tensor the block must have (checked on every rank
    before anything is built, so a misshapen or missing tensor raises everywhere alike)."""
    if fam.layout == "per_expert":
        out = {}
        for e in range(E):
            out[f"experts.expert_{e}.wi.weight"] = (F, D)
            out[f"experts.expert_{e}.wo.weight"] = (D, F)
    elif fam.layout == "fused_chunk":
        out = {"experts.gate_up_proj": (E, 2 * F, D), "experts.down_proj": (E, D, F)}
    else:
        out = {"experts.gate_up_proj": (E, D, 2 * F), "experts.down_proj": (E, F, D)}
        if fam.layout == "interleaved":
            out.update({"experts.gate_up_proj_bias": (E, 2 * F), "experts.down_proj_bias": (E, D)})
    dims = {"router_weight": (E, D), "router_bias": (E,), "expert_bias": (E,), "shared_w1": (Fs, D),
            "shared_w3": (Fs, D), "shared_w2": (D, Fs), "shared_gate": (1, D)}
    for name, key in dense_keys(fam, router_bias).items():
        out[key] = dims[name]
    return out


def block_dims(config):
    """(D, E, F, Fs or 0, MoE options) of ``config``'s block."""
    D, E, F, opts = moe_options(config)
    Fs = opts.get("shared_ffn_hidden", 0) if opts.get("num_shared_experts") else 0
    return D, E, F, Fs, opts


def local_parts(moe: MoE, fam: Family, source, F: int, local: bool = False):
    """This rank's share of the source's tensors, as (name in ``moe``, local expert or None,
    tensor) one expert at a time (the read's temporaries stay one expert large).
    ``local``: the source holds this rank's shard already, in the HF layout (``names``):
    its experts 0..L-1 (per-expert keys by global index), its ffn columns, its TP rows."""
    st, ex = moe.state, moe.experts
    L = moe.num_local_experts
    lo = st.ep_rank * L
    Fl = ex.ffn_local
    cols = slice(ex.etp_rank * Fl, (ex.etp_rank + 1) * Fl)
    for e in range(L):
        g = lo + e if not local or fam.layout == "per_expert" else e
        full = read_experts(fam, source.get, g, g + 1, Fl if local else F)
        for name, t in full.items():
            if not local and name in ("w1", "w3"):
                t = t[:, :, cols]
            elif not local and name in ("w2", "b1", "b3"):
                t = t[:, cols]
            yield "experts." + name, e, t
        del full
    dense = {n: source.get(k) for n, k in dense_keys(fam, moe.router.bias is not None).items()}
    for name, key in (("router_weight", "router.weight"), ("router_bias", "router.bias"),
                      ("expert_bias", "router.expert_bias")):
        if name in dense:
            yield key, None, dense[name].float()
    sh = moe.shared
    if sh is not None:
        n = sh.w1.weight.shape[0]   # this TP rank's rows of the shared ffn
        rows = slice(0, n) if local else slice(st.tp_rank * n, (st.tp_rank + 1) * n)
        yield "shared.w1.weight", None, dense["shared_w1"][rows]
        yield "shared.w3.weight", None, dense["shared_w3"][rows]
        yield "shared.w2.weight", None, dense["shared_w2"][:, rows]
        if sh.gate is not None:
            yield "shared.gate.weight", None, dense["shared_gate"]

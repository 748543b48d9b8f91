"""Helpers for comparing a distributed MoE layer with the single-process one.

The reference is the same layer built with a world-of-one state and the same seed: all
experts local, no collectives. Expert g's weights are identical in both (deterministic
per global expert index), so the distributed parameters are slices of the reference's.
That proves layout-invariance only; ``moe_per_token`` below is the independent check of
what the layer computes (routing, capacity drops, experts, shared experts), token by token.
"""
from __future__ import annotations

import math

import torch

from moepar.moe.layer import MoE
from moepar.parallel.groups import ParallelState

from .tolerances import error_ratio

D, F = 8, 12


def build(state: ParallelState | None, **kw) -> MoE:
    kw.setdefault("init_seed", 77)
    kw.setdefault("ffn_hidden", F)
    hidden = kw.pop("hidden", D)
    num_experts = kw.pop("num_experts", 4)
    ep = 1 if state is None else state.ep_size
    etp = 1 if state is None else state.etp_size
    return MoE(hidden, num_experts, ep, expert_tensor_parallel_size=etp,
               state=state if state is not None else ParallelState.single(), **kw)


def replica_input(dp_rank: int, tokens: int, hidden: int = D, dtype=torch.float32):
    """x and the output-gradient weights g of data-parallel replica ``dp_rank``."""
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    x = torch.randn(tokens, hidden, generator=gen, dtype=dtype)
    g = torch.randn(tokens, hidden, generator=gen, dtype=dtype)
    return x, g


def local_slice(ref: torch.Tensor, param: torch.nn.Parameter, state: ParallelState) -> torch.Tensor:
    """The part of the reference (full) tensor that ``param`` holds on this rank."""
    out = ref
    if getattr(param, "moepar_expert", False):
        L = param.shape[0]
        out = out[state.ep_rank * L:(state.ep_rank + 1) * L]
        pdim = getattr(param, "moepar_expert_partition_dim", None)
        if pdim is not None and state.etp_size > 1:
            n = param.shape[pdim]
            out = out.narrow(pdim, state.etp_rank * n, n)
    elif getattr(param, "tensor_model_parallel", False) and state.tp_size > 1:
        dim = param.partition_dim
        n = param.shape[dim]
        out = out.narrow(dim, state.tp_rank * n, n)
    return out


def max_param_diff(model, ref, state, use_grad: bool) -> dict[str, float]:
    ref_params = dict(ref.named_parameters())
    out = {}
    for name, p in model.named_parameters():
        a = p.grad if use_grad else p.data
        b = ref_params[name].grad if use_grad else ref_params[name].data
        if a is None or b is None:
            out[name] = float("inf") if (a is None) != (b is None) else 0.0
            continue
        out[name] = float((a - local_slice(b, p, state)).abs().max()) if a.numel() else 0.0
    return out


# ---------------------------------------------------------------------------------------
# The dense per-token reference: an independent re-statement of what the layer computes,
# one token at a time, in float64 and plain Python loops (no permute, no grouped GEMM, no
# collectives, none of the router's code). Only the weights' values come from the layer.
# ---------------------------------------------------------------------------------------

def full_weights(moe: MoE) -> dict:
    """The weights of a world-of-one ``moe`` as float64 leaves that require grad:
    router [E, D] (+ router_bias [E] and expert_bias [E], or None), experts: one dict per
    global expert with w1 [D, F], w3 [D, F] (gated), w2 [F, D] (+ b1 [F], b3 [F], b2 [D]), shared: the
    shared FFN in nn.Linear layout (w1 [F, D], w3 [F, D], w2 [D, F]) or None."""
    def leaf(t):
        return t.detach().double().clone().requires_grad_()
    ex = moe.experts
    experts = []
    for g in range(moe.num_experts):
        experts.append({n: leaf(getattr(ex, n)[g]) for n in ("w1", "w3", "w2", "b1", "b3", "b2")
                        if getattr(ex, n) is not None})
    shared = None
    if moe.shared is not None:
        shared = {"w1": leaf(moe.shared.w1.weight), "w2": leaf(moe.shared.w2.weight)}
        if moe.shared.w3 is not None:
            shared["w3"] = leaf(moe.shared.w3.weight)
    # Qwen2-MoE's shared-expert gate (a [1, D] linear), where the layer has one.
    gate = getattr(moe.shared, "gate", None) if moe.shared is not None else None
    eb, rb = moe.router.expert_bias, moe.router.bias
    return {"router": leaf(moe.router.weight), "router_bias": None if rb is None else leaf(rb),
            "expert_bias": None if eb is None else eb.detach().double().clone(),
            "experts": experts, "shared": shared, "shared_gate": None if gate is None else leaf(gate.weight)}


GATED = ("swiglu", "clamped_swiglu")


def _act(h, activation, h3=None, limit=7.0, alpha=1.702):
    if activation == "swiglu":
        return torch.nn.functional.silu(h) * h3
    if activation == "clamped_swiglu":   # GPT-OSS: gate clamped above, up clamped both sides
        g = torch.clamp(h, max=limit)
        return (torch.clamp(h3, -limit, limit) + 1) * g * torch.sigmoid(alpha * g)
    if activation == "gelu":
        return torch.nn.functional.gelu(h)
    return torch.relu(h)


def expert_ffn(x_D: torch.Tensor, p: dict, activation: str, limit: float = 7.0, alpha: float = 1.702
               ) -> torch.Tensor:
    """One token through one expert: act(x w1 + b1) w2 + b2 (swiglu: silu(x w1 + b1) * (x w3 + b3);
    clamped_swiglu: the same two projections through ``_act`` with ``limit``/``alpha``)."""
    h = x_D @ p["w1"] + (p["b1"] if "b1" in p else 0.0)
    h3 = x_D @ p["w3"] + (p["b3"] if "b3" in p else 0.0) if activation in GATED else None
    return _act(h, activation, h3, limit, alpha) @ p["w2"] + (p["b2"] if "b2" in p else 0.0)


def shared_ffn(x_D: torch.Tensor, p: dict, activation: str, gate_weight: torch.Tensor | None = None) -> torch.Tensor:
    """One token through the shared experts (a dense FFN, nn.Linear layout, no bias).
    ``gate_weight`` [1, D]: Qwen2-MoE's shared-expert gate, output x sigmoid(gate . x)."""
    h = p["w1"] @ x_D
    h3 = p["w3"] @ x_D if activation == "swiglu" else None
    y = p["w2"] @ _act(h, activation, h3)
    if gate_weight is not None:
        y = y * torch.sigmoid(gate_weight.double().reshape(-1) @ x_D)
    return y


def reference_capacity(T: int, k: int, E: int, factor: float | None, min_capacity: int) -> int | None:
    """max(ceil(T*k/E*factor), min_capacity), exact (the factor read as its decimal)."""
    if factor is None:
        return None
    from fractions import Fraction
    return max(math.ceil(Fraction(T * k, E) * Fraction(repr(float(factor)))), min_capacity)


def route_per_token(x_TD, w: dict, *, k: int, score_func: str = "softmax", normalize_weights=None,
                    scaling_factor: float = 1.0, capacity_factor: float | None = None, min_capacity: int = 4,
                    drop_policy: str = "probs"):
    """Top-k routing, token by token: (ids [T][k] lists, weights [T][k] float64 tensors in the
    graph of ``w['router']``, kept [T][k] bools). Selection key: score (+ expert_bias), the
    logit for softmax_after_topk; ties to the lower expert id. Capacity: per expert, the
    routes ranked by weight (``probs``) or by arrival (``position``; arrival is slot-major:
    every token's first choice before any second choice, which also breaks weight ties)."""
    W, bias, router_bias = w["router"], w["expert_bias"], w.get("router_bias")
    E = W.shape[0]
    normalize = normalize_weights if normalize_weights is not None else (score_func == "sigmoid" and k > 1)
    ids, weights = [], []
    for t in range(x_TD.shape[0]):
        logits = W @ x_TD[t].double() + (router_bias if router_bias is not None else 0.0)
        scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, 0)
        key = (logits if score_func == "softmax_after_topk" else scores).detach().tolist()
        if bias is not None:
            key = [a + float(b) for a, b in zip(key, bias)]
        chosen = sorted(range(E), key=lambda e: (-key[e], e))[:k]
        if score_func == "softmax_after_topk":
            wt = torch.softmax(torch.stack([logits[e] for e in chosen]), 0)
        else:
            wt = torch.stack([scores[e] for e in chosen])
            if normalize:
                wt = wt / wt.sum()
        ids.append(chosen)
        weights.append(wt * scaling_factor)
    T = len(ids)
    kept = [[True] * k for _ in range(T)]
    cap = reference_capacity(T, k, E, capacity_factor, min_capacity)
    if cap is not None:
        for e in range(E):
            routes = [(s * T + t, t, s) for s in range(k) for t in range(T) if ids[t][s] == e]
            if drop_policy == "probs":
                routes.sort(key=lambda r: (-float(weights[r[1]][r[2]].detach()), r[0]))
            else:
                routes.sort()
            for _, t, s in routes[cap:]:
                kept[t][s] = False
    return ids, weights, kept


def moe_per_token(x_TD: torch.Tensor, w: dict, activation: str = "gelu", *, score_before_experts: bool = False,
                  activation_limit: float = 7.0, activation_alpha: float = 1.702,
                  **route_kw) -> tuple[torch.Tensor, list]:
    """y [T, D] float64 = sum over kept routes of weight x expert(x) (score_before_experts:
    of expert(weight x x), Llama 4's order) (+ shared experts, gated by ``w['shared_gate']``
    when set); also the routing ``(ids, kept)``."""
    ids, weights, kept = route_per_token(x_TD, w, **route_kw)
    rows = []
    for t in range(x_TD.shape[0]):
        x = x_TD[t].double()
        y = torch.zeros(x.shape[0], dtype=torch.float64)
        for s, e in enumerate(ids[t]):
            if not kept[t][s]:
                continue
            p = w["experts"][e]
            if score_before_experts:
                y = y + expert_ffn(weights[t][s] * x, p, activation, activation_limit, activation_alpha)
            else:
                y = y + weights[t][s] * expert_ffn(x, p, activation, activation_limit, activation_alpha)
        if w["shared"] is not None:
            y = y + shared_ffn(x, w["shared"], activation, w.get("shared_gate"))
        rows.append(y)
    y_TD = torch.stack(rows) if rows else torch.zeros(0, x_TD.shape[1], dtype=torch.float64)
    return y_TD, (ids, kept)


ROUTE_KEYS = ("k", "score_func", "normalize_weights", "scaling_factor", "capacity_factor", "min_capacity",
              "drop_policy")


def route_options(kw: dict, training: bool = True) -> dict:
    """The per-token reference's routing options from MoE keyword options ``kw``."""
    out = {key: kw[key] for key in ROUTE_KEYS if key in kw}
    out.setdefault("k", 2)
    if not training and kw.get("eval_capacity_factor") is not None:
        out["capacity_factor"] = kw["eval_capacity_factor"]
    return out


def grads_of(w: dict) -> dict[str, torch.Tensor]:
    """The reference's weight gradients under the layer's parameter names (full tensors)."""
    out = {"router.weight": w["router"].grad}
    if w.get("router_bias") is not None:
        out["router.bias"] = w["router_bias"].grad
    for n in w["experts"][0]:
        out[f"experts.{n}"] = torch.stack([p[n].grad if p[n].grad is not None else torch.zeros_like(p[n])
                                           for p in w["experts"]])
    if w["shared"] is not None:
        for n, p in w["shared"].items():
            out[f"shared.{n}.weight"] = p.grad
    if w.get("shared_gate") is not None:
        out["shared.gate.weight"] = w["shared_gate"].grad
    return out


# Nonzero expert bias, large enough against scores ~1/E to change the selection.
EXPERT_BIAS = [0.3, -0.2, 0.1, 0.0, -0.1, 0.25, 0.05, -0.3]


def layer_kw(case):
    """MoE keyword options of a test case: aux loss off unless the case sets it."""
    kw = dict(case)
    kw.setdefault("aux_loss", None)   # the reference compares y and its gradients only
    return kw


def set_expert_bias(moe):
    """EXPERT_BIAS into a layer built with expert_bias=True (a no-op otherwise)."""
    if moe.router.expert_bias is not None:
        with torch.no_grad():
            moe.router.expert_bias.copy_(torch.tensor(EXPERT_BIAS[:moe.num_experts]))


def per_token_reference(kw, xs, gs, training=True):
    """Per-token reference over the replicas' batches ``xs`` (gradients summed over them):
    ([y_d], [dx_d], full weight grads, weights, routings)."""
    single = build(None, **kw)
    set_expert_bias(single)
    w = full_weights(single)
    ys, dxs, routings = [], [], []
    for x, g in zip(xs, gs):
        x = x.double().clone().requires_grad_()
        layer_opts = {n: kw[n] for n in ("score_before_experts", "activation_limit", "activation_alpha") if n in kw}
        y, routing = moe_per_token(x, w, kw.get("activation", "gelu"), **layer_opts, **route_options(kw, training))
        (y * g.double()).sum().backward()
        ys.append(y.detach())
        dxs.append(x.grad)
        routings.append(routing)
    return ys, dxs, grads_of(w), w, routings


def grad_ratios(moe, ref_grads, state, dtype=torch.float32):
    """error_ratio of each of this rank's weight grads against its slice of the reference's."""
    out = {}
    for name, p in moe.named_parameters():
        ref = ref_grads.get(name)
        if ref is None:
            out[name] = float("inf")   # a parameter the reference does not know
            continue
        out[name] = error_ratio(p.grad, local_slice(ref, p, state), dtype)
    return out

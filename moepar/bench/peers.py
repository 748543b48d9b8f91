"""Optional adapters to other MoE implementations, built with moepar's weights, so that
``bench layer`` and ``bench dispatch`` can time them on the same inputs.

Nothing here is a dependency: each peer is imported lazily, and ``*_status()`` says
why it is absent ("not importable: ...") instead of raising. Supported peers:

* DeepSpeed-MoE (``deepspeed.moe.layer.MoE``): gate ``wg`` = moepar's router weight, one
  ``nn.Module`` FFN per expert (D -> F, act, F -> D, no bias; the weights of moepar's
  expert, transposed into ``nn.Linear`` layout). Its own defaults otherwise (capacity
  factor 1.0, random token selection, second-expert sampling for k=2, min_capacity 4).
  It needs ``torch.distributed``: a one-process gloo group is created when none exists.
* torchtitan's MoE (``torchtitan.models.common.moe.MoE``, torchtitan 0.3.0): its top-k router
  (gate ``nn.Linear`` [E, D] in fp32, softmax or sigmoid scores, ``torch.topk``), its
  ``GroupedExperts`` (SwiGLU only, ``torch._grouped_mm`` in bf16 whatever the layer's dtype)
  and its ``LocalTokenDispatcher`` (argsort, gather, scatter-add; ep = 1, no capacity).
  ``TorchTitanMoE`` holds moepar's weights; ``torchtitan_gap`` says what it cannot hold.
* Megatron-Core MoE: ``megatron_status`` says whether ``megatron.core`` imports; no adapter
  is wired, because its MoE layer needs CUDA (checked with megatron-core 0.16.1 on the CPU:
  the router's gating calls ``torch.cuda.current_device()`` and the all-to-all token
  dispatcher creates a ``torch.cuda.Stream``), so the tables give the reason instead.

Legend: T tokens, D hidden, F ffn hidden, E experts, L local experts, K top-k.
"""
from __future__ import annotations

import importlib
import logging
import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _import(name: str):
    if name == "deepspeed" and not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")   # else it probes for CUDA and fails
    module = importlib.import_module(name)
    if name == "deepspeed" and not torch.cuda.is_available():
        # Its CPU shared-memory all-reduce kernel, which only its inference all-reduce uses,
        # would otherwise be compiled when its comm backend starts (a minute of a core).
        module.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return module


def deepspeed_status() -> tuple[bool, str]:
    """(importable, version or the reason it is not)."""
    try:
        ds = _import("deepspeed")
        _import("deepspeed.moe.layer")
    except Exception as e:   # ImportError, or a broken install raising anything at import
        return False, f"not importable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return True, f"deepspeed {ds.__version__}"


def megatron_status() -> tuple[bool, str]:
    """Megatron-Core is only reported on: its MoE token dispatchers are CUDA-only."""
    try:
        mc = _import("megatron.core")
    except Exception as e:
        return False, f"not importable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    version = getattr(mc, "__version__", "?")
    if not torch.cuda.is_available():
        return False, (f"megatron.core {version} imports, but its MoE layer needs CUDA (router gating calls "
                       f"torch.cuda.current_device()); not run")
    return False, f"megatron.core {version} imports; no adapter is wired yet (not run)"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group() -> None:
    """DeepSpeed's communication backend over torch.distributed: on the existing process
    group when there is one (under torchrun), else a one-process gloo world (DeepSpeed
    needs one even for ep=1)."""
    ds = _import("deepspeed")
    if not dist.is_initialized() and os.environ.get("WORLD_SIZE", "1") == "1":
        # A fresh port every time: a child process inherits its parent's environment.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    if not ds.comm.is_initialized():
        ds.init_distributed(dist_backend="gloo", verbose=False)


class _FFN(nn.Module):
    """One expert as DeepSpeed expects it: an nn.Module on [..., D]."""

    def __init__(self, hidden: int, ffn_hidden: int, activation: str, dtype):
        super().__init__()
        self.activation = activation
        self.fc1 = nn.Linear(hidden, ffn_hidden, bias=False, dtype=dtype)
        self.fc3 = nn.Linear(hidden, ffn_hidden, bias=False, dtype=dtype) if activation == "swiglu" else None
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.activation == "swiglu":
            h = F.silu(h) * self.fc3(x)
        else:
            h = F.gelu(h) if self.activation == "gelu" else F.relu(h)
        return self.fc2(h)


class DeepSpeedMoE(nn.Module):
    """``deepspeed.moe.layer.MoE`` holding moepar's weights; ``forward(x) -> (y, aux)``
    where aux is DeepSpeed's l_aux times moepar's aux_loss_coeff."""

    def __init__(self, moe, drop_tokens: bool, capacity_factor: float = 1.0, min_capacity: int = 4):
        super().__init__()
        ok, why = deepspeed_status()
        if not ok:
            raise ImportError(f"DeepSpeed {why}")
        ensure_process_group()
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        layer = _import("deepspeed.moe.layer")
        ex = moe.experts
        if ex.bias or ex.etp_size != 1 or moe.shared is not None:
            raise ValueError("the DeepSpeed adapter covers experts without bias, etp=1, no shared experts")
        dtype = ex.w1.dtype
        expert = _FFN(moe.hidden, ex.ffn_hidden, ex.activation, dtype)
        self.coeff = moe.router.config.aux_loss_coeff
        self.inner = layer.MoE(moe.hidden, expert=expert, num_experts=moe.num_experts, ep_size=moe.ep,
                               k=moe.k, capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor,
                               min_capacity=min_capacity, drop_tokens=drop_tokens)
        self.inner.set_deepspeed_parallelism()
        with torch.no_grad():
            self.inner.deepspeed_moe.gate.wg.weight.copy_(moe.router.weight)
            for e, m in enumerate(self.inner.deepspeed_moe.experts.deepspeed_experts):
                m.fc1.weight.copy_(ex.w1[e].t())
                m.fc2.weight.copy_(ex.w2[e].t())
                if m.fc3 is not None:
                    m.fc3.weight.copy_(ex.w3[e].t())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, l_aux, _ = self.inner(x)
        return y, self.coeff * l_aux


# ---- torchtitan ----------------------------------------------------------------------------
TITAN_MOE = "torchtitan.models.common.moe"


def _reason(e: Exception) -> str:
    return f"not importable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def torchtitan_status() -> tuple[bool, str]:
    """(importable, version or the reason it is not): whether torchtitan's MoE imports."""
    try:
        _import(TITAN_MOE)
        from importlib.metadata import version
        return True, f"torchtitan {version('torchtitan')}"
    except Exception as e:   # ImportError, or a partial install raising anything at import
        return False, _reason(e)


def torchtitan_gap(moe) -> str | None:
    """Why ``TorchTitanMoE`` cannot compute what ``moe`` computes (None: it can). torchtitan's
    local MoE has SwiGLU experts without bias, softmax or sigmoid scores (top-k of the scores,
    plus an expert bias for selection only, optionally renormalised and scaled), no capacity,
    no expert TP, one rank."""
    cfg, r = moe.config, moe.router.config
    gaps = []
    if moe.experts.activation != "swiglu":
        gaps.append(f"activation={moe.experts.activation!r} (torchtitan's experts are SwiGLU only)")
    if moe.experts.bias:
        gaps.append("expert bias (torchtitan's experts have none)")
    if moe.ep != 1 or moe.etp != 1:
        gaps.append(f"ep={moe.ep}, etp={moe.etp} (the adapter builds torchtitan's local dispatcher)")
    if moe.shared is not None:
        gaps.append("shared experts")
    if r.score_func not in ("softmax", "sigmoid"):
        gaps.append(f"score_func={r.score_func!r}")
    if r.capacity_factor is not None or r.expert_capacity is not None:
        gaps.append("a capacity (torchtitan's local MoE is dropless)")
    if r.num_groups is not None:
        gaps.append("group-limited routing")
    if r.noisy_gate_policy is not None:
        gaps.append(f"noisy_gate_policy={r.noisy_gate_policy!r}")
    if cfg.hf.score_before_experts:
        gaps.append("scores applied before the experts")
    return "; ".join(gaps) or None


def _gate_in_fp32(module, args):
    # torchtitan runs its gate inside torch.autocast(dtype=float32), which torch enables on
    # CUDA only ("CPU autocast only supports bf16/fp16"; without a CUDA runtime it is
    # disabled too): where it is off, cast the input as that region would, so that the gate
    # runs in fp32 as it does on a GPU (and as moepar's router does).
    x = args[0]
    if torch.is_autocast_enabled(x.device.type):
        return None
    return (x.float(),) + tuple(args[1:])


class TorchTitanMoE(nn.Module):
    """torchtitan's ``MoE`` holding moepar's weights: gate = moepar's router weight (fp32,
    [E, D], ``nn.Linear`` layout), ``w1_EFD``/``w3_EFD``/``w2_EDF`` = moepar's ``w1``/``w3``/
    ``w2`` transposed, in the layer's dtype; moepar's expert bias (if any) as torchtitan's
    ``expert_bias_E`` (its load balancing, ``load_balance_coeff`` 1e-3), else none.
    ``forward(x [..., D]) -> y [..., D]`` (torchtitan has no aux loss: ``aux_loss`` is None).

    Where the routing rules coincide (softmax or sigmoid scores, top-k, the same
    normalisation and scale, no capacity), both compute the same function but for rounding:
    torchtitan's experts cast rows and weights to bf16 for ``torch._grouped_mm`` whatever the
    layer's dtype, it breaks ties in ``torch.topk``'s order (moepar: the lower index), and its
    combine scales each route's rows in fp32, rounds them to the layer's dtype and sums them
    in it (moepar sums the k routes before rounding)."""

    aux_loss = None

    def __init__(self, moe):
        super().__init__()
        ok, why = torchtitan_status()
        if not ok:
            raise ImportError(f"torchtitan {why}")
        gap = torchtitan_gap(moe)
        if gap is not None:
            raise ValueError(f"the torchtitan adapter cannot hold this layer: {gap}")
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import MoE, GroupedExperts, RoutedExperts, TokenChoiceTopKRouter
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
        from moepar.moe.routing.router import normalizes
        r, ex = moe.router.config, moe.experts
        D, E, F_, K = moe.hidden, moe.num_experts, ex.ffn_hidden, moe.k
        router = TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=D, out_features=E, bias=r.bias), top_k=K,
            score_func=r.score_func, route_norm=normalizes(r), route_scale=r.scaling_factor)
        experts = RoutedExperts.Config(inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F_, num_experts=E),
                                       token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K))
        config = MoE.Config(num_experts=E, router=router, routed_experts=experts,
                            load_balance_coeff=1e-3 if r.expert_bias else None)
        device = moe.router.weight.device
        with torch.device(device):
            self.inner = config.build()
        dtype = ex.w1.dtype
        inner = self.inner.routed_experts.inner_experts
        with torch.no_grad():
            self.inner.router.gate.weight.copy_(moe.router.weight)
            if r.bias:
                self.inner.router.gate.bias.copy_(moe.router.bias)
            for name, src in (("w1_EFD", ex.w1), ("w3_EFD", ex.w3), ("w2_EDF", ex.w2)):
                setattr(inner, name, nn.Parameter(src.detach().transpose(1, 2).contiguous().to(dtype)))
            if r.expert_bias:
                self.inner.expert_bias_E.copy_(moe.router.expert_bias)
            self.inner.tokens_per_expert_E.zero_()
        if not (device.type == "cuda" and torch.cuda.is_available()):
            self.inner.router.gate.register_forward_pre_hook(_gate_in_fp32)
            # torch's note at every call that it turned the region off: the hook stands in for it
            warnings.filterwarnings("ignore", "In CPU autocast, but the target dtype is not supported",
                                    UserWarning)
        self.train(moe.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.reshape(1, -1, x.shape[-1])).reshape(x.shape)


def compare_with_moepar(moe, peer: TorchTitanMoE, x: torch.Tensor, g: torch.Tensor) -> dict:
    """One forward + backward of both on ``x`` (output gradient ``g``): the relative errors
    ``|a - b| / |b|`` (Frobenius norms) of torchtitan's output and input gradient against
    moepar's, and on how many tokens their routers pick the same set of experts."""
    xa, xb = x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
    ya, yb = moe(xa), peer(xb)
    (dxa,) = torch.autograd.grad(ya, xa, g)
    (dxb,) = torch.autograd.grad(yb, xb, g)
    with torch.no_grad():
        x_TD = x.detach().reshape(-1, x.shape[-1])
        ids_a = moe.router(x_TD, count=False).expert_ids.sort(-1).values
        inner = peer.inner
        ids_b = inner.router(x_TD.unsqueeze(0), inner.expert_bias_E)[1].reshape(ids_a.shape).sort(-1).values

    def rel(a, b):
        b = b.detach().double()
        return float((a.detach().double() - b).norm() / b.norm().clamp_min(1e-30))
    return {"rel_err_y": rel(yb, ya), "rel_err_dx": rel(dxb, dxa), "tokens": ids_a.shape[0],
            "same_experts": int((ids_a == ids_b).all(-1).sum())}

"""Optional adapters to other MoE implementations, built with moepar's weights, so that
``bench layer`` and ``bench dispatch`` can time them on the same inputs.

Nothing here is a dependency: each peer is imported lazily, and ``*_status()`` says
why it is absent ("not importable: ...") instead of raising. Supported peers:

* DeepSpeed-MoE (``deepspeed.moe.layer.MoE``): gate ``wg`` = moepar's router weight, one
  ``nn.Module`` FFN per expert (D -> F, act, F -> D, no bias; the weights of moepar's
  expert, transposed into ``nn.Linear`` layout). Its own defaults otherwise (capacity
  factor 1.0, random token selection, second-expert sampling for k=2, min_capacity 4).
  It needs ``torch.distributed``: a one-process gloo group is created when none exists.
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

"""What the DeepSpeed tests share: a small model with every kind of moepar parameter, each
data-parallel rank's batches, DeepSpeed configs, and the slow obvious reference (moepar's
own data-parallel path: ``allreduce_gradients``, ``clip_grad_norm_``, a torch optimizer).

The model: x -> x + Row(gelu(Column(x))) (TP-sliced dense), LayerNorm (replicated dense),
x + MoE(x) (router replicated, experts sliced over EP; aux and z losses), a linear head;
the loss is the mean squared error plus ``moepar.aux_loss``.

Legend: T tokens per data-parallel rank, D hidden, E experts.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

import moepar

T, D, E, FFN = 6, 8, 4, 16
LR = {"sgd": 0.5, "adamw": 0.05}
CLIP = 0.05   # below the gradient norms of these steps: clipping acts on every step


def quiet_deepspeed():
    """Import DeepSpeed for a test: its logger at errors only, and its CPU shared-memory
    all-reduce kernel marked unavailable, so that starting its comm backend does not
    compile it (a minute of a core on a fresh machine); only DeepSpeed's inference
    all-reduce uses that kernel, and no test runs it."""
    import deepspeed
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


class Net(nn.Module):
    """``recompute``: None, or a function ``recompute(block, h)`` that runs the MoE block
    (norm, MoE, head) under an activation checkpoint (DeepSpeed's)."""

    def __init__(self, state, recompute=None, **moe_kw):
        super().__init__()
        self.recompute = recompute
        self.inp = moepar.ColumnParallelLinear(D, 2 * D, init_seed=1, state=state)
        self.out = moepar.RowParallelLinear(2 * D, D, init_seed=2, state=state)
        self.norm = nn.LayerNorm(D)
        self.moe = moepar.MoE(D, E, state.ep_size, k=2, ffn_hidden=FFN, state=state, init_seed=3,
                              aux_loss_coeff=1e-2, z_loss_coeff=1e-3, **moe_kw)
        self.head = nn.Linear(D, 1)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=gen) * 0.3)
            self.norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=gen))

    def forward(self, x_TD):
        h = x_TD + self.out(F.gelu(self.inp(x_TD)))
        return self._moe_block(h) if self.recompute is None else self.recompute(self._moe_block, h)

    def _moe_block(self, h_TD):
        h_TD = self.norm(h_TD)
        return self.head(h_TD + self.moe(h_TD)).squeeze(-1)


def batch(step: int, state, dtype=torch.float32):
    """This data-parallel rank's T rows of step ``step``'s global batch (dp x T rows)."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(state.dp_size * T, D, generator=gen)
    y = torch.randn(state.dp_size * T, generator=gen)
    rows = slice(state.dp_rank * T, (state.dp_rank + 1) * T)
    return x[rows].to(dtype), y[rows].to(dtype)


def loss_of(model, inner, x, y):
    """The task loss plus every MoE layer's aux and z losses (``inner``: the bare module)."""
    return F.mse_loss(model(x).float(), y.float()) + moepar.aux_loss(inner)


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)
    return torch.optim.AdamW(params, lr=LR["adamw"], weight_decay=0.1)


def config(stage: int, clip: float = CLIP, bf16: bool = False, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": T, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10 ** 9}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


def reference(state, kind: str, steps: int, clip: float = CLIP, init: dict | None = None):
    """moepar's own path: (initial state dict, parameters after ``steps``, the gradient norms)."""
    model = Net(state)
    if init is not None:
        model.load_state_dict(init)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(kind, model.parameters())
    norms = []
    for step in range(steps):
        x, y = batch(step, state)
        loss_of(model, model, x, y).backward()
        moepar.allreduce_gradients(model, state)
        norms.append(float(moepar.clip_grad_norm_(model, clip, state)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return init, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def reference_bf16(state, kind: str, steps: int, init: dict, clip: float = CLIP):
    """moepar's own path in bf16 with fp32 master weights (what DeepSpeed's bf16 ZeRO keeps):
    the bf16 model's gradients reduced by ``allreduce_gradients``, then in fp32 on the
    masters (an fp32 copy of the model) clipped by ``clip_grad_norm_`` and stepped, and copied
    back. Returns the masters after ``steps``."""
    model, master = Net(state), Net(state)
    model.load_state_dict(init)
    model.to(torch.bfloat16)
    master.load_state_dict(model.state_dict())   # as DeepSpeed's: the masters start from the bf16 weights
    opt = make_optimizer(kind, master.parameters())
    for step in range(steps):
        loss_of(model, model, *batch(step, state, torch.bfloat16)).backward()
        moepar.allreduce_gradients(model, state)
        for p, m in zip(model.parameters(), master.parameters()):
            m.grad, p.grad = p.grad.float(), None
        moepar.clip_grad_norm_(master, clip, state)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(model.parameters(), master.parameters()):
                p.copy_(m)
    return {n: p.detach().clone() for n, p in master.named_parameters()}


def train_engine(engine, steps: int, start: int = 0, dtype=torch.float32) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, engine.parallel_state if hasattr(engine, "parallel_state") else moepar.get_parallel_state(),
                     dtype)
        loss = loss_of(engine, engine.module, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def max_diff(params: dict, module: nn.Module) -> float:
    return max(float((params[n] - p.detach().float()).abs().max()) for n, p in module.named_parameters())

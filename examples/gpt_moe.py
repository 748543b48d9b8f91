"""A nanoGPT-sized GPT whose feed-forward blocks are moepar MoE layers.

Megatron-style tensor parallelism for everything dense: attention heads split over the TP
group (QKV column-parallel, output row-parallel), dense MLPs column -> row parallel,
vocabulary-parallel embedding and loss. Optional sequence parallelism: the residual
stream holds this TP rank's slice of the sequence (dim 1 of [B, S, D]), all-gathered
before each column-parallel linear and reduce-scattered after each row-parallel one.
Built on moepar's public API only.

Legend: B batch, S sequence, D hidden, H heads (Hl per TP rank), V vocabulary.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import moepar


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256          # byte-level tokens
    context: int = 128
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    experts: int = 8
    topk: int = 2
    moe_every: int = 1             # 1: every block is MoE; 2: every other block
    expert_ffn: int = 256
    dense_ffn: int = 512
    capacity_factor: float | None = None
    aux_loss_coeff: float = 1e-2
    aux_loss_scope: str = "global"  # balance over the global batch: same curve at any dp size
    z_loss_coeff: float = 1e-3
    sequence_parallel: bool = False
    checkpoint_activations: bool = False
    cpu_source_major: bool = False  # ExchangeConfig.cpu_source_major: a CPU/gloo-only speed option
    dispatch_dtype: str | None = None   # ExchangeConfig.dispatch_dtype: "fp8" for FP8 dispatch rows
    redundant_experts: int = 0   # ExchangeConfig.redundant_experts: copies of hot experts (moepar.rebalance)
    init_seed: int = 1234

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.moe_every < 1:
            raise ValueError(f"moe_every={self.moe_every} must be >= 1")


class LayerNorm(nn.LayerNorm):
    """LayerNorm whose params see only local tokens under SP: grads summed over TP."""

    def __init__(self, dim: int, sequence_parallel: bool):
        super().__init__(dim)
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, state: moepar.ParallelState, seed: int):
        super().__init__()
        tp = state.tp_size
        if cfg.heads % tp:
            raise ValueError(f"heads={cfg.heads} is not divisible by tensor_parallel_size={tp}")
        self.heads_local, self.head_dim = cfg.heads // tp, cfg.hidden // cfg.heads
        kw = dict(state=state, sequence_parallel=cfg.sequence_parallel, sequence_dim=1)
        # q, k and v as separate column-parallel linears: each TP rank owns whole heads.
        self.q = moepar.ColumnParallelLinear(cfg.hidden, cfg.hidden, init_seed=seed, init_std=0.02, **kw)
        self.k = moepar.ColumnParallelLinear(cfg.hidden, cfg.hidden, init_seed=seed + 1, init_std=0.02, **kw)
        self.v = moepar.ColumnParallelLinear(cfg.hidden, cfg.hidden, init_seed=seed + 2, init_std=0.02, **kw)
        self.proj = moepar.RowParallelLinear(cfg.hidden, cfg.hidden, init_seed=seed + 3,
                                             init_std=0.02 / math.sqrt(2 * cfg.layers), **kw)
        self.recompute = cfg.checkpoint_activations

    def _core(self, q, k, v):
        B, S, _ = q.shape
        q, k, v = (t.view(B, S, self.heads_local, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(B, S, -1)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        # Recompute only the local attention core: no collective is re-run in backward.
        y = checkpoint(self._core, q, k, v, use_reentrant=False) if self.recompute else self._core(q, k, v)
        return self.proj(y)


class DenseMLP(nn.Module):
    def __init__(self, cfg: GPTConfig, state: moepar.ParallelState, seed: int):
        super().__init__()
        kw = dict(state=state, sequence_parallel=cfg.sequence_parallel, sequence_dim=1)
        self.fc1 = moepar.ColumnParallelLinear(cfg.hidden, cfg.dense_ffn, init_seed=seed, init_std=0.02, **kw)
        self.fc2 = moepar.RowParallelLinear(cfg.dense_ffn, cfg.hidden, init_seed=seed + 1,
                                            init_std=0.02 / math.sqrt(2 * cfg.layers), **kw)
        self.recompute = cfg.checkpoint_activations

    def forward(self, x):
        h = self.fc1(x)
        h = checkpoint(F.gelu, h, use_reentrant=False) if self.recompute else F.gelu(h)
        return self.fc2(h)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, state: moepar.ParallelState, index: int):
        super().__init__()
        seed = cfg.init_seed + 100 * (index + 1)
        self.ln1 = LayerNorm(cfg.hidden, cfg.sequence_parallel)
        self.attn = Attention(cfg, state, seed)
        self.ln2 = LayerNorm(cfg.hidden, cfg.sequence_parallel)
        self.is_moe = index % cfg.moe_every == cfg.moe_every - 1
        if self.is_moe:
            self.ffn = moepar.MoE(
                cfg.hidden, cfg.experts, state.ep_size, k=cfg.topk, ffn_hidden=cfg.expert_ffn,
                capacity_factor=cfg.capacity_factor, aux_loss_coeff=cfg.aux_loss_coeff,
                z_loss_coeff=cfg.z_loss_coeff, aux_loss_scope=cfg.aux_loss_scope,
                expert_tensor_parallel_size=state.etp_size,
                sequence_parallel=cfg.sequence_parallel, state=state, init_seed=seed + 50, init_std=0.02,
                recompute_experts=cfg.checkpoint_activations, cpu_source_major=cfg.cpu_source_major,
                dispatch_dtype=cfg.dispatch_dtype, redundant_experts=cfg.redundant_experts)
        else:
            self.ffn = DenseMLP(cfg, state, seed + 50)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class GPT(nn.Module):
    """The whole model, or with ``stage=(index, num_stages)`` one pipeline stage of it: the
    embedding on stage 0, ``layers / num_stages`` consecutive blocks (in a ModuleDict keyed
    by their index in the whole model, so parameter names are the whole model's), the
    final norm and head on the last stage. Every part is initialised as in the whole model.
    A ``stage`` that is not such a pair (``0 <= index < num_stages <= layers``, integers,
    ``num_stages`` dividing ``layers``) is refused by name before anything is built."""

    def __init__(self, cfg: GPTConfig, state: moepar.ParallelState | None = None,
                 stage: tuple[int, int] | None = None):
        super().__init__()
        if stage is not None:
            from moepar.parallel.pipeline import check_stage
            if not isinstance(stage, (tuple, list)) or len(stage) != 2:
                raise ValueError(f"stage={stage!r} must be a pair (index, num_stages)")
            check_stage(stage[0], stage[1], cfg.layers)
        state = state if state is not None else moepar.get_parallel_state()
        self.cfg, self.state = cfg, state
        if cfg.sequence_parallel and cfg.context % state.tp_size:
            raise ValueError(f"context={cfg.context} is not divisible by tensor_parallel_size="
                             f"{state.tp_size} (sequence parallelism splits the sequence)")
        index, num_stages = stage if stage is not None else (0, 1)
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        # checked by moepar.Pipeline against the stage it runs this module as
        self.pipeline_stage = (index, num_stages) if stage is not None else None
        if self.is_first:
            self.embed = moepar.VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, init_seed=cfg.init_seed,
                                                       sequence_parallel=cfg.sequence_parallel,
                                                       sequence_dim=1, state=state)
            gen = torch.Generator().manual_seed(cfg.init_seed + 1)
            pos = torch.randn(cfg.context, cfg.hidden, generator=gen) * 0.02
            if cfg.sequence_parallel:
                n = cfg.context // state.tp_size
                pos = pos[state.tp_rank * n:(state.tp_rank + 1) * n]
            self.pos = nn.Parameter(pos.clone())
            self.pos.tensor_model_parallel = cfg.sequence_parallel  # sliced by sequence under SP
            self.pos.partition_dim = 0
        if stage is None:
            self.blocks = nn.ModuleList(Block(cfg, state, i) for i in range(cfg.layers))
        else:
            from moepar.parallel.pipeline import layer_range
            self.blocks = nn.ModuleDict({str(i): Block(cfg, state, i)
                                         for i in layer_range(index, num_stages, cfg.layers)})
        if self.is_last:
            self.ln_f = LayerNorm(cfg.hidden, cfg.sequence_parallel)
            self.head = moepar.ColumnParallelLinear(cfg.hidden, cfg.vocab_size, bias=False, init_std=0.02,
                                                    init_seed=cfg.init_seed + 2, state=state,
                                                    sequence_parallel=cfg.sequence_parallel, sequence_dim=1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx [B, S] -> vocab-parallel logits [B, S, V/tp], or the mean loss with targets.
        A pipeline stage takes idx on stage 0, else the previous stage's [B, S(/tp), D], and
        returns [B, S(/tp), D] except on the last stage."""
        x = idx
        if self.is_first:
            B, S = idx.shape
            if S > self.cfg.context:
                raise ValueError(f"sequence length {S} exceeds context={self.cfg.context}")
            x = self.embed(idx)                   # [B, S(/tp under SP), D]
            x = x + self.pos[: x.shape[1]]
        blocks = self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks
        for block in blocks:
            x = block(x)
        if not self.is_last:
            return x
        logits = self.head(self.ln_f(x))          # [B, S, V/tp] (SP: sequence gathered)
        if targets is None:
            return logits
        return self.loss(logits, targets)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of vocab-parallel ``logits`` (the pipeline's loss function)."""
        return moepar.vocab_parallel_cross_entropy(logits, targets, state=self.state)

    def stage_shapes(self, batch: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensors shaped like this stage's input and output for ``batch`` sequences of
        ``context`` tokens (torch's static stage shapes; ``dtype``: the activations')."""
        cfg, tp = self.cfg, self.state.tp_size
        seq = cfg.context // tp if cfg.sequence_parallel else cfg.context
        # requires_grad: a gradient of the same shape crosses the boundary backwards
        hidden = torch.empty(batch, seq, cfg.hidden, dtype=dtype, requires_grad=True)
        x = torch.empty(batch, cfg.context, dtype=torch.long) if self.is_first else hidden
        y = (torch.empty(batch, cfg.context, cfg.vocab_size // tp, dtype=dtype, requires_grad=True)
             if self.is_last else hidden)
        return x, y

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 top_k: int = 20, seed: int = 0) -> torch.Tensor:
        """Sample ``new_tokens`` bytes after ``prompt`` [1, S]. Every rank runs it with the
        same seed (the layers' collectives need all ranks) and gets the same tokens."""
        gen = torch.Generator(device=prompt.device).manual_seed(seed)   # multinomial draws on the logits' device
        idx = prompt
        for _ in range(new_tokens):
            window = idx[:, -self.cfg.context:]
            if self.cfg.sequence_parallel:  # SP needs a sequence divisible by tp: left-pad
                pad = (-window.shape[1]) % self.state.tp_size
                window = F.pad(window, (pad, 0), value=ord(" "))
            logits = self.full_logits(self(window)[:, -1, :]).float() / temperature
            top = torch.topk(logits, top_k).values[:, -1:]
            probs = torch.softmax(logits.masked_fill(logits < top, float("-inf")), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)], dim=1)
        return idx

    def full_logits(self, logits_parallel: torch.Tensor) -> torch.Tensor:
        from moepar.parallel.comm import all_gather_rows
        if self.state.tp_size == 1:
            return logits_parallel
        parts = all_gather_rows(logits_parallel.movedim(-1, 0).contiguous(), self.state.tp_group)
        return parts.movedim(0, -1)

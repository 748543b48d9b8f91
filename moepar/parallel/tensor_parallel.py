"""Tensor-parallel layers (Megatron style): column/row-sliced linears, vocab-parallel
embedding and cross-entropy.

Every weight is cut from the full master weight, drawn on the CPU with the given
``init_seed`` (or the default RNG), so models built with the same seed at TP=1 and TP=n hold
the same global weights. Each layer's ``reset_parameters()`` draws it (its ``__init__`` calls
it), writing through ``copy_local``: a layer built on the meta device takes, after ``to_empty``
and ``reset_parameters()``, exactly the values of one built directly, sharded by FSDP2 or not.

Collectives per call, bytes per rank (legend, docs/moe.md: T tokens, D hidden, b bytes per
element; ``in`` / ``out`` a layer's input / output features, written in words):
ColumnParallel: bwd all-reduce of dx [T, in] (or SP: fwd all-gather / bwd reduce-scatter of x);
RowParallel: fwd all-reduce of y [T, out] (or SP: fwd reduce-scatter / bwd all-gather).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import comm, regions
from .fsdp import copy_local
from .groups import ParallelState, get_parallel_state


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={parts}")
    return total // parts


def _master(shape: tuple[int, ...], fan_in: int, init_std: float | None,
            init_seed: int | None, is_bias: bool = False) -> torch.Tensor:
    """The full (unsliced) parameter, identical on every rank for a given seed (drawn on the
    CPU, whatever the default device: the seeded generator is a CPU one)."""
    gen = None
    if init_seed is not None:
        gen = torch.Generator().manual_seed(init_seed + (7919 if is_bias else 0))
    out = torch.empty(shape, device="cpu")
    if init_std is None:  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        bound = 1.0 / math.sqrt(fan_in)
        return out.uniform_(-bound, bound, generator=gen)
    if is_bias:
        return out.zero_()
    return out.normal_(0.0, init_std, generator=gen)


class _TPModule(nn.Module):
    def _setup(self, state: ParallelState | None) -> None:
        self.state = state if state is not None else get_parallel_state()
        self.tp_size = self.state.tp_size
        self.tp_rank = self.state.tp_rank

    @property
    def group(self):
        """The TP group, read from the parallel state at call time (never cached in the module,
        so that destroy_parallel() can free it)."""
        return self.state.tp_group

    @staticmethod
    def _mark_sliced(p: torch.Tensor | None, dim: int) -> None:
        """Megatron's markers on a parameter sliced along ``dim`` (not replicated), read by the
        gradient sync, FSDP and checkpoints. Set by ``reset_parameters``: ``to_empty`` makes
        new parameters without them."""
        if p is not None:
            p.tensor_model_parallel, p.partition_dim = True, dim


class ColumnParallelLinear(_TPModule):
    """y = x weight^T + bias with the weight split by output rows: each rank holds
    ``out_features/tp`` outputs.

    ``gather_output`` all-gathers y to full width; otherwise y stays sliced (feed it to a
    ``RowParallelLinear`` with ``input_is_parallel=True``). ``sequence_parallel`` means x
    arrives split along ``sequence_dim`` and is all-gathered first.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, sequence_parallel: bool = False, sequence_dim: int = 0,
                 init_std: float | None = None, init_seed: int | None = None,
                 state: ParallelState | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self._setup(state)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = _divide(out_features, self.tp_size, "out_features")
        self.gather_output, self.sequence_parallel, self.sequence_dim = gather_output, sequence_parallel, sequence_dim
        self.init_std, self.init_seed = init_std, init_seed
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """This rank's rows of the master weight (and bias) from ``init_seed``/``init_std``:
        the construction's values (e.g. after ``to_empty`` of a layer built on the meta device)."""
        self._mark_sliced(self.weight, 0)
        self._mark_sliced(self.bias, 0)
        if self.weight.is_meta:   # built on the meta device: values come after to_empty
            return
        rows = slice(self.tp_rank * self.out_per_rank, (self.tp_rank + 1) * self.out_per_rank)
        copy_local(self.weight, _master((self.out_features, self.in_features), self.in_features,
                                        self.init_std, self.init_seed)[rows])
        if self.bias is not None:
            copy_local(self.bias, _master((self.out_features,), self.in_features, self.init_std, self.init_seed,
                                          is_bias=True)[rows])

    def forward(self, x: torch.Tensor, sequence_sizes: Sequence[int] | None = None,
                stats: comm.CommStats | None = None) -> torch.Tensor:
        """``sequence_sizes``: with sequence parallelism, every TP rank's length along
        ``sequence_dim`` where they may differ (None: all equal, Megatron's rule). ``stats``
        receives the collectives' events."""
        return self.local(self.region_input(x, sequence_sizes, stats), stats)

    def region_input(self, x: torch.Tensor, sequence_sizes: Sequence[int] | None = None,
                     stats: comm.CommStats | None = None) -> torch.Tensor:
        """The input as the TP region sees it: all-gathered along the sequence (SP), else the
        identity whose backward all-reduces the gradient. Column-parallel linears that share
        an input (a gated MLP's w1 and w3) call it once and ``local`` each."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input last dim {x.shape[-1]} != in_features={self.in_features}")
        if self.sequence_parallel:
            return regions.gather_partial_grads(x, self.group, dim=self.sequence_dim, sizes=sequence_sizes,
                                                stats=stats)
        return regions.copy_to_region(x, self.group, stats=stats)

    def local(self, x: torch.Tensor, stats: comm.CommStats | None = None) -> torch.Tensor:
        """This rank's output columns of ``region_input``'s result (gathered if asked)."""
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = regions.gather_from_region(y, self.group, dim=-1, stats=stats)
        return y


class RowParallelLinear(_TPModule):
    """y = x weight^T + bias with the weight split by input columns; partial products
    all-reduced.

    ``input_is_parallel`` means x is already sliced along its last dim (the usual case
    after a ``ColumnParallelLinear``); otherwise it is split here. With
    ``sequence_parallel`` the sum is reduce-scattered along ``sequence_dim``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, sequence_dim: int = 0,
                 init_std: float | None = None, init_seed: int | None = None,
                 state: ParallelState | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self._setup(state)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _divide(in_features, self.tp_size, "in_features")
        self.input_is_parallel, self.sequence_parallel, self.sequence_dim = (
            input_is_parallel, sequence_parallel, sequence_dim)
        self.init_std, self.init_seed = init_std, init_seed
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype))
        if bias:   # replicated: added once, after the reduction
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """This rank's columns of the master weight, and the whole bias, from
        ``init_seed``/``init_std``: the construction's values (e.g. after ``to_empty`` of a
        layer built on the meta device)."""
        self._mark_sliced(self.weight, 1)
        if self.bias is not None:
            # With SP each rank adds the bias to its own tokens only: its gradient must be
            # summed over the TP group (Megatron marks such params the same way).
            self.bias.sequence_parallel = self.sequence_parallel
        if self.weight.is_meta:   # built on the meta device: values come after to_empty
            return
        cols = slice(self.tp_rank * self.in_per_rank, (self.tp_rank + 1) * self.in_per_rank)
        copy_local(self.weight, _master((self.out_features, self.in_features), self.in_features,
                                        self.init_std, self.init_seed)[:, cols])
        if self.bias is not None:
            copy_local(self.bias, _master((self.out_features,), self.in_features, self.init_std, self.init_seed,
                                          is_bias=True))

    def forward(self, x: torch.Tensor, sequence_sizes: Sequence[int] | None = None,
                stats: comm.CommStats | None = None) -> torch.Tensor:
        """``sequence_sizes``: with sequence parallelism, every TP rank's length of the
        reduce-scattered ``sequence_dim`` where they may differ (None: all equal). ``stats``
        receives the collectives' events."""
        if not self.input_is_parallel:
            if x.shape[-1] != self.in_features:
                raise ValueError(f"input last dim {x.shape[-1]} != in_features={self.in_features}")
            x = regions.scatter_to_region(x, self.group, dim=-1, stats=stats)
        elif x.shape[-1] != self.in_per_rank:
            raise ValueError(f"input last dim {x.shape[-1]} != in_features/tp = {self.in_per_rank} "
                             f"(input_is_parallel=True expects the rank's slice)")
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = regions.reduce_scatter_to_region(y, self.group, dim=self.sequence_dim, sizes=sequence_sizes,
                                                 stats=stats)
        else:
            y = regions.reduce_from_region(y, self.group, stats=stats)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(_TPModule):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns and the
    partial embeddings are all-reduced (bytes = T*D*b), or reduce-scattered along
    ``sequence_dim`` with sequence parallelism."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_std: float | None = 0.02,
                 init_seed: int | None = None, sequence_parallel: bool = False, sequence_dim: int = 0,
                 state: ParallelState | None = None):
        super().__init__()
        self._setup(state)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = _divide(num_embeddings, self.tp_size, "num_embeddings")
        self.vocab_start = self.tp_rank * self.per_rank
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.init_std, self.init_seed = init_std, init_seed
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """This rank's rows of the full table from ``init_seed``/``init_std``: the
        construction's values (e.g. after ``to_empty`` of a layer built on the meta device)."""
        self._mark_sliced(self.weight, 0)
        if self.weight.is_meta:   # built on the meta device: values come after to_empty
            return
        std = 1.0 if self.init_std is None else self.init_std  # nn.Embedding's default is N(0, 1)
        gen = None if self.init_seed is None else torch.Generator().manual_seed(self.init_seed)
        w = torch.empty(self.num_embeddings, self.embedding_dim, device="cpu").normal_(0.0, std, generator=gen)
        copy_local(self.weight, w[self.vocab_start:self.vocab_start + self.per_rank])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"token ids must be int32/int64, got {ids.dtype}")
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        emb = F.embedding(local.masked_fill(outside, 0), self.weight)
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return regions.reduce_scatter_to_region(emb, self.group, dim=self.sequence_dim)
        return regions.reduce_from_region(emb, self.group)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split by vocab; 3 all-reduces forward (max, target logit,
    sum exp: 3*T*4 bytes), none backward: d logits = softmax - onehot(target)."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, ignore_index):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        comm.all_reduce_(local_max, group, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        local_t = target - vocab_start
        inside = (local_t >= 0) & (local_t < logits.shape[-1])
        idx = local_t.clamp(0, logits.shape[-1] - 1)
        tgt = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * inside
        comm.all_reduce_(tgt, group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce_(sum_exp, group)
        loss = sum_exp.log() - tgt
        valid = target != ignore_index
        loss = loss * valid
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, idx, inside & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, hit, valid = ctx.saved_tensors
        grad = softmax * valid.unsqueeze(-1)
        grad.scatter_add_(-1, idx.unsqueeze(-1), -hit.unsqueeze(-1).to(grad.dtype))
        return grad * g.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 state: ParallelState | None = None, reduction: str = "mean",
                                 ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy`` for logits [..., vocab/tp] split by vocab over the TP group.

    ``reduction``: "none" (per token, fp32), "sum" or "mean" (over non-ignored tokens).
    """
    state = state if state is not None else get_parallel_state()
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction={reduction!r} must be 'none', 'sum' or 'mean'")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} "
                         f"must agree on every dim but the last")
    vocab_start = state.tp_rank * logits.shape[-1]
    loss = _VocabParallelCE.apply(logits, target, state.tp_group, vocab_start, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().clamp(min=1)

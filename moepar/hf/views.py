"""transformers' expert tensors read in moepar's layouts by the grouped GEMMs, and their
gradients written back in transformers' layouts, with as few copies as each layout allows.

Legend (docs/moe.md): L local experts, D hidden, Fl the ffn slice held here.

moepar's GEMMs read w1 / w3 [L, D, Fl] and w2 [L, Fl, D]; a GEMM takes a weight with a unit
stride in either of its last two dims as it is (a transposed matrix is a BLAS flag, not a
copy). Per layout (``moepar.hf.families``):

- "fused_chunk" ([L, 2Fl, D] gate rows then up rows; down [L, D, Fl]) and "chunk_in_out"
  ([L, D, 2Fl] gate columns then up columns; down [L, Fl, D]): w1 / w3 / w2 are views (slices
  and transposes). The backward writes the weight gradients straight into views of fresh
  gradients in transformers' layouts (``grad_buffers``, handed to ``ExpertsFunction``), and
  ``SplitGateUp`` then recognises its two gradients as the halves of one fused gradient and
  returns that: no gradient is copied. Any other pair of gradients is concatenated.
- "interleaved" (GPT-OSS, gate columns 0::2, up 1::2): a stride-2 view is no GEMM operand,
  so the GEMMs read the fused ``gate_up_proj`` [L, D, 2Fl] (and its bias) as it is, as their
  "w1" without a "w3": one GEMM gives the interleaved pre-activations [N, 2Fl], and the
  activation (``InterleavedGLU``) takes gate and up from its even and odd columns. The weight
  gradient then comes out of one GEMM in transformers' layout: nothing is copied but the
  activation's gradient, interleaved into one [N, 2Fl] buffer.
- "per_expert" (Switch, one ``wi`` [Fl, D] / ``wo`` [D, Fl] per expert): ``adopt`` makes the
  experts' Parameters the rows of one [L, ...] block, which ``StackT`` hands the GEMMs as it
  is; where they are not (a loader or ``.to()`` gave each its own storage) it copies them
  into one buffer. Their gradients are views of one gradient buffer (no copy).

Every buffer here comes from moepar's CPU buffer pool (``moepar.moe.cpu``), as the
gradients of moepar's own layout do: a fresh buffer of this size would be faulted in page by
page at every step.
"""
from __future__ import annotations

import torch

from moepar.moe import cpu


def split(fused: torch.Tensor, layout: str, dim: int):
    """(gate, up) views in moepar's layout: [L, D, Fl] each (``dim`` 2), or [L, Fl] (biases)."""
    if layout == "interleaved":
        return fused[..., 0::2], fused[..., 1::2]
    if layout == "fused_chunk" and dim == 2:           # [L, 2Fl, D]: rows :Fl gate, Fl: up
        Fl = fused.shape[1] // 2
        return fused[:, :Fl].transpose(1, 2), fused[:, Fl:].transpose(1, 2)
    Fl = fused.shape[-1] // 2                          # chunk_in_out [L, D, 2Fl]: columns
    return fused[..., :Fl], fused[..., Fl:]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def fused_of(g_gate, g_up, shape, layout: str, dim: int):
    """The contiguous fused tensor of ``shape`` whose ``split`` views are exactly ``g_gate`` and
    ``g_up`` (the halves of one gradient buffer from ``grad_buffers``), or None."""
    if g_gate is None or g_up is None or g_gate.dtype != g_up.dtype or g_gate.device != g_up.device:
        return None
    storage = g_gate.untyped_storage()
    numel = 1
    for s in shape:
        numel *= s
    if (g_gate.storage_offset() + numel) * g_gate.element_size() > storage.nbytes():
        return None
    strides, step = [], 1
    for s in reversed(shape):
        strides.insert(0, step)
        step *= s
    fused = g_gate.as_strided(shape, strides, g_gate.storage_offset())
    gate, up = split(fused, layout, dim)
    return fused if _same_view(gate, g_gate) and _same_view(up, g_up) else None


class SplitGateUp(torch.autograd.Function):
    """(gate, up) of a fused tensor as views; the backward returns the fused gradient the
    two gradients are views of, else writes both into one fused gradient (one pass), where
    slicing would build a zero-filled one per half and add."""

    @staticmethod
    def forward(ctx, fused, layout, dim):
        ctx.layout, ctx.dim, ctx.shape = layout, dim, tuple(fused.shape)
        return split(fused, layout, dim)

    @staticmethod
    def backward(ctx, g_gate, g_up):
        lay, dim = ctx.layout, ctx.dim
        fused = fused_of(g_gate, g_up, ctx.shape, lay, dim)
        if fused is not None:
            return fused, None, None
        like = g_gate if g_gate is not None else g_up
        g_gate = torch.zeros_like(like) if g_gate is None else g_gate
        g_up = torch.zeros_like(like) if g_up is None else g_up
        if lay == "interleaved":                       # columns 0::2 gate, 1::2 up
            return torch.stack([g_gate, g_up], dim=-1).flatten(-2), None, None
        if lay == "fused_chunk" and dim == 2:          # the views were transposed: [L, 2Fl, D]
            return torch.cat([g_gate.transpose(1, 2), g_up.transpose(1, 2)], dim=1), None, None
        return torch.cat([g_gate, g_up], dim=-1), None, None


def split_gate_up(fused: torch.Tensor, layout: str, dim: int):
    """``split``, differentiable (``SplitGateUp``) where autograd records."""
    if fused.requires_grad and torch.is_grad_enabled():
        return SplitGateUp.apply(fused, layout, dim)
    return split(fused, layout, dim)


class InterleavedGLU:
    """A gated activation (``inner``: ``ClampedSwiGLU``, ``Elementwise``) over interleaved
    pre-activations h [N, 2Fl] (gate columns 0::2, up 1::2): what one GEMM on transformers'
    fused ``gate_up_proj`` gives. ``forward`` -> a [N, Fl]; ``backward`` writes d gate and
    d up into one interleaved gradient [N, 2Fl] (pooled), so that the experts' backward
    computes the fused weight gradient [L, D, 2Fl] in one GEMM, in transformers' layout.
    ``ExpertsFunction`` sees an activation without an up projection (``gated`` False)."""

    gated = False

    def __init__(self, inner):
        self.inner = inner

    def forward(self, h: torch.Tensor, _unused=None) -> torch.Tensor:
        return self.inner.forward(h[:, 0::2], h[:, 1::2])

    def backward(self, ga: torch.Tensor, h: torch.Tensor, _unused=None):
        g_gate, g_up = self.inner.backward(ga, h[:, 0::2], h[:, 1::2])
        gh = cpu.empty_like_rows(h, h.shape[0])
        gh[:, 0::2].copy_(g_gate)
        gh[:, 1::2].copy_(g_up)
        return gh, None


def rows_of_one_block(tensors) -> torch.Tensor | None:
    """The contiguous [L, ...] block whose rows are exactly ``tensors`` (contiguous, in order,
    one after the other in one storage), or None."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype for t in tensors):
        return None
    ptr, n = first.untyped_storage().data_ptr(), first.numel()
    if any(t.untyped_storage().data_ptr() != ptr or t.storage_offset() != first.storage_offset() + e * n
           for e, t in enumerate(tensors)):
        return None
    shape = (len(tensors), *first.shape)
    if (first.storage_offset() + shape[0] * n) * first.element_size() > first.untyped_storage().nbytes():
        return None
    return first.as_strided(shape, (n, *first.stride()), first.storage_offset())


class StackT(torch.autograd.Function):
    """Per-expert tensors [A, B] (one Parameter each) as one [L, B, A] tensor, transposed (the
    GEMMs read it as it is): the block they are the rows of where they are (``adopt`` builds
    them so: no copy), else each copied into its row of a pooled [L, A, B] buffer. The
    backward hands each expert its row of the gradient, transposed back: a view, contiguous
    when the gradient is the transpose of a contiguous buffer (``grad_buffers``)."""

    @staticmethod
    def forward(ctx, *tensors):
        block = rows_of_one_block(tensors)
        if block is not None:
            return block.transpose(1, 2)
        first = tensors[0]
        out = cpu.empty((len(tensors), *first.shape), first.dtype, first.device)
        for e, t in enumerate(tensors):
            out[e].copy_(t)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, g):
        return tuple(g[e].t() for e in range(g.shape[0]))


def gemm_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a GEMM operand: copied (differentiably) only when neither of its last two dims
    has a unit stride (a bias [L, Fl]: when its last dim has none)."""
    if t.dim() == 3 and t.stride(-1) != 1 and t.stride(-2) != 1:
        return t.contiguous()
    if t.dim() == 2 and t.stride(-1) != 1:   # a bias [L, Fl] read per expert row
        return t.contiguous()
    return t

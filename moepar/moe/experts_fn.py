"""The grouped experts' forward and backward as one autograd Function (``ExpertsFunction``),
used by ``GroupedExperts`` (eager) and by its custom ops (``experts_op``, under
torch.compile). Legend as in ``experts.py``: E local experts, D hidden, F ffn held here,
N rows (expert-major unless ``segment_experts`` names each row block's expert).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from . import cpu
from .gemm import LoopGemm, make_gemm


def expert_segments(counts: Sequence[int], row_bytes: int, limit: int | None = None
                    ) -> list[tuple[int, int, int, int]]:
    """(first expert, end expert, first row, end row) of each segment: consecutive experts
    whose [rows, F] intermediates stay under ``limit`` bytes (None: one segment; the CPU
    path passes ``cpu.SEGMENT_BYTES``)."""
    if limit is None:
        return [(0, len(counts), 0, sum(counts))]
    segs, e0, r0, rows = [], 0, 0, 0
    for e, c in enumerate(counts):
        if e > e0 and (rows + c) * row_bytes > limit:
            segs.append((e0, e, r0, r0 + rows))
            e0, r0, rows = e, r0 + rows, 0
        rows += c
    segs.append((e0, len(counts), r0, r0 + rows))
    return segs


class ExpertsFunction(torch.autograd.Function):
    """All local experts' FFN, forward and backward, on ragged expert-major rows, one
    segment of experts at a time on the CPU (see ``cpu.SEGMENT_BYTES``): the [rows, F] intermediates are
    per segment, the outputs and gradients are written into slices of whole buffers. Off
    the CPU there is one segment and the GEMMs' own results are the outputs and gradients
    (no copy into a second buffer). Only the pre-activations are kept for backward
    (gelu/swiglu recompute their output there, one elementwise pass; relu keeps its in-place
    output): half the [N, F] memory.

    ``counts``: rows per local expert on the host, or None where only ``counts_dev`` (the same
    on the device) is known: then ``path`` must be "grouped_mm" (nothing read to the host)."""

    @staticmethod
    def forward(ctx, x, w1, w2, w3, b1, b2, b3, counts, counts_dev, path, activation, segment_experts=None):
        # segment_experts: row block i is for expert segment_experts[i] (any order, repeats
        # allowed; the loop path with whole weights, see LoopGemm); None: block e is expert e.
        mapped = segment_experts is not None
        on_cpu = x.device.type == "cpu"
        saved = []
        # Segments only on the CPU (heap-sized intermediates, cpu.py); one GEMM group elsewhere.
        if on_cpu:
            segments = expert_segments(counts, w1.shape[2] * x.element_size(), cpu.SEGMENT_BYTES)
        else:
            segments = [(0, w1.shape[0] if not mapped else len(counts), 0, x.shape[0])]
        whole = on_cpu or mapped or len(segments) > 1   # else the one GEMM's output is y itself
        y = cpu.empty_like_rows(x, x.shape[0], w2.shape[2]) if whole else None
        for e0, e1, r0, r1 in segments:
            sl = slice(e0, e1)
            part = (lambda t: t) if mapped else (lambda t: part_of(t, sl))   # noqa: E731
            if mapped:
                gemm = LoopGemm(counts[sl], segment_experts[sl])
            else:
                gemm = make_gemm(path, None if counts is None else counts[sl], x.device,
                                 counts_dev if not whole else None, r1 - r0)
            xg = gemm.pad(x[r0:r1])                      # [n', D]: a view except for padded bmm
            h1 = gemm.fwd(xg, part(w1), part(b1))        # [n', F]
            h3 = None
            if activation == "swiglu":
                h3 = gemm.fwd(xg, part(w3), part(b3))
                a = F.silu(h1).mul_(h3)
            elif not isinstance(activation, str):   # ClampedSwiGLU (GPT-OSS), Elementwise: w1 the gate
                h3 = gemm.fwd(xg, part(w3), part(b3)) if activation.gated else None
                a = activation.forward(h1, h3)
            elif activation == "gelu":
                a = F.gelu(h1)
            else:  # relu in place: the backward only needs the output's sign
                a = h1.relu_()
                h1 = None
            if not whole:
                y = gemm.unpad(gemm.fwd(a, part(w2), part(b2)))
            elif gemm.same_layout:
                gemm.fwd(a, part(w2), part(b2), out=y[r0:r1])
            else:
                torch.index_select(gemm.fwd(a, part(w2), part(b2)), 0, gemm.dest, out=y[r0:r1])
            saved.append((e0, e1, r0, r1, gemm, xg, h1, h3, a if activation == "relu" else None))
            del a
        ctx.save_for_backward(w1, w2, w3)
        ctx.segments, ctx.activation, ctx.mapped, ctx.whole = saved, activation, mapped, whole
        ctx.has_b = (b1 is not None, b2 is not None, b3 is not None)
        return y

    @staticmethod
    def backward(ctx, gy):
        w1, w2, w3 = ctx.saved_tensors
        act, need, whole = ctx.activation, ctx.needs_input_grad, ctx.whole
        gy = gy.contiguous()
        # Whole gradient buffers, each segment writes its slice (one segment off the CPU: the
        # GEMMs' results are the gradients). gx is allocated after the first (last) segment
        # is done and freed, from its memory; that segment's rows wait in a small temporary.
        gx, gx_first = None, None
        has_b = ctx.has_b
        grads = {}   # name -> whole buffer (None: taken from the one segment's result)
        for name, i, like, cols in (("w1", 1, w1, None), ("w2", 2, w2, None), ("w3", 3, w3, None),
                                    ("b1", 4, w1, 2), ("b2", 5, w2, 2), ("b3", 6, w1, 2)):
            present = like is not None and (name[0] == "w" or has_b[int(name[1]) - 1])
            if not (present and need[i]):
                continue
            shape = like.shape if cols is None else (like.shape[0], like.shape[cols])
            grads[name] = (cpu.empty(shape, like.dtype, like.device) if cols is None else like.new_empty(shape)) \
                if whole else None
        if ctx.mapped:   # blocks accumulate into their expert's gradients (none: zero)
            for t in grads.values():
                t.zero_()
        segments, ctx.segments = ctx.segments, None

        def put(name, part, fn):
            """Write gradient ``name`` for this segment: into its slice, or as the whole result."""
            if name not in grads:
                return
            if whole:
                fn(part(grads[name]))
            else:
                grads[name] = fn(None)
        while segments:
            # Last segment first, each freed once done: its intermediates, the most recently
            # allocated, are returned before the gradients grow (lower peak memory).
            e0, e1, r0, r1, gemm, xg, h1, h3, a = segments.pop()
            sl = slice(e0, e1)
            part = (lambda t: t) if ctx.mapped else (lambda t: part_of(t, sl))   # noqa: E731
            gyg = gemm.pad(gy[r0:r1])
            if a is None:   # recompute the activation's output (gw2 needs it)
                if not isinstance(act, str):
                    a = act.forward(h1, h3)
                else:
                    a = F.silu(h1).mul_(h3) if act == "swiglu" else F.gelu(h1)
            put("w2", part, lambda out: gemm.wgrad(a, gyg, out=out))
            put("b2", part, lambda out: gemm.bias_grad(gyg, out=out))
            if act != "relu":
                del a                                     # ga below can take its place
            ga = gemm.dgrad(gyg, part(w2))                # [n', F]
            del gyg
            gh3 = None
            if act == "swiglu":
                gh3 = F.silu(h1).mul_(ga)                 # d/dh3 of silu(h1) * h3
                gh1 = torch.ops.aten.silu_backward.grad_input(ga.mul_(h3), h1, grad_input=ga)
            elif not isinstance(act, str):   # its own backward: (d h1, d h3 or None)
                gh1, gh3 = act.backward(ga, h1, h3)
            elif act == "gelu":
                gh1 = torch.ops.aten.gelu_backward.grad_input(ga, h1, grad_input=ga)
            else:
                gh1 = torch.ops.aten.threshold_backward.grad_input(ga, a, 0, grad_input=ga)
                del a
            del h1, h3
            if need[0]:
                dst = gx[r0:r1] if gemm.same_layout and gx is not None else None
                dst = gemm.dgrad(gh1, part(w1), out=dst)
                if gh3 is not None:
                    gemm.dgrad(gh3, part(w3), out=dst, acc=True)
                if not whole:
                    gx = gemm.unpad(dst)
                elif gx is None:
                    gx_first = (r0, r1, gemm.unpad(dst))
                elif not gemm.same_layout:
                    torch.index_select(dst, 0, gemm.dest, out=gx[r0:r1])
            put("w1", part, lambda out: gemm.wgrad(xg, gh1, out=out))
            put("b1", part, lambda out: gemm.bias_grad(gh1, out=out))
            if gh3 is not None:
                put("w3", part, lambda out: gemm.wgrad(xg, gh3, out=out))
                put("b3", part, lambda out: gemm.bias_grad(gh3, out=out))
            del xg, ga, gh1, gh3
            if gx_first is not None:
                gx = cpu.empty_like_rows(gy, gy.shape[0], w1.shape[1])
                gx[gx_first[0]:gx_first[1]] = gx_first[2]
                gx_first = None
        g = grads.get
        return gx, g("w1"), g("w2"), g("w3"), g("b1"), g("b2"), g("b3"), None, None, None, None, None


def check_counts(counts: list[int], num_local_experts: int, rows: int) -> list[int]:
    """``counts`` if it holds one count >= 0 per local expert, summing to ``rows``."""
    if len(counts) != num_local_experts:
        raise ValueError(f"tokens_per_expert has {len(counts)} entries but num_local_experts={num_local_experts}")
    if any(c < 0 for c in counts):
        raise ValueError(f"tokens_per_expert={counts} must be >= 0")
    if sum(counts) != rows:
        raise ValueError(f"tokens_per_expert sums to {sum(counts)} but x_ND has {rows} rows")
    return counts


def part_of(b, sl):
    return None if b is None else b[sl]

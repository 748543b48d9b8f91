"""The grouped GEMMs and the autograd Function over them: all local experts' FFN on ragged rows.

``ExpertsFunction`` is the grouped experts' forward and backward as one autograd Function,
used by ``GroupedExperts`` (eager) and by its custom ops (``custom_op``, under
torch.compile). Below it, the GEMM paths it drives ("loop", "grouped_mm", "bmm"): each
computes, per local expert e on its row block, the forward ``x_e @ w_e (+ b_e)``, the data
gradient ``g_e @ w_e^T``, the weight gradient ``x_e^T @ g_e`` and the bias gradient; last,
``choose_gemm_path``, the measured "auto" rule (docs/local.md). Legend as in ``grouped.py``:
E local experts, D hidden, Fl the ffn slice held here (F / etp), N rows (expert-major
unless ``segment_experts`` names each row block's expert).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from .. import cpu
from ...parallel.comm import to_device


GEMM_PATHS = ("auto", "grouped_mm", "loop", "bmm")


def expert_segments(counts: Sequence[int], row_bytes: int, limit: int | None = None
                    ) -> list[tuple[int, int, int, int]]:
    """(first expert, end expert, first row, end row) of each segment: consecutive experts
    whose [rows, Fl] intermediates stay under ``limit`` bytes (None: one segment; the CPU
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
    segment of experts at a time on the CPU (see ``cpu.SEGMENT_BYTES``): the [rows, Fl] intermediates are
    per segment, the outputs and gradients are written into slices of whole buffers. Off
    the CPU there is one segment and the GEMMs' own results are the outputs and gradients
    (no copy into a second buffer). Only the pre-activations are kept for backward
    (gelu/swiglu recompute their output there, one elementwise pass; relu keeps its in-place
    output): half the [N, Fl] memory.

    ``counts``: rows per local expert on the host, or None where only ``counts_dev`` (the same
    on the device) is known: then ``path`` must be "grouped_mm" (nothing read to the host).

    ``grad_buffers`` (optional): called once in the backward, returns {name: tensor} of
    whole weight / bias gradients to write into instead of allocating them, each in the
    shape, dtype and device of its weight but with any strides (a buffer that does not
    match is ignored). A module holding its tensors in another layout (moepar.hf) hands
    views of its own layout's gradients here, so that no gradient is copied into it."""

    @staticmethod
    def forward(ctx, x, w1, w2, w3, b1, b2, b3, plan):
        # plan: (counts, counts_dev, path, activation, segment_experts, rebuild, grad_buffers),
        # one argument (Function.apply pays Python work per argument; none of these has a grad).
        counts, counts_dev, path, activation, segment_experts, rebuild, grad_buffers = plan
        # segment_experts: row block i is for expert segment_experts[i] (any order, repeats
        # allowed; the loop path with whole weights, see LoopGemm); None: block e is expert e.
        # rebuild: a function returning (w1, w2, w3) again in the backward, for weights the
        # caller assembled (expert replication's slots): then autograd keeps none of them.
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
            # the whole weights where the segment spans every expert (off the CPU: always)
            pw1, pw2, pw3, pb1, pb2, pb3 = (w1, w2, w3, b1, b2, b3) if mapped or (e0, e1) == (0, w1.shape[0]) \
                else [part_of(t, sl) for t in (w1, w2, w3, b1, b2, b3)]
            if mapped:
                gemm = LoopGemm(counts[sl], segment_experts[sl])
            else:
                gemm = make_gemm(path, None if counts is None else counts[sl], x.device,
                                 counts_dev if not whole else None, r1 - r0)
            xg = gemm.pad(x[r0:r1])                      # [n', D]: a view except for padded bmm
            h1 = gemm.fwd(xg, pw1, pb1)                  # [n', Fl]
            h3 = None
            if activation == "swiglu":
                h3 = gemm.fwd(xg, pw3, pb3)
                a = F.silu(h1).mul_(h3)
            elif not isinstance(activation, str):   # ClampedSwiGLU (GPT-OSS), Elementwise: w1 the gate
                h3 = gemm.fwd(xg, pw3, pb3) if activation.gated else None
                a = activation.forward(h1, h3)
            elif activation == "gelu":
                a = F.gelu(h1)
            else:  # relu in place: the backward only needs the output's sign
                a = h1.relu_()
                h1 = None
            if not whole:
                y = gemm.unpad(gemm.fwd(a, pw2, pb2))
            elif gemm.same_layout:
                gemm.fwd(a, pw2, pb2, out=y[r0:r1])
            else:
                torch.index_select(gemm.fwd(a, pw2, pb2), 0, gemm.dest, out=y[r0:r1])
            saved.append((e0, e1, r0, r1, gemm, xg, h1, h3, a if activation == "relu" else None))
            del a
        # Under saved-tensor hooks (activation recomputation, offloading) the activations go
        # through them: a checkpoint must be able to drop them. Otherwise they are kept on ctx,
        # so that the backward frees each segment's as it goes (a lower peak).
        ctx.hooked = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        ctx.rebuild = rebuild
        weights = (w1, w2, w3) if rebuild is None else (None, None, None)
        if ctx.hooked:
            ctx.save_for_backward(*weights, *(t for seg in saved for t in seg[5:]))
            saved = [seg[:5] for seg in saved]
        else:
            ctx.save_for_backward(*weights)
        ctx.segments, ctx.activation, ctx.mapped, ctx.whole = saved, activation, mapped, whole
        ctx.grad_buffers = grad_buffers
        ctx.has_b = (b1 is not None, b2 is not None, b3 is not None)
        return y

    @staticmethod
    def backward(ctx, gy):
        w1, w2, w3, *activations = ctx.saved_tensors
        if ctx.rebuild is not None:
            w1, w2, w3 = ctx.rebuild()
        act, need, whole = ctx.activation, ctx.needs_input_grad, ctx.whole
        gy = gy.contiguous()
        # Whole gradient buffers, each segment writes its slice (one segment off the CPU: the
        # GEMMs' results are the gradients). gx is allocated after the first (last) segment
        # is done and freed, from its memory; that segment's rows wait in a small temporary.
        gx, gx_first = None, None
        has_b = ctx.has_b
        grads = {}   # name -> whole buffer (None: taken from the one segment's result)
        given = ctx.grad_buffers() if ctx.grad_buffers is not None else {}
        for name, i, like, cols in (("w1", 1, w1, None), ("w2", 2, w2, None), ("w3", 3, w3, None),
                                    ("b1", 4, w1, 2), ("b2", 5, w2, 2), ("b3", 6, w1, 2)):
            present = like is not None and (name[0] == "w" or has_b[int(name[1]) - 1])
            if not (present and need[i]):
                continue
            shape = like.shape if cols is None else (like.shape[0], like.shape[cols])
            buf = given.get(name)
            if buf is not None and buf.shape == shape and buf.dtype == like.dtype and buf.device == like.device:
                grads[name] = buf
                continue
            grads[name] = (cpu.empty(shape, like.dtype, like.device) if cols is None else like.new_empty(shape)) \
                if whole else None
        if ctx.mapped:   # blocks accumulate into their expert's gradients (none: zero)
            for t in grads.values():
                t.zero_()
        if ctx.hooked:   # the hooks' tensors, 4 a segment (xg, h1, h3, relu's a): kept on ctx
            segments = [(*seg, *activations[4 * i:4 * i + 4]) for i, seg in enumerate(ctx.segments)]
        else:
            segments, ctx.segments = ctx.segments, None
        if segments is None:   # not silently zero: the buffers above were never written
            raise RuntimeError(
                "moepar's grouped experts were backpropagated a second time through the same graph "
                "(backward(retain_graph=True), then backward again): their backward frees the "
                "activations it used as it goes, for a lower peak memory; run the forward again, or "
                "build the layer with recompute_experts=True (the experts then recompute them in each "
                "backward)")

        def put(name, sl, fn, *args):
            """Gradient ``name`` = fn(*args): into its slice ``sl`` (None: whole), or the result."""
            if name not in grads:
                return
            buf = grads[name]
            if buf is not None:   # a whole buffer: this segment's slice of it
                fn(*args, out=buf if sl is None else buf[sl])
            else:
                grads[name] = fn(*args)
        while segments:
            # Last segment first, each freed once done: its intermediates, the most recently
            # allocated, are returned before the gradients grow (lower peak memory).
            e0, e1, r0, r1, gemm, xg, h1, h3, a = segments.pop()
            # None where the segment spans every expert (as in the forward): no slicing calls
            sl = None if ctx.mapped or (e0, e1) == (0, w1.shape[0]) else slice(e0, e1)
            pw1, pw2, pw3 = (w1, w2, w3) if sl is None else (w1[sl], w2[sl], part_of(w3, sl))
            gyg = gemm.pad(gy[r0:r1])
            s1 = None
            if a is None:   # recompute the activation's output (gw2 needs it)
                if not isinstance(act, str):
                    a = act.forward(h1, h3)
                elif act == "swiglu":   # silu(h1) kept: d/dh3 below is silu(h1) * ga (one op fewer)
                    s1 = F.silu(h1)
                    a = s1 * h3
                else:
                    a = F.gelu(h1)
            put("w2", sl, gemm.wgrad, a, gyg)
            put("b2", sl, gemm.bias_grad, gyg)
            if act != "relu":
                del a                                     # ga below can take its place
            ga = gemm.dgrad(gyg, pw2)                     # [n', Fl]
            del gyg
            gh3 = None
            if act == "swiglu":
                gh3 = (F.silu(h1) if s1 is None else s1).mul_(ga)   # d/dh3 of silu(h1) * h3
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
                dst = gemm.dgrad(gh1, pw1, out=dst)
                if gh3 is not None:
                    gemm.dgrad(gh3, pw3, out=dst, acc=True)
                if not whole:
                    gx = gemm.unpad(dst)
                elif gx is None:
                    gx_first = (r0, r1, gemm.unpad(dst))
                elif not gemm.same_layout:
                    torch.index_select(dst, 0, gemm.dest, out=gx[r0:r1])
            put("w1", sl, gemm.wgrad, xg, gh1)
            put("b1", sl, gemm.bias_grad, gh1)
            if gh3 is not None:
                put("w3", sl, gemm.wgrad, xg, gh3)
                put("b3", sl, gemm.bias_grad, gh3)
            del xg, ga, gh1, gh3
            if gx_first is not None:
                gx = cpu.empty_like_rows(gy, gy.shape[0], w1.shape[1])
                gx[gx_first[0]:gx_first[1]] = gx_first[2]
                gx_first = None
        g = grads.get
        return gx, g("w1"), g("w2"), g("w3"), g("b1"), g("b2"), g("b3"), None


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


# ---- GEMM paths ------------------------------------------------------------------------------
# Each path computes, per expert e on its row block: fwd x_e @ w_e (+ b_e), dgrad g_e @ w_e^T,
# wgrad x_e^T @ g_e -> [E, A, B], bias_grad sum of g_e's rows -> [E, B]. Every method writes
# into ``out`` when given (dgrad adds to it with ``acc=True``). pad/unpad move rows between the
# caller's ragged layout and the path's own (only bmm over unequal blocks differs; the others
# have ``same_layout`` and write straight into the caller's buffers).

class LoopGemm:
    """One mm/addmm per non-empty expert, written into slices of one output buffer.

    ``experts`` (mapped mode): row block i belongs to expert ``experts[i]`` of the whole
    weight tensors the caller passes, blocks in any order and an expert in several blocks
    (source-rank-major rows). Weight and bias gradients are then accumulated into the
    caller's whole buffers, which the caller zeroes first."""
    same_layout = True

    def __init__(self, counts: Sequence[int], experts: Sequence[int] | None = None):
        self.E, self.N = len(counts), sum(counts)
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)
        idx = range(len(counts)) if experts is None else experts
        self.segs = [(e, s, c) for e, s, c in zip(idx, starts, counts) if c > 0]
        self.accumulate = experts is not None
        self.empty = [] if self.accumulate else [e for e, c in enumerate(counts) if c == 0]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def fwd(self, x, w, b=None, out=None):
        out = x.new_empty(self.N, w.shape[2]) if out is None else out
        for e, s, c in self.segs:
            if b is None:
                torch.mm(x[s:s + c], w[e], out=out[s:s + c])
            else:
                torch.addmm(b[e], x[s:s + c], w[e], out=out[s:s + c])
        return out

    def dgrad(self, g, w, out=None, acc=False):
        out = g.new_empty(self.N, w.shape[1]) if out is None else out
        for e, s, c in self.segs:
            if acc:
                out[s:s + c].addmm_(g[s:s + c], w[e].t())
            else:
                torch.mm(g[s:s + c], w[e].t(), out=out[s:s + c])
        return out

    def _per_expert(self, out, fn, acc_fn):
        for e, s, c in self.segs:
            (acc_fn if self.accumulate else fn)(s, c, out[e])
        for e in self.empty:
            out[e].zero_()
        return out

    def wgrad(self, x, g, out=None):
        out = x.new_empty(self.E, x.shape[1], g.shape[1]) if out is None else out
        return self._per_expert(out, lambda s, c, o: torch.mm(x[s:s + c].t(), g[s:s + c], out=o),
                                lambda s, c, o: o.addmm_(x[s:s + c].t(), g[s:s + c]))

    def bias_grad(self, g, out=None):
        out = g.new_empty(self.E, g.shape[1]) if out is None else out
        return self._per_expert(out, lambda s, c, o: torch.sum(g[s:s + c], 0, out=o),
                                lambda s, c, o: o.add_(g[s:s + c].sum(0)))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """grouped_mm wants 16-byte aligned storage (a view at an odd offset is copied)."""
    t = t if t.is_contiguous() else t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _into(r: torch.Tensor, out, acc: bool = False) -> torch.Tensor:
    if out is None:
        return r
    return out.add_(r) if acc else out.copy_(r)


class _GroupedMMGemm(LoopGemm):
    """torch.nn.functional.grouped_mm with int32 end offsets computed on the device from the
    device counts (no host list, no copy from the host). Off the CPU the bias adds and bias
    gradients are one gather / index_add each over a row->expert index built on the device;
    the GEMMs' results are the caller's buffers (grouped_mm has no ``out=``). On the CPU,
    where grouped_mm's kernel is itself a loop of mm, a result that lands in a slice of a
    caller's buffer is computed by the loop's mm(out=) instead of grouped_mm + a copy."""

    def __init__(self, counts: Sequence[int] | None, device: torch.device, counts_dev: torch.Tensor | None = None,
                 rows: int | None = None):
        if counts is not None:
            super().__init__(counts)
        else:   # rows per expert known on the device only (an accelerator)
            self.E, self.N, self.segs, self.accumulate, self.empty = counts_dev.numel(), rows, None, False, []
        if counts_dev is None:
            counts_dev = to_device(torch.tensor(list(counts), dtype=torch.int64), device)
        self.counts_dev = counts_dev.to(device=device, dtype=torch.int64)
        self.offs = torch.cumsum(self.counts_dev, 0, dtype=torch.int32)   # one op, not a sum and a cast
        self._expert_of_row = None

    def _row_experts(self) -> torch.Tensor:
        if self._expert_of_row is None:
            E = self.counts_dev.numel()
            self._expert_of_row = torch.repeat_interleave(torch.arange(E, device=self.counts_dev.device),
                                                          self.counts_dev, output_size=self.N)
        return self._expert_of_row

    def fwd(self, x, w, b=None, out=None):
        if out is not None and out.device.type == "cpu":
            return super().fwd(x, w, b, out)
        r = F.grouped_mm(_aligned(x), w, offs=self.offs)
        if b is not None:
            if self.segs is not None and r.device.type == "cpu":
                for e, s, c in self.segs:
                    r[s:s + c].add_(b[e])
            else:
                r.add_(b.index_select(0, self._row_experts()))
        return _into(r, out)

    def dgrad(self, g, w, out=None, acc=False):
        if out is not None and out.device.type == "cpu":
            return super().dgrad(g, w, out, acc)
        return _into(F.grouped_mm(_aligned(g), w.transpose(1, 2), offs=self.offs), out, acc)

    def wgrad(self, x, g, out=None):
        if out is not None and out.device.type == "cpu":
            return super().wgrad(x, g, out)
        return _into(F.grouped_mm(_aligned(x).t(), _aligned(g), offs=self.offs), out)

    def bias_grad(self, g, out=None):
        if self.segs is not None and g.device.type == "cpu":
            return super().bias_grad(g, out)
        r = g.new_zeros(self.counts_dev.numel(), g.shape[1]).index_add_(0, self._row_experts(), g)
        return _into(r, out)


class _BmmGemm:
    """Rows in E equal blocks of C (the largest count), one bmm per GEMM. Padding rows
    are zero on the way in and their gradient is zero on the way back, so they add
    nothing to any weight or bias gradient."""

    def __init__(self, counts: Sequence[int], device: torch.device):
        self.E, self.N = len(counts), sum(counts)
        self.C = max(counts, default=0)
        self.same_layout = all(c == self.C for c in counts)   # equal blocks: the caller's layout
        self.dest = None
        if not self.same_layout:  # row n of expert e (start s_e) goes to e*C + (n - s_e)
            cnt = torch.tensor(list(counts), dtype=torch.int64)
            shift = torch.arange(self.E, dtype=torch.int64) * self.C - (torch.cumsum(cnt, 0) - cnt)
            self.dest = (torch.arange(self.N) + torch.repeat_interleave(shift, cnt, output_size=self.N)).to(device)

    def pad(self, x):
        if self.same_layout:
            return x
        return x.new_zeros(self.E * self.C, x.shape[1]).index_copy_(0, self.dest, x)

    def unpad(self, y):
        return y if self.same_layout else y.index_select(0, self.dest)

    def _3d(self, t):
        return t.view(self.E, self.C, t.shape[-1])

    def fwd(self, x, w, b=None, out=None):
        out = x.new_empty(self.E * self.C, w.shape[2]) if out is None else out
        if b is None:
            torch.bmm(self._3d(x), w, out=self._3d(out))
        else:
            torch.baddbmm(b[:, None, :], self._3d(x), w, out=self._3d(out))
        return out

    def dgrad(self, g, w, out=None, acc=False):
        if out is None:
            return torch.bmm(self._3d(g), w.transpose(1, 2)).view(self.E * self.C, w.shape[1])
        if acc:
            self._3d(out).baddbmm_(self._3d(g), w.transpose(1, 2))
        else:
            torch.bmm(self._3d(g), w.transpose(1, 2), out=self._3d(out))
        return out

    def wgrad(self, x, g, out=None):
        if out is None:
            return torch.bmm(self._3d(x).transpose(1, 2), self._3d(g))
        # straight into the caller's buffer, whatever its strides (a transposed one: moepar.hf)
        return torch.bmm(self._3d(x).transpose(1, 2), self._3d(g), out=out)

    def bias_grad(self, g, out=None):
        return _into(self._3d(g).sum(1), out)


def make_gemm(path: str, counts: Sequence[int] | None, device: torch.device, counts_dev: torch.Tensor | None = None,
              rows: int | None = None):
    """The GEMM object of ``path`` for these row counts: host ``counts`` (None on an
    accelerator when only ``counts_dev`` is known: grouped_mm only) and ``rows`` in all."""
    if path == "grouped_mm":
        return _GroupedMMGemm(counts, device, counts_dev, rows)
    if path == "loop" or sum(counts) == 0:   # no rows: every path gives zeros, the loop cheapest
        return LoopGemm(counts)
    if path == "bmm":
        return _BmmGemm(counts, device)
    raise ValueError(f"gemm path {path!r} must be one of {GEMM_PATHS[1:]}")


# ---- the path to run: an explicit one if available here, else the measured "auto" rule ------

def path_supported(path: str, device: torch.device, dtype: torch.dtype, D: int, Fl: int) -> tuple[bool, str]:
    """(available, why not) for an explicit path on this device/dtype/shape."""
    if path != "grouped_mm":
        return True, ""
    if not hasattr(F, "grouped_mm"):
        return False, f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False, f"grouped_mm takes float32, bfloat16 or float16, not {dtype}"
    item = torch.empty((), dtype=dtype).element_size()
    if (D * item) % 16 or (Fl * item) % 16:
        return False, (f"grouped_mm needs rows of a multiple of 16 bytes: hidden={D} and ffn slice={Fl} "
                       f"times {item} bytes ({dtype})")
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major < 9 or dtype != torch.bfloat16:
            return False, f"grouped_mm on CUDA is used for bf16 on sm >= 90 (got sm{major}x, {dtype})"
    elif device.type != "cpu":
        return False, f"grouped_mm is not wired for device type {device.type!r}"
    return True, ""


# CPU rule, from `python -m moepar bench local --sweep` (figures in docs/local.md): small
# blocks favour one bmm (a few hundred tiny mm calls cost more than the padding); larger
# ones grouped_mm when there are many experts (its loop over them is in C++, where the
# Python loop's per-expert overhead adds up), else a Python loop of mm (with few experts
# and big GEMMs each mm runs at full speed and grouped_mm's setup is not repaid).
_BMM_MAX_MEAN_ROWS = 128
_BMM_MAX_PAD = 2.0       # largest block / mean block: the padding bmm computes for nothing
_GROUPED_MM_MIN_EXPERTS = 32


def choose_gemm_path(device: torch.device, dtype: torch.dtype, counts: Sequence[int] | None, D: int, Fl: int,
                     rows: int | None = None) -> str:
    """The "auto" choice for these rows (deterministic: a function of the counts and shapes;
    off the CPU of the shapes alone, so that the counts need not be read to the host).

    CPU: "bmm" when the blocks are equal (capacity mode) or small (mean <= 128 rows and
    max/mean <= 2), else "grouped_mm" for 32 experts or more (when the rows allow it),
    else "loop". CUDA: "grouped_mm" for bf16 on sm >= 90 with aligned
    rows, else "loop" (not measured here: no GPU on the development machines)."""
    if device.type == "cuda":
        ok, _ = path_supported("grouped_mm", device, dtype, D, Fl)
        return "grouped_mm" if ok and rows != 0 else "loop"
    N, E = sum(counts), len(counts)
    if N == 0:
        return "loop"
    biggest, mean = max(counts), N / E
    if biggest * E == N or (mean <= _BMM_MAX_MEAN_ROWS and biggest <= _BMM_MAX_PAD * mean):
        return "bmm"
    if E >= _GROUPED_MM_MIN_EXPERTS and path_supported("grouped_mm", device, dtype, D, Fl)[0]:
        return "grouped_mm"
    return "loop"


def resolve_gemm_path(path: str, device: torch.device, dtype: torch.dtype, counts: Sequence[int] | None,
                      D: int, Fl: int, rows: int | None = None) -> str:
    """The path to run: ``choose_gemm_path`` for "auto", else ``path`` if available here."""
    if path == "auto":
        return choose_gemm_path(device, dtype, counts, D, Fl, rows)
    ok, why = path_supported(path, device, dtype, D, Fl)
    if not ok:
        raise ValueError(f"gemm_path={path!r} is not available here: {why}")
    return path

"""The GEMM paths of GroupedExperts: per-expert products on ragged expert-major rows.

Each path computes, per local expert e on its row block, the forward ``x_e @ w_e (+ b_e)``,
the data gradient ``g_e @ w_e^T``, the weight gradient ``x_e^T @ g_e`` and the bias
gradient; ``choose_gemm_path`` is the measured "auto" rule (docs/local.md).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..parallel.device import to_device


GEMM_PATHS = ("auto", "grouped_mm", "loop", "bmm")


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
        self.offs = torch.cumsum(self.counts_dev, 0).to(torch.int32)
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
        return _into(torch.bmm(self._3d(x).transpose(1, 2), self._3d(g)), out)

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


# CPU rule, from `python -m moepar bench local --sweep` (docs/local.md, fp32, 2 threads):
# small blocks favour one bmm (a few hundred tiny mm calls cost more than the padding);
# larger ones grouped_mm when there are many experts (its loop over them is in C++: 1.5-22%
# ahead of the Python loop at E=64), else a Python loop of mm (1-9% ahead of grouped_mm at
# E=8 with big GEMMs in most runs).
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

"""GroupedExperts: every local expert's FFN in one module, weights as single tensors,
computed with grouped GEMMs over expert-major rows.

Legend: E local experts (``num_local_experts``), G global expert index, D hidden,
F ffn hidden held by this rank (``ffn_hidden / etp_size``), N rows (expert-major, the
counts say how many rows each expert owns), C rows per expert in a padded block.

Parameters: ``w1 [E, D, F]``, ``w3 [E, D, F]`` (swiglu only), ``w2 [E, F, D]``; with
``bias=True`` also ``b1 [E, F]``, ``b3 [E, F]`` (swiglu), ``b2 [E, D]``.
Expert FFN: ``y = act(x @ w1 + b1) @ w2 + b2``; swiglu: ``(silu(x@w1+b1) * (x@w3+b3)) @ w2 + b2``.

The forward and backward are one autograd Function that calls the GEMMs directly (no
per-expert autograd graph, no ``torch.cat``, outputs written in place into one buffer),
through one of three GEMM paths, all giving the same numbers within float rounding:

* ``"loop"``: a Python loop of ``mm``/``addmm`` with ``out=`` slices of one buffer;
* ``"grouped_mm"``: ``torch.nn.functional.grouped_mm`` (CPU; CUDA with sm >= 90, bf16),
  needs 16-byte aligned rows (D and F times the element size a multiple of 16);
* ``"bmm"``: rows padded to ``[E, C, *]`` blocks (C = the largest count), one ``bmm``
  per GEMM; free when the rows already are equal blocks (capacity mode).

``gemm_path="auto"`` picks per device, dtype and shape from the table in
``choose_gemm_path`` (measured, see docs/local.md).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


GEMM_PATHS = ("auto", "grouped_mm", "loop", "bmm")

ACTIVATIONS = ("gelu", "swiglu", "relu")
_SEED_MIX = 0x9E3779B97F4A7C15   # golden-ratio constant: spreads (seed, g) over the 64-bit space


def _expert_seed(init_seed: int, g: int) -> int:
    """Deterministic per (init_seed, global expert): splitmix64 of the pair."""
    z = (int(init_seed) * _SEED_MIX + int(g) + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


# ---- GEMM paths ------------------------------------------------------------------------------
# Each path computes, per expert e on its row block: fwd x_e @ w_e (+ b_e), dgrad g_e @ w_e^T,
# wgrad x_e^T @ g_e -> [E, A, B], bias_grad sum of g_e's rows -> [E, B]. pad/unpad move rows
# between the caller's ragged layout and the path's own (only bmm over ragged rows differs).

class _LoopGemm:
    """One mm/addmm per non-empty expert, written into slices of one output buffer."""

    def __init__(self, counts: Sequence[int]):
        self.E, self.N = len(counts), sum(counts)
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)
        self.segs = [(e, s, c) for e, (s, c) in enumerate(zip(starts, counts)) if c > 0]
        self.empty = [e for e, c in enumerate(counts) if c == 0]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def fwd(self, x, w, b=None):
        out = x.new_empty(self.N, w.shape[2])
        for e, s, c in self.segs:
            if b is None:
                torch.mm(x[s:s + c], w[e], out=out[s:s + c])
            else:
                torch.addmm(b[e], x[s:s + c], w[e], out=out[s:s + c])
        return out

    def dgrad(self, g, w, out=None):
        """g_e @ w_e^T; accumulates into ``out`` when given."""
        if out is None:
            out = g.new_empty(self.N, w.shape[1])
            for e, s, c in self.segs:
                torch.mm(g[s:s + c], w[e].t(), out=out[s:s + c])
        else:
            for e, s, c in self.segs:
                out[s:s + c].addmm_(g[s:s + c], w[e].t())
        return out

    def wgrad(self, x, g):
        out = x.new_empty(self.E, x.shape[1], g.shape[1])
        for e, s, c in self.segs:
            torch.mm(x[s:s + c].t(), g[s:s + c], out=out[e])
        for e in self.empty:
            out[e].zero_()
        return out

    def bias_grad(self, g):
        out = g.new_empty(self.E, g.shape[1])
        for e, s, c in self.segs:
            torch.sum(g[s:s + c], 0, out=out[e])
        for e in self.empty:
            out[e].zero_()
        return out


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """grouped_mm wants 16-byte aligned storage (a view at an odd offset is copied)."""
    t = t if t.is_contiguous() else t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class _GroupedMMGemm(_LoopGemm):
    """torch.nn.functional.grouped_mm with int32 end offsets; bias adds and bias grads
    stay per-expert slices (E small elementwise ops)."""

    def __init__(self, counts: Sequence[int], device: torch.device):
        super().__init__(counts)
        ends, acc = [], 0
        for c in counts:
            acc += c
            ends.append(acc)
        self.offs = torch.tensor(ends, dtype=torch.int32, device=device)

    def fwd(self, x, w, b=None):
        out = F.grouped_mm(_aligned(x), w, offs=self.offs)
        if b is not None:
            for e, s, c in self.segs:
                out[s:s + c].add_(b[e])
        return out

    def dgrad(self, g, w, out=None):
        r = F.grouped_mm(_aligned(g), w.transpose(1, 2), offs=self.offs)
        return r if out is None else out.add_(r)

    def wgrad(self, x, g):
        return F.grouped_mm(_aligned(x).t(), _aligned(g), offs=self.offs)


class _BmmGemm:
    """Rows in E equal blocks of C (the largest count), one bmm per GEMM. Padding rows
    are zero on the way in and their gradient is zero on the way back, so they add
    nothing to any weight or bias gradient."""

    def __init__(self, counts: Sequence[int], device: torch.device):
        self.E, self.N = len(counts), sum(counts)
        self.C = max(counts, default=0)
        self.uniform = all(c == self.C for c in counts)
        self.dest = None
        if not self.uniform:  # row n of expert e (start s_e) goes to e*C + (n - s_e)
            cnt = torch.tensor(list(counts), dtype=torch.int64)
            shift = torch.arange(self.E, dtype=torch.int64) * self.C - (torch.cumsum(cnt, 0) - cnt)
            self.dest = (torch.arange(self.N) + torch.repeat_interleave(shift, cnt, output_size=self.N)).to(device)

    def pad(self, x):
        if self.uniform:
            return x
        return x.new_zeros(self.E * self.C, x.shape[1]).index_copy_(0, self.dest, x)

    def unpad(self, y):
        return y if self.uniform else y.index_select(0, self.dest)

    def _3d(self, t):
        return t.view(self.E, self.C, t.shape[-1])

    def fwd(self, x, w, b=None):
        x3 = self._3d(x)
        out = torch.bmm(x3, w) if b is None else torch.baddbmm(b[:, None, :], x3, w)
        return out.view(self.E * self.C, w.shape[2])

    def dgrad(self, g, w, out=None):
        if out is None:
            return torch.bmm(self._3d(g), w.transpose(1, 2)).view(self.E * self.C, w.shape[1])
        self._3d(out).baddbmm_(self._3d(g), w.transpose(1, 2))
        return out

    def wgrad(self, x, g):
        return torch.bmm(self._3d(x).transpose(1, 2), self._3d(g))

    def bias_grad(self, g):
        return self._3d(g).sum(1)


def make_gemm(path: str, counts: Sequence[int], device: torch.device):
    if path == "loop" or sum(counts) == 0:   # no rows: every path gives zeros, the loop cheapest
        return _LoopGemm(counts)
    if path == "grouped_mm":
        return _GroupedMMGemm(counts, device)
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


def choose_gemm_path(device: torch.device, dtype: torch.dtype, counts: Sequence[int], D: int, Fl: int) -> str:
    """The "auto" choice for these rows (deterministic: a function of the counts and shapes).

    CPU: "bmm" when the blocks are equal (capacity mode) or small (mean <= 128 rows and
    max/mean <= 2), else "grouped_mm" for 32 experts or more (when the rows allow it),
    else "loop". CUDA: "grouped_mm" for bf16 on sm >= 90 with aligned
    rows, else "loop" (not measured here: no GPU on the development machines)."""
    N, E = sum(counts), len(counts)
    if N == 0:
        return "loop"
    if device.type == "cuda":
        ok, _ = path_supported("grouped_mm", device, dtype, D, Fl)
        return "grouped_mm" if ok else "loop"
    biggest, mean = max(counts), N / E
    if biggest * E == N or (mean <= _BMM_MAX_MEAN_ROWS and biggest <= _BMM_MAX_PAD * mean):
        return "bmm"
    if E >= _GROUPED_MM_MIN_EXPERTS and path_supported("grouped_mm", device, dtype, D, Fl)[0]:
        return "grouped_mm"
    return "loop"


class _ExpertsFunction(torch.autograd.Function):
    """All local experts' FFN, forward and backward, on ragged expert-major rows."""

    @staticmethod
    def forward(ctx, x, w1, w2, w3, b1, b2, b3, counts, path, activation):
        gemm = make_gemm(path, counts, x.device)
        xg = gemm.pad(x)                       # [N', D]: x itself except for bmm over ragged rows
        h1 = gemm.fwd(xg, w1, b1)              # [N', F]
        h3 = None
        if activation == "swiglu":
            h3 = gemm.fwd(xg, w3, b3)
            a = F.silu(h1).mul_(h3)
        elif activation == "gelu":
            a = F.gelu(h1)
        else:  # relu in place: the backward only needs the output's sign
            a = h1.relu_()
            h1 = None
        y = gemm.unpad(gemm.fwd(a, w2, b2))    # [N, D]
        ctx.save_for_backward(xg, w1, w2, w3, h1, h3, a)
        ctx.gemm, ctx.activation = gemm, activation
        ctx.has_b = (b1 is not None, b2 is not None, b3 is not None)
        return y

    @staticmethod
    def backward(ctx, gy):
        xg, w1, w2, w3, h1, h3, a = ctx.saved_tensors
        gemm, act = ctx.gemm, ctx.activation
        need = ctx.needs_input_grad
        gyg = gemm.pad(gy.contiguous())
        gx = gw1 = gw2 = gw3 = gb1 = gb2 = gb3 = None
        if need[2]:
            gw2 = gemm.wgrad(a, gyg)
        if ctx.has_b[1] and need[5]:
            gb2 = gemm.bias_grad(gyg)
        ga = gemm.dgrad(gyg, w2)               # [N', F]
        del gyg
        gh3 = None
        if act == "swiglu":
            gh3 = F.silu(h1).mul_(ga)          # d/dh3 of silu(h1) * h3
            gh1 = torch.ops.aten.silu_backward.grad_input(ga.mul_(h3), h1, grad_input=ga)
        elif act == "gelu":
            gh1 = torch.ops.aten.gelu_backward.grad_input(ga, h1, grad_input=ga)
        else:
            gh1 = torch.ops.aten.threshold_backward.grad_input(ga, a, 0, grad_input=ga)
        if need[0]:
            gx = gemm.dgrad(gh1, w1)
            if gh3 is not None:
                gemm.dgrad(gh3, w3, out=gx)    # accumulate
            gx = gemm.unpad(gx)
        if need[1]:
            gw1 = gemm.wgrad(xg, gh1)
        if ctx.has_b[0] and need[4]:
            gb1 = gemm.bias_grad(gh1)
        if gh3 is not None:
            if need[3]:
                gw3 = gemm.wgrad(xg, gh3)
            if ctx.has_b[2] and need[6]:
                gb3 = gemm.bias_grad(gh3)
        return gx, gw1, gw2, gw3, gb1, gb2, gb3, None, None, None


class GroupedExperts(nn.Module):
    """All local experts of one MoE layer, each an FFN ``D -> F -> D``.

    Args:
        num_local_experts: experts held here (E).
        hidden, ffn_hidden: D and the full (unsliced) F.
        activation: "gelu" (exact erf), "swiglu" (silu(x w1) * (x w3)) or "relu".
        bias: add b1 (b3) and b2.
        first_expert: global index of local expert 0 (EP rank * num_local_experts).
        etp_size, etp_rank: expert tensor parallelism; this rank holds columns
            ``[etp_rank*F/etp, (etp_rank+1)*F/etp)`` of w1/w3/b1/b3 and the same rows of w2,
            and ``forward`` returns a partial sum (without b2) that the caller reduces.
        init_seed, init_std: expert g's weights are ``global_expert_init(g, ...)`` sliced,
            identical whatever the ep/etp layout.
        dtype: parameter dtype (default: torch's default dtype).
        gemm_path: "auto" | "grouped_mm" | "loop" | "bmm" (see the module docstring).

    Every parameter carries ``moepar_expert = True`` and ``moepar_expert_partition_dim``
    (the dim sliced by etp: 2 for w1/w3, 1 for w2/b1/b3, None for b2).
    """

    def __init__(self, num_local_experts: int, hidden: int, ffn_hidden: int, activation: str = "gelu",
                 bias: bool = False, *, first_expert: int = 0, etp_size: int = 1, etp_rank: int = 0,
                 init_seed: int = 1234, init_std: float | None = None, dtype: torch.dtype | None = None,
                 gemm_path: str = "auto"):
        super().__init__()
        for name, v, lo in (("num_local_experts", num_local_experts, 1), ("hidden", hidden, 1),
                            ("ffn_hidden", ffn_hidden, 1), ("etp_size", etp_size, 1),
                            ("first_expert", first_expert, 0), ("etp_rank", etp_rank, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} must be an integer >= {lo}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
        if ffn_hidden % etp_size:
            raise ValueError(f"ffn_hidden={ffn_hidden} is not divisible by etp_size={etp_size}")
        if etp_rank >= etp_size:
            raise ValueError(f"etp_rank={etp_rank} must be < etp_size={etp_size}")
        if gemm_path not in GEMM_PATHS:
            raise ValueError(f"gemm_path={gemm_path!r} must be one of {GEMM_PATHS}")
        if init_std is not None and not init_std > 0:
            raise ValueError(f"init_std={init_std!r} must be None or > 0")
        self.num_local_experts, self.hidden, self.ffn_hidden = num_local_experts, hidden, ffn_hidden
        self.activation, self.bias = activation, bool(bias)
        self.first_expert, self.etp_size, self.etp_rank = first_expert, etp_size, etp_rank
        self.init_seed, self.init_std = int(init_seed), init_std
        self.gemm_path = gemm_path
        self.ffn_local = ffn_hidden // etp_size
        E, D, Fl = num_local_experts, hidden, self.ffn_local
        dtype = dtype or torch.get_default_dtype()
        swiglu = activation == "swiglu"
        shapes = {"w1": ((E, D, Fl), 2), "w3": ((E, D, Fl), 2), "w2": ((E, Fl, D), 1),
                  "b1": ((E, Fl), 1), "b3": ((E, Fl), 1), "b2": ((E, D), None)}
        for name, (shape, pdim) in shapes.items():
            if (name in ("w3", "b3") and not swiglu) or (name[0] == "b" and not self.bias):
                self.register_parameter(name, None)
                continue
            p = nn.Parameter(torch.empty(shape, dtype=dtype))
            p.moepar_expert = True
            p.moepar_expert_partition_dim = pdim
            setattr(self, name, p)
        self.reset_parameters()

    @staticmethod
    def global_expert_init(g: int, hidden: int, ffn_hidden: int, activation: str, bias: bool,
                           init_seed: int, init_std: float | None) -> dict[str, torch.Tensor]:
        """Full (unsliced) fp32 weights of global expert ``g``: w1 [D, F], w3 [D, F] (swiglu),
        w2 [F, D], and b1 [F], b3 [F], b2 [D] with bias. Drawn in that order from
        ``torch.Generator().manual_seed(f(init_seed, g))``: U(+-1/sqrt(fan_in)) like
        nn.Linear (fan_in D for w1/w3/b1/b3, F for w2/b2) when ``init_std`` is None, else
        N(0, init_std) weights and zero biases."""
        gen = torch.Generator().manual_seed(_expert_seed(init_seed, g))
        D, Fh = hidden, ffn_hidden
        names = ["w1"] + (["w3"] if activation == "swiglu" else []) + ["w2"]
        shapes = {"w1": (D, Fh), "w3": (D, Fh), "w2": (Fh, D), "b1": (Fh,), "b3": (Fh,), "b2": (D,)}
        fan_in = {"w1": D, "w3": D, "w2": Fh, "b1": D, "b3": D, "b2": Fh}
        if bias:
            names += [n.replace("w", "b") for n in names]
        out = {}
        for n in names:
            t = torch.empty(shapes[n])
            if init_std is None:
                bound = 1.0 / math.sqrt(fan_in[n])
                t.uniform_(-bound, bound, generator=gen)
            elif n[0] == "w":
                t.normal_(0.0, init_std, generator=gen)
            else:
                t.zero_()
            out[n] = t
        return out

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw every local expert from its global init (deterministic, layout-free)."""
        lo, hi = self.etp_rank * self.ffn_local, (self.etp_rank + 1) * self.ffn_local
        for e in range(self.num_local_experts):
            full = self.global_expert_init(self.first_expert + e, self.hidden, self.ffn_hidden, self.activation,
                                           self.bias, self.init_seed, self.init_std)
            for name, t in full.items():
                p = getattr(self, name)
                if name in ("w1", "w3"):
                    t = t[:, lo:hi]
                elif name in ("w2", "b1", "b3"):
                    t = t[lo:hi]
                p[e].copy_(t)

    def _counts(self, tokens_per_expert, x_ND: torch.Tensor) -> list[int]:
        if isinstance(tokens_per_expert, torch.Tensor):
            if tokens_per_expert.dim() != 1 or tokens_per_expert.is_floating_point():
                raise ValueError(f"tokens_per_expert must be a 1-D integer tensor, got "
                                 f"{tokens_per_expert.dtype} of shape {tuple(tokens_per_expert.shape)}")
            counts = tokens_per_expert.tolist()   # a host sync if it lives on the GPU
        else:
            counts = [int(c) for c in tokens_per_expert]
        if len(counts) != self.num_local_experts:
            raise ValueError(f"tokens_per_expert has {len(counts)} entries but num_local_experts="
                             f"{self.num_local_experts}")
        if any(c < 0 for c in counts):
            raise ValueError(f"tokens_per_expert={counts} must be >= 0")
        if sum(counts) != x_ND.shape[0]:
            raise ValueError(f"tokens_per_expert sums to {sum(counts)} but x_ND has {x_ND.shape[0]} rows")
        return counts

    def _check_input(self, x_ND: torch.Tensor) -> None:
        if not isinstance(x_ND, torch.Tensor) or x_ND.dim() != 2:
            raise ValueError(f"x_ND must be a 2-D [N, D] tensor, got shape {tuple(getattr(x_ND, 'shape', ()))}")
        if x_ND.shape[1] != self.hidden:
            raise ValueError(f"x_ND has D={x_ND.shape[1]} but the experts have hidden={self.hidden}")
        if x_ND.dtype != self.w1.dtype:
            raise ValueError(f"x_ND dtype {x_ND.dtype} != expert weight dtype {self.w1.dtype}; "
                             f"cast one of them (no implicit upcast of the activations)")
        if x_ND.device != self.w1.device:
            raise ValueError(f"x_ND is on {x_ND.device} but the expert weights are on {self.w1.device}")

    def resolve_gemm_path(self, x_ND: torch.Tensor, counts: Sequence[int]) -> str:
        """The GEMM path ``forward`` uses for these rows (``gemm_path`` unless "auto")."""
        if self.gemm_path == "auto":
            return choose_gemm_path(x_ND.device, x_ND.dtype, counts, self.hidden, self.ffn_local)
        ok, why = path_supported(self.gemm_path, x_ND.device, x_ND.dtype, self.hidden, self.ffn_local)
        if not ok:
            raise ValueError(f"gemm_path={self.gemm_path!r} is not available here: {why}")
        return self.gemm_path

    def forward(self, x_ND: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        """``y_ND [N, D]``: row block e (``tokens_per_expert[e]`` rows, expert-major) through
        local expert e. ``tokens_per_expert``: [E] int64 tensor (best on the CPU) or a list.
        With ``etp_size > 1`` the result is this rank's partial sum and excludes b2."""
        params = (self.w1, self.w2, self.w3, self.b1, self.b2 if self.etp_size == 1 else None, self.b3)
        dev = x_ND.device.type
        if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) != self.w1.dtype:
            # Under autocast the GEMMs run in the autocast dtype (master weights stay fp32;
            # the casts are differentiable), as nn.Linear would.
            dt = torch.get_autocast_dtype(dev)
            x_ND = x_ND.to(dt)
            params = tuple(None if p is None else p.to(dt) for p in params)
            with torch.autocast(dev, enabled=False):
                return self._run(x_ND, tokens_per_expert, params)
        self._check_input(x_ND)
        return self._run(x_ND, tokens_per_expert, params)

    def _run(self, x_ND, tokens_per_expert, params) -> torch.Tensor:
        counts = self._counts(tokens_per_expert, x_ND)
        path = self.resolve_gemm_path(x_ND, counts)
        return _ExpertsFunction.apply(x_ND, *params, counts, path, self.activation)

    def add_output_bias(self, y_ND: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        """``y_ND`` plus b2 on each expert's row block (a no-op without bias). For the
        etp > 1 caller, after it has reduced the partial sums."""
        if self.b2 is None:
            return y_ND
        counts = self._counts(tokens_per_expert, y_ND)
        reps = torch.tensor(counts, dtype=torch.int64, device=y_ND.device)
        return y_ND + torch.repeat_interleave(self.b2, reps, dim=0, output_size=y_ND.shape[0])

    def extra_repr(self) -> str:
        return (f"num_local_experts={self.num_local_experts}, hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, "
                f"activation={self.activation!r}, bias={self.bias}, first_expert={self.first_expert}, "
                f"etp={self.etp_rank}/{self.etp_size}, gemm_path={self.gemm_path!r}")

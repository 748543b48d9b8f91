"""GroupedExperts: every local expert's FFN in one module, weights as single tensors,
computed with grouped GEMMs over expert-major rows.

Legend (docs/moe.md): E local experts (``num_local_experts``), g a global expert's index, D hidden,
Fl = F / etp the ffn hidden this rank holds (``ffn_hidden / etp_size``; F when etp = 1), N rows
(expert-major, the counts say how many rows each expert owns), C slots per expert (padded
capacity).

Parameters: ``w1 [E, D, Fl]``, ``w3 [E, D, Fl]`` (swiglu, clamped_swiglu), ``w2 [E, Fl, D]``;
with ``bias=True`` also ``b1 [E, Fl]``, ``b3 [E, Fl]`` (gated), ``b2 [E, D]``.
Expert FFN: ``y = act(x @ w1 + b1) @ w2 + b2``; swiglu: ``(silu(x@w1+b1) * (x@w3+b3)) @ w2 + b2``.

The forward and backward are one autograd Function that calls the GEMMs directly (no
per-expert autograd graph, no ``torch.cat``, outputs written in place into one buffer),
through one of three GEMM paths (the Function and the paths: ``moepar/moe/experts/function.py``),
all giving the same numbers within float rounding:

* ``"loop"``: a Python loop of ``mm``/``addmm`` with ``out=`` slices of one buffer;
* ``"grouped_mm"``: ``torch.nn.functional.grouped_mm`` (CPU; CUDA with sm >= 90, bf16),
  needs 16-byte aligned rows (D and Fl times the element size a multiple of 16);
* ``"bmm"``: rows padded to ``[E, C, *]`` blocks (C = the largest count), one ``bmm``
  per GEMM; free when the rows already are equal blocks (capacity mode).

``gemm_path="auto"`` picks per device, dtype and shape from the table in
``choose_gemm_path`` (measured, see docs/local.md).

Experts run in segments of consecutive experts whose [rows, Fl] intermediates stay under
``SEGMENT_BYTES`` (heap-sized buffers, no fresh page faults at every call); backward walks
the segments last-first, freeing each as it goes, and gelu/swiglu recompute their output
from the saved pre-activation instead of storing it (docs/local.md).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
import torch.nn as nn


from ... import checks
from .activations import GATED, ClampedSwiGLU, Elementwise
from ..config import HFOptions, MoEConfig, RouterConfig
from .function import ExpertsFunction, check_counts, resolve_gemm_path
from .custom_op import experts_fwd
from ...parallel.fsdp import copy_local

RECEIVE = object()   # GroupedExperts.forward's default: the replicas' copies arrive inside it


_SEED_MIX = 0x9E3779B97F4A7C15   # golden-ratio constant: spreads (seed, g) over the 64-bit space


def _expert_seed(init_seed: int, g: int) -> int:
    """Deterministic per (init_seed, global expert): splitmix64 of the pair."""
    z = (int(init_seed) * _SEED_MIX + int(g) + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """Which experts, and which slice of their FFN, this rank holds: ``num_local_experts``
    consecutive experts from global expert ``first_expert``; with expert tensor parallelism
    (``etp_size`` > 1) columns ``[etp_rank*F/etp, (etp_rank+1)*F/etp)`` of w1/w3/b1/b3 and the
    same rows of w2, ``forward`` then returning a partial sum (without b2) that the caller reduces."""

    num_local_experts: int
    first_expert: int = 0
    etp_size: int = 1
    etp_rank: int = 0

    def __post_init__(self) -> None:
        for name, lo in (("num_local_experts", 1), ("first_expert", 0), ("etp_size", 1), ("etp_rank", 0)):
            checks.int_at_least(name, getattr(self, name), lo)
        if self.etp_rank >= self.etp_size:
            raise ValueError(f"etp_rank={self.etp_rank} must be < etp_size={self.etp_size}")


class GroupedExperts(nn.Module):
    """All local experts of one MoE layer, each an FFN ``D -> F -> D``.

    ``GroupedExperts(config, shard)``: the layer's ``MoEConfig`` (validated there: hidden D,
    ffn_hidden F (full, unsliced), activation, bias, init_seed/init_std, dtype, gemm_path,
    activation_limit/alpha; its ``init_seed`` is the experts' own) and this rank's
    ``ExpertShard``. Expert g's weights are ``global_expert_init(g, ...)`` sliced, identical
    whatever the ep/etp layout. ``GroupedExperts(num_local_experts, hidden, ffn_hidden,
    activation="gelu", bias=False, *, first_expert=0, etp_size=1, etp_rank=0, init_seed=1234,
    init_std=None, dtype=None, gemm_path="auto", activation_limit=7.0, activation_alpha=1.702)``
    is the shortcut that builds both. Activations: "gelu" (exact erf), "swiglu"
    (silu(x w1) * (x w3)), "relu", "clamped_swiglu" (GPT-OSS, ``ClampedSwiGLU``; w1 the gate,
    w3 the up projection), or an elementwise one of ``moepar.moe.experts.activations``.

    Every parameter carries ``moepar_expert = True`` and ``moepar_expert_partition_dim``
    (the dim sliced by etp: 2 for w1/w3, 1 for w2/b1/b3, None for b2).
    """

    replicas = None   # moepar.moe.replication.replicas.Replicas: set by the layer for redundant_experts > 0
    # () -> {name: gradient buffer} for ExpertsFunction's ``grad_buffers``, or None: a subclass
    # holding its tensors in another layout (moepar.hf) has the gradients written into views of
    # its own layout's gradients (no copy into it afterwards).
    weight_grad_buffers = None
    # The config's and the shard's fields, read-only (the names the rest of the package reads).
    hidden = property(lambda self: self.config.hidden)
    ffn_hidden = property(lambda self: self.config.ffn)
    activation = property(lambda self: self.config.activation)
    bias = property(lambda self: self.config.bias)
    init_seed = property(lambda self: self.config.init_seed)
    init_std = property(lambda self: self.config.init_std)
    # gemm_path may be switched on a built module (benchmarks time each path): a new config, validated.
    gemm_path = property(lambda self: self.config.gemm_path,
                         lambda self, path: setattr(self, "config", dataclasses.replace(self.config, gemm_path=path)))
    num_local_experts = property(lambda self: self.shard.num_local_experts)
    first_expert = property(lambda self: self.shard.first_expert)
    etp_size = property(lambda self: self.shard.etp_size)
    etp_rank = property(lambda self: self.shard.etp_rank)

    def __init__(self, config: MoEConfig | int | None = None, shard: ExpertShard | int | None = None, *args,
                 **options):
        super().__init__()
        if not isinstance(config, MoEConfig):   # the keyword form (its arguments may be all keywords)
            config, shard = _shortcut(*[a for a in (config, shard) if a is not None], *args, **options)
        elif args or options or not isinstance(shard, ExpertShard):
            raise ValueError("GroupedExperts(config, shard) takes a MoEConfig and an ExpertShard and nothing else")
        if config.init_seed is None:
            raise ValueError("GroupedExperts needs config.init_seed (the MoE layer sets the one it drew)")
        if shard.etp_size != config.expert_tensor_parallel_size:
            raise ValueError(f"shard etp_size={shard.etp_size} != config expert_tensor_parallel_size="
                             f"{config.expert_tensor_parallel_size}")
        self.config, self.shard = config, shard
        # What ExpertsFunction gets: the name, or the clamped SwiGLU's constants (validated there).
        act = config.activation
        self._act = (ClampedSwiGLU(config.hf.activation_limit, config.hf.activation_alpha)
                     if act == "clamped_swiglu" else Elementwise.of(act) or act)
        self.ffn_local = config.ffn // shard.etp_size
        E, D, Fl = shard.num_local_experts, config.hidden, self.ffn_local
        dtype = config.dtype or torch.get_default_dtype()
        swiglu = config.activation in GATED
        shapes = {"w1": ((E, D, Fl), 2), "w3": ((E, D, Fl), 2), "w2": ((E, Fl, D), 1),
                  "b1": ((E, Fl), 1), "b3": ((E, Fl), 1), "b2": ((E, D), None)}
        for name, (shape, pdim) in shapes.items():
            if (name in ("w3", "b3") and not swiglu) or (name[0] == "b" and not config.bias):
                self.register_parameter(name, None)
                continue
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype)))
        self._partition_dims = {n: pdim for n, (_, pdim) in shapes.items()}
        self.reset_parameters()

    @staticmethod
    def global_expert_init(g: int, hidden: int, ffn_hidden: int, activation: str, bias: bool,
                           init_seed: int, init_std: float | None) -> dict[str, torch.Tensor]:
        """Full (unsliced) fp32 weights of global expert ``g``: w1 [D, F], w3 [D, F] (gated),
        w2 [F, D], and b1 [F], b3 [F], b2 [D] with bias. Drawn in that order from
        ``torch.Generator().manual_seed(f(init_seed, g))``: U(+-1/sqrt(fan_in)) like
        nn.Linear (fan_in D for w1/w3/b1/b3, F for w2/b2) when ``init_std`` is None, else
        N(0, init_std) weights and zero biases."""
        gen = torch.Generator().manual_seed(_expert_seed(init_seed, g))
        D, Fh = hidden, ffn_hidden
        names = ["w1"] + (["w3"] if activation in GATED else []) + ["w2"]
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
        # A parameter FSDP2 sharded (a DTensor) takes its shard of the whole local tensor.
        whole = {n: torch.empty(p.shape, dtype=p.dtype, device="cpu") for n, p in self.named_parameters(recurse=False)
                 if hasattr(p, "to_local")}
        for e in range(self.num_local_experts):
            full = self.global_expert_init(self.first_expert + e, self.hidden, self.ffn_hidden, self.activation,
                                           self.bias, self.init_seed, self.init_std)
            for name, t in full.items():
                p = whole.get(name, getattr(self, name))
                if name in ("w1", "w3"):
                    t = t[:, lo:hi]
                elif name in ("w2", "b1", "b3"):
                    t = t[lo:hi]
                p[e].copy_(t)
        for name, t in whole.items():
            copy_local(getattr(self, name), t)
        # The markers live on the parameter objects, which ``to_empty`` replaces: set here.
        for name, p in self.named_parameters(recurse=False):
            if name in self._partition_dims:
                p.moepar_expert = True
                p.moepar_expert_partition_dim = self._partition_dims[name]

    def weights(self) -> tuple:
        """(w1, w2, w3, b1, b2, b3) in moepar's layouts (None where absent): what the GEMMs
        read. A subclass holding its tensors in another layout returns views of them here."""
        p = self._parameters   # what self.w1 ... reads, without a Python __getattr__ each
        return (p["w1"], p["w2"], p["w3"], p["b1"], p["b2"], p["b3"])

    def _counts(self, tokens_per_expert, x_ND: torch.Tensor, num_blocks: int | None = None) -> list[int]:
        """The counts as a host list (a host read if they live on an accelerator)."""
        if isinstance(tokens_per_expert, torch.Tensor):
            if tokens_per_expert.dim() != 1 or tokens_per_expert.is_floating_point():
                raise ValueError(f"tokens_per_expert must be a 1-D integer tensor, got "
                                 f"{tokens_per_expert.dtype} of shape {tuple(tokens_per_expert.shape)}")
            counts = tokens_per_expert.tolist()
        else:
            counts = [int(c) for c in tokens_per_expert]
        return check_counts(counts, self.num_slots if num_blocks is None else num_blocks, x_ND.shape[0])

    def _both_counts(self, tokens_per_expert, host_counts, x_ND: torch.Tensor):
        """(host list or None, device tensor or None): the host list where it is known or
        free (given, a list, or a CPU tensor), else None; the device counts where given."""
        if host_counts is not None:
            host = check_counts(list(host_counts), self.num_slots, x_ND.shape[0])
        elif not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.device.type == "cpu":
            host = self._counts(tokens_per_expert, x_ND)
        elif x_ND.shape[0] == 0:
            host = [0] * self.num_slots
        else:
            host = None
        dev = None
        if isinstance(tokens_per_expert, torch.Tensor) and tokens_per_expert.device == x_ND.device:
            dev = tokens_per_expert
        return host, dev

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

    def resolve_gemm_path(self, x_ND: torch.Tensor, counts: Sequence[int] | None) -> str:
        """The GEMM path ``forward`` uses for these rows (``gemm_path`` unless "auto")."""
        return resolve_gemm_path(self.gemm_path, x_ND.device, x_ND.dtype, counts, self.hidden, self.ffn_local,
                                 x_ND.shape[0])

    def forward(self, x_ND: torch.Tensor, tokens_per_expert, segment_experts: Sequence[int] | None = None, *,
                host_counts: Sequence[int] | None = None, copies=RECEIVE) -> torch.Tensor:
        """``y_ND [N, D]``: row block e (``tokens_per_expert[e]`` rows, expert-major) through
        local expert e. ``tokens_per_expert``: [E] int64 tensor on x's device, or a list;
        ``host_counts``: the same on the host when the caller knows them. On an accelerator
        with device counts only, the grouped-GEMM path reads nothing back to the host (the
        other paths read the counts once). With ``etp_size > 1`` the result is this rank's
        partial sum (b2 included on expert-TP rank 0 only). With ``replicas`` (set by the
        layer for ``redundant_experts``) the blocks are this rank's slots
        (``moepar.moe.replication.replicas``), whose remote copies arrive here unless the caller passes
        ``copies`` (``receive_copies()``, e.g. from outside an activation recompute).

        ``segment_experts`` (optional): the rows are blocks in any order, block i
        (``tokens_per_expert[i]`` rows) going through local expert ``segment_experts[i]``
        (e.g. the source-rank-major rows of an all-to-all, which then need no regrouping
        copy). Runs the loop GEMM path, one product per block on the expert's weights in
        place, weight gradients accumulated per expert."""
        dt = self._compute_dtype(x_ND)
        params, rebuild, b2 = self._gemm_params(dt), None, None
        if self.replicas is not None:   # local experts [L, ...] -> this rank's slots [H, ...]
            params, rebuild = self._slot_params(params, copies, dt)
        if self.etp_size > 1:   # partial sums: b2 is added after the GEMMs, once over the group
            params, b2 = params[:4] + (None,) + params[5:], params[4]
        if dt is not None:
            # Under autocast the GEMMs run in the autocast dtype (master weights stay fp32;
            # the casts, before the copies travel, are differentiable), as nn.Linear would.
            x_ND = x_ND.to(dt)
            with torch.autocast(x_ND.device.type, enabled=False):
                y_ND = self._run(x_ND, tokens_per_expert, params, segment_experts, host_counts, rebuild)
        else:
            self._check_input(x_ND)
            y_ND = self._run(x_ND, tokens_per_expert, params, segment_experts, host_counts, rebuild)
        return y_ND if b2 is None else self._add_partial_bias(y_ND, b2, tokens_per_expert, host_counts)

    def _slot_params(self, params: tuple, copies, dt):
        """(this rank's slots' weights, the function the backward assembles them again with,
        or None): the owners' weights and the copies that arrived (received here unless given)."""
        if copies is RECEIVE:
            copies = self.replicas.receive(params)
        params, again = self.replicas.assemble(params, copies)
        if again is None:
            return params, None
        return params, lambda: again(self._gemm_params(dt))[:3]   # autograd keeps no slot weights

    def _add_partial_bias(self, y_ND, b2, tokens_per_expert, host_counts):
        """Every expert-TP rank adds its copy of b2, rank 0 with weight 1 and the others with 0:
        the reduction of the partial sums adds it once, and b2 has a gradient on every rank
        (zero off rank 0). A parameter used on some ranks only would be left out of FSDP2's
        reduce-scatter there: mismatched collectives, a hang."""
        return self._add_bias(y_ND, b2 if self.etp_rank == 0 else b2 * 0.0, tokens_per_expert, host_counts)

    def _compute_dtype(self, x_ND: torch.Tensor) -> torch.dtype | None:
        """The autocast dtype the GEMMs run in, None outside autocast (or where it is the weights')."""
        dev = x_ND.device.type
        if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) != self.w1.dtype:
            return torch.get_autocast_dtype(dev)
        return None

    def _gemm_params(self, dt: torch.dtype | None) -> tuple:
        """(w1, w2, w3, b1, b2, b3) as the GEMMs read them: cast to ``dt`` where given
        (differentiable; None entries stay None)."""
        params = self.weights()
        if dt is None:
            return params
        return tuple(None if p is None else p.to(dt) for p in params)

    def receive_copies(self, x_ND: torch.Tensor):
        """With replicas: the remote copies this rank's slots hold, for ``forward(copies=...)``
        (the weights' all-to-all; None where none travel). Without: None."""
        if self.replicas is None:
            return None
        return self.replicas.receive(self._gemm_params(self._compute_dtype(x_ND)))

    @property
    def num_slots(self) -> int:
        """Row blocks ``forward`` takes: the local experts, or with replicas this rank's slots."""
        return self.num_local_experts if self.replicas is None else self.replicas.slots_per_rank

    def _run(self, x_ND, tokens_per_expert, params, segment_experts=None, host_counts=None,
             rebuild=None) -> torch.Tensor:
        if segment_experts is not None:
            seg = [int(e) for e in segment_experts]
            if any(not 0 <= e < self.num_slots for e in seg):
                raise ValueError(f"segment_experts={seg} must lie in [0, {self.num_slots}) (the local experts or slots)")
            counts = self._counts(tokens_per_expert, x_ND, len(seg))
            return ExpertsFunction.apply(x_ND, *params, (counts, None, "loop", self._act, seg, rebuild,
                                                         self.weight_grad_buffers))
        # The custom op takes the built-in activation names only: the others stay eager.
        if (torch.compiler.is_compiling() and isinstance(tokens_per_expert, torch.Tensor)
                and isinstance(self._act, str)):
            # Traced: the counts' host read happens inside a custom op (no graph break).
            return experts_fwd(x_ND, *params, tokens_per_expert, self.gemm_path, self.activation)
        counts, counts_dev = self._both_counts(tokens_per_expert, host_counts, x_ND)
        path = self.resolve_gemm_path(x_ND, counts)
        if counts is None and path != "grouped_mm":   # the other paths size their GEMMs on the host
            counts = self._counts(tokens_per_expert, x_ND)
        return ExpertsFunction.apply(x_ND, *params, (counts, counts_dev, path, self._act, None, rebuild,
                                                     self.weight_grad_buffers))

    def _add_bias(self, y_ND: torch.Tensor, b2: torch.Tensor, tokens_per_expert, host_counts) -> torch.Tensor:
        """``y_ND`` plus b2 [S, D] on each block's rows (device counts where given: no host read)."""
        if isinstance(tokens_per_expert, torch.Tensor) and tokens_per_expert.device == y_ND.device:
            reps = tokens_per_expert
        else:
            counts = host_counts if host_counts is not None else self._counts(tokens_per_expert, y_ND)
            reps = torch.tensor(list(counts), dtype=torch.int64, device=y_ND.device)
        return y_ND + torch.repeat_interleave(b2, reps, dim=0, output_size=y_ND.shape[0])

    def extra_repr(self) -> str:
        return (f"num_local_experts={self.num_local_experts}, hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, "
                f"activation={self.activation!r}, bias={self.bias}, first_expert={self.first_expert}, "
                f"etp={self.etp_rank}/{self.etp_size}, gemm_path={self.gemm_path!r}")


def _shortcut(num_local_experts: int, hidden: int | None = None, ffn_hidden: int | None = None,
              activation: str = "gelu", bias: bool = False, *, first_expert: int = 0, etp_size: int = 1,
              etp_rank: int = 0, init_seed: int = 1234, activation_limit: float = 7.0,
              activation_alpha: float = 1.702, **config) -> tuple[MoEConfig, ExpertShard]:
    """The keyword form's (config, shard): the experts alone, as a one-rank layer's."""
    shard = ExpertShard(num_local_experts, first_expert, etp_size, etp_rank)
    if hidden is None or ffn_hidden is None:
        raise ValueError(f"GroupedExperts({num_local_experts!r}, hidden={hidden!r}, ffn_hidden={ffn_hidden!r}) "
                         f"needs hidden and ffn_hidden (or pass a MoEConfig and an ExpertShard)")
    if not checks.is_int(ffn_hidden) or not checks.is_int(etp_size) or ffn_hidden % etp_size:
        raise ValueError(f"ffn_hidden={ffn_hidden!r} is not divisible by etp_size={etp_size}")
    E = first_expert + num_local_experts
    # The experts take no routing options; a k=1 router config fits even one expert.
    cfg = MoEConfig(hidden, E, router=RouterConfig(hidden, E, k=1), ffn_hidden=ffn_hidden, activation=activation,
                    bias=bias, expert_tensor_parallel_size=etp_size, init_seed=init_seed,
                    hf=HFOptions(activation_limit=activation_limit, activation_alpha=activation_alpha), **config)
    return cfg, shard

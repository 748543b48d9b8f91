"""``moepar.MoE``: router + dispatcher + grouped experts (+ shared experts).

Legend: T tokens (all leading dims of x flattened), D hidden, F expert ffn, E experts,
K top-k, L = E/ep local experts.

Collectives per layer (b = activation bytes; R = routes this rank dispatches = (T/tp)*K
dropless, E*C/tp*... rows padded): see docs/moe.md for the table the cost model prices.
  forward : [ep>1] counts all-to-all (tiny) + token all-to-all R*D*b, [etp>1] all-gather
            etp*M*D*b, [etp>1] reduce-scatter etp*M*D*b, [ep>1] token all-to-all back,
            [tp>1, not SP] all-gather of the outputs T*D*b, [shared, tp>1] all-reduce T*D*b
  backward: the mirrors: 2 token all-to-alls, [etp>1] reduce-scatter + all-gather,
            [tp>1, not SP] all-gather of dX (T*D*b) and of d(weights) (T*K*4),
            [shared, tp>1] all-reduce of dX.
  dedup (dispatcher, MOEPAR_DEDUP): token all-to-alls of f*R*D*b plus a side all-to-all of
            f*R*2K*4 each way (f = rows per route: one row per token and destination rank).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

from ..parallel import comm
from ..parallel.groups import ParallelState, get_parallel_state
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .dispatcher import Dispatcher
from .experts import GroupedExperts
from .layer_options import SharedExpertGate, routes_as_rows, sum_routes   # issue 18
from .router import TopKRouter


@dataclasses.dataclass
class MoEStats:
    """What the last forward (and its backward) did on this rank."""

    tokens_per_expert: torch.Tensor | None = None  # [E] kept routes per global expert (this rank's router)
    routes: int = 0                                 # T*K routes the router produced
    dropped: torch.Tensor | None = None             # scalar: routes dropped for capacity
    comm: comm.CommStats = dataclasses.field(default_factory=comm.CommStats)

    @property
    def dropped_fraction(self) -> float:
        if self.dropped is None or self.routes == 0:
            return 0.0
        return float(self.dropped) / self.routes

    def comm_bytes(self, op: str | None = None, backward: bool | None = None) -> int:
        return sum(e.nbytes for e in self.comm.events
                   if (op is None or e.op == op) and (backward is None or e.backward == backward))


class SharedExperts(nn.Module):
    """A dense FFN every token passes through, TP-sliced like Megatron's MLP
    (column-parallel in, row-parallel out: one all-reduce forward, one backward)."""

    def __init__(self, hidden: int, ffn_hidden: int, activation: str, state: ParallelState,
                 sequence_parallel: bool, init_seed: int, init_std: float | None, dtype,
                 gate: bool = False):   # issue 18: gate = Qwen2-MoE's shared_expert_gate
        super().__init__()
        self.activation = activation
        kw = dict(bias=False, state=state, sequence_parallel=sequence_parallel, init_std=init_std, dtype=dtype)
        self.w1 = ColumnParallelLinear(hidden, ffn_hidden, init_seed=init_seed, **kw)
        self.w3 = (ColumnParallelLinear(hidden, ffn_hidden, init_seed=init_seed + 1, **kw)
                   if activation == "swiglu" else None)
        self.w2 = RowParallelLinear(ffn_hidden, hidden, init_seed=init_seed + 2, **kw)
        # issue 18: sigmoid(x . w_gate) [T, 1] scales the output (weight [1, D] at self.gate.weight)
        self.gate = SharedExpertGate(hidden, init_seed + 3, sequence_parallel, dtype) if gate else None

    def forward(self, x: torch.Tensor, sequence_sizes: list[int] | None = None) -> torch.Tensor:
        """``sequence_sizes``: with sequence parallelism, every TP rank's token count."""
        h = self.w1(x, sequence_sizes)
        if self.activation == "swiglu":
            h = F.silu(h) * self.w3(x, sequence_sizes)
        elif self.activation == "gelu":
            h = F.gelu(h)
        else:
            h = F.relu(h)
        y = self.w2(h, sequence_sizes)
        return y if self.gate is None else self.gate(x) * y   # issue 18


class MoE(nn.Module):
    """Mixture-of-Experts feed-forward layer with expert parallelism.

    ``MoE(hidden, num_experts, ep_size)`` is a drop-in for a dense MLP: ``forward(x)`` takes
    ``[..., hidden]`` and returns the same shape. The parallel layout comes from ``state``
    (default: the last ``moepar.init_parallel``); ``ep_size`` and
    ``expert_tensor_parallel_size`` must match it. Routing options are ``TopKRouter``'s.
    ``aux_loss_scope``: "local" computes the aux/z statistics over this replica's batch
    (DeepSpeed's behaviour); "global" over the whole global batch (all data-parallel
    replicas), which makes training independent of the dp size.
    ``sequence_parallel=True`` means x holds this TP rank's own slice of the tokens (the
    slices may differ in length; the aux-loss statistics are then summed over the TP group);
    otherwise x is replicated over the TP group and each TP rank dispatches a 1/tp share of it.
    Options for Hugging Face families (docs/hf.md): ``router_bias``; ``shared_expert_gate``
    (Qwen2-MoE: the shared output times sigmoid(x . w_gate)); ``score_before_experts``
    (Llama 4: each route's input scaled by its weight, outputs summed with weight 1);
    ``activation="clamped_swiglu"`` with ``activation_limit``/``activation_alpha`` (GPT-OSS);
    ``group_score``/``group_score_topn``, ``expert_capacity``, ``aux_loss_convention``,
    ``noise_eps`` as in ``TopKRouter``.
    """

    def __init__(self, hidden: int, num_experts: int, ep_size: int = 1, *, k: int = 2,
                 ffn_hidden: int | None = None, activation: str = "gelu", bias: bool = False,
                 capacity_factor: float | None = None, eval_capacity_factor: float | None = None,
                 min_capacity: int = 4, drop_policy: str = "probs", pad_to_capacity: bool = False,
                 score_func: str = "softmax", normalize_weights: bool | None = None,
                 scaling_factor: float = 1.0, noisy_gate_policy: str | None = None,
                 aux_loss: str | None = "switch", aux_loss_coeff: float = 1e-2, seq_len: int | None = None,
                 aux_loss_scope: str = "local",
                 z_loss_coeff: float = 0.0, expert_bias: bool = False, num_groups: int | None = None,
                 topk_groups: int | None = None, num_shared_experts: int = 0,
                 shared_ffn_hidden: int | None = None, expert_tensor_parallel_size: int = 1,
                 sequence_parallel: bool = False, state: ParallelState | None = None,
                 init_seed: int | None = None, init_std: float | None = None,
                 use_kernels: bool | None = None, gemm_path: str = "auto", checkpoint_experts: bool = False,
                 dtype: torch.dtype | None = None,
                 # issue 18: options for Hugging Face families (moepar.hf; docs/hf.md)
                 shared_expert_gate: bool = False, router_bias: bool = False, score_before_experts: bool = False,
                 activation_limit: float = 7.0, activation_alpha: float = 1.702, noise_eps: float = 1e-2,
                 group_score: str = "sum_topn", group_score_topn: int | None = None,
                 expert_capacity: int | None = None, aux_loss_convention: str = "moepar"):
        super().__init__()
        state = state if state is not None else get_parallel_state()
        self._check_layout(hidden, num_experts, ep_size, expert_tensor_parallel_size, state)
        self.state = state
        self.hidden, self.num_experts, self.k = hidden, num_experts, k
        self.ep, self.etp, self.tp = state.ep_size, state.etp_size, state.tp_size
        self.sequence_parallel = sequence_parallel
        if aux_loss_scope not in ("local", "global"):
            raise ValueError(f"aux_loss_scope={aux_loss_scope!r} must be 'local' or 'global'")
        self.aux_loss_scope = aux_loss_scope
        self.pad_to_capacity = pad_to_capacity
        # issue 18: Llama 4 scales each route's input by its weight, not its output
        self.score_before_experts = bool(score_before_experts)
        if shared_expert_gate and not num_shared_experts:
            raise ValueError("shared_expert_gate=True needs num_shared_experts >= 1 (it gates their output)")
        if num_shared_experts and activation == "clamped_swiglu":
            raise ValueError("activation='clamped_swiglu' is for the routed experts only; shared experts "
                             "take 'swiglu', 'gelu' or 'relu'")
        # Recompute the expert FFNs in backward instead of storing [M, F] activations; the
        # dispatch collectives sit outside the recomputed region, so none is re-run.
        self.checkpoint_experts = checkpoint_experts
        ffn_hidden = ffn_hidden or 4 * hidden
        if init_seed is None:  # same on every rank: init_parallel seeded the default RNG alike
            init_seed = int(torch.randint(0, 2 ** 30, ()))
        self.router = TopKRouter(
            hidden, num_experts, k, score_func=score_func, normalize_weights=normalize_weights,
            scaling_factor=scaling_factor, expert_bias=expert_bias, num_groups=num_groups,
            topk_groups=topk_groups, noisy_gate_policy=noisy_gate_policy, capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor, min_capacity=min_capacity, drop_policy=drop_policy,
            pad_to_capacity=pad_to_capacity, aux_loss=aux_loss, aux_loss_coeff=aux_loss_coeff,
            seq_len=seq_len, z_loss_coeff=z_loss_coeff, nonfinite="propagate", use_kernel=use_kernels,
            init_seed=init_seed, init_std=init_std,
            bias=router_bias, noise_eps=noise_eps, group_score=group_score,   # issue 18
            group_score_topn=group_score_topn, expert_capacity=expert_capacity,
            aux_loss_convention=aux_loss_convention)
        if sequence_parallel and self.tp > 1:
            for p in self.router.parameters():  # fed only this rank's tokens: grads summed over TP
                p.sequence_parallel = True
        self.num_local_experts = num_experts // self.ep
        self.experts = GroupedExperts(
            self.num_local_experts, hidden, ffn_hidden, activation, bias,
            first_expert=state.ep_rank * self.num_local_experts, etp_size=self.etp, etp_rank=state.etp_rank,
            init_seed=init_seed + 1, init_std=init_std, dtype=dtype, gemm_path=gemm_path,
            activation_limit=activation_limit, activation_alpha=activation_alpha)   # issue 18
        self.shared = None
        if num_shared_experts:
            self.shared = SharedExperts(hidden, shared_ffn_hidden or ffn_hidden * num_shared_experts,
                                        activation, state, sequence_parallel, init_seed + 2, init_std, dtype,
                                        gate=shared_expert_gate)   # issue 18
        self._stats = MoEStats()
        self.dispatcher = Dispatcher(num_experts, state.ep_group, state.etp_group,
                                     None if sequence_parallel else state.tp_group, stats=self._stats.comm)
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None

    @staticmethod
    def _check_layout(hidden, num_experts, ep_size, etp_size, state) -> None:
        for name, v in (("hidden", hidden), ("num_experts", num_experts), ("ep_size", ep_size),
                        ("expert_tensor_parallel_size", etp_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if ep_size != state.ep_size:
            raise ValueError(f"ep_size={ep_size} does not match the parallel state's expert_parallel_size="
                             f"{state.ep_size}; call moepar.init_parallel(expert_parallel_size={ep_size}) "
                             f"first or pass ep_size={state.ep_size}")
        if etp_size != state.etp_size:
            raise ValueError(f"expert_tensor_parallel_size={etp_size} does not match the parallel state's "
                             f"expert_tensor_parallel_size={state.etp_size}")
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")

    @property
    def stats(self) -> MoEStats:
        """Tokens per expert, dropped routes and the collectives of the last forward/backward."""
        return self._stats

    def _input_error(self, x: torch.Tensor) -> str | None:
        if x.dim() < 1 or x.shape[-1] != self.hidden:
            return f"x's last dim is {tuple(x.shape)[-1:] or '()'} but the MoE layer has hidden={self.hidden}"
        if not x.is_floating_point():
            return f"x must be a floating-point tensor, got {x.dtype}"
        return self.router.config.input_error(x.numel() // self.hidden)   # issue 18: seq_len tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        error = self._input_error(x)
        if error is not None:  # tell the EP peers before raising, so nobody hangs
            self.dispatcher.preflight_error(error, int(x.shape[-1]) if x.dim() else 0, x.dtype)
        shape = x.shape
        x_TD = x.reshape(-1, self.hidden)
        self._stats.comm.reset()
        routing = self.router(x_TD, stats_group=self._aux_group())
        capacity = routing.capacity if self.pad_to_capacity else None
        # Dropless routing drops nothing: passing no mask keeps the row count static (T*K),
        # which torch.compile can trace without a data-dependent shape.
        dropped = routing.dropped if routing.capacity is not None else None
        x_rows, ids, w = x_TD, routing.expert_ids, routing.weights
        if self.score_before_experts:   # issue 18: route rows scaled by their weight, combined with 1
            x_rows, ids, dropped, w = routes_as_rows(x_TD, ids, w, dropped)
        # Source-major rows (no regroup copy) when the experts can take them: not under
        # torch.compile (its custom op takes expert-major rows) and without expert TP.
        source_ok = self.etp == 1 and not torch.compiler.is_compiling()
        x_local, meta = self.dispatcher.dispatch(x_rows, ids, dropped, w, capacity,   # issue 18: x_rows, ids, w
                                                 source_major=source_ok)
        counts, seg = ((meta.tokens_per_local_expert, None) if meta.segment_experts is None
                       else (meta.segment_counts, meta.segment_experts))
        if self.checkpoint_experts and torch.is_grad_enabled():
            y_local = torch.utils.checkpoint.checkpoint(self.experts, x_local, counts, seg, use_reentrant=False)
        else:
            y_local = self.experts(x_local, counts, seg)
        if self.etp > 1 and self.state.etp_rank == 0:  # partial sums: add the output bias once
            y_local = self.experts.add_output_bias(y_local, meta.tokens_per_local_expert)
        y_TD = self.dispatcher.combine(y_local, meta)
        if self.score_before_experts:   # issue 18
            y_TD = sum_routes(y_TD, x_TD.shape[0])
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD, self._sequence_sizes(x_TD))
        self.aux_loss, self.z_loss = routing.aux_loss, routing.z_loss
        if self.aux_loss_scope == "global" and self.state.dp_size > 1:
            # Each replica back-propagates only its own tokens' share of the global loss and
            # allreduce_gradients averages over dp: scale the share by dp so the result is
            # the gradient of the global-batch loss (the forward value is unchanged).
            self.aux_loss = _scale_grad(self.aux_loss, self.state.dp_size)
            self.z_loss = _scale_grad(self.z_loss, self.state.dp_size)
        self._stats.tokens_per_expert = routing.tokens_per_expert.detach()
        self._stats.routes = routing.expert_ids.numel()
        self._stats.dropped = routing.dropped.sum().detach()
        return y_TD.reshape(shape)

    def _sequence_sizes(self, x_TD: torch.Tensor) -> list[int] | None:
        """Under sequence parallelism, every TP rank's token count (one small all-gather
        over the TP group), so that the shared experts' all-gather and reduce-scatter agree
        on the sizes also where the TP ranks' slices differ (a token count not divisible by
        tp, a rank with no tokens). None without SP or TP."""
        if not self.sequence_parallel or self.tp == 1:
            return None
        group = self.state.tp_group
        n = torch.tensor([[x_TD.shape[0]]], dtype=torch.int64, device=comm.small_device(group, x_TD))
        return comm.all_gather_rows(n, group, stats=self._stats.comm).flatten().tolist()

    def _aux_group(self):
        """The ranks whose tokens the aux/z statistics cover (None: this rank alone).

        local: this model replica's batch (the TP group's tokens under SP, else this rank's,
        which the TP ranks share). global: the whole global batch across data parallelism
        (Megatron-Core's global-batch load balancing), so the loss does not depend on dp.
        """
        st = self.state
        if self.aux_loss_scope == "global":
            if self.sequence_parallel:
                return dist.group.WORLD if st.world_size > 1 else None
            return st.dp_group
        return st.tp_group if self.sequence_parallel else None

    def update_expert_bias(self, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step (``expert_bias=True``): loads summed over the world."""
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        self.router.update_expert_bias(rate, group=group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def _scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    return _ScaleGrad.apply(x, scale) if x.requires_grad else x


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of every MoE layer's aux loss and z-loss from its last forward (0 if none)."""
    total = None
    for m in model.modules():
        if isinstance(m, MoE):
            for t in (m.aux_loss, m.z_loss):
                if t is not None:
                    total = t if total is None else total + t
    return total if total is not None else torch.zeros(())

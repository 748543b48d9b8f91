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
  dedup (MoEConfig.dedup): token all-to-alls of f*R*D*b plus a side all-to-all of
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
from .config import MoEConfig, make_config
from .dispatcher import Dispatcher, dtype_code, dtype_name
from .experts import GroupedExperts
from .guard import GroupLoad
from .layer_options import SharedExpertGate, routes_as_rows, sum_routes
from .router import TopKRouter


@dataclasses.dataclass
class MoEStats:
    """What the last forward (and its backward) did on this rank."""

    tokens_per_expert: torch.Tensor | None = None  # [E] kept routes per global expert (this rank's router)
    routes: int = 0                                 # T*K routes the router produced
    dropped: torch.Tensor | None = None             # scalar: routes dropped for capacity + by the receive guard
    comm: comm.CommStats = dataclasses.field(default_factory=comm.CommStats)
    # The EP group's load from the counts exchange (moepar.moe.guard.GroupLoad; None in
    # padded capacity mode): overload factors, the receive guard's cap and drops.
    load: GroupLoad | None = None
    capacity_dropped: torch.Tensor | None = None    # scalar: the router's capacity drops alone
    # The token exchange form the dispatch took (DispatchMeta.exchange_form): "padded" |
    # "dedup" | "source_major" | "regroup" | "direct"; the same on every rank of an EP group.
    exchange_form: str | None = None

    @property
    def dropped_fraction(self) -> float:
        """Fraction of the router's routes dropped, for capacity or by the receive guard.
        Under TP without SP the guard cuts this TP rank's share of the tokens: its part is
        the share's fraction of the routes kept after capacity (exact elsewhere)."""
        if self.dropped is None or self.routes == 0:
            return 0.0
        cap = float(self.capacity_dropped if self.capacity_dropped is not None else self.dropped)
        guard = self.load.guard_dropped if self.load is not None else 0
        if guard == 0:
            return cap / self.routes
        kept = 1.0 - cap / self.routes
        return cap / self.routes + kept * guard / max(self.load.dispatched, 1)

    @property
    def expert_overload(self) -> float | None:
        """max / mean routes per expert over the EP group (before the guard)."""
        return None if self.load is None else self.load.expert_overload

    @property
    def rank_overload(self) -> float | None:
        """max / mean rows received per EP rank (before the guard)."""
        return None if self.load is None else self.load.rank_overload

    def comm_bytes(self, op: str | None = None, backward: bool | None = None) -> int:
        return sum(e.nbytes for e in self.comm.events
                   if (op is None or e.op == op) and (backward is None or e.backward == backward))


class SharedExperts(nn.Module):
    """A dense FFN every token passes through, TP-sliced like Megatron's MLP
    (column-parallel in, row-parallel out: one all-reduce forward, one backward).
    ``gate``: Qwen2-MoE's shared_expert_gate, sigmoid(x . w_gate) [T, 1] scaling the output
    (``self.gate.weight`` [1, D]; None without it)."""

    def __init__(self, hidden: int, ffn_hidden: int, activation: str, state: ParallelState,
                 sequence_parallel: bool, init_seed: int, init_std: float | None, dtype, gate: bool = False):
        super().__init__()
        self.activation = activation
        kw = dict(bias=False, state=state, sequence_parallel=sequence_parallel, init_std=init_std, dtype=dtype)
        self.w1 = ColumnParallelLinear(hidden, ffn_hidden, init_seed=init_seed, **kw)
        self.w3 = (ColumnParallelLinear(hidden, ffn_hidden, init_seed=init_seed + 1, **kw)
                   if activation == "swiglu" else None)
        self.w2 = RowParallelLinear(ffn_hidden, hidden, init_seed=init_seed + 2, **kw)
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
        return y if self.gate is None else self.gate(x) * y


class MoE(nn.Module):
    """Mixture-of-Experts feed-forward layer with expert parallelism.

    ``MoE(hidden, num_experts, ep_size)`` is a drop-in for a dense MLP: ``forward(x)`` takes
    ``[..., hidden]`` and returns the same shape. Options: a ``MoEConfig`` as ``config``,
    and/or its fields (and the nested ``RouterConfig``'s: k, capacity_factor, aux_loss, ...)
    as keywords, which fill it (``moepar.moe.config``, where each option is documented).
    The parallel layout comes from ``state`` (default: the last ``moepar.init_parallel``);
    ``ep_size`` and ``expert_tensor_parallel_size`` must match it. The process groups are
    read from ``state`` at every call, never kept here.

    Attributes: ``config``, ``router`` (TopKRouter), ``experts`` (GroupedExperts),
    ``shared`` (SharedExperts or None), ``dispatcher``, ``stats``, ``aux_loss``, ``z_loss``.
    """

    def __init__(self, hidden: int, num_experts: int, ep_size: int = 1, config: MoEConfig | None = None, *,
                 state: ParallelState | None = None, **options):
        super().__init__()
        self.config = cfg = make_config(hidden, num_experts, ep_size, config, **options)
        state = state if state is not None else get_parallel_state()
        self._check_layout(cfg, state)
        self.state = state
        self.hidden, self.num_experts, self.k = hidden, num_experts, cfg.router.k
        self.ep, self.etp, self.tp = state.ep_size, state.etp_size, state.tp_size
        self.sequence_parallel, self.aux_loss_scope = cfg.sequence_parallel, cfg.aux_loss_scope
        self.pad_to_capacity = cfg.router.pad_to_capacity
        # Recompute the expert FFNs in backward instead of storing [M, F] activations; the
        # dispatch collectives sit outside the recomputed region, so none is re-run.
        self.checkpoint_experts = cfg.checkpoint_experts
        init_seed = cfg.init_seed
        if init_seed is None:  # same on every rank: init_parallel seeded the default RNG alike
            init_seed = int(torch.randint(0, 2 ** 30, ()))
        router_cfg = dataclasses.replace(cfg.router, init_seed=init_seed)
        self.router = TopKRouter(**{f.name: getattr(router_cfg, f.name) for f in dataclasses.fields(router_cfg)})
        if cfg.sequence_parallel and self.tp > 1:
            for p in self.router.parameters():  # fed only this rank's tokens: grads summed over TP
                p.sequence_parallel = True
        self.num_local_experts = num_experts // self.ep
        self.experts = GroupedExperts(
            self.num_local_experts, hidden, cfg.ffn, cfg.activation, cfg.bias,
            first_expert=state.ep_rank * self.num_local_experts, etp_size=self.etp, etp_rank=state.etp_rank,
            init_seed=init_seed + 1, init_std=cfg.init_std, dtype=cfg.dtype, gemm_path=cfg.gemm_path,
            activation_limit=cfg.activation_limit, activation_alpha=cfg.activation_alpha)
        self.shared = None
        if cfg.num_shared_experts:
            self.shared = SharedExperts(hidden, cfg.shared_ffn, cfg.activation, state, cfg.sequence_parallel,
                                        init_seed + 2, cfg.init_std, cfg.dtype, gate=cfg.shared_expert_gate)
        self._stats = MoEStats()
        self.dispatcher = Dispatcher(num_experts, state=state, sequence_parallel=cfg.sequence_parallel,
                                     stats=self._stats.comm, dedup=cfg.dedup,
                                     receive_capacity_factor=cfg.receive_capacity_factor)
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None

    @staticmethod
    def _check_layout(cfg: MoEConfig, state: ParallelState) -> None:
        if cfg.ep_size != state.ep_size:
            raise ValueError(f"ep_size={cfg.ep_size} does not match the parallel state's expert_parallel_size="
                             f"{state.ep_size}; call moepar.init_parallel(expert_parallel_size={cfg.ep_size}) "
                             f"first or pass ep_size={state.ep_size}")
        if cfg.expert_tensor_parallel_size != state.etp_size:
            raise ValueError(f"expert_tensor_parallel_size={cfg.expert_tensor_parallel_size} does not match the "
                             f"parallel state's expert_tensor_parallel_size={state.etp_size}")

    @property
    def stats(self) -> MoEStats:
        """Tokens per expert, dropped routes and the collectives of the last forward/backward."""
        return self._stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden] -> [..., hidden]``; the steps, each named in docs/moe.md."""
        self._stats.comm.reset()
        self._preflight(x)
        x_TD = x.reshape(-1, self.hidden)
        routing = self.router(x_TD, stats_group=self._aux_group())                   # 1. route
        x_rows, ids, dropped, w = self._dispatched_rows(x_TD, routing)
        x_local, meta = self.dispatcher.dispatch(                                    # 2-4. permute, exchange
            x_rows, ids, dropped, w, routing.capacity if self.pad_to_capacity else None,
            source_major=self.config.cpu_source_major and self.etp == 1 and not torch.compiler.is_compiling())
        y_local = self._run_experts(x_local, meta)                                   # 5. experts
        y_TD = self.dispatcher.combine(y_local, meta)                                # 6-8. back, unpermute, gather
        if self.config.score_before_experts:   # each token's K route rows summed: [T, D]
            y_TD = sum_routes(y_TD, x_TD.shape[0])
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD, self._sequence_sizes(x_TD))
        self._record(routing, meta)
        return y_TD.reshape(x.shape)

    def _preflight(self, x: torch.Tensor) -> None:
        """Raise on every rank when any rank's input is invalid, before the first collective.

        Every rank checks its own x (last dim = hidden, floating point, and finite with
        ``check_finite``), then one all-reduce over the whole world of a [world, 3] int64
        table (error flag, hidden, dtype code per rank: 24*world bytes) tells each rank
        every rank's verdict. The world, not the EP group: the forward also waits in ETP,
        TP and data-parallel collectives, whose peers must raise too. Cost: one tiny
        collective (and its host read) per forward."""
        error = self._input_error(x)
        if error is None and self.config.check_finite and not bool(torch.isfinite(x).all()):
            error = "check_finite=True: non-finite values in the MoE layer input"
        # A layer of a one-rank state (ParallelState.single()) stays local even where a
        # process group exists: it issues no collective at all.
        world = dist.group.WORLD if self.state.world_size > 1 else None
        if world is not None:
            rank, size = dist.get_rank(), dist.get_world_size()
            table = torch.zeros(size, 3, dtype=torch.int64)
            table[rank] = torch.tensor([error is not None, int(x.shape[-1]) if x.dim() else -1, dtype_code(x.dtype)])
            table = comm.all_reduce_(table.to(comm.small_device(world, x)), world, stats=self._stats.comm).cpu()
            bad = torch.nonzero(table[:, 0]).flatten().tolist()
            if error is None and bad:
                error = (f"MoE forward aborted: rank(s) {bad} reported invalid input (see their error); "
                         f"this is rank {rank}")
            elif error is None and (table[:, 2] != table[rank, 2]).any():
                error = (f"MoE forward: the input dtypes {[dtype_name(int(c)) for c in table[:, 2]]} differ across "
                         f"the ranks (by global rank); every rank must pass the same dtype")
        if error is not None:
            raise ValueError(error)

    def _input_error(self, x: torch.Tensor) -> str | None:
        if not isinstance(x, torch.Tensor):
            return f"x must be a tensor, got {type(x).__name__}"
        if x.dim() < 1 or x.shape[-1] != self.hidden:
            return f"x's last dim is {tuple(x.shape)[-1:] or '()'} but the MoE layer has hidden={self.hidden}"
        if not x.is_floating_point():
            return f"x must be a floating-point tensor, got {x.dtype}"
        return self.router.config.input_error(x.numel() // self.hidden)   # whole sequences of seq_len

    def _dispatched_rows(self, x_TD: torch.Tensor, routing):
        """What the dispatcher moves: (rows, expert ids, dropped or None, weights). The tokens
        with their K routes [T, D] / [T, K]; with ``score_before_experts`` (Llama 4) every
        route as its own row scaled by its weight [T*K, D], with ids [T*K, 1] and weight 1."""
        dropped = routing.dropped if routing.capacity is not None else None
        if not self.config.score_before_experts:
            return x_TD, routing.expert_ids, dropped, routing.weights
        return routes_as_rows(x_TD, routing.expert_ids, routing.weights, dropped)

    def _run_experts(self, x_local: torch.Tensor, meta) -> torch.Tensor:
        """Step 5: the local experts on the received rows (expert-major, or source-major
        blocks named by ``meta.segment_experts``); with expert TP the partial sums are
        reduced in ``combine``, so the output bias is added once, on ETP rank 0."""
        counts, seg = ((meta.tokens_per_local_expert, None) if meta.segment_experts is None
                       else (meta.segment_counts, meta.segment_experts))
        if self.checkpoint_experts and torch.is_grad_enabled():
            y_local = torch.utils.checkpoint.checkpoint(self.experts, x_local, counts, seg, use_reentrant=False)
        else:
            y_local = self.experts(x_local, counts, seg)
        if self.etp > 1 and self.state.etp_rank == 0:
            y_local = self.experts.add_output_bias(y_local, meta.tokens_per_local_expert)
        return y_local

    def _record(self, routing, meta) -> None:
        """The losses and statistics of this forward."""
        self.aux_loss, self.z_loss = routing.aux_loss, routing.z_loss
        if self.aux_loss_scope == "global" and self.state.dp_size > 1:
            # Each replica back-propagates only its own tokens' share of the global loss and
            # allreduce_gradients averages over dp: scale the share by dp so the result is
            # the gradient of the global-batch loss (the forward value is unchanged).
            self.aux_loss = _scale_grad(self.aux_loss, self.state.dp_size)
            self.z_loss = _scale_grad(self.z_loss, self.state.dp_size)
        self._stats.tokens_per_expert = routing.tokens_per_expert.detach()
        self._stats.routes = routing.expert_ids.numel()
        self._stats.capacity_dropped = routing.dropped.sum().detach()
        self._stats.load = meta.load
        self._stats.exchange_form = meta.exchange_form
        guard = 0 if meta.load is None else meta.load.guard_dropped
        self._stats.dropped = self._stats.capacity_dropped + guard if guard else self._stats.capacity_dropped

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

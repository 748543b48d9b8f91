"""``moepar.MoE``: router + dispatcher + grouped experts (+ shared experts).

Legend: T tokens (all leading dims of x flattened), D hidden, F expert ffn, E experts,
K top-k, L = E/ep local experts.

The forward reads as its steps (docs/moe.md numbers them; the collectives and their bytes
are rows of ``moepar/moe/traffic.py``, which the cost model prices): route, dispatch (the counts all-gather
over the layer's MoE block, its one host read, then the token all-to-all with the shared
experts computed while it is in flight), the experts, combine. Nothing here reaches wider
than the block: a bad input raises on every rank of the block, in the counts exchange.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.utils.checkpoint
from torch import nn

from ..parallel.groups import ParallelState, get_parallel_state
from .config import MoEConfig, make_config
from .exchange.dispatcher import Dispatcher
from .experts.grouped import ExpertShard, GroupedExperts
from .layer_options import SharedExperts, routes_as_rows, sum_routes
from .replication.replicas import Replicas
from .routing.recompute import LossCell, Record, Replay, attach_losses, in_recompute, keep_scope, tapped
from .stats import MoEStats
from .routing.router import TopKRouter, input_error as routing_input_error
from .traffic import aux_group_name


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
        init_seed = cfg.init_seed
        if init_seed is None:  # same on every rank: init_parallel seeded the default RNG alike;
            # drawn on the CPU also under torch.device("meta") (a CPU draw is no host read)
            init_seed = int(torch.randint(0, 2 ** 30, (), device="cpu"))
        router_cfg = dataclasses.replace(cfg.router, init_seed=init_seed)
        self.router = TopKRouter(router_cfg)
        self._mark_router()
        shard = ExpertShard(self.num_local_experts, state.ep_rank * self.num_local_experts, self.etp, state.etp_rank)
        self.experts = GroupedExperts(dataclasses.replace(cfg, init_seed=init_seed + 1), shard)
        self.replicas = None
        if cfg.exchange.redundant_experts:   # E + X slots per EP group (moepar.moe.replication.replicas)
            self.replicas = self.experts.replicas = Replicas(cfg.num_experts, cfg.exchange.redundant_experts,
                                                             cfg.ep_size, state, stats=None)
        self.shared = None
        if cfg.num_shared_experts:
            self.shared = SharedExperts(hidden, cfg.shared_ffn, cfg.activation, state, cfg.sequence_parallel,
                                        init_seed + 2, cfg.init_std, cfg.dtype, gate=cfg.hf.shared_expert_gate)
        self._stats = MoEStats()
        self.dispatcher = Dispatcher(cfg, state, self._stats.comm)
        if self.replicas is not None:
            self.replicas.stats = self._stats.comm
        self._losses: dict[str, torch.Tensor | None] = {"aux": None, "z": None}
        # Set when the last forward ran under no_grad in training (the reentrant recompute's
        # forward): the losses are then read through taps (moepar.moe.routing.recompute).
        self._loss_cell: LossCell | None = None
        self._replay = Replay()
        # The group the router's statistics span, by name (the table's: moepar.moe.traffic).
        self._aux_group_name = aux_group_name(cfg.aux_loss_scope, cfg.sequence_parallel)

    def reset_parameters(self) -> None:
        """Initialise every parameter and buffer as at construction (the same values for the
        same ``init_seed``), e.g. after ``to_empty`` of a layer built on the meta device:
        the router (weight, bias, ``expert_bias`` to zeros), the experts, the shared experts."""
        self.router.reset_parameters()
        self._mark_router()   # to_empty replaced the parameter objects that carried the marker
        self.experts.reset_parameters()
        if self.shared is not None:
            self.shared.reset_parameters()

    def _mark_router(self) -> None:
        if self.config.sequence_parallel and self.tp > 1:
            for p in self.router.parameters():  # fed only this rank's tokens: grads summed over TP
                p.sequence_parallel = True

    @staticmethod
    def _check_layout(cfg: MoEConfig, state: ParallelState) -> None:
        if cfg.ep_size != state.ep_size:
            raise ValueError(f"ep_size={cfg.ep_size} does not match the parallel state's expert_parallel_size="
                             f"{state.ep_size}; call moepar.init_parallel(expert_parallel_size={cfg.ep_size}) "
                             f"first or pass ep_size={state.ep_size}")
        if cfg.expert_tensor_parallel_size != state.etp_size:
            raise ValueError(f"expert_tensor_parallel_size={cfg.expert_tensor_parallel_size} does not match the "
                             f"parallel state's expert_tensor_parallel_size={state.etp_size}")

    # Read-only views of the config and the layout (one source of truth: ``config``, ``state``).
    hidden = property(lambda self: self.config.hidden)
    num_experts = property(lambda self: self.config.num_experts)
    k = property(lambda self: self.config.router.k)
    sequence_parallel = property(lambda self: self.config.sequence_parallel)
    aux_loss_scope = property(lambda self: self.config.aux_loss_scope)
    pad_to_capacity = property(lambda self: self.config.router.pad_to_capacity)
    # Recompute the expert FFNs in backward instead of storing [M, F] activations; the
    # dispatch collectives sit outside the recomputed region, so none is re-run.
    recompute_experts = property(lambda self: self.config.recompute_experts)
    ep = property(lambda self: self.state.ep_size)
    etp = property(lambda self: self.state.etp_size)
    tp = property(lambda self: self.state.tp_size)
    num_local_experts = property(lambda self: self.config.num_experts // self.state.ep_size)

    @property
    def placement(self):
        """The slot map in use (``moepar.moe.replication.placement.Placement``), None without replicas."""
        return None if self.replicas is None else self.replicas.placement

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """The last forward's load-balancing loss (already x aux_loss_coeff), in the graph."""
        return self._loss("aux")

    @property
    def z_loss(self) -> torch.Tensor | None:
        """The last forward's router z-loss (already x z_loss_coeff), in the graph."""
        return self._loss("z")

    def _loss(self, name: str) -> torch.Tensor | None:
        value, cell = self._losses[name], self._loss_cell
        if value is None or cell is None or not torch.is_grad_enabled():
            return value
        return tapped(value, cell, name)

    def seed_loss_gradient(self, scale: float) -> bool:
        """For a caller that adds this forward's aux and z losses to its loss itself (a
        pipeline stage) when the forward ran without grad inside a reentrant checkpoint: the
        gradient ``scale`` those losses get, applied by the recompute (moepar.moe.routing.recompute).
        False where this forward kept no record (no checkpoint will recompute it)."""
        cell = self._loss_cell
        if cell is None:
            return False
        for name in ("aux", "z"):
            if self._losses[name] is not None:
                cell.add(name, scale)
        return True

    def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
        """DeepSpeed's engine calls this on every module that has it while it is built. The
        layer trains exactly under the engine as ``moepar.deepspeed.initialize`` builds it
        (its experts tagged as DeepSpeed's own); any other engine over a layout that splits
        experts or tensors (Hugging Face's Trainer through accelerate, a plain
        ``deepspeed.initialize`` without moepar's mpu) would silently train it wrong, so it
        is refused here, on every rank, before the engine's first collective."""
        if getattr(next(self.experts.parameters()), "allreduce", True) is False:   # tagged
            return
        from ..deepspeed import plain_engine_error   # the message alone: no DeepSpeed import
        error = plain_engine_error(self.state, mpu=False)
        if error is not None:
            raise ValueError(error)

    @property
    def stats(self) -> MoEStats:
        """Tokens per expert, dropped routes and the collectives of the last forward/backward."""
        return self._stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden] -> [..., hidden]``; the steps, each named in docs/moe.md. A call
        from inside a backward is an activation recompute: it routes as its forward did and
        counts nothing (moepar.moe.routing.recompute)."""
        traced = torch.compiler.is_compiling()   # a traced graph keeps no Python-side records
        recompute = not traced and in_recompute()
        if not recompute:
            self._stats.comm.reset()
            self._loss_cell = None   # set again where this forward keeps a reentrant record
        cfg, router = self.config, self.router
        error = self._input_error(x, cfg, router)
        # A rank whose input is invalid routes an empty batch instead, so that it still meets
        # its peers in every collective up to the counts exchange, where they all raise.
        x_TD = x.reshape(-1, cfg.hidden) if error is None else self._empty_input(x)
        flags = {}
        if cfg.exchange.check_finite and error is None:
            flags["nonfinite_input"] = (~torch.isfinite(x_TD)).sum()
        record = self._replay.find(x_TD) if recompute and self.training else None
        routing = router(x_TD, stats_group=self._aux_group(), defer_checks=True,             # 1. route
                              replay=record, count=not recompute, comm_stats=self._stats.comm)
        scope = keep_scope() if self.training and not traced else None
        if scope is not None:   # a recompute may re-run this forward (a nested one: this recompute)
            routing = self._keep_routing(routing, x_TD, scope, record, recompute)
        if routing.nonfinite is not None:
            flags["nonfinite_logits"] = routing.nonfinite
        x_rows, ids, dropped, w = self._dispatched_rows(x_TD, routing)
        if self.replicas is not None:   # routes -> slots, split among the copies as planned
            ids = self.replicas.route_slots(ids, dropped)
            if self.training and not recompute and not traced:
                self.replicas.record_load(routing.tokens_per_expert)
        during = None
        if self.shared is not None and cfg.exchange.overlap_shared_experts:
            during = lambda tp_tokens: self.shared(x_TD, self._sequence_sizes(tp_tokens),   # noqa: E731
                                                   self._stats.comm)
        x_local, meta, shared_TD = self.dispatcher.dispatch(                              # 2-7. exchange
            x_rows, ids, dropped, w, routing.capacity if cfg.router.pad_to_capacity else None, during=during,
            flags=flags, error=error, trusted=True, tokens=x_TD.shape[0],
            counts_E=routing.tokens_per_expert if self.replicas is None else None)
        y_local = self._run_experts(x_local, meta)                                         # 8. experts
        y_TD = self.dispatcher.combine(y_local, meta)                                      # 9-11. back
        if cfg.hf.score_before_experts:   # each token's K route rows summed: [T, D]
            y_TD = sum_routes(y_TD, x_TD.shape[0])
        if self.shared is not None and shared_TD is None:
            shared_TD = self.shared(x_TD, self._sequence_sizes(meta.tp_tokens), self._stats.comm)
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        if not recompute:
            self._record(routing, meta)                                                    # 12. record
        elif record is not None and record.cell is not None:
            aux, z = self._scaled_losses(routing)
            y_TD = attach_losses(y_TD, aux, z, record.cell)
        return y_TD.reshape(x.shape)

    def _keep_routing(self, routing, x_TD: torch.Tensor, scope, replayed: Record | None, recompute: bool):
        """Keep this training forward's routing where its recompute will find it
        (moepar.moe.routing.recompute); kept on a reentrant checkpoint's node (a no_grad forward),
        with a cell that will carry its losses' gradient: the replayed forward's own cell
        when this is a recompute inside another (nested checkpoints)."""
        graph = scope == "graph"
        cell = None
        if not graph:
            cell = replayed.cell if replayed is not None and replayed.cell is not None else LossCell()
        noise = routing.noise_rng if routing.noise_rng is not None or replayed is None else replayed.noise_rng
        key = self._replay.fingerprint(x_TD) if not graph or routing.weights.requires_grad else None
        record = Record(x_TD.shape[0], routing.expert_ids, routing.dropped_TK, noise, cell, key)
        if not recompute:
            self._loss_cell = cell
        return dataclasses.replace(routing, weights=self._replay.keep(scope, record, routing.weights))

    def _input_error(self, x: torch.Tensor, cfg: MoEConfig, router: TopKRouter) -> str | None:
        """What is wrong with ``x`` here, on the host (no data read), or None."""
        hidden, weight = cfg.hidden, router.weight
        if not isinstance(x, torch.Tensor):
            return f"x must be a tensor, got {type(x).__name__}"
        if x.dim() < 1 or x.shape[-1] != hidden:
            return f"x's last dim is {tuple(x.shape)[-1:] or '()'} but the MoE layer has hidden={hidden}"
        if not x.is_floating_point():
            return f"x must be a floating-point tensor, got {x.dtype}"
        if x.device != weight.device:
            return f"x is on {x.device} but the MoE layer's parameters are on {weight.device}; move one of them"
        return routing_input_error(router.config, x.numel() // hidden)   # whole sequences of seq_len

    def _empty_input(self, x) -> torch.Tensor:
        """[0, hidden] on the layer's device, in x's dtype where x is a floating tensor."""
        ok = isinstance(x, torch.Tensor) and x.is_floating_point()
        return self.router.weight.new_zeros(0, self.hidden, dtype=x.dtype if ok else None)

    def _dispatched_rows(self, x_TD: torch.Tensor, routing):
        """What the dispatcher moves: (rows, expert ids, dropped or None, weights). The tokens
        with their K routes [T, D] / [T, K]; with ``score_before_experts`` (Llama 4) every
        route as its own row scaled by its weight [T*K, D], with ids [T*K, 1] and weight 1.
        Under autocast the rows are cast to its dtype here, once: the all-to-alls carry the
        dtype the experts compute in (half the bytes of fp32 for bf16)."""
        dev = x_TD.device.type
        if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) != x_TD.dtype:
            x_TD = x_TD.to(torch.get_autocast_dtype(dev))
        dropped = routing.dropped_TK
        if not self.config.hf.score_before_experts:
            return x_TD, routing.expert_ids, dropped, routing.weights
        return routes_as_rows(x_TD, routing.expert_ids, routing.weights, dropped)

    def _run_experts(self, x_local: torch.Tensor, meta) -> torch.Tensor:
        """Step 8: the local experts on the received rows (expert-major, or the source-major
        blocks that ``meta.segments`` names); with expert TP the partial sums (the output
        bias from ETP rank 0 alone) are reduced in ``combine``."""
        segments = getattr(meta, "segments", None)
        if segments is not None:
            args, kw = (x_local, segments[1], segments[0]), {}
        else:
            args, kw = (x_local, meta.counts_dev), {"host_counts": meta.counts}
        experts = self.experts
        if self.config.recompute_experts and torch.is_grad_enabled():
            # The replicas' weight all-to-all runs here, once: the recompute re-runs local work only.
            kw["copies"] = experts.receive_copies(x_local)
            return torch.utils.checkpoint.checkpoint(experts, *args, use_reentrant=False, **kw)
        return experts(*args, **kw)

    def _record(self, routing, meta) -> None:
        """The losses and statistics of this forward."""
        aux, z = self._scaled_losses(routing)
        self._losses = {"aux": aux, "z": z}
        self._stats.tokens_per_expert = routing.tokens_per_expert.detach()
        self._stats.routes = routing.expert_ids.numel()
        dropped_TK = routing.dropped_TK   # None when dropless: a zero made once, no op
        self._stats.capacity_dropped = (self.router._zero(routing.weights.device, torch.int64)
                                        if dropped_TK is None else dropped_TK.sum().detach())
        self._stats.load = meta.load
        self._stats.exchange_form = meta.form
        guard = 0 if meta.load is None or meta.load.cap is None else meta.load.guard_dropped   # cap: a guard ran
        self._stats.dropped = self._stats.capacity_dropped + guard if guard else self._stats.capacity_dropped

    def _scaled_losses(self, routing):
        """The aux and z losses as the user's loss takes them."""
        aux, z = routing.aux_loss, routing.z_loss
        if self.config.aux_loss_scope == "global" and self.state.dp_size > 1:
            # Each replica back-propagates only its own tokens' share of the global loss and
            # allreduce_gradients averages over dp: scale the share by dp so the result is
            # the gradient of the global-batch loss (the forward value is unchanged).
            aux, z = _scale_grad(aux, self.state.dp_size), _scale_grad(z, self.state.dp_size)
        return aux, z

    def _sequence_sizes(self, tp_tokens) -> list[int] | None:
        """Under sequence parallelism with TP, every TP rank's token count (from the counts
        exchange), so that the shared experts' all-gather and reduce-scatter agree on the
        sizes also where the TP ranks' slices differ. None otherwise (padded capacity mode:
        equal slices)."""
        if not self.sequence_parallel or self.tp == 1 or tp_tokens is None:
            return None
        return list(tp_tokens)

    def _aux_group(self):
        """The ranks whose tokens the aux/z statistics cover (None: this rank alone).

        local: this model replica's batch (the TP group's tokens under SP, else this rank's,
        which the TP ranks share). global: the whole global batch across data parallelism
        (Megatron-Core's global-batch load balancing), so the loss does not depend on dp.
        """
        name = self._aux_group_name
        if name == "world":   # this pipeline stage's ranks (the world when pp = 1)
            return self.state.stage_group
        return None if name is None else self.state.groups.get(name)

    def update_expert_bias(self, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step (``expert_bias=True``): loads summed over the world."""
        self.router.update_expert_bias(rate, group=self.state.stage_group)   # this stage's ranks


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

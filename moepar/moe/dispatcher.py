"""Token dispatch to the experts' ranks and back: the MoE forward between router and experts.

Legend: T tokens this rank dispatches, D hidden, E global experts, L = E/ep local experts,
K top-k, P the EP group size, B the MoE block's size (``moepar.parallel.groups``).

``dispatch`` (dropless), each step a method or a module, numbered as in docs/moe.md's one
list of the forward's steps (1 is the router's):
  2. ``_tp_share``        with a TP group whose ranks hold the same tokens, keep this TP
                          rank's near-even share of them (a slice: no communication);
  3. ``_exchange_counts`` count the routes per expert on the device, all-gather one row per
                          rank over the MoE block and read it to the host: the forward's
                          one host read (``plan.py``). A bad input on any rank of the block
                          raises on every rank there; the block agrees on the splits, the
                          receive guard's quotas (``guard.py``) and the exchange form;
     ``_apply_guard``     drop the routes past this rank's quotas (receive guard only);
  4-7. the exchange form (``exchange.py``): permute the rows expert-major, start the token
                          all-to-all-v over the EP group, run the caller's ``during`` work
                          (the shared experts) while it is in flight, all-gather over expert
                          TP, regroup the received blocks by local expert.
``combine`` (steps 9-11) undoes them in reverse. Padded capacity mode replaces steps 2-3: its splits are
known on every rank without an exchange, so it reads nothing back to the host. A layer whose
block is one rank (tp = ep = etp = 1) exchanges nothing either.

Its collectives, with their groups and bytes, are rows of the layer's table
(``moepar/moe/traffic.py``), which the cost model prices and tests/test_traffic.py checks
against what a call records; the backward reads nothing back to the host.
The dispatcher keeps no state between calls (``combine`` needs only the metadata) and no
process group: it reads them from the ParallelState at each call.
"""
from __future__ import annotations

import dataclasses

import torch

from moepar_kernels.permute_checks import check_permute_args

from ..parallel import comm
from . import cpu, plan as planning
from .dedup import DEDUP_MAX_FRACTION, dedup_rows
from .exchange import FORMS, Call, DedupMeta, Meta, PaddedMeta, Routes, SourceMajorMeta
from .guard import check_receive_capacity_factor, guard_drops
from .plan import DEDUP_VOTES, SOURCE_MAJOR, Contribution, Topology, dtype_code

__all__ = ["Dispatcher", "Dispatched"]


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """``dispatch``'s result: this rank's expert rows, the metadata ``combine`` needs, and
    what the caller's ``during`` work returned (None without it)."""

    x_local: torch.Tensor
    meta: Meta
    during: torch.Tensor | None = None

    def __iter__(self):   # x_local, meta, during = dispatcher.dispatch(...)
        return iter((self.x_local, self.meta, self.during))


class Dispatcher:
    """Moves routes to the ranks that own their experts and back.

    Groups: ``state`` (a ParallelState, read at every call; ``sequence_parallel=True``: the
    TP ranks' tokens are their own, so no TP share), or an explicit ``ep_group`` alone
    (None = one rank). Global expert g lives on EP rank ``g // L`` as its local expert
    ``g % L``. ``dedup``: "off" | "auto" | "on" (``dedup.py``); ``receive_capacity_factor``:
    None, or f >= 1: no rank receives more than ceil(f x mean) rows (``guard.py``);
    ``source_major``: on gloo with CPU tensors, let the experts take the received rows
    source-major (``cpu.py``); ``padded``: capacity mode (``dispatch`` gets the capacity);
    ``dispatch_fp8``: the dispatch all-to-all's rows in FP8 with block scales (``fp8.py``);
    ``combine_grad_fp8``: the combine's gradient, sent to the experts' ranks, in FP8 too.
    ``stats`` receives every collective's event.
    """

    def __init__(self, num_experts: int, ep_group=None, stats: comm.CommStats | None = None, *, state=None,
                 sequence_parallel: bool = False, dedup: str = "auto", receive_capacity_factor: float | None = None,
                 source_major: bool = False, padded: bool = False, dispatch_fp8: bool = False,
                 combine_grad_fp8: bool = False):
        if state is not None and ep_group is not None:
            raise ValueError("pass either state or an explicit ep_group to the Dispatcher, not both")
        if dedup not in DEDUP_VOTES:
            raise ValueError(f"dedup={dedup!r} must be one of {tuple(DEDUP_VOTES)}")
        check_receive_capacity_factor(receive_capacity_factor)
        self.receive_capacity_factor = receive_capacity_factor
        self._state, self._ep_group = state, ep_group
        self.sequence_parallel, self.dedup = sequence_parallel, dedup
        self.source_major, self.padded, self.dispatch_fp8 = source_major, padded, dispatch_fp8
        self.combine_grad_fp8 = combine_grad_fp8
        self.num_experts, self.stats = num_experts, stats
        self.ep = comm.group_size(self.ep_group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={self.ep}")
        self.num_local = num_experts // self.ep

    @classmethod
    def for_layer(cls, config, state, stats: comm.CommStats | None = None) -> "Dispatcher":
        """The dispatcher of an MoE layer: its options from the layer's ``MoEConfig`` (already
        validated there), its groups from ``state`` at every call."""
        # With redundant experts the exchange runs over the E + R slots, as if each were an expert.
        return cls(config.num_experts + config.redundant_experts, state=state, stats=stats, sequence_parallel=config.sequence_parallel,
                   dedup=config.dedup, receive_capacity_factor=config.receive_capacity_factor,
                   source_major=config.cpu_source_major, padded=config.router.pad_to_capacity,
                   dispatch_fp8=config.dispatch_dtype == "fp8", combine_grad_fp8=config.combine_grad_dtype == "fp8")

    @property
    def ep_group(self):
        return self._state.ep_group if self._state is not None else self._ep_group

    def topology(self) -> Topology:
        """This call's groups (read from the state now, never kept)."""
        if self._state is not None:
            return Topology.of_state(self._state, self.sequence_parallel)
        return Topology.of_ep_group(self._ep_group)

    def _call(self) -> Call:
        return Call(self.topology(), self.num_experts, self.stats, fp8=self.dispatch_fp8,
                    fp8_grad=self.combine_grad_fp8)

    # ---- dispatch ---------------------------------------------------------------------
    def dispatch(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
                 weights_TK: torch.Tensor, capacity: int | None = None, *, during=None,
                 flags: dict | None = None, error: str | None = None, trusted: bool = False,
                 tokens: int | None = None) -> Dispatched:
        """Rows for this rank's local experts, expert-major (or source-major where the form
        says so), and the metadata to ``combine`` them.

        Dropless: with a TP group of replicated tokens, each TP rank dispatches its
        near-even share. Padded (``capacity`` = the router's slots per expert): every expert
        gets the same slots, the TP ranks split each expert's slots.
        ``during(tp_tokens)``: work to run while the token all-to-all is in flight (the
        shared experts), called with every TP peer's token count (None where not known).
        ``flags``: the caller's device-side verdicts ({"nonfinite_input": count, ...},
        ``counts_message.DEVICE_FIELDS``), raised on every rank of the block if nonzero.
        ``error``: the caller found its input invalid (it dispatches an empty routing): every
        rank of the block raises, this one with ``error``, after the counts exchange.
        ``trusted``: the ids come from a router (in range): a rank alone then reads nothing.
        ``tokens``: this rank's token count as ``during`` sees it (default: x_TD's rows; the
        layer's differ when every route travels as its own row).
        """
        problem = _dispatch_arg_error(x_TD, expert_ids_TK, dropped_TK, weights_TK, self.num_experts, capacity)
        if problem is None and self.padded != (capacity is not None):
            problem = (f"capacity={capacity} but this dispatcher was built with padded={self.padded}: padded "
                       f"capacity mode takes the router's capacity, dropless mode none")
        if error is not None or problem is not None:   # tell the block first (it waits in the counts exchange)
            ok = isinstance(x_TD, torch.Tensor)
            self.abort(error or f"MoE dispatch: {problem}", int(x_TD.shape[-1]) if ok and x_TD.dim() else 0,
                       x_TD.dtype if ok else torch.float32, x_TD.device if ok else torch.device("cpu"))
        call = self._call()
        if self.padded:
            _check_alone(flags, call, self.num_experts)
            return Dispatched(*FORMS["padded"].dispatch(call, x_TD, expert_ids_TK, dropped_TK, weights_TK,
                                                        capacity, during))
        routes = self._tp_share(call, x_TD, expert_ids_TK, dropped_TK, weights_TK)       # 2
        if call.topo.block_size == 1:
            _check_alone(flags, call, self.num_experts)
            return Dispatched(*FORMS["rows"].dispatch(call, routes, None, during, trusted))
        plan = self._exchange_counts(call, routes, x_TD.shape[0] if tokens is None else tokens, flags)  # 3
        routes = self._apply_guard(routes, plan)
        return Dispatched(*FORMS[plan.form].dispatch(call, routes, plan, during))        # 4-7

    def _tp_share(self, call: Call, x_TD, expert_ids_TK, dropped_TK, weights_TK) -> Routes:
        """Step 2. Inside a TP group the tokens are replicated: each TP rank dispatches its
        near-even share (DeepSpeed's parallelism-coordinated dispatch); the slices are
        differentiable (their backward all-gathers, T*D*b and T*K*4 bytes)."""
        group, tp = call.topo.tp_group, call.topo.tp
        if tp == 1:
            return Routes(x_TD=x_TD, expert_ids_TK=expert_ids_TK, dropped_TK=dropped_TK, weights_TK=weights_TK,
                          token_sizes=None)
        sizes = tuple(comm.split_sizes(x_TD.shape[0], tp))
        rank = comm.group_rank(group)
        lo = sum(sizes[:rank])
        hi = lo + sizes[rank]
        x_TD = comm.scatter_to_region(x_TD, group, 0, sizes, stats=self.stats)
        weights_TK = comm.scatter_to_region(weights_TK, group, 0, sizes, stats=self.stats)
        return Routes(x_TD=x_TD, expert_ids_TK=expert_ids_TK[lo:hi], weights_TK=weights_TK,
                      dropped_TK=None if dropped_TK is None else dropped_TK[lo:hi], token_sizes=sizes)

    def _exchange_counts(self, call: Call, routes: Routes, tokens: int, flags: dict | None) -> planning.Plan:
        """Step 3: a histogram of the kept routes per global expert (out-of-range ids in a
        spare bin and counted: every rank raises on them), the dedup vote and whether this
        rank may take source-major rows, all-gathered over the block and read once."""
        E, L = self.num_experts, self.num_local
        ids_R = routes.expert_ids_TK.reshape(-1).long()
        bad_R = (ids_R < 0) | (ids_R >= E)
        ids_R = ids_R.masked_fill(bad_R, E)
        ones_R = torch.ones_like(ids_R) if routes.dropped_TK is None else (~routes.dropped_TK).reshape(-1).long()
        counts_E = torch.zeros(E + 1, dtype=torch.int64, device=ids_R.device).scatter_add_(0, ids_R, ones_R)[:E]
        vote = self._dedup_vote(call, routes.expert_ids_TK)
        x = routes.x_TD
        # A CUDA tensor never enters cpu.py: source-major rows pay only on gloo.
        on_cpu = self.source_major and x.device.type == "cpu" and call.topo.etp == 1 and call.topo.ep > 1
        forms = SOURCE_MAJOR if on_cpu and cpu.source_major_pays(call.topo.ep_group, L) else 0
        contribution = Contribution(
            counts_E=counts_E, hidden=x.shape[1], dtype=dtype_code(x.dtype), tokens=tokens, forms=forms,
            flags={**(flags or {}), "bad_ids": bad_R.sum()}, dedup_vote=vote,
            dedup_P=dedup_rows(routes.expert_ids_TK, routes.dropped_TK, L, call.topo.ep) if vote else None)
        rows_dev, host = planning.exchange(contribution, call.topo, E, x, self.stats)
        planning.raise_on_bad_input(host, call.topo, E, None)
        return planning.decide(rows_dev, host, call.topo, E, self.receive_capacity_factor)

    def _apply_guard(self, routes: Routes, plan: planning.Plan) -> Routes:
        """Step 3, receive guard: drop this rank's routes past its quotas, lowest routing
        weight first within each expert (``guard.py``); they weigh 0 in the combine and the
        permute skips them. No communication: the quotas came with the counts exchange."""
        load = plan.load
        if load.cap is None or load.guard_dropped == 0:
            return routes
        drop_TK = guard_drops(routes.expert_ids_TK, routes.weights_TK, routes.dropped_TK, load.kept_PE[load.rank])
        dropped_TK = drop_TK if routes.dropped_TK is None else routes.dropped_TK | drop_TK
        weights_TK = torch.where(drop_TK, torch.zeros_like(routes.weights_TK), routes.weights_TK)
        return dataclasses.replace(routes, dropped_TK=dropped_TK, weights_TK=weights_TK)

    def _dedup_vote(self, call: Call, expert_ids_TK: torch.Tensor) -> int:
        """This rank's dedup vote: 0 off, 1 auto, 2 on. Dedup needs more than one route per
        token, an EP group and no expert TP. "auto" votes off at once where it can never
        apply (a token sends at least one row, so rows/routes >= 1/K)."""
        K = expert_ids_TK.shape[1]
        if (self.dedup == "off" or call.topo.ep == 1 or call.topo.etp > 1 or K < 2
                or (self.dedup == "auto" and 1 / K > DEDUP_MAX_FRACTION)):
            return 0
        return DEDUP_VOTES[self.dedup]

    def abort(self, error: str, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raise ``error`` here and on every rank of the block: a rank whose input is invalid
        calls this instead of ``dispatch``; its peers learn of it in the counts exchange.
        ``device``: where the layer's collectives run (its parameters' device)."""
        call = self._call()
        if not self.padded and call.topo.block_size > 1:
            contribution = Contribution(counts_E=None, hidden=hidden, dtype=dtype_code(dtype), error=error)
            planning.exchange(contribution, call.topo, self.num_experts, torch.empty(0, device=device), self.stats)
        raise ValueError(error)

    def exchange_empty_counts(self, like: torch.Tensor) -> None:
        """The counts exchange alone, of no routes (benchmarks time it)."""
        call = self._call()
        zeros = torch.zeros(self.num_experts, dtype=torch.int64, device=like.device)
        contribution = Contribution(counts_E=zeros, hidden=like.shape[-1], dtype=dtype_code(like.dtype))
        planning.exchange(contribution, call.topo, self.num_experts, like, self.stats)

    # ---- combine ----------------------------------------------------------------------
    def combine(self, y_local: torch.Tensor, meta: Meta) -> torch.Tensor:
        """Inverse of ``dispatch``; weights each route's output and sums per token: [T, D]."""
        if isinstance(meta, PaddedMeta):
            form = FORMS["padded"]
        elif isinstance(meta, DedupMeta):
            form = FORMS["dedup"]
        elif isinstance(meta, SourceMajorMeta):
            form = FORMS["source_major"]
        else:
            form = FORMS["rows"]
        return form.combine(self._call(), y_local, meta)


def _check_alone(flags: dict | None, call: Call, num_experts: int) -> None:
    """Where no counts exchange runs (padded mode, a block of one rank), the caller's device
    verdicts are read here: one host read, only when the caller asked for a check."""
    if not flags:
        return
    counts = {name: int(t) for name, t in flags.items()}
    for name, n in counts.items():
        if n:
            raise ValueError(planning.FLAG_ERRORS[name].format(n=n, E=num_experts))


def _dispatch_arg_error(x_TD, expert_ids_TK, dropped_TK, weights_TK, num_experts, capacity) -> str | None:
    """What is wrong with ``dispatch``'s arguments, or None: checked before any collective so
    that a rank with bad arguments raises together with its peers, not alone after them. The
    permute's own checks, plus what only the dispatcher needs (floating x, the weights)."""
    for name, t in (("x_TD", x_TD), ("expert_ids_TK", expert_ids_TK), ("weights_TK", weights_TK),
                    ("dropped_TK", dropped_TK)):
        if not (isinstance(t, torch.Tensor) or (t is None and name == "dropped_TK")):
            return f"{name} must be a tensor, got {type(t).__name__}"
    try:
        check_permute_args(x_TD, expert_ids_TK, dropped_TK, num_experts, capacity)
    except ValueError as e:
        return str(e)
    if not x_TD.is_floating_point():
        return f"x_TD must be floating point, got {x_TD.dtype}"
    shape = tuple(expert_ids_TK.shape)
    if not weights_TK.is_floating_point() or tuple(weights_TK.shape) != shape:
        return f"weights_TK must be a floating-point tensor of expert_ids_TK's shape {shape}, got " \
               f"{weights_TK.dtype} of shape {tuple(weights_TK.shape)}"
    if weights_TK.device != x_TD.device:
        return f"weights_TK is on {weights_TK.device} but x_TD is on {x_TD.device}"
    return None


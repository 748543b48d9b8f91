"""Activation recomputation and the router: each real forward counted once, the recompute
routed exactly as its own forward was, the aux and z losses' gradients kept under the
reentrant flavour.

A recompute (``torch.utils.checkpoint``, either flavour, DeepSpeed's or Megatron's
checkpointing, or any recompute that re-runs the layer's forward from inside the backward)
calls ``MoE.forward`` a second time for the same tokens. Three things would go wrong if it
were treated as a forward (torchtitan #1593, and the counts doubled in moepar before this
module):

1. Counters. ``router.load_accum`` (expert-bias balancing), ``moe.stats`` and the load
   report would count the tokens twice. A forward that runs while autograd executes a
   backward (``in_recompute()``) is a recompute: it updates none of them.
2. Routing. Jitter or Gumbel noise redrawn, or a near-tie decided the other way by a
   kernel that is not bit-reproducible upstream, would send a token to another expert the
   second time: its gradient would belong to a routing that never ran. A forward that may
   be recomputed keeps a ``Record`` (Megatron-Core's router replay keeps the same): the
   top-k ids [T, K] int64, the capacity drops [T, K] bool and, when a noisy gate is on, the
   RNG state its noise was drawn from; the recompute routes with its own forward's record
   (the weights, aux and z losses are recomputed from the recomputed logits at those ids).
3. Loss gradients. Under the reentrant flavour the forward runs under ``no_grad``: the aux
   loss it records has no graph, so the router would get no aux-loss gradient. The loss is
   then returned through a tap (``_LossTap``) that catches the gradient the user's loss
   gives it, and the recompute attaches its own aux and z losses to the layer's output
   (``_AttachLosses``, Megatron-Core's MoEAuxLossAutoScaler idea) with that gradient.

Which forwards keep a record, where, and how a recompute finds its own (``keep_scope`` and
``Replay.find``); no other forward keeps anything:

- A forward under grad with saved-tensor hooks active (the non-reentrant flavour saves
  nothing but hooks' handles) keeps a record held by its autograd graph: an identity node on
  the routing weights owns it, the layer only a weak reference, so it lives exactly as long
  as the graph. Its key is a fingerprint of the layer's input, ``x_TD @ probe_D`` [T] (one
  matrix-vector product): the recompute's input is its forward's (the premise of activation
  recomputation), so among the live records of its token count the recompute takes the one
  whose fingerprint is nearest its own, chosen on the device (no host read) when there are
  several: forwards backpropagated in any order, two forwards with one backward, micro-batches.
- A training forward under ``no_grad`` inside an autograd Function's forward (the reentrant
  flavour: torch's, DeepSpeed's and Megatron's checkpoints are Functions) keeps its record
  on that Function's node (on each enclosing one, for nested checkpoints), in call order:
  it lives as long as that node, and the recompute, which runs inside that node's backward
  (``torch._C._current_autograd_node()``), takes the node's records in the same order.
- Any other forward keeps nothing: a forward under grad without hooks is never recomputed,
  and a ``no_grad`` forward outside any Function (validation in training mode, rollouts,
  reference log-probabilities) has no backward.

Memory: 9·T·K bytes per layer and micro-batch between its forward and its backward, plus
4·T for a fingerprint (plus the RNG state, 5 KB on the CPU, 16 bytes on CUDA, with noise
on). Under ``torch.compile`` the layer keeps no records (a traced graph has no Python-side
state): a compiled region is recomputed by the compiler's own activation recomputation,
from the graph it traced.
"""
from __future__ import annotations

import contextlib
import sys
import weakref

import torch

# The attribute of an autograd node (a reentrant checkpoint's Function) that holds the
# records kept in its forward: {Replay: _Scope}.
_NODE_ATTR = "_moepar_replay"


def in_recompute() -> bool:
    """True while autograd executes a backward: a forward called now is a recompute."""
    return torch._C._current_graph_task_id() != -1


def rng_state(device: torch.device) -> torch.Tensor:
    """The generator state that noise drawn on ``device`` comes from (a host copy)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


@contextlib.contextmanager
def rng_replayed(device: torch.device, state: torch.Tensor):
    """Draw on ``device`` from ``state``, leaving the generator as it was afterwards."""
    devices = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        if device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.get_device_module(device.type).set_rng_state(state, device)
        yield


class LossCell:
    """The gradient that the user's loss gave a layer's no_grad aux / z losses."""

    __slots__ = ("grads",)

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def add(self, name: str, g) -> None:
        prev = self.grads.get(name)
        self.grads[name] = g if prev is None else prev + g

    def take(self, name: str, like: torch.Tensor) -> torch.Tensor:
        g = self.grads.pop(name, None)
        if g is None:
            return torch.zeros_like(like)
        return g.to(like.dtype) if isinstance(g, torch.Tensor) else torch.full_like(like, g)


class Record:
    """One training forward's routing, kept for its recompute; ``key_T`` the fingerprint of
    its input (graph-held records), ``cell`` the taps' gradients (reentrant records)."""

    __slots__ = ("tokens", "ids_TK", "dropped_TK", "noise_rng", "cell", "key_T", "__weakref__")

    def __init__(self, tokens: int, ids_TK, dropped_TK, noise_rng=None, cell: LossCell | None = None,
                 key_T: torch.Tensor | None = None):
        self.tokens, self.ids_TK = tokens, ids_TK.detach()
        self.dropped_TK = None if dropped_TK is None else dropped_TK.detach()
        self.noise_rng, self.cell, self.key_T = noise_rng, cell, key_T


class _Scope:
    """The records one reentrant checkpoint's forward kept for one layer, in call order, and
    how many each recompute (graph task) has taken."""

    __slots__ = ("records", "taken")

    def __init__(self):
        self.records: list[Record] = []
        self.taken: dict[int, int] = {}


def _function_frames():
    """(``"forward"`` or ``"backward"``, node) for each custom autograd Function whose
    ``forward(ctx, ...)`` or ``backward(ctx, ...)`` runs on this thread's Python stack,
    innermost first (a Function's ``ctx`` is its node)."""
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if code.co_name in ("forward", "backward") and code.co_argcount and code.co_varnames[0] == "ctx":
            ctx = f.f_locals.get("ctx")
            if isinstance(ctx, torch.autograd.function.BackwardCFunction):
                yield code.co_name, ctx
        f = f.f_back


def keep_scope():
    """Where a training forward starting now must keep its record for a recompute to find
    it: "graph" (held by its autograd graph), a list of Function nodes (reentrant
    checkpoints whose forward runs now), or None (nothing can recompute it). Read on the
    host, no device work."""
    if torch.is_grad_enabled():
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return "graph" if hooks is not None else None
    nodes = [ctx for kind, ctx in _function_frames() if kind == "forward"]
    return nodes or None


class Replay:
    """A layer's live records, as weak references (their graph or their checkpoint's node
    holds them)."""

    def __init__(self):
        self._live: list[weakref.ref] = []
        self._probes: dict = {}

    def __len__(self) -> int:
        self._prune()
        return len(self._live)

    def _prune(self) -> None:
        self._live = [r for r in self._live if r() is not None]

    def fingerprint(self, x_TD: torch.Tensor) -> torch.Tensor:
        """``x_TD @ probe_D`` [T]: a fixed quasi-random direction, born on x's device once."""
        key = (x_TD.device, x_TD.dtype, x_TD.shape[1])
        probe = self._probes.get(key)
        if probe is None:   # golden-ratio fractions in [-0.5, 0.5): no two columns alike
            probe = torch.arange(1, x_TD.shape[1] + 1, device=x_TD.device, dtype=torch.float64)
            probe = probe.mul_(0.6180339887498949).frac_().sub_(0.5).to(x_TD.dtype)
            self._probes[key] = probe
        return x_TD.detach() @ probe

    def keep(self, scope, record: Record, weights_TK: torch.Tensor) -> torch.Tensor:
        """Keep ``record`` where ``scope`` (``keep_scope()``) says; returns ``weights_TK``,
        through the node that holds it for a graph-held record."""
        if scope == "graph" and not weights_TK.requires_grad:   # no graph: nothing recomputes it
            return weights_TK
        self._prune()
        self._live.append(weakref.ref(record))
        if scope == "graph":
            return _Hold.apply(weights_TK, record)
        for node in scope:
            scopes = getattr(node, _NODE_ATTR, None)
            if scopes is None:
                scopes = {}
                setattr(node, _NODE_ATTR, scopes)
            scopes.setdefault(self, _Scope()).records.append(record)
        return weights_TK

    def find(self, x_TD: torch.Tensor) -> Record | None:
        """The record of the forward this recompute re-runs, or None (a recompute of a forward
        that kept nothing: it routes afresh)."""
        for kind, node in _function_frames():
            if kind == "forward":   # a checkpoint's forward inside a recompute (nested): by input
                break
            scope = getattr(node, _NODE_ATTR, {}).get(self)
            if scope is not None:   # this reentrant checkpoint's recompute: its calls in order
                task = torch._C._current_graph_task_id()
                i = scope.taken.get(task, 0)
                scope.taken[task] = i + 1
                return scope.records[i] if i < len(scope.records) else None
        tokens = x_TD.shape[0]
        self._prune()
        found = [r for r in (w() for w in self._live) if r is not None and r.tokens == tokens]
        if len(found) <= 1:
            return found[0] if found else None
        return self._nearest(found, self.fingerprint(x_TD))

    @staticmethod
    def _nearest(found: list[Record], key_T: torch.Tensor) -> Record:
        """The record whose fingerprint is nearest ``key_T``, chosen on the device; read on
        the host only where the records carry host values (a noisy gate's RNG state, a
        reentrant forward's loss cell: a recompute nested in another one)."""
        keys_CT = torch.stack([r.key_T for r in found]).float()
        best_1 = (keys_CT - key_T.float()).square().sum(1).argmin().reshape(1)
        if any(r.noise_rng is not None or r.cell is not None for r in found):
            return found[int(best_1)]
        ids_TK = torch.stack([r.ids_TK for r in found]).index_select(0, best_1)[0]
        dropped_TK = (None if found[0].dropped_TK is None
                      else torch.stack([r.dropped_TK for r in found]).index_select(0, best_1)[0])
        return Record(found[0].tokens, ids_TK, dropped_TK)


def scoped(node) -> int:
    """Records kept on a Function node (a reentrant checkpoint), every layer's."""
    return sum(len(s.records) for s in getattr(node, _NODE_ATTR, {}).values())


class _Hold(torch.autograd.Function):
    """Identity on the routing weights whose node owns the record: the record lives as long
    as the graph (a second backward of a retained graph replays it too)."""

    @staticmethod
    def forward(ctx, w, record):
        ctx.record = record
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _LossTap(torch.autograd.Function):
    """``value`` as a loss term in the graph (through a leaf ``anchor``); its backward stores
    the gradient it receives in the cell, for the recompute to apply."""

    @staticmethod
    def forward(ctx, anchor, value, cell, name):
        ctx.cell, ctx.name = cell, name
        return value.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.cell.add(ctx.name, g)
        return None, None, None, None


def tapped(value: torch.Tensor, cell: LossCell, name: str) -> torch.Tensor:
    """A no_grad loss made a graph leaf whose gradient reaches the recompute. Created when the
    loss is read, after the forward, so that autograd runs the tap before the
    recompute (nodes made later run first)."""
    anchor = torch.zeros((), device=value.device, requires_grad=True)
    with torch.enable_grad():
        return _LossTap.apply(anchor, value.detach(), cell, name)


class _AttachLosses(torch.autograd.Function):
    """Identity on the layer output ``y``; in backward the recomputed losses get the gradient
    that their taps caught (zero where the loss was not used)."""

    @staticmethod
    def forward(ctx, y, aux, z, cell):
        ctx.cell = cell
        ctx.save_for_backward(aux, z)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        aux, z = ctx.saved_tensors
        return g, ctx.cell.take("aux", aux), ctx.cell.take("z", z), None


def attach_losses(y: torch.Tensor, aux: torch.Tensor, z: torch.Tensor, cell: LossCell) -> torch.Tensor:
    if not (aux.requires_grad or z.requires_grad):
        return y
    return _AttachLosses.apply(y, aux, z, cell)

"""Activation recompute and the router: each real forward counted once, the recompute routed
exactly as the forward was, the aux and z losses' gradients kept under the reentrant recompute.

A recompute (``torch.utils.checkpoint``, either flavour, or any recompute that re-runs the
layer's forward from inside the backward) calls ``MoE.forward`` a second time for the same
tokens. Three things would go wrong if it were treated as a forward (torchtitan #1593, and
the counts doubled in moepar before this module):

1. Counters. ``router.load_accum`` (expert-bias balancing), ``moe.stats`` and the load
   report would count the tokens twice. A forward that runs while autograd executes a
   backward (``in_recompute()``) is a recompute: it updates none of them.
2. Routing. Jitter or Gumbel noise redrawn, or a near-tie decided the other way by a
   kernel that is not bit-reproducible upstream, would send a token to another expert the
   second time: its gradient would belong to a routing that never ran. Each training
   forward keeps a ``Record`` (Megatron-Core's router replay keeps the same): the top-k ids
   [T, K] int64, the capacity drops [T, K] bool and, when a noisy gate is on, the RNG state
   its noise was drawn from; the recompute takes the oldest record of its size and routes
   with it (the weights, aux and z losses are recomputed from the recomputed logits at
   those ids). Memory: 9·T·K bytes per layer and micro-batch between its forward and its
   backward (plus the RNG state, 5 KB on the CPU, 16 bytes on CUDA, with noise on).
3. Loss gradients. Under the reentrant flavour the forward runs under ``no_grad``: the aux
   loss it records has no graph, so the router would get no aux-loss gradient. The loss is
   then returned through a tap (``_LossTap``) that catches the gradient the user's loss
   gives it, and the recompute attaches its own aux and z losses to the layer's output
   (``_AttachLosses``, Megatron-Core's MoEAuxLossAutoScaler idea) with that gradient.

Lifetime: a record made under grad mode is held by the autograd graph (an identity node on
the routing weights) and dropped when that node's backward runs or the graph is freed, so a
forward that is never backpropagated leaves nothing behind; one made under ``no_grad`` (the
reentrant flavour's forward) is held by the layer until its recompute takes it, at most
``DETACHED_RECORDS`` of them, and ``model.eval()`` drops them. Under ``torch.compile`` the
layer keeps no records (a traced graph has no Python-side state): a compiled region is
recomputed by the compiler's own activation recomputation, from the graph it traced.
"""
from __future__ import annotations

import collections
import contextlib
import weakref

import torch

DETACHED_RECORDS = 64   # no_grad records kept per layer (micro-batches in flight)


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

    def take(self, name: str, like: torch.Tensor) -> torch.Tensor:
        g = self.grads.pop(name, None)
        return torch.zeros_like(like) if g is None else g.to(like.dtype)


class Record:
    """One training forward's routing, kept for its recompute."""

    __slots__ = ("tokens", "ids_TK", "dropped_TK", "noise_rng", "cell", "__weakref__")

    def __init__(self, tokens: int, ids_TK, dropped_TK, noise_rng=None, cell: LossCell | None = None):
        self.tokens, self.ids_TK, self.dropped_TK = tokens, ids_TK.detach(), dropped_TK.detach()
        self.noise_rng, self.cell = noise_rng, cell


class Replay:
    """A layer's records, oldest first (micro-batches are backpropagated in the order they
    ran forward, 1F1B included)."""

    def __init__(self):
        self._queue: collections.deque = collections.deque()

    def __len__(self) -> int:
        self._prune()
        return len(self._queue)

    def _prune(self) -> None:
        self._queue = collections.deque(r for r in self._queue if _get(r) is not None)

    def keep(self, record: Record, weights_TK: torch.Tensor) -> torch.Tensor:
        """Keep ``record``; returns ``weights_TK`` through the node that holds it (grad mode)."""
        if torch.is_grad_enabled() and weights_TK.requires_grad:
            self._queue.append(weakref.ref(record))
            return _Hold.apply(weights_TK, record, self)
        self._queue.append(record)
        strong = [r for r in self._queue if isinstance(r, Record)]
        if len(strong) > DETACHED_RECORDS:   # forwards under no_grad that nothing recomputed
            self._queue.remove(strong[0])
        return weights_TK

    def take(self, tokens: int) -> Record | None:
        """The oldest live record of ``tokens`` tokens, removed; None if there is none (a
        recompute of a forward that kept nothing: it routes afresh)."""
        self._prune()
        for item in self._queue:
            record = _get(item)
            if record.tokens == tokens:
                self._queue.remove(item)
                return record
        return None

    def drop(self, record: Record) -> None:
        self._queue = collections.deque(r for r in self._queue if _get(r) not in (None, record))

    def clear_detached(self) -> None:
        self._queue = collections.deque(r for r in self._queue if not isinstance(r, Record))


def _get(item):
    return item if isinstance(item, Record) else item()


class _Hold(torch.autograd.Function):
    """Identity on the routing weights whose node holds the record for the recompute; its
    backward (after the recompute has taken the record) lets it go."""

    @staticmethod
    def forward(ctx, w, record, replay):
        ctx.record, ctx.replay = record, replay
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        ctx.replay.drop(ctx.record)
        ctx.record = None
        return g, None, None


class _LossTap(torch.autograd.Function):
    """``value`` as a loss term in the graph (through a leaf ``anchor``); its backward stores
    the gradient it receives in the cell, for the recompute to apply."""

    @staticmethod
    def forward(ctx, anchor, value, cell, name):
        ctx.cell, ctx.name = cell, name
        return value.clone()

    @staticmethod
    def backward(ctx, g):
        prev = ctx.cell.grads.get(ctx.name)
        ctx.cell.grads[ctx.name] = g if prev is None else prev + g
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

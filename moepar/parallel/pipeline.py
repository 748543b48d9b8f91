"""Pipeline stages on torch's own engine, ``torch.distributed.pipelining``.

A model made of ``[first] + blocks + [last]`` (the example GPT-MoE: the embedding, the
transformer blocks, the final norm + head) is cut into ``num_stages = pp x chunks`` stages
of consecutive blocks; each pipeline rank builds only its stages (one module per stage,
whose parameters keep the names they have in the whole model, so a checkpoint is
layout-free), wraps each in a ``PipelineStage`` on the pipeline group and runs torch's
schedule with micro-batches. Nothing here schedules: torch's classes do.

  name         torch class                      stages per rank   placement   micro-batches M
  gpipe        ScheduleGPipe                    1                 -           M >= 1
  1f1b         Schedule1F1B                     1                 -           M >= pp
  interleaved  ScheduleInterleaved1F1B          v                 loop        M >= pp, M % rounds == 0
  zb           ScheduleInterleavedZeroBubble    v                 loop        M >= pp, M % rounds == 0
  zbv          ScheduleZBVZeroBubble            2                 V           M >= pp
  dualpipev    ScheduleDualPipeV                2                 V           M >= 2 pp

(rounds = max(1, M // pp), torch's rule; "loop": rank r holds stages r, r + pp, ...; "V":
rank r holds stages r and 2 pp - 1 - r, so rank 0 holds the first and the last stage.)
zb, zbv and dualpipev order each backward as the input gradient (sent upstream at once) and
the weight gradient (later, to fill the bubble). torch computes the weight part by running
the saved graph a second time from the input part's intermediates; moepar's grouped-experts
Function frees its saved segments in its one backward (and the dispatch collectives must
run once), so here every stage gets a ``dw_builder`` and runs its full backward at the
input step, with an empty weight step: the schedules' order and exact gradients, without
the weight-gradient deferral's overlap.

MoE aux and z losses never leave their stage: a forward hook on each MoE layer (any module
with ``aux_loss`` and ``z_loss``, as ``moepar.MoE``) attaches them to the layer's output
with ``AttachLoss``, identity in forward, whose backward also gives the losses the gradient
1/M (Megatron-Core's MoEAuxLossAutoScaler); the loss function returns the micro-batch's
loss / M, so the gradients are those of the mean over micro-batches, as a single process
accumulating the same M micro-batches gets them.

Every activation and gradient crossing a stage boundary is recorded in ``comm.track()`` as
a "send" or "recv" ``CommEvent`` over the pipeline group (``backward=True`` for gradients),
with its tensor's bytes; the schedule waits on them itself, so their seconds are 0.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
from torch import nn

from .. import checks
from . import comm
from .groups import ParallelState, get_parallel_state


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    torch_name: str
    stages_per_rank: int | None    # None: the virtual pipeline size v
    style: str                     # "loop" or "v" (torch's generate_stage_to_rank_mapping)
    min_microbatches: Callable[[int], int]   # of pp
    split_backward: bool           # input and weight gradients apart (zero-bubble family)


SCHEDULES = {
    "gpipe": ScheduleKind("ScheduleGPipe", 1, "loop", lambda pp: 1, False),
    "1f1b": ScheduleKind("Schedule1F1B", 1, "loop", lambda pp: pp, False),
    "interleaved": ScheduleKind("ScheduleInterleaved1F1B", None, "loop", lambda pp: pp, False),
    "zb": ScheduleKind("ScheduleInterleavedZeroBubble", None, "loop", lambda pp: pp, True),
    "zbv": ScheduleKind("ScheduleZBVZeroBubble", 2, "v", lambda pp: pp, True),
    "dualpipev": ScheduleKind("ScheduleDualPipeV", 2, "v", lambda pp: 2 * pp, True),
}


def schedule_kind(name: str) -> ScheduleKind:
    """The schedule ``name`` (case-insensitive), checked against what torch has."""
    import torch.distributed.pipelining as pipelining
    kind = SCHEDULES.get(str(name).lower())
    valid = [n for n, k in SCHEDULES.items() if hasattr(pipelining, k.torch_name)]
    if kind is None or not hasattr(pipelining, kind.torch_name):
        raise ValueError(f"schedule={name!r} is not a pipeline schedule of torch {torch.__version__}: "
                         f"the valid names are {valid}")
    return kind


def stages_per_rank(schedule: str, virtual_pipeline_size: int = 1) -> int:
    kind = schedule_kind(schedule)
    return virtual_pipeline_size if kind.stages_per_rank is None else kind.stages_per_rank


def check_pipeline(schedule: str, pp: int, microbatches: int, layers: int | None = None,
                   virtual_pipeline_size: int = 1, batch: int | None = None) -> int:
    """Raise ValueError for a pipeline that cannot run, before any communication (every rank
    runs the same check on the same values); returns the number of stages (pp x chunks).

    ``layers``: blocks to cut (must divide into the stages); ``batch``: this rank's
    sequences per step (must divide into the micro-batches)."""
    checks.positive_int("pipeline_parallel_size", pp)
    checks.positive_int("microbatches", microbatches)
    checks.positive_int("virtual_pipeline_size", virtual_pipeline_size)
    kind = schedule_kind(schedule)
    if kind.stages_per_rank is not None and virtual_pipeline_size not in (1, kind.stages_per_rank):
        raise ValueError(f"virtual_pipeline_size={virtual_pipeline_size} does not fit schedule={schedule!r}, "
                         f"which runs {kind.stages_per_rank} stage(s) per rank")
    chunks = stages_per_rank(schedule, virtual_pipeline_size)
    stages = pp * chunks
    need = kind.min_microbatches(pp)
    if microbatches < need:
        raise ValueError(f"microbatches={microbatches} is fewer than schedule={schedule!r} needs with "
                         f"pipeline_parallel_size={pp}: at least {need}")
    if kind.stages_per_rank is None:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(f"microbatches={microbatches} is not a multiple of the {rounds} rounds of "
                             f"schedule={schedule!r} (rounds = microbatches // pipeline_parallel_size={pp})")
    if layers is not None and layers % stages:
        raise ValueError(f"layers={layers} is not divisible by the {stages} pipeline stages "
                         f"(pipeline_parallel_size={pp} x {chunks} stage(s) per rank): every stage "
                         f"gets the same number of layers")
    if batch is not None and batch % microbatches:
        raise ValueError(f"this rank's batch of {batch} sequences is not divisible by microbatches="
                         f"{microbatches}")
    return stages


def stage_ids(pp_rank: int, pp: int, schedule: str, virtual_pipeline_size: int = 1) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in the order torch's schedules expect."""
    kind = schedule_kind(schedule)
    chunks = stages_per_rank(schedule, virtual_pipeline_size)
    if kind.style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(chunks)]


def check_stage(stage, num_stages, layers: int | None = None) -> None:
    """ValueError unless ``stage`` is one of ``num_stages`` stages (integers, 0 <= stage <
    num_stages) and, with ``layers``, the layers cut evenly into them, at least one each.
    A stage out of range would build layers the model does not have (or, indexing a list
    from its end, another stage's); every rank checks before it builds anything."""
    checks.positive_int("num_stages", num_stages)
    if not checks.is_int(stage) or not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage!r} must be an integer in [0, {num_stages}): the index of one of "
                         f"num_stages={num_stages} stages, counted from 0")
    if layers is not None:
        checks.int_at_least("layers", layers, 0)
        if num_stages > layers:
            raise ValueError(f"num_stages={num_stages} is more than the {layers} layers: every stage needs "
                             f"at least one layer")
        if layers % num_stages:
            raise ValueError(f"layers={layers} is not divisible by the {num_stages} pipeline stages")


def layer_range(stage: int, num_stages: int, layers: int) -> range:
    """The blocks of ``stage``: ``layers / num_stages`` consecutive ones (``check_stage``)."""
    check_stage(stage, num_stages, layers)
    n = layers // num_stages
    return range(stage * n, (stage + 1) * n)


class BlockStage(nn.Module):
    """One stage of a plain list of blocks: ``first`` (on stage 0), the stage's blocks in a
    ModuleDict keyed by their index in the whole list (so that parameter names are those of
    the whole model: ``<name>.<index>.<...>``), ``last`` (on the last stage)."""

    def __init__(self, blocks: dict[int, nn.Module], first: nn.Module | None = None,
                 last: nn.Module | None = None, name: str = "blocks"):
        super().__init__()
        self.first, self.last, self._name = first, last, name
        self.add_module(name, nn.ModuleDict({str(i): b for i, b in sorted(blocks.items())}))

    def forward(self, x):
        if self.first is not None:
            x = self.first(x)
        for block in getattr(self, self._name).values():
            x = block(x)
        return self.last(x) if self.last is not None else x


def cut_blocks(blocks: Sequence[nn.Module], stage: int, num_stages: int, first: nn.Module | None = None,
               last: nn.Module | None = None, name: str = "blocks") -> BlockStage:
    """Stage ``stage`` of ``first + blocks + last`` cut into ``num_stages`` equal stages."""
    layers = layer_range(stage, num_stages, len(blocks))
    out = BlockStage({i: blocks[i] for i in layers}, first if stage == 0 else None,
                     last if stage == num_stages - 1 else None, name)
    out.pipeline_stage = (stage, num_stages)   # checked by Pipeline against the stage it runs
    return out


class StageChunks(nn.Module):
    """A rank's stage modules seen as one model, every parameter and buffer under the name it
    has in the whole model (no chunk prefix): what the optimizer, ``allreduce_gradients``,
    ``clip_grad_norm_`` and ``moepar.checkpoint`` take when a rank holds several stages."""

    def __init__(self, chunks: Sequence[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for chunk in self.chunks:
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for chunk in self.chunks:
            yield from chunk.named_buffers(prefix, recurse, remove_duplicate)


class AttachLoss(torch.autograd.Function):
    """Identity on ``y``; in backward ``loss`` gets the gradient ``scale`` (a loss term that
    is not a stage output)."""

    @staticmethod
    def forward(ctx, y, loss, scale):
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        shape, dtype, device = ctx.loss_meta
        return g, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def _no_weight_step() -> None:
    """The weight step of a split backward whose full backward already ran."""


def _has_router_losses(m: nn.Module) -> bool:
    return hasattr(type(m), "aux_loss") and hasattr(type(m), "z_loss")


def _in_backward() -> bool:
    """A forward run while autograd executes a backward is a recompute."""
    return torch._C._current_graph_task_id() != -1


class _TrackedStage:
    """Mixin recording the stage's point-to-point ops (see the module docstring)."""

    def _recorded(self, ops, op: str, backward: bool):
        size = comm.group_size(self.group)
        for p in ops:
            comm.record(comm.CommEvent(op, size, p.tensor.numel() * p.tensor.element_size(), 0.0, backward))
        return ops

    def get_fwd_send_ops(self, i):
        return self._recorded(super().get_fwd_send_ops(i), "send", False)

    def get_fwd_recv_ops(self, i):
        return self._recorded(super().get_fwd_recv_ops(i), "recv", False)

    def get_bwd_send_ops(self, i):
        return self._recorded(super().get_bwd_send_ops(i), "send", True)

    def get_bwd_recv_ops(self, i):
        return self._recorded(super().get_bwd_recv_ops(i), "recv", True)


class Pipeline:
    """This rank's stages and torch's schedule over them.

    ``chunks``: this rank's stage modules, one per id of ``stage_ids(...)``; ``loss_fn(output,
    target)``: the last stage's loss of one micro-batch (a mean over its tokens);
    ``inputs`` / ``outputs``: per chunk, a tensor shaped like one micro-batch's stage input /
    output (torch's static shapes: no extra forward to infer them), floating ones with
    ``requires_grad=True`` (their gradient crosses the boundary backwards). ``step(x, target)``
    runs one training step's forwards and backwards and returns ``(loss, aux)``, each the
    mean over the micro-batches, summed over the stages (the same on every pipeline rank).
    """

    def __init__(self, chunks: Sequence[nn.Module], schedule: str, microbatches: int,
                 loss_fn: Callable, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                 state: ParallelState | None = None, device: torch.device | str = "cpu",
                 virtual_pipeline_size: int | None = None):
        import torch.distributed.pipelining as pipelining
        state = state if state is not None else get_parallel_state()
        v = virtual_pipeline_size if virtual_pipeline_size is not None else state.virtual_pipeline_size
        num_stages = check_pipeline(schedule, state.pp_size, microbatches, None, v)
        ids = stage_ids(state.pp_rank, state.pp_size, schedule, v)
        if len(chunks) != len(ids):
            raise ValueError(f"{len(chunks)} stage modules given, but schedule={schedule!r} runs {len(ids)} "
                             f"per rank (stages {ids} on pipeline rank {state.pp_rank})")
        for k, (c, i) in enumerate(zip(chunks, ids)):
            built = getattr(c, "pipeline_stage", None)   # (stage, num_stages) it was built as, if known
            if built is not None and tuple(built) != (i, num_stages):
                raise ValueError(f"stage module {k} was built as stage {built[0]} of {built[1]}, but pipeline rank "
                                 f"{state.pp_rank} runs stage {i} of {num_stages} there (schedule={schedule!r}; "
                                 f"stage_ids gives a rank's stages)")
        if state.pp_group is None:
            raise ValueError("pipeline stages need pipeline_parallel_size >= 2 in moepar.init_parallel")
        self.state, self.microbatches, self.chunks, self.stage_ids = state, microbatches, list(chunks), ids
        self._aux_sum = None
        self._training = False   # inside step(): a forward without grad must be a checkpoint's
        self._hooks = [m.register_forward_hook(self._attach_router_losses)
                       for c in self.chunks for m in c.modules() if _has_router_losses(m)]
        stage_cls = type("TrackedPipelineStage", (_TrackedStage, pipelining.PipelineStage), {})
        device = torch.device(device)
        # The zero-bubble family: weights with the input gradient (module docstring).
        dw = (lambda: _no_weight_step) if schedule_kind(schedule).split_backward else None
        self.stages = [stage_cls(c, i, num_stages, device, input_args=x, output_args=y, group=state.pp_group,
                                 dw_builder=dw)
                       for c, i, x, y in zip(chunks, ids, inputs, outputs)]
        cls = getattr(pipelining, schedule_kind(schedule).torch_name)
        scaled = lambda out, target: loss_fn(out, target) / microbatches   # noqa: E731
        # The losses and the router losses carry 1/M themselves: no second scaling.
        arg = self.stages[0] if len(self.stages) == 1 and schedule in ("gpipe", "1f1b") else self.stages
        self.schedule = cls(arg, microbatches, loss_fn=scaled, scale_grads=False)
        self._v_shaped = schedule_kind(schedule).style == "v"
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)

    def _attach_router_losses(self, module, inputs, output):
        if not module.training or _in_backward():
            return output
        terms = [t for t in (module.aux_loss, module.z_loss) if t is not None]
        if not terms:
            return output
        loss = terms[0] if len(terms) == 1 else terms[0] + terms[1]
        if not torch.is_grad_enabled():
            # The reentrant checkpoint's forward (no graph): the layer's recompute attaches the
            # losses, with the gradient given here; refused where nothing will recompute it.
            seed = getattr(module, "seed_loss_gradient", None)
            if not self._training or seed is None or not seed(1.0 / self.microbatches):
                if self._training:
                    raise RuntimeError(
                        f"{type(module).__name__} ran a training forward without grad inside a pipeline "
                        f"step, outside any autograd Function (a reentrant checkpoint is one): its aux "
                        f"loss would get no gradient; run the stage's forward with grad, or under "
                        f"torch.utils.checkpoint (either flavour)")
                return output
        value = loss.detach().float().reshape(())
        self._aux_sum = value if self._aux_sum is None else self._aux_sum + value
        if not torch.is_grad_enabled():
            return output
        return AttachLoss.apply(output, loss, 1.0 / self.microbatches) if loss.requires_grad else output

    def _run(self, x, target, train: bool):
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        kwargs = dict(target=target if self.has_last else None, losses=losses if self.has_last else None)
        self._aux_sum = None
        for c in self.chunks:
            c.train(train)
        self._training = train
        if train:
            try:
                self.schedule.step(*args, return_outputs=False, **kwargs)
            finally:
                self._training = False
        elif self._v_shaped:
            # torch 2.13's V-shaped schedules have no forward-only step (their backward actions
            # run anyway): run the step, in eval mode, and drop the gradients it made.
            with torch.enable_grad():
                self.schedule.step(*args, return_outputs=False, **kwargs)
            for c in self.chunks:
                for p in c.parameters():
                    p.grad = None
        else:
            with torch.no_grad():
                self.schedule.eval(*args, **kwargs)
        dev = self.stages[0].device
        out = torch.zeros(2, dtype=torch.float32, device=dev)
        if losses:
            out[0] = torch.stack([t.detach().float().reshape(()) for t in losses]).sum().to(dev)
        if self._aux_sum is not None:
            out[1] = self._aux_sum.to(dev) / self.microbatches
        comm.all_reduce_(out, self.state.pp_group)   # 8 bytes: the last stage's loss, every stage's aux
        return out[0], out[1]

    def step(self, x: torch.Tensor | None, target: torch.Tensor | None):
        """One training step's forwards and backwards (gradients accumulate in the chunks);
        returns (loss, aux), means over the micro-batches, summed over the stages."""
        return self._run(x, target, True)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor | None, target: torch.Tensor | None):
        """The forwards in eval mode; returns (loss, aux) as ``step``. Call it with no
        gradients pending (the V-shaped schedules run their backward too, and it drops the
        gradients afterwards)."""
        try:
            return self._run(x, target, False)
        finally:
            for c in self.chunks:
                c.train(True)

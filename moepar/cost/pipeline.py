"""Pipeline stages: what each stage holds, its point-to-point traffic, and the step it sets.

The model is cut into ``pp·vp`` chunks of consecutive blocks (``schedules.chunk_bounds``: as
even as the count allows) run by the ``pp`` ranks of each pipeline group as the schedule
places them (``schedules.chunk_rank``: looped, or a V for DualPipeV). A rank prices its own
share as a smaller model (``stage_spec``: its blocks, MoE and dense counted apart, the input
embedding where it holds the first chunk, the output layer, final norm and loss where it
holds the last) on its stage's groups (``CostLayout`` with ``pp``: dp and edp per stage, every
group inside one stage, Megatron's rank order), with:

- point-to-point traffic per micro-batch (``p2p_calls``): every chunk boundary between two
  ranks moves the activation forward (``send`` on the earlier rank, ``recv`` on the later,
  phase fwd) and its gradient back (``send`` on the later, ``recv`` on the earlier, phase
  bwd), T·D·b bytes (T/tp·D·b with sequence parallelism), each priced on NVLink when both
  ranks share a node and on the GPU's NICs when they do not (from the real rank lists);
- activations kept for ``schedules.in_flight`` micro-batches (1F1B: p on the first stage);
- the step: the slowest stage's ``m·t_mb`` plus the schedule's bubble ``bubble_units·t_mb``
  (``StepCost.bubble_time``), where ``t_mb`` is its micro-batch's compute, layer collectives
  and stage-boundary receives. With ideal overlap the steady state's transfers hide behind
  compute (torch issues them asynchronously); the fill and drain keep theirs.

``pipeline_cost`` returns the slowest stage's ``StepCost`` with the model's FLOPs (for MFU),
the largest stage memory (what must fit) and a ``PipelineInfo`` of every stage.
"""
from __future__ import annotations

import dataclasses

from .accounting import Call, count_flops
from .step import StepCost, price_stage
from .collectives import P2P, Hardware, Placement, sent_bytes
from .model import CostLayout, MoESpec, count_params, wire_bytes
from .schedules import (bubble_fraction, bubble_units, check_pipeline, chunk_bounds, chunk_rank,
                        in_flight)


def rank_chunks(layout: CostLayout, stage: int) -> list[int]:
    """The model chunks (of pp·vp) pipeline rank ``stage`` runs."""
    chunks = layout.pp * layout.vp
    return [k for k in range(chunks) if chunk_rank(k, layout.pp, layout.vp, layout.schedule) == stage]


def stage_layers(spec: MoESpec, layout: CostLayout, stage: int) -> list[int]:
    bounds = chunk_bounds(spec.layers, layout.pp * layout.vp)
    return [i for k in rank_chunks(layout, stage) for i in range(*bounds[k])]


def check_stages(spec: MoESpec, layout: CostLayout, even: bool = False) -> None:
    """The pipeline rules for this model; ``even``: the layers must split evenly over the
    chunks, as the runtime requires (pricing alone allows an uneven split: DeepSeek-V3's 61
    blocks on 16 stages)."""
    check_pipeline(layout.pp, layout.vp, layout.schedule, spec.micro_batches, spec.layers)
    chunks = layout.pp * layout.vp
    if even and spec.layers % chunks:
        raise ValueError(f"layers={spec.layers} is not divisible by pp x vp = {layout.pp} x {layout.vp} = "
                         f"{chunks}: every stage of the run holds the same number of blocks")


def stage_spec(spec: MoESpec, layout: CostLayout, stage: int) -> MoESpec:
    """The part of ``spec`` pipeline rank ``stage`` holds, as a model of its own."""
    if not 0 <= stage < layout.pp:
        raise ValueError(f"pipeline_stage={stage} is outside 0..{layout.pp - 1} (pp={layout.pp})")
    ids = stage_layers(spec, layout, stage)
    moe = sum(spec.is_moe(i) for i in ids)
    chunks = rank_chunks(layout, stage)
    last = layout.pp * layout.vp - 1
    # sliding-window layers spread over the stages in proportion (gpt-oss alternates them)
    sliding = round(spec.sliding_layers * len(ids) / spec.layers)
    return spec.replace(layers=len(ids), dense_layers=len(ids) - moe, moe_layer_ids=None, sliding_layers=sliding,
                        first_stage=0 in chunks, last_stage=last in chunks)


def boundary_placement(layout: CostLayout, a: int, b: int) -> Placement:
    """Two pipeline ranks a, b of the same pipeline group: one node (NVLink) if every such
    pair of ranks shares a node, else across nodes (Megatron's order: stage s holds ranks
    s·n .. s·n + n - 1)."""
    n, g = layout.stage_size, layout.gpus_per_node
    same = all((a * n + i) // g == (b * n + i) // g for i in range(n))
    return Placement(2, 2) if same else Placement(2, 1)


def p2p_calls(spec: MoESpec, layout: CostLayout, hw: Hardware, stage: int) -> list[Call]:
    """This rank's sends and receives per micro-batch (``per="micro_batch"``)."""
    pp, vp, sched = layout.pp, layout.vp, layout.schedule
    last = pp * vp - 1
    nbytes = spec.tokens * spec.hidden * wire_bytes(spec).act // (layout.tp if layout.sp else 1)
    formula = "T/tp·D·b" if layout.sp else "T·D·b"
    out: list[Call] = []
    for k in rank_chunks(layout, stage):
        for peer_chunk, before in ((k - 1, True), (k + 1, False)):
            if not 0 <= peer_chunk <= last:
                continue
            peer = chunk_rank(peer_chunk, pp, vp, sched)
            if peer == stage:   # two chunks of the same rank (DualPipeV's turn): no transfer
                continue
            pl = boundary_placement(layout, stage, peer)
            t = hw.collective_time(P2P, pl, nbytes)
            where = "NVLink" if pl.nodes == 1 else "network"
            # activations flow forward: received from the chunk before, sent to the chunk after
            fwd_op, bwd_op = ("recv", "send") if before else ("send", "recv")
            for op, phase, what in ((fwd_op, "fwd", "activation"), (bwd_op, "bwd", "activation grad")):
                out.append(Call(f"stage {what} {'from' if op == 'recv' else 'to'} rank {peer} ({where})",
                                op, "direct", "pp", pp, phase, float(nbytes), 1, t,
                                sent_bytes(P2P, pl, nbytes) if op == "send" else 0.0, formula,
                                per="micro_batch"))
    return out


@dataclasses.dataclass(frozen=True)
class StageInfo:
    """One pipeline rank's figures, as the report's stage table prints them."""

    stage: int
    layers: int
    moe_layers: int
    first: bool
    last: bool
    in_flight: float          # micro-batches of activations kept
    microbatch_time: float    # t_mb
    memory: float             # bytes per rank
    p2p_calls: int            # sends + receives per micro-batch


@dataclasses.dataclass(frozen=True)
class PipelineInfo:
    """The schedule, its bubble and every stage, attached to a pipelined ``StepCost``."""

    schedule: str
    pp: int
    vp: int
    micro_batches: int
    bubble_units: float
    bubble_fraction: float
    model_layers: int
    critical_stage: int       # the slowest stage: it sets the step
    memory_stage: int         # the stage with the most memory: it must fit
    stages: tuple[StageInfo, ...]


def stage_cost(spec: MoESpec, layout: CostLayout, hw: Hardware, stage: int,
               compute_efficiency: float | None = None, a2a_algo: str = "pairwise",
               ar_algo: str = "auto", _priced: dict | None = None) -> StepCost:
    """One pipeline rank's ``StepCost``: its blocks, its stage's groups, its boundaries, its
    activations in flight, and the schedule's bubble."""
    check_stages(spec, layout)
    sspec = stage_spec(spec, layout, stage)
    priced = {} if _priced is None else _priced    # stages with the same blocks price alike
    if sspec not in priced:
        priced[sspec] = price_stage(sspec, layout, hw, compute_efficiency, a2a_algo, ar_algo)
    cost = priced[sspec]
    keep = in_flight(layout.schedule, layout.pp, spec.micro_batches, layout.vp, stage)
    mem = cost.memory
    # the logits live one micro-batch (its backward follows at once), all of them under GPipe
    memory = dataclasses.replace(mem, activations=mem.activations * keep, replica_weights=mem.replica_weights * keep,
                                 head=mem.head * (keep if layout.schedule == "gpipe" else 1))
    return dataclasses.replace(cost, memory=memory, p2p=tuple(p2p_calls(sspec, layout, hw, stage)),
                               bubble_units=bubble_units(layout.schedule, layout.pp, layout.vp))


def pipeline_cost(spec: MoESpec, layout: CostLayout, hw: Hardware, compute_efficiency: float,
                  a2a_algo: str = "pairwise", ar_algo: str = "auto") -> StepCost:
    """The step of a pipelined model: the slowest stage's cost (module doc), with the whole
    model's FLOPs per token, the largest stage memory and every stage's figures."""
    check_stages(spec, layout)
    priced: dict = {}
    costs = [stage_cost(spec, layout, hw, s, compute_efficiency, a2a_algo, ar_algo, priced)
             for s in range(layout.pp)]
    crit = max(range(layout.pp), key=lambda s: (costs[s].microbatch_time, -s))
    big = max(range(layout.pp), key=lambda s: (costs[s].memory.total, -s))
    stages = tuple(StageInfo(s, c.spec.layers, c.spec.moe_layers, c.spec.first_stage, c.spec.last_stage,
                             in_flight(layout.schedule, layout.pp, spec.micro_batches, layout.vp, s),
                             c.microbatch_time, c.memory.total, len(c.p2p)) for s, c in enumerate(costs))
    info = PipelineInfo(layout.schedule, layout.pp, layout.vp, spec.micro_batches,
                        bubble_units(layout.schedule, layout.pp, layout.vp),
                        bubble_fraction(layout.schedule, layout.pp, spec.micro_batches, layout.vp),
                        spec.layers, crit, big, stages)
    model_params = count_params(spec, layout)
    whole = count_flops(spec, layout, model_params)
    c = costs[crit]
    flops = dataclasses.replace(c.flops, per_token=whole.per_token, model=whole.model)
    params = dataclasses.replace(c.params, total=model_params.total, active=model_params.active,
                                 mtp=model_params.mtp)
    return dataclasses.replace(c, memory=costs[big].memory, flops=flops, params=params, pipeline=info)


def step_cost(spec: MoESpec, layout: CostLayout, hw: Hardware, compute_efficiency: float | None = None,
              a2a_algo: str = "pairwise", ar_algo: str = "auto") -> StepCost:
    """Check the layout against the model, then price everything for one step.
    ``compute_efficiency`` (default: the hardware generation's large-GEMM efficiency per dtype,
    ``moepar.cost.compute``; 1.0 on a calibrated profile, whose rate is a measured matmul rate)
    replaces that figure."""
    if compute_efficiency is not None and not 0 < compute_efficiency <= 1:
        raise ValueError(f"compute_efficiency={compute_efficiency} must be in (0, 1] "
                         f"(the fraction of the peak FLOP rate reached)")
    if layout.pp > 1:
        return pipeline_cost(spec, layout, hw, compute_efficiency, a2a_algo, ar_algo)
    return price_stage(spec, layout, hw, compute_efficiency, a2a_algo, ar_algo)

"""The example's micro-batches and pipeline stages: the checks that run before any group,
this rank's GPT stages on torch's schedule, each rank's rows of each global micro-batch, and
one step's forwards and backwards (pipelined, or accumulated over the micro-batches at pp = 1)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import moepar
from examples.data import Batches
from examples.gpt_moe import GPT


def pipeline_options(args) -> tuple[int, int]:
    """(micro-batches, stages per rank), checked on every rank before any group exists."""
    from moepar.parallel import pipeline
    micro = args.microbatches if args.microbatches is not None else (2 * args.pp if args.pp > 1 else 1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    v = args.virtual_pipeline_size
    if args.pp == 1:
        if micro < 1:
            raise ValueError(f"microbatches={micro} must be a positive integer")
        v = 1
    else:
        moepar.parallel.Layout(world, args.tp, args.ep, args.etp, args.pp)   # the sizes tile the world
        kind = pipeline.schedule_kind(args.schedule)
        v = v if v is not None else (2 if kind.stages_per_rank is None else kind.stages_per_rank)
        pipeline.check_pipeline(args.schedule, args.pp, micro, args.layers, v)
    dp = max(1, world // args.pp // args.tp)
    if args.batch_size % (dp * micro):
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by data-parallel size {dp} x "
                         f"microbatches={micro}: every rank's micro-batches have the same size")
    return micro, v


def build_pipeline(args, cfg, state, device, micro):
    """This rank's stages of the GPT (embedding on the first, head and loss on the last) and
    torch's schedule over them; the model the optimizer and the checkpoint see."""
    from moepar.parallel import pipeline
    v = state.virtual_pipeline_size
    ids = pipeline.stage_ids(state.pp_rank, state.pp_size, args.schedule, v)
    num = state.pp_size * len(ids)
    chunks = [GPT(cfg, state, stage=(i, num)).to(device) for i in ids]
    if args.fsdp:
        chunks = [moepar.fully_shard(c, state) for c in chunks]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [c.stage_shapes(args.batch_size // state.dp_size // micro, dtype) for c in chunks]
    pipe = pipeline.Pipeline(chunks, args.schedule, micro, chunks[-1].loss, [s[0].to(device) for s in shapes],
                             [s[1].to(device) for s in shapes], state, device)
    model = chunks[0] if len(chunks) == 1 else pipeline.StageChunks(chunks)
    return model, pipe


def micro_rows(batch_size: int, dp_rank: int, dp: int, micro: int) -> list[int]:
    """This dp rank's rows of the global batch, micro-batch by micro-batch: its slice of each
    global micro-batch, so that any dp and pp see the same micro-batches (with one
    micro-batch: rows dp_rank * b ... of the global batch, as Batches.get gives)."""
    per_mb = batch_size // micro
    mine = per_mb // dp
    return [m * per_mb + dp_rank * mine + j for m in range(micro) for j in range(mine)]


def local_batch(batches: Batches, step: int, state, micro: int):
    if micro == 1:
        return batches.get(step, state.dp_rank, state.dp_size)
    x, y = batches.get(step, 0, 1)
    rows = micro_rows(batches.global_batch, state.dp_rank, state.dp_size, micro)
    return x[rows], y[rows]


def train_step(model, pipe, x, y, micro: int, device):
    """Forwards and backwards of one step; returns (loss, aux) as tensors, means over the
    micro-batches (with a pipeline: summed over the stages, the loss from the last)."""
    if pipe is not None:
        return pipe.step(x.to(device), y.to(device))
    ce_sum, aux_sum = 0.0, 0.0
    for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
        with _autocast(device):
            ce = model(xm.to(device), ym.to(device))
            aux = moepar.aux_loss(model)
        ((ce + aux) / micro).backward()
        ce_sum, aux_sum = ce_sum + ce.detach() / micro, aux_sum + aux.detach() / micro
    return ce_sum, aux_sum


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)

"""The examples' ``--deepspeed CONFIG.json``: the GPT-MoE (and the HF fine-tune, which reads
its config with ``read_config``) trained by DeepSpeed's engine over moepar's layers
(``moepar.deepspeed.initialize``, docs/deepspeed.md).

The config file says what DeepSpeed does (the ZeRO stage, bf16, ...); the example fills in
what its own options already say (the micro-batch size, the micro-batches per step, the
clipping norm) and keeps its AdamW and learning-rate schedule, so that a run with the flag
trains the same model on the same batches as a run without it. The engine then does the
steps the plain loop does by hand: the backwards' data-parallel reduction, the clipping and
the optimizer step.
"""
from __future__ import annotations

import json

import moepar


def check_args(args) -> None:
    """Options the flag cannot take, refused before any process group exists."""
    if not args.deepspeed:
        return
    clashes = [flag for flag, on in (("--fsdp", args.fsdp), ("--pp > 1", args.pp > 1),
                                     ("--resume", args.resume not in (None, "never")),
                                     ("--checkpoint-every", args.checkpoint_every)) if on]
    if clashes:
        raise ValueError(f"--deepspeed {args.deepspeed} with {', '.join(clashes)}: DeepSpeed's engine shards and "
                         f"reduces in place of moepar.fully_shard, runs one pipeline stage, and keeps its optimizer "
                         f"state in its own checkpoints (engine.save_checkpoint, docs/deepspeed.md), which the "
                         f"example's resume does not read; its final weights are saved with moepar.checkpoint")


def read_config(path: str, wanted: dict) -> dict:
    """The DeepSpeed config at ``path`` with ``wanted`` filled in: what the example's own
    options already decide (a value the file sets must agree with them)."""
    with open(path) as f:
        cfg = json.load(f)
    for key in ("optimizer", "scheduler"):
        if key in cfg:
            raise ValueError(f"--deepspeed {path} sets {key!r}: the example trains with its own AdamW and "
                             f"learning-rate schedule; remove it")
    for key, value in wanted.items():
        if key in cfg and cfg[key] != value:
            raise ValueError(f"--deepspeed {path} sets {key}={cfg[key]}, but the example's options make it "
                             f"{value}; drop it from the file or agree")
        cfg[key] = value
    # the examples' torch AdamW is not in DeepSpeed's list of optimizers it tested with ZeRO
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 10 ** 9)   # the examples print their own progress
    return cfg


def config(args, dp: int) -> dict:
    """The GPT example's config: its batch split (--batch-size, --microbatches) and --clip."""
    micro = args.microbatches or 1
    return read_config(args.deepspeed, {"train_batch_size": args.batch_size,
                                        "train_micro_batch_size_per_gpu": args.batch_size // dp // micro,
                                        "gradient_accumulation_steps": micro, "gradient_clipping": args.clip})


def initialize(args, state, model, opt):
    """DeepSpeed's engine over ``model`` with ``opt`` (split in place: experts in groups of their own)."""
    from moepar.deepspeed import initialize as deepspeed_initialize   # imports DeepSpeed
    engine, *_ = deepspeed_initialize(model=model, optimizer=opt, config=config(args, state.dp_size), mpu=state)
    return engine


def train_step(engine, x, y, micro: int, device):
    """One step's forwards and backwards through the engine, then its step (reduction,
    clipping, update at the last micro-batch); returns (loss, aux) as the plain loop's
    ``train_step`` does: means over the micro-batches."""
    ce_sum, aux_sum = 0.0, 0.0
    for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
        ce = engine(xm.to(device), ym.to(device))
        aux = moepar.aux_loss(engine.module)
        engine.backward(ce + aux)   # DeepSpeed divides by its gradient_accumulation_steps (= micro)
        engine.step()
        ce_sum, aux_sum = ce_sum + ce.detach() / micro, aux_sum + aux.detach() / micro
    return ce_sum, aux_sum

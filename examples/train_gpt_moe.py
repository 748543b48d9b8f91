"""Train the example GPT-MoE with tensor, expert, data and pipeline parallelism.

    python examples/train_gpt_moe.py                         # one process
    torchrun --nproc_per_node=4 examples/train_gpt_moe.py --tp 2 --ep 2
    torchrun --nproc_per_node=4 examples/train_gpt_moe.py --pp 2 --ep 2 --microbatches 4 \
        --schedule 1f1b          # gpipe | 1f1b | interleaved | zb | zbv | dualpipev (docs/pipeline.md)
    torchrun --nproc_per_node=4 --max-restarts=3 examples/train_gpt_moe.py --tp 2 --ep 2 \
        --checkpoint-every 50 --resume auto --timeout-seconds 300   # survives a lost rank

A collective that waits on a dead or stalled peer fails after ``--timeout-seconds`` (every
process group's timeout: the world's through ``init_process_group(timeout=...)``, moepar's
through ``init_parallel(timeout=...)``) with an error naming the op and the group, and the
process exits 1; torchrun then restarts the job, which resumes from the newest complete
checkpoint with ``--resume auto`` (docs/faults.md).

gloo on CPU and NCCL on GPU are chosen automatically (bf16 autocast on GPU). The default
data is the Python standard library's source (byte-level); ``--data PATH`` for your own.
Every rank prints nothing but rank 0's progress lines; at the end rank 0 writes
``<out>/metrics.json`` and ``<out>/loss.png`` (with matplotlib), prints a text sample and
the communication cost report for this configuration, measured beside predicted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moepar  # noqa: E402
from moepar import checkpoint  # noqa: E402
from moepar.parallel import comm  # noqa: E402
from moepar.parallel.faults import DEFAULT_TIMEOUT, init_distributed  # noqa: E402

from examples import deepspeed_glue  # noqa: E402
from examples.data import Batches, load_corpus  # noqa: E402
from examples.gpt_moe import GPT, GPTConfig  # noqa: E402
from examples.pipeline_steps import (build_pipeline, local_batch, micro_rows,  # noqa: E402,F401
                                     pipeline_options, train_step)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    g.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages of consecutive ranks)")
    g.add_argument("--schedule", default="1f1b",
                   help="pipeline schedule with --pp > 1: gpipe | 1f1b | interleaved | zb | zbv | dualpipev")
    g.add_argument("--virtual-pipeline-size", type=int, default=None,
                   help="stages per rank for interleaved and zb (default 2); zbv and dualpipev hold 2")
    g.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step (default 1, with --pp: 2 x pp); the same M at pp = 1 "
                        "accumulates the same micro-batches")
    g.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and optimizer state with moepar.fully_shard (FSDP2): "
                        "dense over dp, experts over edp (needs torchrun)")
    g.add_argument("--deepspeed", default=None, metavar="CONFIG.json",
                   help="train under DeepSpeed's engine with this config (ZeRO 0-2, bf16, ...; "
                        "moepar.deepspeed.initialize, docs/deepspeed.md)")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--context", type=int, default=128)
    g.add_argument("--experts", type=int, default=8)
    g.add_argument("--topk", type=int, default=2)
    g.add_argument("--moe-every", type=int, default=1, help="1: every block MoE, 2: every other")
    g.add_argument("--expert-ffn", type=int, default=256)
    g.add_argument("--dense-ffn", type=int, default=512)
    g.add_argument("--capacity-factor", type=float, default=None, help="default: dropless")
    g.add_argument("--aux-loss-coeff", type=float, default=1e-2)
    g.add_argument("--z-loss-coeff", type=float, default=1e-3)
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute attention cores, MLP activations and expert FFNs in backward "
                        "(no collective is re-run)")
    g.add_argument("--cpu-source-major", action="store_true",
                   help="on CPUs over gloo, let the experts take the received rows source-major "
                        "(no regroup; the layer's cpu_source_major option)")
    g.add_argument("--dispatch-dtype", choices=["fp8"], default=None,
                   help="fp8: the dispatch all-to-all's rows in FP8 with a fp32 scale per 128 channels "
                        "(DeepSeek-V3's recipe; the layer's dispatch_dtype option)")
    g.add_argument("--redundant-experts", type=int, default=0,
                   help="extra expert slots per EP group holding copies of hot experts (the layer's "
                        "redundant_experts option; divisible by --ep)")
    g.add_argument("--rebalance-every", type=int, default=0,
                   help="re-place the copies from the measured load every N steps (moepar.rebalance; 0: never)")
    g.add_argument("--rebalance-decay", type=float, default=0.0,
                   help="plan from decay x the previous plan's load + the new counts (moepar.rebalance's decay)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=300)
    g.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--warmup", type=int, default=30)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data", default=None, help="text file or folder (default: Python stdlib sources)")
    g = p.add_argument_group("output")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-batches", type=int, default=4)
    g.add_argument("--out", default="runs/gpt_moe")
    g.add_argument("--checkpoint-dir", default=None, help="default: <out>/checkpoints")
    g.add_argument("--checkpoint-every", type=int, default=0, help="0: only at the end")
    g.add_argument("--resume", nargs="?", const="auto", default=None, metavar="auto|PATH",
                   help="'auto' (or the flag alone): continue from the newest complete checkpoint under "
                        "--checkpoint-dir if there is one, else start fresh (for torchrun --max-restarts); "
                        "PATH: from that checkpoint directory")
    g.add_argument("--timeout-seconds", type=float, default=DEFAULT_TIMEOUT.total_seconds(),
                   help="how long a collective waits for a peer before failing (every process group); "
                        "default %(default).0f")
    g.add_argument("--sample-tokens", type=int, default=200)
    g.add_argument("--hardware", default=None, help="hardware preset or calibrated profile for the cost report")
    g.add_argument("--time-peer-wait", action="store_true",
                   help="a barrier before each collective, timed apart: the report then splits waiting "
                        "for peers from the transfer (slows the steps; a measurement mode)")
    g.add_argument("--quiet", action="store_true", help="no progress lines (tests)")
    return p.parse_args(argv)


def setup_distributed(timeout_seconds: float = DEFAULT_TIMEOUT.total_seconds()) -> torch.device:
    """Join the torchrun world (if any): NCCL on GPU, gloo on CPU, with a rendezvous that
    survives torchrun's restarts and the world group's timeout."""
    init_distributed(timeout=timeout_seconds)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def lr_at(step: int, args) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def _mean_over_dp(value: torch.Tensor, state) -> float:
    v = value.detach().float().reshape(1).clone()
    comm.all_reduce_(v, state.dp_group)
    return float(v) / state.dp_size


def build(args, device):
    micro, v = pipeline_options(args)
    args.microbatches = micro
    state = moepar.init_parallel(args.tp, args.ep, args.etp, seed=args.seed, verbose=not args.quiet,
                                 timeout=args.timeout_seconds, pipeline_parallel_size=args.pp,
                                 virtual_pipeline_size=v)
    cfg = GPTConfig(context=args.context, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    experts=args.experts, topk=args.topk, moe_every=args.moe_every,
                    expert_ffn=args.expert_ffn, dense_ffn=args.dense_ffn, capacity_factor=args.capacity_factor,
                    aux_loss_coeff=args.aux_loss_coeff, z_loss_coeff=args.z_loss_coeff,
                    sequence_parallel=args.sequence_parallel,
                    checkpoint_activations=args.checkpoint_activations, init_seed=args.seed,
                    cpu_source_major=args.cpu_source_major, dispatch_dtype=args.dispatch_dtype,
                    redundant_experts=args.redundant_experts)
    if args.pp == 1:
        model = GPT(cfg, state).to(device)
        if args.fsdp:
            model = moepar.fully_shard(model, state)  # the optimizer below sees the sharded params
    else:
        model, pipe = build_pipeline(args, cfg, state, device, micro)
        model.pipeline = pipe   # torch's schedule over this rank's stages: train() steps with it
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    return state, cfg, model, opt


@torch.no_grad()
def evaluate(model, batches: Batches, args, state, device, pipe=None, micro: int = 1) -> float:
    model.eval()
    losses = []
    for i in range(args.eval_batches):
        x, y = local_batch(batches, 10_000_000 + i, state, micro if pipe is not None else 1)
        with _autocast(device):
            loss = pipe.evaluate(x.to(device), y.to(device))[0] if pipe is not None else model(
                x.to(device), y.to(device))
        losses.append(_mean_over_dp(loss, state))
    model.train()
    return sum(losses) / len(losses)


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)


def train(args) -> dict:
    """Run training; returns the metrics dict (also written to <out>/metrics.json by rank 0)."""
    if args.rebalance_every < 0 or (args.rebalance_every and not args.redundant_experts):
        raise ValueError(f"--rebalance-every {args.rebalance_every} needs --redundant-experts R > 0 and a "
                         f"period >= 0 (the copies are what a rebalance re-places)")
    deepspeed_glue.check_args(args)
    device = setup_distributed(args.timeout_seconds)
    corpus = load_corpus(args.data, args.context)
    state, cfg, model, opt = build(args, device)
    engine = deepspeed_glue.initialize(args, state, model, opt) if args.deepspeed else None
    pipe, micro = getattr(model, "pipeline", None), args.microbatches
    rank0 = state.rank == 0
    log = (lambda *a: print(*a, flush=True)) if rank0 and not args.quiet else (lambda *a: None)
    log(f"data: {corpus.description}")
    log(f"layout: world {state.world_size} = " + (f"pp {state.pp_size} x " if state.pp_size > 1 else "")
        + f"tp {state.tp_size} x dp {state.dp_size}; experts: ep {state.ep_size}"
        f" x etp {state.etp_size} x edp {state.edp_size}; params on rank 0: "
        f"{sum(p.numel() for p in model.parameters()):,}")
    train_b = Batches(corpus.train, args.context, args.batch_size, args.seed)
    val_b = Batches(corpus.val, args.context, args.batch_size, args.seed + 1)
    ckpt_dir = args.checkpoint_dir or os.path.join(args.out, "checkpoints")
    metrics = {"args": vars(args), "losses": [], "val": [], "aux": [], "dropped": [], "tokens_per_s": [],
               "comm_seconds": {}, "compute_seconds": 0.0}
    start = 0
    if path := _resume_path(args, ckpt_dir):
        # Model, optimizer (its lr included), metrics, every RNG stream, every MoE layer's
        # counters and slot maps (re-planned at another --ep or --redundant-experts); the data
        # and the lr schedule are functions of the step.
        extra = checkpoint.load(path, model, opt, extra_keys=("step", "metrics"), state=state, rng=True)
        start, metrics = extra["step"], extra["metrics"]
        metrics["resumed_at"] = start
        # Checkpoints of earlier versions kept the slot maps here instead.
        moepar.load_placement_state(model, metrics.pop("replicas", None))
        log(f"resumed from {path} (step {start})")
    all_events: list[comm.CommEvent] = []
    rows_in = _watch_expert_rows(model)  # rows each MoE layer's experts got (the report's routing input)
    received_rows = 0
    rebalance_calls = 0   # moepar.rebalance calls since the start or the resume (the run report's)
    replica_returned = 0   # and the copies whose gradients it sent back
    replica_copies = 0   # expert slices this rank sent in the replica all-to-alls (the run report's)
    tokens_per_step = args.batch_size * args.context
    t_start = time.perf_counter()
    for step in range(start, args.steps):
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = local_batch(train_b, step, state, micro)
        rows_in.clear()
        if cfg.redundant_experts:   # this step's forwards use the slot maps in place now
            from moepar.cost.replication import replica_copies_per_forward
            placements = [m.placement for m in model.modules() if isinstance(m, moepar.MoE)]
            replica_copies += (micro or 1) * replica_copies_per_forward(placements, state.ep_rank)
            replica_returned += (micro or 1) * replica_copies_per_forward(placements, state.ep_rank, received=True)
        t0 = time.perf_counter()
        peer_wait = comm.peer_wait_timing() if args.time_peer_wait else contextlib.nullcontext()
        with comm.track() as events, peer_wait:
            if engine is not None:   # the engine reduces, clips and steps
                ce, aux = deepspeed_glue.train_step(engine, x, y, micro, device)
            else:
                ce, aux = train_step(model, pipe, x, y, micro, device)
                if not args.fsdp:  # under FSDP the backward pass reduced the gradients
                    moepar.allreduce_gradients(model, state)
                moepar.clip_grad_norm_(model, args.clip, state)
                opt.step()
                opt.zero_grad(set_to_none=True)
            loss = _mean_over_dp(ce, state)
            if args.rebalance_every and (step + 1) % args.rebalance_every == 0:
                rebalance_calls += 1
                for r in moepar.rebalance(model, decay=args.rebalance_decay):
                    metrics.setdefault("rebalances", []).append((step + 1, r.layer, r.before, r.after))
        dt = time.perf_counter() - t0
        all_events.extend(events.events)
        received_rows += sum(rows_in.values())
        moes = [m for m in model.modules() if isinstance(m, moepar.MoE)]
        dropped = sum(m.stats.dropped_fraction for m in moes) / max(1, len(moes))
        # The worst layer's max/mean routes per expert over its EP group (moepar.load_report).
        report = moepar.load_report(model) if moes else None
        overload = (report.worst()["expert_overload"] or 0.0) if moes else 0.0
        metrics.setdefault("overload", []).append(overload)
        if moes:   # the worst layer's received rows per EP rank, max / mean (before copies: unreplicated)
            metrics.setdefault("rank_overload", []).append(report.worst("rank_overload")["rank_overload"])
            if cfg.redundant_experts:
                metrics.setdefault("unreplicated_overload", []).append(
                    report.worst("unreplicated_overload")["unreplicated_overload"])
        metrics["losses"].append(loss)
        metrics["aux"].append(float(aux.detach()))
        metrics["dropped"].append(dropped)
        metrics["tokens_per_s"].append(tokens_per_step / dt)
        for e in events.events:
            metrics["comm_seconds"][e.op] = metrics["comm_seconds"].get(e.op, 0.0) + e.seconds
        waited = sum(e.wait_seconds for e in events.events)  # 0 unless --time-peer-wait
        metrics["peer_wait_seconds"] = metrics.get("peer_wait_seconds", 0.0) + waited
        metrics["compute_seconds"] += dt - events.seconds() - waited
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            metrics["val"].append((step + 1, evaluate(model, val_b, args, state, device, pipe, micro)))
        if (step + 1) % args.log_interval == 0 or step == start:
            by_op = {op: sum(e.seconds for e in events.events if e.op == op) * 1e3
                     for op in ("all_to_all", "all_reduce", "all_gather", "reduce_scatter")}
            val = f" val {metrics['val'][-1][1]:.3f}" if metrics["val"] and metrics["val"][-1][0] == step + 1 else ""
            log(f"step {step + 1:4d}/{args.steps} loss {loss:.3f}{val} aux {float(aux.detach()):.4f} dropped {dropped:.1%} overload {overload:.2f} "
                f"lr {lr:.1e} {tokens_per_step / dt:,.0f} tok/s | ms: a2a {by_op['all_to_all']:.0f} "
                f"allreduce {by_op['all_reduce']:.0f} allgather+rs {by_op['all_gather'] + by_op['reduce_scatter']:.0f}"
                f" compute {(dt - events.seconds()) * 1e3:.0f}")
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
            checkpoint.save_checkpoint(ckpt_dir, step + 1, model, opt, {"metrics": metrics}, state)
    metrics["wall_seconds"] = time.perf_counter() - t_start
    if args.steps > start:
        # (under --deepspeed the optimizer state is DeepSpeed's: the weights alone)
        checkpoint.save_checkpoint(ckpt_dir, args.steps, model, opt if engine is None else None,
                                   {"metrics": metrics}, state)
    metrics["received_rows"] = received_rows
    metrics["replica_copies"] = replica_copies
    metrics["replica_returned"] = replica_returned
    metrics["rebalance_calls"] = rebalance_calls
    _finish(args, cfg, state, model, metrics, all_events, device, log)
    return metrics


def _resume_path(args, ckpt_dir: str) -> str | None:
    if args.resume in (None, "never"):
        return None
    if args.resume == "auto":
        return checkpoint.latest_checkpoint(ckpt_dir)   # None: a fresh start
    if not os.path.isdir(args.resume):
        raise ValueError(f"--resume {args.resume!r}: no such checkpoint directory")
    return args.resume


def _watch_expert_rows(model) -> dict:
    """{MoE layer: rows its experts were given in its training forwards since the dict was
    last cleared (every micro-batch's)}, kept by forward hooks; a recomputation under
    --checkpoint-activations (a forward run inside the backward) adds nothing."""
    rows: dict = {}
    for m in model.modules():
        if isinstance(m, moepar.MoE):
            def hook(module, inputs, output, key=m):
                if module.training and torch._C._current_graph_task_id() == -1:
                    rows[key] = rows.get(key, 0) + int(inputs[0].shape[0])
            m.experts.register_forward_hook(hook)
    return rows


def _finish(args, cfg, state, model, metrics, events, device, log) -> None:
    if args.sample_tokens and state.pp_size == 1:  # every rank generates: the layers' collectives need them all
        prompt = torch.tensor([list(b"def ")], device=device)
        with _autocast(device):
            text = model.generate(prompt, args.sample_tokens, seed=args.seed)
        metrics["sample"] = bytes(text[0].tolist()).decode("utf-8", errors="replace")
    hardware = _report_hardware(args, state, log)  # may calibrate: a collective, all ranks
    if state.rank != 0:
        return
    losses, val = metrics["losses"], metrics["val"]
    if losses:
        log(f"\n== summary: {len(losses)} steps, {metrics.get('wall_seconds', 0):.0f}s; train loss "
            f"{losses[0]:.3f} -> {losses[-1]:.3f}" + (f"; validation loss {val[-1][1]:.3f}" if val else ""))
        comm_s = metrics["comm_seconds"]
        log("time: compute {:.1f}s, all-to-all {:.1f}s, all-reduce {:.1f}s, all-gather {:.1f}s, "
            "reduce-scatter {:.1f}s".format(metrics["compute_seconds"], *(comm_s.get(op, 0.0) for op in (
                "all_to_all", "all_reduce", "all_gather", "reduce_scatter")))
            + (f", waiting for peers {metrics['peer_wait_seconds']:.1f}s" if metrics.get("peer_wait_seconds") else ""))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1, default=str)
    _plot(args, metrics, log)
    if "sample" in metrics:
        log("== sample (prompt 'def '):\n" + metrics["sample"])
    if hardware is not None:
        log(cost_report(args, cfg, state, model, events, len(losses) - metrics.get("resumed_at", 0), hardware,
                        metrics.get("received_rows"), metrics.get("replica_copies"),
                        metrics.get("rebalance_calls", 0), metrics.get("replica_returned")))


def _report_hardware(args, state, log):
    """The hardware the cost report prices with: ``--hardware`` (preset or profile JSON),
    else a quick calibration of this run's own backend (all ranks take part)."""
    from moepar.cost import get_hardware
    from moepar.cost.calibrate import calibrate, size_sweep
    if args.hardware:
        return get_hardware(args.hardware)
    if state.world_size < 2:
        return None  # one process: no collectives to price
    sizes = [n for n in (2, 4, 8) if n <= state.world_size and state.world_size % n == 0]
    log("calibrating this backend's collectives for the cost report (--hardware skips this) ...")
    return calibrate(size_sweep(16 * 1024, 4 * 1024 * 1024, 4.0), sizes, repeats=3)


def _plot(args, metrics, log) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("(matplotlib not installed: no loss plot; pip install moepar[plot])")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(metrics["losses"]) + 1), metrics["losses"], label="train")
    if metrics["val"]:
        ax.plot(*zip(*metrics["val"]), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.legend()
    if metrics.get("overload"):   # beside the loss: the worst layer's expert overload factor
        ax2 = ax.twinx()
        ax2.plot(range(1, len(metrics["overload"]) + 1), metrics["overload"], color="tab:red", alpha=0.6)
        ax2.set_ylabel("worst layer's expert overload (max/mean)", color="tab:red")
    path = os.path.join(args.out, "loss.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    log(f"wrote {path} and {os.path.join(args.out, 'metrics.json')}")


def run_spec(args, cfg, state, model, imbalance: float = 1.0):
    """The cost model's description of this run's GPT-MoE, parameter for parameter: LayerNorms
    (with bias), biased q/k/v/output and dense-MLP linears, a learned position table, GELU
    (2-matrix) experts, three column-parallel attention inputs, the router's aux (and z)
    statistics, the gradient-norm and loss reductions of the training step."""
    from moepar.cost import MoESpec
    # The whole model's MoE blocks (with pipeline stages this rank holds only its stages').
    moe_layers = sum(1 for i in range(cfg.layers) if i % cfg.moe_every == cfg.moe_every - 1)
    return MoESpec(hidden=cfg.hidden, ffn=cfg.expert_ffn, experts=cfg.experts, topk=cfg.topk,
                   tokens=args.batch_size // state.dp_size // (args.microbatches or 1) * cfg.context,  # a micro-batch's
                   dtype="bf16" if torch.cuda.is_available() else "fp32", dispatch_dtype=cfg.dispatch_dtype,
                   capacity_factor=cfg.capacity_factor, gated=False, layers=cfg.layers,
                   dense_layers=cfg.layers - moe_layers, dense_ffn=cfg.dense_ffn, heads=cfg.heads,
                   vocab=cfg.vocab_size, seq_len=cfg.context, imbalance=max(1.0, imbalance),
                   norm_bias=True, attn_bias="all", mlp_bias=True, pos_embeddings=cfg.context, qkv_linears=3,
                   aux_loss=cfg.aux_loss_coeff > 0, z_loss=cfg.z_loss_coeff > 0, aux_scope=cfg.aux_loss_scope,
                   clip_grad=True, loss_allreduce=True)


def cost_report(args, cfg, state, model, events, steps, hardware, received_rows=None, replica_copies=None,
                rebalances=0, replica_returned=None) -> str:
    """The cost model's report for this configuration, and every collective the run
    recorded beside the model's calls, bytes and time for the same steps."""
    from moepar.cost import CostLayout, imbalance_from_counts
    from moepar.cost.report import report_for
    from moepar.cost.run_report import compare_run, render_run
    moes = [m for m in model.modules() if isinstance(m, moepar.MoE)]
    counts = sum(m.stats.tokens_per_expert.double() for m in moes).tolist() if moes else None
    imbalance = imbalance_from_counts(counts, state.ep_size) if counts and sum(counts) else 1.0
    spec = run_spec(args, cfg, state, model, imbalance)
    layout = CostLayout(gpus=state.world_size, gpus_per_node=hardware.gpus_per_node, tp=state.tp_size,
                        ep=state.ep_size, etp=state.etp_size, sp=cfg.sequence_parallel)
    import dataclasses
    try:   # a cost model with pipeline stages prices the stages, the micro-batches and the schedule
        if (args.microbatches or 1) > 1:
            spec = dataclasses.replace(spec, micro_batches=args.microbatches)
        if state.pp_size > 1:
            layout = dataclasses.replace(layout, pp=state.pp_size, vp=state.virtual_pipeline_size,
                                         schedule=args.schedule)
    except (TypeError, ValueError):   # one without them (or without this schedule)
        pass
    kw = {}
    if cfg.redundant_experts:   # the copies' weights and gradients, as the slot maps sent them
        spec = dataclasses.replace(spec, redundant_experts=cfg.redundant_experts, imbalance=1.0,
                                   expert_loads=tuple(counts) if counts and sum(counts) else None)
        kw["replica_copies"] = replica_copies
        kw["rebalances"] = rebalances
        kw["replica_returned"] = replica_returned
    if state.pp_size > 1:
        try:   # the run report's pipeline rows (this rank's stage)
            rows = compare_run(spec, layout, hardware, events, max(1, steps), received_rows,
                               pipeline_stage=state.pp_rank, **kw)
        except TypeError:   # a cost model without pipeline stages: the per-stage collectives only
            rows = compare_run(spec, layout, hardware, events, max(1, steps), received_rows, **kw)
    else:
        rows = compare_run(spec, layout, hardware, events, max(1, steps), received_rows, **kw)
    return "\n".join(["", "== communication cost report for this run " + "=" * 30,
                      report_for(spec, layout, hardware), "",
                      render_run(rows, hardware, layout, max(1, steps))])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        train(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        moepar.destroy_parallel()
        return 2
    except BaseException:
        if dist.is_initialized() and dist.get_world_size() > 1:
            # A peer may be dead or stuck in a collective: a clean teardown (a barrier) would
            # wait for it. Exit now, non-zero; torchrun restarts the job (--max-restarts).
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        moepar.destroy_parallel()
        raise
    moepar.destroy_parallel()  # joins every group's threads before the interpreter finalizes
    return 0


if __name__ == "__main__":
    sys.exit(main())

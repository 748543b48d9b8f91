"""Fine-tune a Hugging Face MoE model with moepar's expert parallelism, then save it back
as an HF checkpoint that transformers loads.

  python examples/finetune_hf_moe.py --out /tmp/hfmoe --ep 1               # one process
  torchrun --nproc_per_node 2 examples/finetune_hf_moe.py --out /tmp/hfmoe --ep 2
  torchrun --nproc_per_node 4 examples/finetune_hf_moe.py --out /tmp/hfmoe --tp 2 --ep 2
  torchrun --nproc_per_node 4 examples/finetune_hf_moe.py --out /tmp/hfmoe --ep 2 --deepspeed zero2.json

1. Rank 0 builds a small Qwen3-MoE causal LM from a config (no download; byte tokens,
   a few million parameters) and saves it as a sharded safetensors checkpoint.
2. Every rank loads it with ``moepar.hf.load_pretrained``: the dense part from the
   checkpoint, each MoE block as a moepar ``MoE`` holding only this rank's experts, read
   lazily (the peak RSS line shows what that costs).
3. A few hundred AdamW steps on the embedded text, loss printed; moepar's aux loss added.
   With ``--deepspeed CONFIG.json`` (e.g. ``{"zero_optimization": {"stage": 2}}``) DeepSpeed's
   engine reduces and steps (``moepar.deepspeed.initialize``: ZeRO-2 shards the gradients and
   AdamW's state, the swapped blocks' experts over their expert-data-parallel group).
4. ``save_hf_checkpoint`` gathers the experts into an HF checkpoint; rank 0 reloads it with
   plain transformers, checks its logits against the moepar model's, and generates.

For a real model, point ``--init`` at its checkpoint folder (a family ``moepar.hf``
converts; docs/hf.md lists them) and skip step 1.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make `examples` importable (--deepspeed's glue)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moepar  # noqa: E402
from moepar.hf import load_pretrained, save_hf_checkpoint  # noqa: E402

TEXT = (
    "A mixture of experts replaces the dense feed-forward layer of a transformer by many "
    "smaller ones, the experts, and a router that sends every token to a few of them. "
    "Expert parallelism spreads the experts over the ranks: each token travels to the "
    "ranks of its experts and back in two all-to-all exchanges. Tensor parallelism slices "
    "each matrix instead and adds the partial results with an all-reduce. "
) * 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for the checkpoints")
    p.add_argument("--init", default=None, help="HF checkpoint to start from (default: build one in OUT/init)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--no-save", action="store_true", help="stop after training (e.g. for the RSS benchmark)")
    p.add_argument("--deepspeed", default=None, metavar="CONFIG.json",
                   help="train under DeepSpeed's engine with this config (e.g. ZeRO-2; docs/deepspeed.md)")
    return p.parse_args(argv)


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident set size now ("VmRSS") or its peak so far ("VmHWM"), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_initial(args, path: str) -> None:
    import transformers
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden, num_experts=args.experts, num_experts_per_tok=2,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
        max_position_embeddings=4 * args.seq, norm_topk_prob=True, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path, max_shard_size="1MB")
    n = sum(p.numel() for p in model.parameters())
    print(f"built {cfg.model_type} with {n / 1e6:.2f}M parameters -> {path}", flush=True)


def batch(step: int, args, state) -> torch.Tensor:
    """This data-parallel replica's rows of the global batch of ``step`` (same on every layout)."""
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed * 100003 + step)
    starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
    rows = torch.stack([data[s:s + args.seq] for s in starts.tolist()])
    per = args.batch // state.dp_size
    return rows[state.dp_rank * per:(state.dp_rank + 1) * per]


def main(argv=None) -> int:
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    init = args.init or os.path.join(args.out, "init")
    build = args.init is None and rank == 0 and not os.path.exists(os.path.join(init, "config.json"))
    if build and not dist.is_initialized():
        build_initial(args, init)
    elif build:
        # In a child process, so that building the whole model does not count in rank 0's RSS.
        import multiprocessing
        child = multiprocessing.get_context("spawn").Process(target=build_initial, args=(args, init))
        child.start()
        child.join()
        if child.exitcode:
            raise RuntimeError(f"building the initial checkpoint failed (exit code {child.exitcode})")
    if dist.is_initialized():
        dist.barrier()

    state = moepar.init_parallel(args.tp, args.ep, seed=args.seed, verbose=False)
    if args.batch % state.dp_size:
        raise ValueError(f"--batch={args.batch} is not divisible by the data-parallel size {state.dp_size}")
    import transformers   # its modeling code imported first (no model built): not part of the load's RSS
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    MODEL_FOR_CAUSAL_LM_MAPPING[type(transformers.AutoConfig.from_pretrained(init))]
    rss_before, file_before = rss_mib(), rss_mib("RssFile")
    model, blocks = load_pretrained(init, state, aux_loss="switch", aux_loss_coeff=1e-2, keep_open=True)
    file_peak = rss_mib("RssFile")   # file-backed pages: the checkpoint's maps this rank touched, libraries
    model.hf_checkpoint.close()
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." in n)
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." not in n)
    grown = rss_mib("VmHWM") - rss_before
    line = (f"rank {rank}: peak RSS grew {grown:.1f} MiB while loading (from {rss_before:.0f} MiB); this rank's "
            f"experts {experts / 2**20:.1f} MiB + dense part {dense / 2**20:.1f} MiB; slack "
            f"{grown - (experts + dense) / 2**20:+.1f} MiB, of which file-backed pages mapped meanwhile (checkpoint, libraries) "
            f"{file_peak - file_before:.1f} MiB")
    if dist.is_initialized():
        lines = [None] * dist.get_world_size()
        dist.all_gather_object(lines, line)
        log("\n".join(lines))
    else:
        log(line)
    log(f"{blocks} MoE blocks replaced; layout tp={state.tp_size} ep={state.ep_size} dp={state.dp_size}")

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine = None
    if args.deepspeed:   # the engine reduces (experts over their edp group), shards and steps
        from examples.deepspeed_glue import read_config
        from moepar.deepspeed import initialize
        # (DeepSpeed clips at 1.0 unless told otherwise; this loop does not clip)
        cfg = read_config(args.deepspeed, {"train_batch_size": args.batch, "gradient_clipping": 0.0,
                                           "train_micro_batch_size_per_gpu": args.batch // state.dp_size})
        engine, *_ = initialize(model=model, optimizer=opt, config=cfg, mpu=state)
    t0 = time.time()
    for step in range(args.steps):
        ids = batch(step, args, state)
        if engine is not None:
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss + moepar.aux_loss(model))
            engine.step()
        else:
            out = model(input_ids=ids, labels=ids)
            loss = out.loss + moepar.aux_loss(model)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            moepar.allreduce_gradients(model, state)
            opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            lm = out.loss.detach().clone()
            if dist.is_initialized():
                dist.all_reduce(lm)
                lm /= dist.get_world_size()
            log(f"step {step:4d}  loss {float(lm):.4f}  ({time.time() - t0:.0f} s)")

    if args.no_save:
        return 0
    final = os.path.join(args.out, "finetuned")
    model.eval()
    save_hf_checkpoint(model, final)
    probe = batch(10 ** 6, args, state)[:1]
    with torch.no_grad():
        ours = model(input_ids=probe).logits
    if rank == 0:
        import transformers
        back = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
        with torch.no_grad():
            diff = float((back(input_ids=probe).logits - ours).abs().max())
            prompt = torch.tensor([list(b"Expert parallelism ")])
            gen = back.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
        log(f"reloaded {final} with transformers: max |logits - moepar's| = {diff:.2e}")
        log("generated: " + repr(bytes(gen[0].tolist()).decode(errors="replace")))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

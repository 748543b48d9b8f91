"""Model-state memory per rank: ``moepar.fully_shard`` (FSDP2) against ``allreduce_gradients``.

    torchrun --standalone --nproc_per_node 4 scripts/fsdp_memory.py --tp 1 --ep 2

Builds the example GPT-MoE (examples/gpt_moe.py, default sizes unless given), takes one
AdamW step each way and prints, per way, the bytes each rank holds in parameters, gradients
and optimizer state (local shards only; the max over ranks). Not counted: FSDP's transient
all-gathered parameters (one unit, a transformer block, at a time) and activations.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moepar  # noqa: E402

from examples.gpt_moe import GPT, GPTConfig  # noqa: E402


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(model, opt) -> dict[str, int]:
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for p in model.parameters():
        out["params"] += _local(p).numel() * p.element_size()
        if p.grad is not None:
            out["grads"] += _local(p.grad).numel() * p.grad.element_size()
        for v in opt.state[p].values():
            if torch.is_tensor(v):
                out["optimizer"] += _local(v).numel() * v.element_size()
    return out


def measure(fsdp: bool, state, cfg, batch: int) -> dict[str, int]:
    model = GPT(cfg, state)
    if fsdp:
        model = moepar.fully_shard(model, state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(state.dp_rank)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.context), generator=gen)
    loss = model(x, torch.roll(x, -1, 1)) + moepar.aux_loss(model)
    loss.backward()
    if not fsdp:
        moepar.allreduce_gradients(model, state)
    opt.step()
    out = _bytes(model, opt)  # gradients kept (no zero_grad): the step's peak model state
    t = torch.tensor([out[k] for k in sorted(out)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(sorted(out), (int(v) for v in t.tolist())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    state = moepar.init_parallel(args.tp, args.ep, verbose=False)
    cfg = GPTConfig(layers=args.layers, hidden=args.hidden, experts=args.experts)
    rows = [("fully_shard", measure(True, state, cfg, args.batch)),
            ("allreduce_gradients", measure(False, state, cfg, args.batch))]
    if state.rank == 0:
        print(f"world {state.world_size}: tp {state.tp_size} ep {state.ep_size} (dp {state.dp_size}, "
              f"edp {state.edp_size}); GPT layers {args.layers} hidden {args.hidden} experts {args.experts}")
        print(f"{'way':22s} {'params':>10s} {'grads':>10s} {'optimizer':>10s} {'total':>10s}"
              "   (MiB per rank, max over ranks)")
        for name, b in rows:
            total = b["params"] + b["grads"] + b["optimizer"]
            print(f"{name:22s} " + " ".join(f"{v / 2**20:10.2f}" for v in (b["params"], b["grads"],
                                                                            b["optimizer"], total)))
    moepar.destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())

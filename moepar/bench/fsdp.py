"""``torchrun --standalone --nproc_per_node=4 -m moepar bench fsdp --tp 1 --ep 2``: model-state
memory per rank, ``moepar.fully_shard`` (FSDP2) against ``allreduce_gradients``.

Builds the example GPT-MoE (examples/gpt_moe.py, default sizes unless given), takes one
AdamW step each way and prints, per way, the bytes each rank holds in parameters, gradients
and optimizer state (local shards only; the max over ranks). Not counted: FSDP's transient
all-gathered parameters (one unit, a transformer block, at a time) and activations.
Needs the repository's ``examples`` package (a source checkout) and torchrun.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import moepar

WAYS = ("fully_shard", "allreduce_gradients")
KINDS = ("grads", "optimizer", "params")   # sorted: the order of the all-reduced vector


def _gpt_module():
    """examples.gpt_moe: importable from the repository root; otherwise from the checkout this
    package lives in (an editable install), appended so that it shadows no installed package."""
    try:
        from examples import gpt_moe
    except ImportError:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if not os.path.isfile(os.path.join(root, "examples", "gpt_moe.py")):
            raise SystemExit("bench fsdp needs examples/gpt_moe.py: run it from a moepar source checkout")
        sys.path.append(root)
        from examples import gpt_moe
    return gpt_moe


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(model, opt) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for p in model.parameters():
        out["params"] += _local(p).numel() * p.element_size()
        if p.grad is not None:
            out["grads"] += _local(p.grad).numel() * p.grad.element_size()
        for v in opt.state[p].values():
            if torch.is_tensor(v):
                out["optimizer"] += _local(v).numel() * v.element_size()
    return out


def measure(fsdp: bool, state, cfg, batch: int) -> dict[str, int]:
    """Bytes of model state per rank after one AdamW step, max over ranks."""
    model = _gpt_module().GPT(cfg, state)
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
    t = torch.tensor([out[k] for k in KINDS], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(KINDS, (int(v) for v in t.tolist())))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moepar bench fsdp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    args = p.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        p.error("run under torchrun: torchrun --standalone --nproc_per_node=4 -m moepar bench fsdp")
    return args


def run(args: argparse.Namespace) -> dict:
    """Both ways on this rank's world (torch.distributed initialised, or initialised here from
    torchrun's environment); the same result on every rank."""
    own_group = not dist.is_initialized()
    torch.set_num_threads(1)
    if own_group:
        dist.init_process_group("gloo")
    state = moepar.init_parallel(args.tp, args.ep, verbose=False)
    cfg = _gpt_module().GPTConfig(layers=args.layers, hidden=args.hidden, experts=args.experts)
    out = {"world": state.world_size, "tp": state.tp_size, "ep": state.ep_size, "dp": state.dp_size,
           "edp": state.edp_size, "rank": state.rank,
           "ways": {way: measure(way == "fully_shard", state, cfg, args.batch) for way in WAYS}}
    if own_group:
        moepar.destroy_parallel()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run(args)
    if out["rank"] == 0:
        print(f"world {out['world']}: tp {out['tp']} ep {out['ep']} (dp {out['dp']}, "
              f"edp {out['edp']}); GPT layers {args.layers} hidden {args.hidden} experts {args.experts}")
        print(f"{'way':22s} {'params':>10s} {'grads':>10s} {'optimizer':>10s} {'total':>10s}"
              "   (MiB per rank, max over ranks)")
        for name, b in out["ways"].items():
            total = b["params"] + b["grads"] + b["optimizer"]
            print(f"{name:22s} " + " ".join(f"{v / 2**20:10.2f}" for v in (b["params"], b["grads"],
                                                                           b["optimizer"], total)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

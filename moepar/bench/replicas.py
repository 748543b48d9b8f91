"""``torchrun --nproc_per_node=P -m moepar bench replicas``: expert replication's effect on
skewed routing (``MoE(..., redundant_experts=X)`` with ``moepar.rebalance``).

Every rank is one EP rank (ep = world size, one thread each, so that the most-loaded rank's
extra rows show in the step time). A stack of MoE layers (residual) routes with router
logits of spread ``--logit-std`` plus a fixed logit bias ``log((e + 1) ** -zipf)``: expert 0 the
hottest, Zipf-like. For X = 0 and each
X given, the same model (same seed) trains ``--warmup`` steps, is rebalanced from the load
they measured (X > 0), then the configurations take turns: each round times ``--steps``
training steps (forward, backward, AdamW) of every configuration, interleaved. Reports per
configuration the measured received rows (max / mean over EP ranks, ``load_report``'s
``rank_overload``; ``unreplicated_overload``: the same routes had they all gone to their
experts' owners) and the median step time over the rounds, with its ratio to X = 0.

Legend (docs/moe.md): P EP group size (the world), X redundant expert slots in all.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import moepar
from moepar.tables import format_table


class Stack(nn.Module):
    def __init__(self, args, ep: int, X: int, state):
        super().__init__()
        self.layers = nn.ModuleList(
            moepar.MoE(args.hidden, args.experts, ep, k=args.k, ffn_hidden=args.ffn, activation="swiglu",
                       router_bias=True, aux_loss=None, redundant_experts=X, init_seed=args.seed + i, state=state)
            for i in range(args.layers))
        bias = torch.tensor([-args.zipf * math.log(e + 1) for e in range(args.experts)])
        g = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            for m in self.layers:
                m.router.bias.copy_(bias)   # on the logits: softmax odds (e + 1) ** -zipf
                # logits of std ~logit_std on unit inputs, as a trained router's spread
                w = torch.randn(m.router.weight.shape, generator=g) * args.logit_std / math.sqrt(args.hidden)
                m.router.weight.copy_(w)

    def forward(self, x):
        for m in self.layers:
            x = x + m(x)
        return x


def _step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moepar bench replicas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redundant", default="4",
                   help="comma-separated X values (redundant expert slots) compared with X = 0")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank and step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--zipf", type=float, default=1.0, help="router bias exponent: bias_e = -zipf x log(e + 1)")
    p.add_argument("--logit-std", type=float, default=1.0, help="router logits' spread on unit-variance inputs")
    p.add_argument("--warmup", type=int, default=3, help="steps measured before the rebalance")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", action="store_true", help="also print one JSON line of the results")
    args = p.parse_args(argv)
    Xs = [0] + [int(r) for r in args.redundant.split(",") if r.strip()]
    if "WORLD_SIZE" not in os.environ:
        p.error("run under torchrun: torchrun --standalone --nproc_per_node=4 -m moepar bench replicas")
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    state = moepar.init_parallel(1, int(os.environ["WORLD_SIZE"]), 1, seed=args.seed, verbose=False)
    ep = state.ep_size
    for X in Xs:   # the layer's rules, on every rank before any collective
        moepar.MoEConfig(args.hidden, args.experts, ep, exchange=moepar.ExchangeConfig(redundant_experts=X))
    runs = {}
    for X in Xs:
        model = Stack(args, ep, X, state)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(args.seed + state.rank)
        x = torch.randn(args.tokens, args.hidden, generator=g)
        for _ in range(args.warmup):
            _step(model, opt, x)
        if X:
            moepar.rebalance(model)
        _step(model, opt, x)   # the figures of one step with the new slot map
        rows = moepar.load_report(model).rows
        runs[X] = {"model": model, "opt": opt, "x": x, "times": [],
                   "rank_overload": max(r["rank_overload"] for r in rows),
                   "unreplicated_overload": max((r["unreplicated_overload"] or r["rank_overload"]) for r in rows)}
    for _ in range(args.rounds):
        for X in Xs:
            run = runs[X]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                _step(run["model"], run["opt"], run["x"])
            dist.barrier()
            run["times"].append((time.perf_counter() - t0) / args.steps)
    if state.rank == 0:
        base = statistics.median(runs[0]["times"])
        table = []
        for X in Xs:
            med = statistics.median(runs[X]["times"])
            table.append({"X": X, "received max/mean": f"{runs[X]['rank_overload']:.3f}",
                          "unreplicated max/mean": f"{runs[X]['unreplicated_overload']:.3f}",
                          "step ms (median)": f"{med * 1e3:.1f}", "vs X=0": f"{med / base:.3f}",
                          "rounds ms": " ".join(f"{t * 1e3:.0f}" for t in runs[X]["times"])})
        print(f"expert replication, ep={ep} (one thread a rank), E={args.experts}, D={args.hidden}, "
              f"F={args.ffn}, K={args.k}, {args.tokens} tokens a rank, {args.layers} layers, router bias "
              f"-{args.zipf} x log(e+1); {platform.node() and 'cpu'} torch {torch.__version__}, "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
        print(format_table(table, list(table[0])))
        if args.json:
            print(json.dumps({"args": vars(args), "results": table}))
    moepar.destroy_parallel()
    return 0

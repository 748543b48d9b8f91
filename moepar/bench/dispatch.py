"""``torchrun --nproc_per_node=4 -m moepar bench dispatch``: the all-to-all dispatch of the MoE
layer across processes, against the raw collective.

Legend (docs/moe.md): T tokens per rank, D hidden, F ffn hidden, E experts, K top-k, L = E/ep
local experts, R rows this rank sends (its routes), M rows its experts receive, b bytes per
element.

For each ep in ``--ep`` (default 2 and 4; the world is split into ep groups, dp = world size / ep):

* **dispatch + combine**: the real ``Dispatcher`` forward and backward with identity experts,
  as the MoE layer calls it (``source_major=True``: its experts take the rows source-major)
  (permute, the counts all-gather, the token all-to-all R*D*b — on gloo one call whose rows
  stay source-major (``--source-major off``: a local regroup); with NCCL one call and a
  local regroup; with dedup (``--dedup``, see the dispatcher) one row per
  token and destination rank plus a small side all-to-all; column "a2a" — the
  inverse of each on the way back, the weighted unpermute; backward: 2 token all-to-alls,
  gradients to x and to the routing weights), i.e. 4 token all-to-alls + 1 counts exchange;
* **raw all-to-all**: ``dist.all_to_all_single`` of exactly the same splits and bytes, the
  same 4 calls, on preallocated buffers (the pure cost of moving the tokens); with dedup
  also ``raw_routes``: the same calls with one row per route (the bytes without dedup, what
  a route-replicating dispatcher moves); without dedup raw_routes = raw;
* where the difference goes: the local passes alone (permute + unpermute forward and
  backward on the same routes, no communication; with dedup the sender's passes and the
  receiver's on the rows this rank sends) and the counts exchange alone;
* **floor** (of one row per route): the same 4 calls plus the least local work that any dispatch over
  ``all_to_all_single`` adds: each token copied to its K rows before each outbound call and
  each token's K rows summed after each return call, on contiguous token-major buffers (no
  gather, no weights, no counts exchange), and the rows for the rank's own experts kept out
  of the calls. A collective takes one contiguous buffer, so a token routed K ways must be
  written K times before it leaves and its K returned rows read and reduced; ``floor / raw``
  is the lowest ratio a dispatch that moves the same bytes reaches on the machine
  (docs/bench.md). The reduce is one ``embedding_bag`` over contiguous bags, the fastest
  measured here;
* **floor, MoE**: the floor plus what every MoE dispatch + combine must also do: the counts
  exchange (receivers learn their splits), the routing weights in the forward sum and in
  the gradient rows, and the weights' gradient (one more read of the returned rows); still
  contiguous token-major rows, so it leaves out the expert-major order a grouped GEMM needs;
* with ``--layer`` (default on), the whole layer step (router, dispatch, experts, combine,
  forward + backward) with skewed routing (busiest expert 2.5x the mean load) against
  DeepSpeed-MoE's step (drop_tokens=False, same weights) when deepspeed is importable.

Each time is the slowest rank's (all-reduce MAX) per round, median over rounds; the
candidates are interleaved round by round. Rank 0 prints the table (``--json``: one JSON
object). Runs alone too (a world of one: only ep=1, no all-to-all).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moepar.tables import format_table
from moepar.bench.common import grad_step, keep_freed_memory
from moepar.bench.layer import parse_config, skew_input_shift, zipf_input_shift
from moepar.bench.local import machine, random_routes
from moepar.bench.peers import DeepSpeedMoE, deepspeed_status
from moepar.moe.exchange.dedup import dedup_expand, dedup_send
from moepar.moe.layer import MoE
from moepar.parallel import destroy_parallel, groups
from moepar_kernels.permute import permute, unpermute


def _timed_rounds(fns: dict, rounds: int, warmup: int) -> dict[str, float]:
    """Median over rounds of the slowest rank's seconds, candidates interleaved (in reverse
    order every other round)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns.items())
    for r in range(warmup + rounds):
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r >= warmup:
                times[name].append(float(t))
    return {k: statistics.median(v) for k, v in times.items()}


def bench_dispatch(cfg_name: str, ep: int, state, rounds: int, warmup: int, dedup: str = "auto",
                   source_major: bool = True) -> dict:
    """Dispatcher forward + backward vs the same 4 raw all-to-alls, for one config shape."""
    cfg = parse_config(cfg_name)
    T, D, E, K = cfg.T, cfg.D, cfg.E, cfg.K
    rank = dist.get_rank()
    moe = MoE(D, E, ep, k=K, ffn_hidden=8, init_seed=1, state=state, dedup=dedup,   # only its dispatcher is used
              cpu_source_major=source_major)
    disp = moe.dispatcher
    ids, w = random_routes(T, E, K, "cpu", seed=100 + rank)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=gen).requires_grad_(True)
    w = w.requires_grad_(True)
    g = torch.randn(T, D, generator=gen)

    def dispatch_combine():
        x_local, meta, _ = disp.dispatch(x, ids, None, w)
        y = disp.combine(x_local, meta)                  # identity experts
        return torch.autograd.grad(y, [x, w], g), y

    (gx, gw), y = dispatch_combine()
    # Identity experts: y = sum_k w * x, dy/dx = sum_k w, dy/dw = <g, x>.
    ok = bool(torch.allclose(y, x * w.sum(1, keepdim=True), atol=1e-5)
              and torch.allclose(gx, g * w.sum(1, keepdim=True), atol=1e-5)
              and torch.allclose(gw, (g * x).sum(1, keepdim=True).expand_as(w), atol=1e-4))
    _, meta, _ = disp.dispatch(x.detach(), ids, None, w.detach())
    send, recv = list(meta.send), list(meta.recv)
    group = state.ep_group
    L = E // ep
    # The splits of one row per route (what a route-replicating dispatch sends; with dedup
    # the dispatcher sends fewer rows, one per token and destination rank).
    send_r = torch.bincount(torch.div(ids, L, rounding_mode="floor").flatten(), minlength=ep)
    recv_r = torch.empty_like(send_r)
    dist.all_to_all_single(recv_r, send_r, group=group)
    send_r, recv_r = send_r.tolist(), recv_r.tolist()

    def raw_calls(send, recv):
        """The same 4 all_to_all_single calls of these splits, on preallocated buffers."""
        R, M = sum(send), sum(recv)
        a_send, b_send = torch.randn(R, D), torch.empty(R, D)
        a_recv, b_recv = torch.randn(M, D), torch.empty(M, D)

        def calls():
            dist.all_to_all_single(b_recv, a_send, recv, send, group=group)   # dispatch forward
            dist.all_to_all_single(b_send, a_recv, send, recv, group=group)   # combine forward
            dist.all_to_all_single(b_recv, a_send, recv, send, group=group)   # combine backward
            dist.all_to_all_single(b_send, a_recv, send, recv, group=group)   # dispatch backward
        return calls
    raw = raw_calls(send, recv)

    # Where the difference goes: the dispatcher's local passes alone (permute, unpermute and
    # their backward on the same routes, in the same row order, no communication) and the
    # counts exchange alone.
    key = ids

    def passes():
        x_p, _, row_map = permute(x, key, None, E)
        torch.autograd.grad(unpermute(x_p, row_map, w, T), [x, w], g)

    def passes_dedup():   # the sender's passes, then the receiver's on the rows this rank sends
        x_s, row_map, side = dedup_send(x, ids, None, w, L, ep)
        x_l, row_map_r, w_r = dedup_expand(x_s, side, L)
        y_s = unpermute(x_l, row_map_r, w_r, row_map_r.shape[0])
        torch.autograd.grad(unpermute(y_s, row_map, None, T), [x, w], g)

    # The floor: the 4 calls with the least local work (replicate and reduce, contiguous), the
    # rows for this rank's own experts kept out of the calls (they need no copy through it).
    me = dist.get_group_rank(group, rank)
    send_o = [0 if i == me else n for i, n in enumerate(send_r)]
    recv_o = [0 if i == me else n for i, n in enumerate(recv_r)]
    fl_send, fl_back = torch.empty(T * K, D), torch.empty(T * K, D)
    fl_recv = torch.empty(sum(recv_r), D)
    so, ro = sum(send_o), sum(recv_o)
    xd = x.detach()
    bags = torch.arange(T * K).view(T, K)   # token t's K rows, contiguous

    def there_and_back():             # fl_send's rows out to the peers and back into fl_back
        dist.all_to_all_single(fl_recv[:ro], fl_send[:so], recv_o, send_o, group=group)
        dist.all_to_all_single(fl_back[:so], fl_recv[:ro], send_o, recv_o, group=group)

    def floor():
        for src in (xd, g):           # forward (x), then backward (the incoming gradient)
            fl_send.view(T, K, D).copy_(src[:, None, :].expand(T, K, D))
            there_and_back()
            # The K-row sum as one embedding_bag over contiguous bags: of the reduces tried
            # (torch.sum over the K axis of [T, K, D] among them), the fastest on the CPU.
            F.embedding_bag(bags, fl_back, mode="sum")

    w_TK1 = w.detach().float().view(T, K, 1)
    w_TK = w_TK1.view(T, K)
    dw = torch.empty(T, K)
    step = max(1, (1 << 19) // (K * D))     # tokens per 2 MB chunk of the weights' gradient

    def floor_moe():
        """The floor plus what every MoE dispatch + combine also does: the counts exchange,
        the weighted sum, the gradient rows scaled by the weights, and the weights' gradient
        <g_t, y_tk> (one more read of the returned rows)."""
        disp.exchange_empty_counts(xd)
        fl_send.view(T, K, D).copy_(xd[:, None, :].expand(T, K, D))
        there_and_back()
        F.embedding_bag(bags, fl_back, mode="sum", per_sample_weights=w_TK)
        y_TKD = fl_back.view(T, K, D)
        for t0 in range(0, T, step):
            torch.linalg.vecdot(y_TKD[t0:t0 + step], g[t0:t0 + step, None, :], out=dw[t0:t0 + step])
        torch.mul(g[:, None, :], w_TK1, out=fl_send.view(T, K, D))
        there_and_back()
        F.embedding_bag(bags, fl_back, mode="sum")

    fns = {"dispatch+combine": lambda: dispatch_combine(), "raw all_to_all_single": raw,
           "passes": passes if meta.form != "dedup" else passes_dedup,
           "counts": lambda: disp.exchange_empty_counts(xd), "floor": floor,
           "floor, MoE": floor_moe}
    if meta.form == "dedup":   # also the raw calls of one row per route, the bytes without dedup
        fns["raw, one row per route"] = raw_calls(send_r, recv_r)
    floor()                       # the round trip brings back exactly the rows sent
    ok = ok and torch.equal(fl_back[:so], fl_send[:so])
    secs = {k: v * 1e3 for k, v in _timed_rounds(fns, rounds, warmup).items()}
    nbytes = torch.tensor([2 * (sum(send) + sum(recv)) * D * 4], dtype=torch.int64)
    dist.all_reduce(nbytes, op=dist.ReduceOp.MAX)
    raw_ms = secs["raw all_to_all_single"]
    raw_routes_ms = secs.get("raw, one row per route", raw_ms)
    return {"config": cfg_name, "ep": ep, "T": T, "D": D, "E": E, "K": K, "correct": ok,
            "bytes_per_rank_max": int(nbytes), "dispatch_ms": secs["dispatch+combine"],
            "raw_ms": raw_ms, "ratio": secs["dispatch+combine"] / raw_ms,
            "raw_routes_ms": raw_routes_ms, "ratio_routes": secs["dispatch+combine"] / raw_routes_ms,
            "passes_ms": secs["passes"], "counts_ms": secs["counts"],
            "floor_ms": secs["floor"], "floor_ratio": secs["floor"] / raw_routes_ms,
            "floor_moe_ms": secs["floor, MoE"], "floor_moe_ratio": secs["floor, MoE"] / raw_routes_ms,
            "a2a": {"regroup": "one + regroup", "source_major": "one, source-major",
                    "dedup": "one, dedup"}.get(meta.form, "one")}


def bench_layer_step(cfg_name: str, ep: int, state, rounds: int, warmup: int, tokens: int | None,
                     dedup: str = "auto", source_major: bool = True) -> dict:
    """moepar's whole layer step vs DeepSpeed's (drop_tokens=False) with skewed routing."""
    cfg = parse_config(cfg_name)
    T = tokens or cfg.T
    rank = dist.get_rank()
    moe = MoE(cfg.D, cfg.E, ep, k=cfg.K, ffn_hidden=cfg.F, init_seed=1, state=state, dedup=dedup,
              cpu_source_major=source_major)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(T, cfg.D, generator=gen)
    g = torch.randn(T, cfg.D, generator=gen)
    if cfg.skew:
        # One Zipf exponent for the whole world (the mean of the ranks' fits), same offsets.
        _, s = skew_input_shift(moe.router.weight.detach(), x, cfg.K, cfg.skew)
        s_all = torch.tensor([s], dtype=torch.float64)
        dist.all_reduce(s_all)
        x = x + zipf_input_shift(moe.router.weight.detach(), float(s_all) / dist.get_world_size())
    x.requires_grad_(True)
    with torch.no_grad():
        counts = moe.router(x).tokens_per_expert.clone()
    dist.all_reduce(counts)
    load = float(counts.max() / counts.float().mean())

    fns = {"moepar MoE": grad_step(moe, x, g)}
    ds_ok, ds_why = deepspeed_status()
    if ds_ok:
        fns["DeepSpeed-MoE"] = grad_step(DeepSpeedMoE(moe, drop_tokens=False), x, g)
    secs = _timed_rounds(fns, rounds, warmup)
    out = {"config": cfg_name, "ep": ep, "T": T, "load_max_over_mean": load, "deepspeed": ds_why,
           "moepar_ms": secs["moepar MoE"] * 1e3}
    if ds_ok:
        out["deepspeed_ms"] = secs["DeepSpeed-MoE"] * 1e3
        out["ratio"] = secs["moepar MoE"] / secs["DeepSpeed-MoE"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun --nproc_per_node=4 -m moepar bench dispatch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", default="2,4", help="comma list of expert-parallel sizes (each must divide the world)")
    p.add_argument("--configs", default="A,B",
                   help="config shapes of the dispatch rows (bench layer's names or T:D:F:E:K)")
    p.add_argument("--layer-config", default="C", help="config of the whole-layer step (C: skewed routing)")
    p.add_argument("--layer-tokens", type=int, default=None, help="tokens per rank of the layer step")
    p.add_argument("--no-layer", action="store_true", help="skip the whole-layer step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--malloc", default="default", choices=("default", "keep"),
                   help="keep: glibc keeps freed memory mapped (no page faults on fresh buffers at every "
                        "step, as with jemalloc/tcmalloc); default: the allocator as it is")
    p.add_argument("--dedup", default="auto", choices=("off", "auto", "on"),
                   help="the layer's dedup option (one row per token and destination rank)")
    p.add_argument("--source-major", default="on", choices=("on", "off"),
                   help="the layer's cpu_source_major option (off: always regroup the received rows)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        for c in args.configs.split(",") + [args.layer_config]:
            if c:
                parse_config(c)
    except ValueError as e:
        p.error(str(e))
    return args


def run(args: argparse.Namespace) -> dict:
    """Every row of ``args`` on this rank's world (torch.distributed initialised, or a world
    of one created here); the same result on every rank."""
    own_group = not dist.is_initialized()
    if own_group:
        if "RANK" not in os.environ:   # alone: a world of one
            from moepar.bench.peers import free_port
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    if getattr(args, "malloc", "default") == "keep" and not keep_freed_memory():
        raise SystemExit("--malloc keep needs glibc's mallopt")
    eps = [int(v) for v in args.ep.split(",") if v and world % int(v) == 0] or [1]
    rows, layer_rows = [], []
    for ep in eps:
        state = groups.init_parallel(expert_parallel_size=ep, verbose=False)
        try:
            if ep > 1:
                rows += [bench_dispatch(c, ep, state, args.rounds, args.warmup, getattr(args, "dedup", "auto"),
                                        getattr(args, "source_major", "on") == "on")
                         for c in args.configs.split(",") if c]
            if not args.no_layer:
                layer_rows.append(bench_layer_step(args.layer_config, ep, state, args.rounds, args.warmup,
                                                   args.layer_tokens, getattr(args, "dedup", "auto"),
                                                   getattr(args, "source_major", "on") == "on"))
        finally:
            groups.reset_parallel_state()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
           "torch": torch.__version__, "world": world, "backend": dist.get_backend(),
           "threads": torch.get_num_threads(), "malloc": getattr(args, "malloc", "default"), "dispatch": rows, "layer": layer_rows}
    dist.barrier()
    if own_group:
        destroy_parallel()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    out = run(args)
    if rank == 0:
        if args.json:
            print(json.dumps(out, indent=1))
        else:
            print(f"# bench dispatch  {out['date']}  {out['machine']}  torch {out['torch']}  world={out['world']} "
                  f"({out['backend']}, {out['threads']} thread(s) per rank)  malloc={out['malloc']}")
            if out["dispatch"]:
                print("\ndispatch + combine (forward + backward, identity experts) vs raw all_to_all_single "
                      "of the same splits (4 calls):")
                print(format_table(out["dispatch"], ["config", "ep", "T", "D", "K", "E", "bytes_per_rank_max",
                                                     "a2a", "dispatch_ms", "raw_ms", "ratio", "raw_routes_ms",
                                                     "ratio_routes", "passes_ms", "counts_ms", "floor_ms",
                                                     "floor_ratio", "floor_moe_ratio", "correct"]))
                print("passes_ms: the local passes alone (permute + unpermute, forward + backward, no "
                      "communication); counts_ms: the counts exchange alone. dispatch ~ raw + passes + counts.\n"
                      "floor_ms: the same 4 calls plus the least local work any dispatch over all_to_all_single "
                      "adds (copy each token to its K rows, sum K rows per token; contiguous, no gather, own rows "
                      "kept out of the calls);\nfloor_ratio = floor_ms / raw_routes_ms: the lowest ratio of a "
                      "dispatch that sends one row per route, on this machine. raw_routes_ms: the raw calls of one "
                      "row per route (= raw_ms unless a2a is 'one, dedup', which sends one row per token and rank).\n"
                      "floor_moe_ratio: the floor plus what every MoE dispatch + combine also does (the counts "
                      "exchange, the routing weights in the sum and in the gradient rows, the weights' gradient: "
                      "one more read of the returned rows), over raw_routes_ms.")
            if out["layer"]:
                print(f"\nwhole layer step (config {args.layer_config}, skewed routing) vs DeepSpeed-MoE "
                      f"(drop_tokens=False):")
                cols = ("ep", "T", "load_max_over_mean", "moepar_ms", "deepspeed_ms", "ratio", "deepspeed")
                print(format_table(out["layer"], [c for c in cols if any(c in r for r in out["layer"])]))
    return 0 if all(r["correct"] for r in out["dispatch"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

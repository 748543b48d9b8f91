"""Expert replication on the GPU path: index tables built once a placement, the copies' weights
in the compute dtype, no [H, ...] slot weights kept for autograd, the weight exchange not
re-run by ``recompute_experts``, leftover routes spread over the copies (the fake-CUDA rows
of tests/parallel/test_gpu_discipline.py count the host reads and copies).

Before: the copies travelled as fp32 master weights under autocast (twice the bytes), each
forward's concatenated slot weights stayed alive until the backward, ``recompute_experts``
ran the weights' all-to-all again in the backward, and every tie of the route split went to
the expert's first copy on every rank."""
import gc
import random
import types

import torch

import moepar
from moepar.moe.replication.placement import Copy, Placement, plan_placement, split_counts, zipf_loads
from moepar.moe.replication.replicas import Replicas, SlotMap, local_order, split_counts_device

from ..helpers.multiproc import run_ranks

E, D, F, TOKENS = 8, 16, 24, 16


def _rotated_split(count, shares, first):
    """The host rule with ties from copy ``first`` on: split_counts of the rotated shares."""
    A = len(shares)
    order = [(first + i) % A for i in range(A)]
    got = split_counts(count, [shares[i] for i in order])
    out = [0] * A
    for i, n in zip(order, got):
        out[i] = n
    return tuple(out)


def test_split_counts_device_ties_follow_the_given_order():
    rng = random.Random(1)
    for _ in range(300):
        A = rng.randint(1, 4)
        shares = [rng.choice([0.25, 0.5, 1.0, rng.random()]) for _ in range(A)]
        first = rng.randrange(A)
        count = rng.randint(0, 9)
        tie = torch.tensor([[(i - first) % A for i in range(A)]])
        got = split_counts_device(torch.tensor([count]), torch.tensor([shares], dtype=torch.float64), tie)
        assert tuple(got[0].tolist()) == _rotated_split(count, shares, first), (count, shares, first)


def _even_placement():
    """E = 4 experts on 2 ranks (2 each), one redundant slot a rank: expert 0 copied onto
    rank 1 and expert 2 onto rank 0, every copy's share equal."""
    slots = ((0, 1, 2), (0, 2, 3))
    copies = []
    for g in range(4):
        held = [(r, i) for r in range(2) for i, h in enumerate(slots[r]) if h == g]
        copies.append(tuple(Copy(r, i, 1.0 / len(held)) for r, i in held))
    return Placement(4, 2, 2, (1.0,) * 4, slots, tuple(copies))


def test_leftover_routes_spread_over_the_copies_by_rank():
    """One route a rank to each replicated expert: the two ranks send it to different copies
    (before, both to the first copy, the owner), as the rotated host rule says."""
    p = _even_placement()
    S = 3
    seen = {}
    for rank in range(2):
        rep = Replicas(4, 2, 2, types.SimpleNamespace(ep_rank=rank, ep_group=None))
        rep.set_placement(p)
        slots = rep.route_slots(torch.tensor([[0, 2]]), None).reshape(-1).tolist()
        held = SlotMap.of(p, rank)
        position = [{i: at for at, i in enumerate(local_order(p, r))} for r in range(2)]
        for g, s in zip((0, 2), slots):
            copies = p.copies[g]
            want = _rotated_split(1, [c.share for c in copies], (rank + g) % len(copies))
            c = copies[want.index(1)]
            assert s == c.rank * S + position[c.rank][c.slot], (rank, g, s)
            seen.setdefault(g, set()).add(s)
        assert len(held.held) == S
    assert all(len(v) == 2 for v in seen.values()), seen   # each copy took one of the two routes


def _live(shape):
    gc.collect()
    return [tuple(o.shape) for o in gc.get_objects()
            if type(o) in (torch.Tensor, torch.nn.Parameter) and tuple(o.shape) == shape]


def _gpu_path(owner_slack, R, recompute):
    state = moepar.init_parallel(1, 2, 1, verbose=False)
    out = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        ys, grads, events = {}, {}, {}
        for r in (0, R):
            torch.manual_seed(0)
            m = moepar.MoE(D, E, 2, k=2, ffn_hidden=F, activation="swiglu", redundant_experts=r, init_seed=3,
                           recompute_experts=recompute, state=state)
            if r:
                m.replicas.set_placement(plan_placement(zipf_loads(E, 1.2), E, r, 2, owner_slack=owner_slack))
            g = torch.Generator().manual_seed(10 + state.rank)
            x = torch.randn(TOKENS, D, generator=g, requires_grad=True)
            w = torch.randn(TOKENS, D, generator=g)
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                y = m(x)
            H = (E + r) // 2
            out.setdefault("slot_weights_alive", []).extend(_live((H, D, F)) if r else [])
            (y.float() * w).sum().backward()
            ys[r], grads[r] = y.detach().float(), [p.grad.float().clone() for p in m.parameters()]
            events[r] = [(e.op, e.backward, e.nbytes) for e in m.stats.comm.events if e.op.startswith("all_to_all")]
        row = 3 * D * F * (4 if dtype is None else 2)   # w1, w3, w2 of one expert
        extra = [e for e in events[R] if e[2] % row == 0 and e[2]]   # the weights' all-to-alls
        out[name] = {"y": float((ys[0] - ys[R]).abs().max()),
                     "grads": max(float((a - b).abs().max()) for a, b in zip(grads[0], grads[R])),
                     "weights_fwd": [n for op, bwd, n in extra if not bwd],
                     "weights_bwd": [n for op, bwd, n in extra if bwd],
                     "sent": sum(m.replicas.map.send_splits), "received": sum(m.replicas.map.recv_splits)}
    return out


def test_copies_travel_in_the_compute_dtype_and_nothing_concatenated_is_kept():
    for owner_slack, recompute in ((0.05, False), (0.0, False), (0.05, True)):
        for res in run_ranks(_gpu_path, 2, owner_slack, 2, recompute):
            assert res["slot_weights_alive"] == [], res   # autograd keeps no [H, D, F] slot weights
            for name, bytes_per in (("fp32", 4), ("bf16", 2)):
                r = res[name]
                tol = 1e-5 if name == "fp32" else 2e-2
                assert r["y"] <= tol and r["grads"] <= tol * 10, (owner_slack, recompute, name, r)
                # one weight all-to-all each way (recompute_experts re-runs none), w1 w3 w2 per copy
                assert len(r["weights_fwd"]) == 1 and len(r["weights_bwd"]) == 1, (owner_slack, recompute, name, r)
                row = 3 * D * F * bytes_per   # the bytes of one copy, sent forward, its gradient back
                assert r["weights_fwd"][0] == r["sent"] * row and r["weights_bwd"][0] == r["received"] * row, r

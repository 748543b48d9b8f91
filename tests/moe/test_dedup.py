"""Dedup dispatch (one row per token and destination rank): its tensor work against loops."""
import pytest
import torch

from moepar.moe.exchange import dedup
from moepar_kernels.permute import unpermute


def _routes(T, K, E, seed, drop_p=0.0, repeats=False):
    gen = torch.Generator().manual_seed(seed)
    if repeats:   # a direct caller may route a token to one expert twice
        ids = torch.randint(0, E, (T, K), generator=gen)
    else:
        ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=gen)
    dropped = (torch.rand(T, K, generator=gen) < drop_p) if drop_p else None
    return ids, w, dropped


def _loop_plan(ids, dropped, L, P):
    """Token by token: a kept route sends a row unless an earlier kept route of its token
    already goes to the same rank."""
    T, K = ids.shape
    rows = [0] * P
    drop = torch.zeros(T, K, dtype=torch.bool)
    for t in range(T):
        seen = set()
        for k in range(K):
            if dropped is not None and dropped[t, k]:
                drop[t, k] = True
                continue
            p = int(ids[t, k]) // L
            if p in seen:
                drop[t, k] = True
            else:
                seen.add(p)
                rows[p] += 1
    return torch.tensor(rows), drop


@pytest.mark.parametrize("P,L,K,drop_p,repeats", [(1, 4, 2, 0.0, False), (2, 4, 3, 0.0, False),
                                                  (4, 2, 4, 0.3, False), (4, 3, 4, 0.0, True),
                                                  (3, 2, 1, 0.2, False)])
def test_rows_and_plan_match_a_loop(P, L, K, drop_p, repeats):
    ids, _, dropped = _routes(40, K, P * L, seed=P * 10 + K, drop_p=drop_p, repeats=repeats)
    rows, drop = _loop_plan(ids, dropped, L, P)
    assert dedup.dedup_rows(ids, dropped, L, P).tolist() == rows.tolist()
    dest, plan_drop = dedup._dedup_plan(ids, dropped, L, P)
    assert torch.equal(dest, ids // L) and torch.equal(plan_drop, drop)


def test_rows_ignore_out_of_range_ids():
    ids = torch.tensor([[0, 9], [-1, 3], [2, 3]])   # L=2, P=2: ids 9 and -1 count nowhere
    assert dedup.dedup_rows(ids, None, 2, 2).tolist() == [1, 2]


def _experts(x, e):
    """Expert e: an elementwise nonlinear map with its own constants."""
    return torch.tanh(x * (e + 1.0)) + 0.1 * e


@pytest.mark.parametrize("P,L,K,drop_p,repeats", [(2, 4, 3, 0.0, False), (4, 2, 4, 0.25, False),
                                                  (4, 3, 4, 0.0, True), (1, 5, 2, 0.0, False)])
def test_send_expand_combine_equals_the_routes(P, L, K, drop_p, repeats):
    # The whole dedup round trip on P simulated ranks (the all-to-alls as block moves) equals
    # sum_k w[t, k] * expert_{ids[t, k]}(x[t]) over kept routes, values and gradients.
    T, D = 33, 5
    ids, w, dropped = _routes(T, K, P * L, seed=7 + P + K, drop_p=drop_p, repeats=repeats)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, D, generator=gen, requires_grad=True)
    w.requires_grad_(True)
    g = torch.randn(T, D, generator=gen)

    rows = dedup.dedup_rows(ids, dropped, L, P).tolist()
    x_SD, row_map_TK, side = dedup.dedup_send(x, ids, dropped, w, L, P)
    assert x_SD.shape == (sum(rows), D) and side.shape == (sum(rows), 2 * K)
    outs = []
    for p, (x_p, side_p) in enumerate(zip(x_SD.split(rows), side.split(rows))):
        x_local, row_map_MK, w_MK = dedup.dedup_expand(x_p, side_p, L)
        local = side_p[:, K:].long()
        counts = torch.bincount(local[local >= 0], minlength=L).tolist()
        y_local = torch.cat([_experts(blk, p * L + l) for l, blk in enumerate(x_local.split(counts))])
        outs.append(unpermute(y_local, row_map_MK, w_MK, row_map_MK.shape[0]))
    y = unpermute(torch.cat(outs), row_map_TK, None, T)
    gx, gw = torch.autograd.grad(y, [x, w], g)

    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ref = torch.zeros(T, D)
    for t in range(T):
        for k in range(K):
            if dropped is None or not dropped[t, k]:
                ref[t] = ref[t] + w2[t, k] * _experts(x2[t], int(ids[t, k]))
    rx, rw = torch.autograd.grad(ref, [x2, w2], g)
    assert torch.allclose(y, ref, atol=1e-5)
    assert torch.allclose(gx, rx, atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)


@pytest.mark.parametrize("votes,rows,routes,expected", [
    ([1, 1], [30, 30], [100, 100], True),          # 0.30 of the routes: at the limit
    ([1, 1], [31, 30], [100, 100], False),
    ([2, 2], [100, 100], [100, 100], True),        # forced by every rank
    ([2, 1], [90, 90], [100, 100], False),         # one rank on auto: the threshold decides
    ([0, 2], [10, 10], [100, 100], False),         # one rank votes off: off everywhere
])
def test_the_group_decides_from_every_vote(votes, rows, routes, expected):
    assert dedup.DEDUP_MAX_FRACTION == 0.3
    t = torch.tensor
    assert dedup.group_dedups(t(votes), t(rows), t(routes)) is expected

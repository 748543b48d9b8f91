"""``torch.compile(moe, fullgraph=True)`` with inductor: the layer compiles whole, forward and
backward, and equals eager, for the two paths with no host read (docs/moe.md, "Compile and
graphs"): dropless at ep = 1 (the grouped-GEMM path) and padded capacity mode, at ep = 1 and
at ep = 2 on two gloo ranks (the all-to-alls as torch's functional collectives).

Before: padded capacity mode did not compile ("Failed to convert args/kwargs to proxy": the
capacity's exact arithmetic went through ``fractions.Fraction``), and at ep = 2 the
all-to-all's timing (``time.perf_counter``) broke the graph.
"""
import pytest
import torch

import moepar
from ..helpers import moe_ref
from ..helpers.multiproc import run_ranks

D, E, F, K = 32, 8, 64, 2
PADDED = dict(capacity_factor=1.25, pad_to_capacity=True)


def _steps(moe, x, model, steps=2):
    """Outputs, input gradients and parameter gradients of ``steps`` forward + backward."""
    out = []
    for _ in range(steps):
        xx = x.clone().requires_grad_()
        y = model(xx)
        (y.float().sum() + moepar.aux_loss(moe)).backward()
        out.append((y.detach().float(), xx.grad.float(), [p.grad.float().clone() for p in moe.parameters()]))
        moe.zero_grad()
    return out


def _compare(moe, x, tol):
    torch._dynamo.reset()
    # compiled first, on a fresh layer: nothing cached by an eager call may be what lets it trace
    compiled = _steps(moe, x, torch.compile(moe, fullgraph=True, backend="inductor"))
    eager = _steps(moe, x, moe)
    worst = 0.0
    for (ye, xe, ge), (yc, xc, gc) in zip(eager, compiled):
        worst = max([worst, float((ye - yc).abs().max()), float((xe - xc).abs().max())]
                    + [float((a - b).abs().max()) for a, b in zip(ge, gc)])
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("kw,dtype,tol", [({}, torch.float32, 1e-6), ({}, torch.bfloat16, 1e-2),
                                          (PADDED, torch.float32, 1e-6)],
                         ids=["dropless-fp32", "dropless-bf16", "padded-fp32"])
def test_one_rank_compiles_whole_and_equals_eager(kw, dtype, tol):
    moe = moe_ref.build(None, hidden=D, num_experts=E, ffn_hidden=F, k=K, dtype=dtype, **kw)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(1), dtype=dtype)
    _compare(moe, x, tol)


def _padded_ep2():
    state = moepar.init_parallel(1, 2, verbose=False)
    moe = moe_ref.build(state, hidden=D, num_experts=E, ffn_hidden=F, k=K, **PADDED)
    x = torch.randn(16, D, generator=torch.Generator().manual_seed(10 + state.rank))
    return _compare(moe, x, 1e-6)


def test_padded_capacity_at_ep2_compiles_whole_and_equals_eager():
    assert len(run_ranks(_padded_ep2, 2)) == 2

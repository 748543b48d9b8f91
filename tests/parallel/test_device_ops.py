"""How many device ops one MoE forward and backward issue, counted on fake CUDA
(tests/helpers/fake_cuda: every aten op on a "cuda" tensor that a GPU would run as a
kernel or a copy, and every Triton launch).

On a GPU at the benchmark sizes the layer is host-bound (the issue cost of an op and of a
Triton launch against the device's busy time were measured on an H200: docs/benchmarks.md,
"First GPU run"). So the number of ops is the host's cost, and it is held to a budget here:
a change that adds ops to the default path fails this test and must raise the budget on
purpose (world of one, bf16, dropless top-2, aux loss; the budgets are ``BUDGET`` below)."""
import torch

from ..helpers.multiproc import run_ranks

BUDGET = {"forward": (18, 3), "backward": (18, 3)}   # (aten device ops, Triton launches)


def _count():
    import moepar
    from tests.helpers import fake_cuda, moe_ref
    with fake_cuda.session(strict=True) as rec:
        moe = fake_cuda.to_cuda(moe_ref.build(None, hidden=32, num_experts=8, ffn_hidden=64, k=2,
                                              dtype=torch.bfloat16))
        x = fake_cuda.to_cuda(torch.randn(64, 32, dtype=torch.bfloat16)).requires_grad_()
        (moe(x).float().sum() + moepar.aux_loss(moe)).backward()   # warm-up
        with rec.phase("forward"):
            loss = moe(x).float().sum() + moepar.aux_loss(moe)
        with rec.phase("backward"):
            loss.backward()
    return {p: (rec.device_ops(p), rec.launches(p)) for p in BUDGET}


def test_one_forward_and_backward_stay_within_their_device_op_budget():
    counts = run_ranks(_count, 1, fake_cuda=True)[0]
    for phase, (ops_budget, launch_budget) in BUDGET.items():
        ops, launches = counts[phase]
        assert len(ops) >= 10 and launches, f"{phase}: the instrument counted almost nothing: {ops} {launches}"
        assert len(ops) <= ops_budget and len(launches) <= launch_budget, (
            f"{phase}: {len(ops)} device ops and {len(launches)} Triton launches, budget {ops_budget} + "
            f"{launch_budget} (each op is host time on a GPU; docs/benchmarks.md): ops {sorted(ops)}, "
            f"launches {launches}")

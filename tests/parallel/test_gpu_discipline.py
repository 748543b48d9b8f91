"""GPU discipline of the MoE layer, proven on the CPU with fake CUDA tensors (tests/helpers/fake_cuda).

Every case runs the layer's forward and backward on "cuda" tensors in a strict session (a
CPU tensor handed to NCCL or mixed into a CUDA op raises, as on a GPU) and counts what a GPU
pays: a dropless forward reads the host once (the counts exchange), padded capacity mode
and every backward never, and no forward blocks on a host-to-device copy. Every collective
of the forward stays inside the layer's MoE block (no barrier over the world). The numbers
equal the same layer's on the CPU. docs/moe.md ("GPU discipline") has the table per layout
and today's code beside it (scripts/gpu_discipline.py prints both).

The four NCCL crashes of the old code (a CPU counts tensor in padded mode, the CPU error
flag of the preflight, a CPU input on an NCCL rank, grad_norm's CPU sums) each have a case
here; each was seen failing on the commit before the GPU-true hot path with the same
instrument (scripts/gpu_discipline.py --moepar-path <worktree of 4b131ec>).
"""
import pytest
import torch

from ..helpers import moe_ref
from ..helpers.multiproc import run_ranks

TOKENS = 6


def _split(x, state):
    """This TP rank's slice of the replica's tokens (sequence parallelism)."""
    per = [TOKENS // state.tp_size + (i < TOKENS % state.tp_size) for i in range(state.tp_size)]
    lo = sum(per[:state.tp_rank])
    return x[lo:lo + per[state.tp_rank]].clone()


def _layouts_on_fake_cuda(tp, ep, etp, variants):
    """For each variant: host reads and blocking copies per phase, the forward's collective
    groups, this rank's MoE block, and the largest difference from the CPU layer."""
    import moepar
    from tests.helpers import fake_cuda
    state = moepar.init_parallel(tp, ep, etp, verbose=False)
    block = sorted(range(state.rank - state.rank % state.moe_size, state.rank - state.rank % state.moe_size
                         + state.moe_size))
    out = []
    for kw in variants:
        kw = dict(kw)
        dtype = kw.pop("dtype", torch.float32)
        kw.setdefault("ffn_hidden", 16 if dtype == torch.bfloat16 else moe_ref.F)
        moe = moe_ref.build(state, dtype=dtype, **kw)
        ref = moe_ref.build(state, dtype=dtype, **kw)
        x, g = moe_ref.replica_input(state.dp_rank, TOKENS, dtype=dtype)
        if kw.get("sequence_parallel") and state.tp_size > 1:
            x, g = _split(x, state), _split(g, state)
        with fake_cuda.session(strict=True) as rec:
            m = fake_cuda.to_cuda(moe)
            xc = fake_cuda.to_cuda(x).requires_grad_()
            with rec.phase("forward"):
                y = m(xc)
                loss = (y.float() * fake_cuda.to_cuda(g).float()).sum() + moepar.aux_loss(m)
            with rec.phase("backward"):
                loss.backward()
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        ((yr.float() * g.float()).sum() + moepar.aux_loss(ref)).backward()
        diff = max(float((fake_cuda.to_cpu(y).detach().float() - yr.detach().float()).abs().max()),
                   float((fake_cuda.to_cpu(xc.grad).float() - xr.grad.float()).abs().max()))
        out.append({"variant": kw, "dtype": str(dtype), "reads": (len(rec.host_reads("forward")), len(rec.host_reads("backward"))),
                    "blocking": (len(rec.blocking_h2d("forward")), len(rec.blocking_h2d("backward"))),
                    "groups": sorted({tuple(c.ranks) for c in rec.collectives("forward")}),
                    "block": block, "diff": diff, "where": rec.report("forward")})
    return out


CASES = [  # world, (tp, ep, etp), variants, forward host reads allowed
    (2, (1, 2, 1), [{}, {"num_shared_experts": 1}, {"dedup": "on"}, {"dtype": torch.bfloat16},
                    {"dispatch_dtype": "fp8"}, {"dispatch_dtype": "fp8", "dtype": torch.bfloat16}], 1),
    (2, (1, 2, 1), [{"capacity_factor": 2.0, "pad_to_capacity": True},
                    {"capacity_factor": 1.0, "pad_to_capacity": True, "num_shared_experts": 1},
                    {"capacity_factor": 2.0, "pad_to_capacity": True, "dispatch_dtype": "fp8"}], 0),
    (2, (2, 1, 1), [{}, {"sequence_parallel": True, "num_shared_experts": 1}], 1),
    (4, (2, 2, 1), [{}, {"sequence_parallel": True}, {"num_shared_experts": 1}], 1),
    (4, (1, 4, 1), [{}], 1),
    # expert replication: the copies' weights travel and return, the routes split among the
    # copies, all on the device (the index tables cross without blocking, once a placement)
    (2, (1, 2, 1), [{"redundant_experts": 2}, {"redundant_experts": 2, "dtype": torch.bfloat16},
                    {"redundant_experts": 2, "recompute_experts": True}], 1),
    (4, (1, 4, 1), [{"redundant_experts": 4, "num_experts": 8}], 1),
    (4, (1, 2, 2), [{}, {"bias": True}], 1),
    (1, (1, 1, 1), [{"dtype": torch.bfloat16}], 0),   # grouped_mm: the counts stay on the device
    (1, (1, 1, 1), [{}], 1),                          # fp32: the loop path reads the counts once
]


@pytest.mark.parametrize("world,layout,variants,reads", CASES)
def test_one_host_read_per_dropless_forward_none_padded_none_backward(world, layout, variants, reads):
    for rank, results in enumerate(run_ranks(_layouts_on_fake_cuda, world, *layout, variants, fake_cuda=True)):
        for r in results:
            where = (rank, layout, r["variant"])
            assert r["reads"][0] <= reads and r["reads"][1] == 0, (where, r["reads"], r["where"])
            assert r["blocking"] == (0, 0), (where, r["blocking"], r["where"])
            # no collective over the world: each spans only ranks of this rank's MoE block
            assert all(set(g) <= set(r["block"]) for g in r["groups"]), (where, r["groups"], r["block"])
            tol = 2e-2 if r["dtype"] == "torch.bfloat16" else 1e-5
            assert r["diff"] <= tol, (where, r["diff"])


def _bad_input_on_rank0(tp, ep, kind):
    """Rank 0 passes a wrong hidden size or a CPU tensor (the layer is on CUDA): every rank of
    its block must raise a ValueError (not a RuntimeError of NCCL, not a hang)."""
    import moepar
    from tests.helpers import fake_cuda
    state = moepar.init_parallel(tp, ep, verbose=False)
    moe = moe_ref.build(state, k=2, num_shared_experts=1)
    x = torch.randn(4, moe_ref.D + (1 if kind == "hidden" and state.rank == 0 else 0))
    with fake_cuda.session(strict=True):
        m = fake_cuda.to_cuda(moe)
        xc = x if kind == "cpu" and state.rank == 0 else fake_cuda.to_cuda(x)
        try:
            m(xc)
        except ValueError as e:
            return str(e)
    return None


@pytest.mark.parametrize("kind", ["hidden", "cpu"])
@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1)])
def test_a_bad_input_raises_on_every_rank_of_the_block_on_nccl(kind, tp, ep):
    own = {"hidden": f"x's last dim is ({moe_ref.D + 1},)", "cpu": "x is on cpu but the MoE layer's parameters"}
    msgs = run_ranks(_bad_input_on_rank0, 2, tp, ep, kind, fake_cuda=True)
    assert own[kind] in msgs[0], msgs
    assert "MoE forward aborted: rank(s) [0] reported invalid input" in msgs[1], msgs


def _norms_on_fake_cuda():
    import moepar
    from moepar.parallel import allreduce_gradients, clip_grad_norm_, grad_norm
    from tests.helpers import fake_cuda
    state = moepar.init_parallel(2, 2, verbose=False)
    moe = moe_ref.build(state, k=2, num_shared_experts=1)
    x, g = moe_ref.replica_input(state.dp_rank, TOKENS)
    (moe(x) * g).sum().backward()
    allreduce_gradients(moe, state)
    cpu_norm = float(grad_norm(moe, state))
    grads = [p.grad.clone() for p in moe.parameters()]
    with fake_cuda.session(strict=True) as rec:
        m = fake_cuda.to_cuda(moe)
        with rec.phase("norm"):
            norm = grad_norm(m, state)
            clipped = clip_grad_norm_(m, cpu_norm / 2, state)
        after = float(fake_cuda.to_cpu(grad_norm(m, state)))
        scaled = max(float((fake_cuda.to_cpu(p.grad) - gr / 2).abs().max()) for p, gr in zip(m.parameters(), grads))
    return (norm.device.type, cpu_norm, float(fake_cuda.to_cpu(norm)), float(fake_cuda.to_cpu(clipped)), after,
            scaled, len(rec.host_reads("norm")))


def test_grad_norm_and_clipping_stay_on_the_device():
    for dev, cpu_norm, norm, clipped, after, scaled, reads in run_ranks(_norms_on_fake_cuda, 4, fake_cuda=True):
        assert dev == "cuda" and reads == 0
        assert norm == pytest.approx(cpu_norm, rel=1e-6) and clipped == pytest.approx(cpu_norm, rel=1e-6)
        assert after == pytest.approx(cpu_norm / 2, rel=1e-5) and scaled <= 1e-6

"""TP layers equal their TP=1 versions: outputs and every gradient (slices gathered)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moepar.parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                             init_parallel, vocab_parallel_cross_entropy)
from moepar.parallel.comm import all_gather_rows

from ..helpers.multiproc import run_ranks

D, F_HID, T = 8, 16, 8


def _mlp(state, sequence_parallel=False):
    fc1 = ColumnParallelLinear(D, F_HID, init_seed=1, state=state, sequence_parallel=sequence_parallel,
                               dtype=torch.float64)
    fc2 = RowParallelLinear(F_HID, D, init_seed=2, state=state, sequence_parallel=sequence_parallel,
                            dtype=torch.float64)
    return fc1, fc2


def _gather_param(p, group, dim):
    parts = all_gather_rows(p.movedim(dim, 0).contiguous(), group)
    return parts.movedim(0, dim)


def _tp_mlp_matches(tp, sequence_parallel):
    state = init_parallel(tensor_parallel_size=tp, verbose=False)
    x_full = torch.randn(T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    # TP=1 reference built from the same seeds, in this process.
    ref1 = ColumnParallelLinear(D, F_HID, init_seed=1, state=_single(), dtype=torch.float64)
    ref2 = RowParallelLinear(F_HID, D, init_seed=2, state=_single(), dtype=torch.float64)
    xr = x_full.clone().requires_grad_()
    yr = ref2(F.gelu(ref1(xr)))
    (yr * dy).sum().backward()

    fc1, fc2 = _mlp(state, sequence_parallel)
    if sequence_parallel:  # tokens split over TP ranks along dim 0
        n = T // tp
        x = x_full[state.tp_rank * n:(state.tp_rank + 1) * n].clone().requires_grad_()
        dyl = dy[state.tp_rank * n:(state.tp_rank + 1) * n]
    else:
        x, dyl = x_full.clone().requires_grad_(), dy
    y = fc2(F.gelu(fc1(x)))
    (y * dyl).sum().backward()
    g = state.tp_group
    out_ok = torch.allclose(y, yr[state.tp_rank * (T // tp):(state.tp_rank + 1) * (T // tp)] if sequence_parallel else yr)
    gx = x.grad if not sequence_parallel else all_gather_rows(x.grad, g)
    checks = {
        "y": out_ok,
        "dx": torch.allclose(gx, xr.grad),
        "w1": torch.allclose(_gather_param(fc1.weight, g, 0), ref1.weight),
        "dw1": torch.allclose(_gather_param(fc1.weight.grad, g, 0), ref1.weight.grad),
        "db1": torch.allclose(_gather_param(fc1.bias.grad, g, 0), ref1.bias.grad),
        "w2": torch.allclose(_gather_param(fc2.weight, g, 1), ref2.weight),
        "dw2": torch.allclose(_gather_param(fc2.weight.grad, g, 1), ref2.weight.grad),
        # Under SP the replicated bias sees only this rank's tokens: its grad is summed over
        # TP (Megatron's rule for params marked sequence_parallel).
        "db2": torch.allclose(_sp_sum(fc2.bias, g), ref2.bias.grad),
    }
    return checks


def _sp_sum(p, group):
    grad = p.grad.clone()
    if getattr(p, "sequence_parallel", False) and group is not None:
        dist.all_reduce(grad, group=group)
    return grad


def _single():
    from moepar.parallel.groups import ParallelState
    return ParallelState.single()


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (2, True), (4, True)])
def test_column_row_mlp_equals_tp1(tp, sp):
    for checks in run_ranks(_tp_mlp_matches, 4, tp, sp):
        assert all(checks.values()), checks


def _vocab_parallel(tp, V=12):
    state = init_parallel(tensor_parallel_size=tp, verbose=False)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (2, 5), generator=gen)
    target = torch.randint(0, V, (2, 5), generator=gen)
    target[0, 1] = -100  # ignored position
    emb = VocabParallelEmbedding(V, D, init_seed=9, state=state)
    ref_emb = VocabParallelEmbedding(V, D, init_seed=9, state=_single())
    head = ColumnParallelLinear(D, V, bias=False, init_seed=10, state=state)
    ref_head = ColumnParallelLinear(D, V, bias=False, init_seed=10, state=_single())
    loss = vocab_parallel_cross_entropy(head(emb(ids)), target, state=state)
    loss.backward()
    ref = F.cross_entropy(ref_head(ref_emb(ids)).reshape(-1, V), target.reshape(-1), ignore_index=-100)
    ref.backward()
    g = state.tp_group
    per_tok = vocab_parallel_cross_entropy(head(emb(ids)).detach(), target, state=state, reduction="none")
    ref_tok = F.cross_entropy(ref_head(ref_emb(ids)).detach().reshape(-1, V), target.reshape(-1),
                              ignore_index=-100, reduction="none").reshape(2, 5)
    return {"loss": torch.allclose(loss, ref, atol=1e-6),
            "per_token": torch.allclose(per_tok, ref_tok, atol=1e-6),
            "d_emb": torch.allclose(_gather_param(emb.weight.grad, g, 0), ref_emb.weight.grad, atol=1e-6),
            "d_head": torch.allclose(_gather_param(head.weight.grad, g, 0), ref_head.weight.grad, atol=1e-6)}


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_and_cross_entropy(tp):
    for checks in run_ranks(_vocab_parallel, 4, tp):
        assert all(checks.values()), checks


def test_cross_entropy_single_process_matches_torch():
    logits = torch.randn(7, 11, requires_grad=True)
    target = torch.randint(0, 11, (7,))
    ours = vocab_parallel_cross_entropy(logits, target)
    ours.backward()
    g_ours = logits.grad.clone()
    logits.grad = None
    ref = F.cross_entropy(logits, target)
    ref.backward()
    assert torch.allclose(ours, ref, atol=1e-6) and torch.allclose(g_ours, logits.grad, atol=1e-6)


def _bad_hidden(tp):
    state = init_parallel(tensor_parallel_size=tp, verbose=False)
    errors = []
    for build in (lambda: ColumnParallelLinear(8, 10, state=state),
                  lambda: RowParallelLinear(10, 8, state=state),
                  lambda: VocabParallelEmbedding(10, 8, state=state)):
        try:
            build()
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_sizes_not_divisible_by_tp_raise_on_every_rank():
    for errors in run_ranks(_bad_hidden, 4, 4):
        assert errors == ["out_features=10 is not divisible by tensor_parallel_size=4",
                          "in_features=10 is not divisible by tensor_parallel_size=4",
                          "num_embeddings=10 is not divisible by tensor_parallel_size=4"]


class _TPStack(torch.nn.Module):
    """Every TP layer kind, in several options: the example's attention (q, k, v column- and
    proj row-parallel, init_std set), a biased pair left to nn.Linear's init (bf16, SP) and
    the vocab-parallel embedding."""

    def __init__(self, state):
        super().__init__()
        from examples.gpt_moe import Attention, GPTConfig
        self.attn = Attention(GPTConfig(hidden=16, heads=4, layers=2), state, seed=21)
        self.fc1 = ColumnParallelLinear(D, F_HID, init_seed=1, state=state, sequence_parallel=True,
                                        dtype=torch.bfloat16)
        self.fc2 = RowParallelLinear(F_HID, D, init_seed=2, state=state, sequence_parallel=True,
                                     dtype=torch.bfloat16)
        self.embed = VocabParallelEmbedding(12, D, init_seed=9, state=state)


_MARKERS = ("tensor_model_parallel", "partition_dim", "sequence_parallel")


def _meta_build_equals_direct(tp):
    """(worst |difference| of any tensor, whether every parameter's markers match) between a
    direct build and a meta build + to_empty + every module's reset_parameters()."""
    state = init_parallel(tensor_parallel_size=tp, verbose=False)
    ref = _TPStack(state)
    with torch.device("meta"):
        model = _TPStack(state)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(123.0)   # what to_empty may leave behind
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    got, want = model.state_dict(), ref.state_dict()
    assert sorted(got) == sorted(want) and all(got[k].dtype == want[k].dtype for k in got)
    worst = max(float((got[k].double() - want[k].double()).abs().max()) for k in got)
    markers = all(getattr(p, m, None) == getattr(q, m, None) for p, q in zip(model.parameters(), ref.parameters())
                  for m in _MARKERS)
    return worst, markers


@pytest.mark.parametrize("tp", [1, 2])
def test_meta_build_then_reset_equals_direct_build(tp):
    for worst, markers in run_ranks(_meta_build_equals_direct, 2, tp):
        assert worst == 0.0 and markers


def test_reset_parameters_redraws_the_construction_values():
    fc = ColumnParallelLinear(D, F_HID, init_seed=4, init_std=0.02, state=_single())
    row = RowParallelLinear(F_HID, D, init_seed=5, state=_single())
    before = [p.detach().clone() for p in (*fc.parameters(), *row.parameters())]
    with torch.no_grad():
        for p in (*fc.parameters(), *row.parameters()):
            p.zero_()
    fc.reset_parameters()
    row.reset_parameters()
    assert all(torch.equal(a, b) for a, b in zip(before, (*fc.parameters(), *row.parameters())))

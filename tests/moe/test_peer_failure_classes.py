"""The MoE failures that users of Megatron-LM, torchtitan and DeepSpeed keep reporting, one
test per class, each naming the peer issue it guards against. The expert-TP ×
FSDP2 hang has its own file (tests/parallel/test_fsdp_expert_tp.py), activation recompute too
(tests/moe/test_recompute.py).

How each was checked to fail on a build with the bug (a mutation made by hand, the test run,
the mutation reverted) is in each test's docstring.
"""

import pytest
import torch
import torch.distributed as dist

import moepar
from moepar.parallel import clip_grad_norm_, grad_norm
from moepar.parallel.groups import ParallelState
from moepar_kernels import routing as rk

from ..helpers import hf_cases
from ..helpers.moe_ref import local_slice
from ..helpers.multiproc import run_ranks
from ..parallel.test_fsdp_expert_tp import Stack, _loss, _replica

LR = 1e-2


# --- an EP rank or an expert that receives nothing (DeepSpeed #4808, #5066) ----------------

def _starve(model):
    """Experts 2 and 3 (EP rank 1's at ep 2) never chosen: their router bias is -1e4."""
    with torch.no_grad():
        for block in model.blocks:
            block.router.bias[2:] = -1e4


def _train_steps(model, state, fsdp, steps=3, dp=None):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        if state is None:   # one process: the mean of the replicas' losses
            loss = sum(_loss(model, *_replica(100 * step + d)) for d in range(dp)) / dp
        else:
            loss = _loss(model, *_replica(100 * step + state.dp_rank))
        loss.backward()
        if state is not None and not fsdp:
            moepar.allreduce_gradients(model, state)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def _max_diff(model, ref, state):
    worst = 0.0
    for name, p in model.named_parameters():
        mine = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        worst = max(worst, float((mine - local_slice(ref[name], p, state)).abs().max()))
    return worst


def _starved_rank(ref):
    state = moepar.init_parallel(1, 2, verbose=False)
    out = {}
    for fsdp in (False, True):
        model = Stack(state, router_bias=True)
        _starve(model)
        if fsdp:
            model = moepar.fully_shard(model, state)
        _train_steps(model, state, fsdp)
        out[fsdp] = (_max_diff(model, ref, state), int(model.blocks[0].stats.load.received_P[1])
                     if model.blocks[0].stats.load is not None else None)
    return out


def test_deepspeed_4808_an_ep_rank_whose_experts_receive_nothing_trains_without_a_hang():
    """EP rank 1 holds experts 2 and 3, which no token chooses: plain and FSDP2, 3 AdamW
    steps exact against one process. Checked: returning early from the experts on a rank
    that received no rows (their weights then get no gradient there, and FSDP2 leaves them out
    of its reduce-scatter) hangs this test."""
    ref_model = Stack(ParallelState.single(), router_bias=True)
    _starve(ref_model)
    ref = {n: p.detach().clone() for n, p in _train_steps(ref_model, None, False, dp=2).named_parameters()}
    for per_rank in run_ranks(_starved_rank, 2, ref, timeout=240):
        for fsdp, (diff, received) in per_rank.items():
            assert diff <= 1e-5, (fsdp, diff)
            assert received == 0, received


# --- the gradient norm under EP / TP / ETP (Megatron-LM #5916, #5956; DeepSpeed #8469, #8478) --

def _norm_of(grads):
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


def _one_process_grads(kw, dp):
    model = Stack(ParallelState.single(), **kw)
    (sum(_loss(model, *_replica(d)) for d in range(dp)) / dp).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _norms(tp, ep, etp, kw, ref_grads):
    state = moepar.init_parallel(tp, ep, etp, verbose=False)
    out = {}
    for fsdp in (False, True):
        model = Stack(state, **kw)
        if fsdp:
            model = moepar.fully_shard(model, state)
        _loss(model, *_replica(state.dp_rank)).backward()
        if not fsdp:
            moepar.allreduce_gradients(model, state)
        norm = float(grad_norm(model, state))
        ref_norm = _norm_of(ref_grads)
        returned = float(clip_grad_norm_(model, ref_norm / 2, state))
        worst = 0.0   # every gradient after clipping against the clipped one-process gradient
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            want = local_slice(ref_grads[name], p, state) / 2
            worst = max(worst, float((g - want).abs().max()))
        out[fsdp] = (norm, returned, worst)
    return out


@pytest.mark.parametrize("tp,ep,etp", [(2, 2, 1), (1, 4, 1), (1, 2, 2)])
def test_megatron_5916_grad_norm_and_clipping_equal_the_one_process_gradient(tp, ep, etp):
    """``grad_norm`` and ``clip_grad_norm_`` at tp2·ep2, ep4 and ep2·etp2, plain and FSDP2,
    with biases and a shared expert: the norm of the one-process model's whole gradient, each
    parameter counted once (expert slices summed over EP and ETP, replicated ones not).
    Checked: dropping the all-reduce of the expert squares over the EP group (Megatron-LM #5916's
    undercount: some experts left out of the norm) fails all three layouts."""
    kw = dict(bias=True, num_shared_experts=1)
    ref_grads = _one_process_grads(kw, 4 // tp)
    ref_norm = _norm_of(ref_grads)
    for per_rank in run_ranks(_norms, 4, tp, ep, etp, kw, ref_grads, timeout=240):
        for fsdp, (norm, returned, worst) in per_rank.items():
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (fsdp, norm, ref_norm)
            assert abs(returned - ref_norm) <= 1e-5 * ref_norm, (fsdp, returned, ref_norm)
            assert worst <= 1e-6, (fsdp, worst)


# --- the HF export at EP > 1 (Megatron-LM #5844; Megatron-Bridge #1716, #1871) --------------

def _export(src, dst, tp, ep):
    hf_cases.import_transformers()
    from moepar.hf import load_pretrained, save_hf_checkpoint
    state = moepar.init_parallel(tp, ep, verbose=False)
    model, _ = load_pretrained(src, state)
    sd = save_hf_checkpoint(model, dst)
    return sorted(sd) if dist.get_rank() == 0 else None


@pytest.mark.parametrize("family,tp,ep", [("mixtral", 1, 2), ("deepseek_v3", 1, 2), ("qwen3_moe", 1, 4),
                                          ("mixtral", 2, 2)])
def test_megatron_5844_hf_export_at_ep_is_bit_identical_per_expert(family, tp, ep, tmp_path):
    """Load a checkpoint at ep 2 / ep 4 / tp2·ep2 and export it: every tensor (each expert's
    included) bit-identical to the one loaded, none missing, none extra. Checked: gathering
    the EP ranks' experts in reverse rank order in ``hf_model_state_dict`` fails this test
    (experts mixed across ranks, as in Megatron-Bridge #1716)."""
    from safetensors.torch import load_file
    from ..hf.test_hf_models import _model
    src, dst = tmp_path / "src", tmp_path / "dst"
    model = _model(family)
    model.save_pretrained(str(src))
    keys = run_ranks(_export, ep * tp, str(src), str(dst), tp, ep, timeout=240)[0]
    # transformers' own state dict of the model saved (its in-memory layout, which is the one
    # save_hf_checkpoint writes; save_pretrained may convert to a legacy layout on disk)
    want, got = model.state_dict(), load_file(str(dst / "model.safetensors"))
    want = {k: v for k, v in want.items() if k in got or not k.endswith("lm_head.weight")}
    assert sorted(got) == sorted(want) == keys
    expert_keys = [k for k in want if ".experts." in k]
    assert expert_keys
    for k in want:
        assert torch.equal(got[k], want[k]), k


# --- the per-sequence aux loss and the batch size (Megatron-LM #5798) -----------------------

def test_megatron_5798_sequence_aux_loss_does_not_depend_on_how_sequences_are_batched():
    """aux_loss="seq": four sequences routed in one batch give the mean of the per-sequence
    losses, which is what the same sequences give one at a time or two by two. Checked:
    summing over sequences instead of the mean (the loss growing with the batch size, the
    Megatron-LM #5798 report) fails this test."""
    L, E = 6, 4
    router = moepar.TopKRouter(8, E, 2, aux_loss="seq", seq_len=L, init_seed=3)
    x = torch.randn(4 * L, 8, generator=torch.Generator().manual_seed(0))
    whole = float(router(x).aux_loss)
    ones = [float(router(x[i * L:(i + 1) * L]).aux_loss) for i in range(4)]
    twos = [float(router(x[i * 2 * L:(i + 1) * 2 * L]).aux_loss) for i in range(2)]
    assert abs(whole - sum(ones) / 4) <= 1e-6 and abs(whole - sum(twos) / 2) <= 1e-6
    assert len({round(v, 6) for v in ones}) > 1   # the sequences differ: the test has teeth


# --- top-k on exact ties (torchtitan #3600) -------------------------------------------------

def _tied_logits():
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 3, (64, 8), generator=g).float() / 4   # many exact ties per row
    base[:8] = 0.5                                                  # whole rows tied
    return base


def _python_topk(logits, k):
    """The documented rule: the k largest, ties to the lower expert id."""
    return torch.tensor([sorted(range(row.numel()), key=lambda e: (-float(row[e]), e))[:k] for row in logits])


def _ties_on_rank():
    logits = _tied_logits()
    return [rk.routing_reference(logits, 2)[0] for _ in range(2)] + [rk.routing(logits, 2)[0]]


def test_torchtitan_3600_topk_on_exact_ties_is_the_same_everywhere():
    """Exact ties: the Triton kernel, the torch reference and a Python sort agree (lowest id
    wins); repeated runs agree; two ranks agree. Checked: ``torch.topk`` in place of
    ``_topk_lowest_index`` (which breaks ties in an unspecified order) fails the Python-sort
    comparison (and ties resolved by ``torch.topk`` differ from the kernel's here)."""
    logits = _tied_logits()
    want = _python_topk(logits, 2)
    for rank_ids in run_ranks(_ties_on_rank, 2):
        for ids in rank_ids:
            assert torch.equal(ids.sort(-1).values, want.sort(-1).values)
            assert torch.equal(ids[:, 0], want[:, 0])


# --- two MoE layers on their EP groups, shared experts, many steps (DeepSpeed #5794) --------

def _long_run(tp, ep, steps, ref):
    state = moepar.init_parallel(tp, ep, verbose=False)
    model = _train_steps(Stack(state, num_shared_experts=1, bias=True), state, False, steps=steps)
    return _max_diff(model, ref, state)


def test_deepspeed_5794_two_moe_layers_with_shared_experts_train_20_steps_without_a_hang():
    """tp2·ep2 (EP groups {0, 1} and {2, 3}, the TP pairs): two layers with their own routes,
    shared experts all-reduced over TP and overlapped with the dispatch, 20 AdamW steps, exact
    against one process. Checked: overlapping the shared experts on TP rank 0 only (the two
    ranks then enter their collectives in different orders) hangs this test."""
    ref_model = _train_steps(Stack(ParallelState.single(), num_shared_experts=1, bias=True), None, False,
                             steps=20, dp=2)
    ref = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    for diff in run_ranks(_long_run, 4, 2, 2, 20, ref, timeout=300):
        assert diff <= 1e-4, diff


# --- expert TP different from TP (Megatron-Bridge #1363) ------------------------------------

@pytest.mark.parametrize("tp,ep,etp", [(2, 2, 1), (1, 2, 2), (2, 1, 1)])
def test_megatron_bridge_1363_expert_tp_unlike_tp_trains_exactly(tp, ep, etp):
    """Layouts whose expert TP differs from TP (including etp 1 under tp 2): 3 AdamW steps
    with biases and shared experts, plain and FSDP2, exact against one process. Checked: the
    old b2-on-ETP-rank-0-only placement hangs the FSDP2 half at ep2·etp2."""
    kw = dict(bias=True, num_shared_experts=1)
    ref_model = _train_steps(Stack(ParallelState.single(), **kw), None, False, dp=4 // tp)
    ref = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    for per_rank in run_ranks(_layout_run, 4, tp, ep, etp, kw, ref, timeout=240):
        assert max(per_rank) <= 1e-5, per_rank


def _layout_run(tp, ep, etp, kw, ref):
    state = moepar.init_parallel(tp, ep, etp, verbose=False)
    out = []
    for fsdp in (False, True):
        model = Stack(state, **kw)
        if fsdp:
            model = moepar.fully_shard(model, state)
        out.append(_max_diff(_train_steps(model, state, fsdp), ref, state))
    return out


# --- one hot expert (torchtitan #1558) ------------------------------------------------------

def _one_hot_expert(cap):
    state = moepar.init_parallel(1, 2, verbose=False)
    model = Stack(state, router_bias=True, receive_capacity_factor=cap)
    with torch.no_grad():
        for block in model.blocks:
            block.router.bias.copy_(torch.tensor([0.0, -1e4, 1e4, 1e4]))   # experts 2, 3: every token
    x, g = _replica(state.dp_rank)
    y = model(x)
    (y * g).sum().backward()
    stats = model.blocks[0].stats
    return (y.detach(), float(stats.dropped), stats.load.guard_dropped, stats.load.group_guard_dropped,
            stats.dropped_fraction, str(moepar.load_report(model)))


def test_torchtitan_1558_all_tokens_to_one_rank_dropless_exact_and_capped_drops_counted():
    """Every token's two routes go to EP rank 1's experts: dropless, the layer equals one
    process; with ``receive_capacity_factor=1.0`` rank 1 takes at most the mean and the rest
    is dropped, counted in ``stats`` and the load report on every rank. Checked: not adding
    the guard's drops to ``stats.dropped`` fails the capped half."""
    one = Stack(ParallelState.single(), router_bias=True)
    with torch.no_grad():
        for block in one.blocks:
            block.router.bias.copy_(torch.tensor([0.0, -1e4, 1e4, 1e4]))
    want = [one(_replica(d)[0]).detach() for d in range(2)]
    for rank, (y, dropped, guard, group, frac, _) in enumerate(run_ranks(_one_hot_expert, 2, None)):
        assert float((y - want[rank]).abs().max()) <= 1e-5
        assert dropped == 0 and group == 0
    capped = run_ranks(_one_hot_expert, 2, 1.0)
    group = capped[0][3]
    assert group > 0 and group == sum(r[2] for r in capped)   # every rank reports the same total
    for y, dropped, guard, group_seen, frac, report in capped:
        assert group_seen == group and dropped == guard and 0 < frac < 1, (guard, dropped, frac)
        assert "guard_dropped" in report and str(group) in report

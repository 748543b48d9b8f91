"""Layer accounting: Mixtral-8x7B parameters and FLOPs by hand, routes, memory, the
collective list per layer and per step, and the messages for layouts that do not fit."""
import dataclasses
import math

import pytest

from moepar.cost.accounting import count_flops, layer_calls, memory_per_rank, step_calls
from moepar.cost.pipeline import step_cost
from moepar.cost.architectures import MODELS
from moepar.cost.model import CostLayout, MoESpec, check_fits, count_params
from moepar.cost.routes import imbalance_from_counts, routes_per_rank
from moepar.cost.profiles import get_hardware

H100 = get_hardware("h100")


def mixtral(**kw):
    return MoESpec(**{**MODELS["mixtral-8x7b"], "tokens": 4096, **kw})


# Mixtral-8x7B by hand (D=4096, F=14336, E=8, K=2, 32 layers, 32 heads, 8 KV heads, vocab 32000):
EXPERT = 3 * 4096 * 14336                       # 176,160,768 (SwiGLU: w1, w2, w3)
ATTN = 2 * 4096 * 4096 + 2 * 4096 * 8 * 128     # q, o: D x D; k, v: D x 1024 -> 41,943,040
ROUTER, NORMS, EMB = 4096 * 8, 2 * 4096, 2 * 32000 * 4096
TOTAL = 32 * (ATTN + ROUTER + NORMS + 8 * EXPERT) + EMB + 4096      # 46,702,792,704
ACTIVE = 32 * (ATTN + ROUTER + NORMS + 2 * EXPERT) + EMB + 4096     # 12,879,925,248


def test_mixtral_totals_match_the_published_46_7B_and_12_9B():
    p = count_params(mixtral(), CostLayout(8, 8, ep=8))
    assert (p.expert, p.attention) == (176_160_768, 41_943_040)
    assert p.total == TOTAL == 46_702_792_704
    assert p.active == ACTIVE == 12_879_925_248


def test_mixtral_per_rank_params_on_8_h100():
    # ep=8: every rank holds the whole dense part and one expert per layer.
    p = count_params(mixtral(), CostLayout(8, 8, ep=8))
    assert p.dense_rank == 32 * (ATTN + ROUTER + NORMS) + EMB + 4096 == 1_605_632_000 + 4096
    assert p.expert_rank == 32 * EXPERT == 5_637_144_576
    assert p.rank == 7_242_780_672
    # tp=2, ep=4: attention and embeddings halved, router and norms replicated, 2 experts per rank
    q = count_params(mixtral(), CostLayout(8, 8, tp=2, ep=4))
    assert q.dense_rank == 32 * (ATTN // 2 + ROUTER + NORMS) + EMB // 2 + 4096 == 803_475_456
    assert q.expert_rank == 32 * 2 * EXPERT == 11_274_289_152
    # ep=4, etp=2: 2 experts per rank, each half
    r = count_params(mixtral(), CostLayout(8, 8, ep=4, etp=2))
    assert r.expert_rank == 32 * 2 * EXPERT // 2
    # DeepSpeed's "params per GPU x mp_size" is off by the experts held elsewhere
    assert p.rank * 1 != p.total and q.rank * 2 != q.total


def test_mixtral_flops_on_8_h100():
    spec, lay = mixtral(), CostLayout(8, 8, ep=8)
    f = count_flops(spec, lay)
    per_token = 6 * (32 * (ATTN + ROUTER + 2 * EXPERT) + 32000 * 4096)      # 6 x 12,748,587,008
    assert f.per_token == per_token == 76_491_522_048
    # each rank: T=4096 tokens through the dense part and T x K = 8192 routes through its expert
    rank = 6 * 4096 * (32 * (ATTN + ROUTER) + 32000 * 4096) + 6 * 8192 * 32 * EXPERT
    assert f.rank_mean == f.rank_max == rank == per_token * 4096
    assert f.model == per_token * 4096 * 8                                    # all 8 replicas
    # tp=2, ep=4: the TP pair shares T tokens; each rank gets T/2 x K routes
    g = count_flops(spec, CostLayout(8, 8, tp=2, ep=4))
    assert g.rank_max == 6 * 4096 * (32 * ATTN + 32000 * 4096) / 2 + 6 * 4096 * 32 * ROUTER \
        + 6 * (4096 // 2 * 2) * 32 * EXPERT


def test_imbalance_and_capacity_change_the_most_loaded_rank():
    lay = CostLayout(8, 8, ep=8)
    r = routes_per_rank(mixtral(imbalance=1.5), lay)
    assert (r.mean, r.max) == (8192, 8192 * 1.5)
    f = count_flops(mixtral(imbalance=1.5), lay)
    assert f.rank_expert_max == 6 * 8192 * 1.5 * 32 * EXPERT
    assert f.deepspeed_style > f.model       # scaling the most loaded rank overcounts
    # capacity: C = max(ceil(4096 x 2 / 8 x 1.25), 4) = 1280; padded: E x C rows
    cap = routes_per_rank(mixtral(capacity_factor=1.25, pad_to_capacity=True), lay)
    assert cap.capacity == 1280 and cap.max == cap.mean == 8 * 1280
    unpadded = routes_per_rank(mixtral(capacity_factor=1.0, imbalance=3.0), lay)
    assert unpadded.max == 8 * 1024                                          # capped at E x C
    tiny = routes_per_rank(MoESpec(64, 128, 8, 1, tokens=1, capacity_factor=1.0, min_capacity=4),
                           CostLayout(2, 8, ep=2))
    assert tiny.capacity == 4 and tiny.max == 1                              # one token
    # min_capacity=0 (no minimum) is the layer's rule too; it was refused here
    no_min = routes_per_rank(MoESpec(64, 128, 8, 1, tokens=2, capacity_factor=1.0, min_capacity=0),
                             CostLayout(2, 8, ep=2, tp=2))
    assert no_min.capacity == 1
    with pytest.raises(ValueError, match="min_capacity=-1 must be an integer >= 0"):
        MoESpec(64, 128, 8, 1, tokens=1, capacity_factor=1.0, min_capacity=-1)


def test_imbalance_from_measured_counts():
    assert imbalance_from_counts([10, 30, 20, 20], ep=2) == pytest.approx(1.0)
    assert imbalance_from_counts([10, 30, 20, 20], ep=4) == pytest.approx(1.5)
    assert imbalance_from_counts([0, 0, 0, 8], ep=4) == pytest.approx(4.0)   # experts with no tokens
    with pytest.raises(ValueError, match="not divisible by ep=3"):
        imbalance_from_counts([1, 2, 3, 4], ep=3)


def test_memory_with_zero_stages():
    spec = MoESpec(hidden=64, ffn=128, experts=8, topk=2, tokens=16, dtype="bf16", layers=2)
    p0 = count_params(spec, CostLayout(8, 8, ep=4))
    dense, expert = p0.dense_rank, p0.expert_rank
    m0 = memory_per_rank(spec, CostLayout(8, 8, ep=4, zero=0))
    assert m0.weights == m0.grads == 2 * (dense + expert)
    assert m0.optimizer == 12 * (dense + expert)
    m1 = memory_per_rank(spec, CostLayout(8, 8, ep=4, zero=1))     # dp = 8, edp = 2
    assert m1.optimizer == pytest.approx(12 * (dense / 8 + expert / 2))
    m3 = memory_per_rank(spec, CostLayout(8, 8, ep=4, zero=3))
    assert m3.weights == m3.grads == pytest.approx(2 * (dense / 8 + expert / 2))
    assert m3.activations == m0.activations > 0


def _ops(calls, phase=None, group=None):
    return [(c.op, c.group) for c in calls if (phase is None or c.phase == phase)
            and (group is None or c.group == group)]


def test_ep_only_layer_issues_the_counts_all_gather_and_two_plus_two_all_to_alls():
    # No collective over the world: the counts travel in one all-gather over the MoE block
    # (here the EP group), then the token all-to-alls.
    spec, lay = mixtral(), CostLayout(8, 8, ep=8)
    calls = layer_calls(spec, lay, H100)
    assert _ops(calls, "fwd") == [("all_gather", "moe")] + [("all_to_all", "ep")] * 2
    assert _ops(calls, "bwd") == [("all_to_all", "ep")] * 2
    dispatch = [c for c in calls if c.name == "MoE dispatch"][0]
    assert dispatch.nbytes == 4096 * 2 * 4096 * 2                             # R·D·b
    assert dispatch.sent == dispatch.nbytes * 7 / 8
    counts = [c for c in calls if c.name == "MoE counts"][0]
    assert counts.nbytes == 8 * (8 + 11 + 8) * 8                 # block·(E + fields + ep)·8 gathered
    padded = layer_calls(dataclasses.replace(spec, capacity_factor=1.0, pad_to_capacity=True), lay, H100)
    assert _ops(padded, "fwd") == [("all_to_all", "ep")] * 2      # padded: no counts exchange


def test_tp_ep_etp_layer_collectives():
    spec = MoESpec(hidden=1024, ffn=4096, experts=8, topk=2, tokens=512, shared_experts=1)
    T, D, b = 512, 1024, 2
    calls = layer_calls(spec, CostLayout(16, 8, tp=2, ep=4, etp=2), H100)
    R = T // 2 * 2
    fwd = {c.name: c for c in calls if c.phase == "fwd"}
    assert fwd["attention output"].op == "all_reduce" and fwd["attention output"].nbytes == T * D * b
    assert fwd["MoE dispatch"].nbytes == R * D * b
    assert fwd["expert-TP gather rows"].nbytes == fwd["expert-TP reduce-scatter"].nbytes == 2 * R * D * b
    assert fwd["MoE TP gather"].op == "all_gather" and fwd["MoE TP gather"].nbytes == T * D * b
    assert fwd["shared experts"].op == "all_reduce"
    bwd = {c.name: c for c in calls if c.phase == "bwd"}
    assert bwd["routing-weight grad gather"].nbytes == T * 2 * 4
    assert sum(1 for c in calls if c.op == "all_to_all" and c.phase == "bwd") == 2
    # sequence parallel: no TP gather of outputs; all-gather + reduce-scatter; aux statistics
    sp = layer_calls(spec, CostLayout(16, 8, tp=2, ep=4, etp=2, sp=True), H100)
    names = {c.name for c in sp}
    assert "MoE TP gather" not in names and "attention output" not in names
    assert {"attention SP gather", "attention SP scatter", "shared experts SP scatter",
            "aux-loss statistics"} <= names
    # the router's two reductions (moepar/moe/routing/router.py _losses): E fp32 score sums, E + 1
    # int64 counts (the token count last); the old single 3·E·4 call was not what it issues
    assert [c for c in sp if c.name == "aux-loss statistics"][0].nbytes == 8 * 4
    assert [c for c in sp if c.name == "aux-loss counts"][0].nbytes == 9 * 8
    # the TP peers' token counts travel in the counts all-gather (block = lcm(2, 8) = 8 ranks)
    assert "shared experts SP token counts" not in names
    counts = [c for c in sp if c.name == "MoE counts"]
    assert [(c.op, c.group, c.group_size, c.nbytes) for c in counts] == [("all_gather", "moe", 8, 8 * (8 + 11 + 4) * 8)]


def test_step_collectives_per_zero_stage():
    spec = mixtral(micro_batches=4)
    lay0 = CostLayout(16, 8, ep=8)                                  # dp = 16, edp = 2
    s0 = step_calls(spec, lay0, H100)
    p = count_params(spec, lay0)
    assert [(c.op, c.group, c.nbytes) for c in s0] == [("all_reduce", "dp", p.dense_rank * 2),
                                                       ("all_reduce", "edp", p.expert_rank * 2)]
    s3 = step_calls(spec, CostLayout(16, 8, ep=8, zero=3), H100)
    gathers = [c for c in s3 if c.op == "all_gather"]
    assert all(c.count == 2 * 4 for c in gathers)                  # before fwd and bwd, per micro-batch
    assert step_calls(spec, CostLayout(8, 8, ep=8), H100)[0].group == "dp"  # edp = 1: no expert reduction
    sp = step_calls(spec, CostLayout(16, 8, tp=2, ep=8, sp=True), H100)
    assert (sp[0].name, sp[0].group, sp[0].nbytes) == ("SP norm grads", "tp", 32 * 2 * 4096 * 2)


def test_step_cost_totals_and_the_issue_example():
    spec = MoESpec(hidden=4096, ffn=14336, experts=8, topk=2, tokens=8192)
    cost = step_cost(spec, CostLayout(64, 8, tp=2, ep=8), H100)
    assert cost.comm_per_step == pytest.approx(cost.comm_per_layer + sum(c.total_seconds for c in cost.step))
    assert cost.step_time == pytest.approx(cost.comm_per_step + cost.compute_per_step + cost.optimizer_time)
    assert cost.compute_per_step == pytest.approx(cost.compute.total)    # one micro-batch, term by term
    # the attention all-reduce of T·D·b = 64 MiB over tp=2 on NVLink (ring, NCCL's 370 GB/s of
    # the 450 GB/s line rate): 1/2 x 2 x 64 MiB / 370 GB/s + 2 x 3.4 us + 8.4 us
    attn = [c for c in cost.layer if c.name == "attention output"][0]
    assert attn.seconds == pytest.approx(64 * 2 ** 20 / 370e9 + 2 * 3.4e-6 + 8.4e-6)


def test_layouts_that_do_not_fit_name_the_valid_values():
    with pytest.raises(ValueError, match=r"experts=8 is not divisible by ep=3 \(valid ep: 1, 2, 4, 8\)"):
        check_fits(mixtral(), CostLayout(24, 8, ep=3))
    with pytest.raises(ValueError, match=r"gpus=8 is not divisible by tp=3; valid tp: 1, 2, 4, 8"):
        CostLayout(8, 8, tp=3)
    with pytest.raises(ValueError, match="ep x etp = 4 x 4; valid ep with etp=4: 1, 2$"):
        CostLayout(8, 8, ep=4, etp=4)
    # etp alone does not divide the GPUs: no ep would do, so the message names the valid etp
    # (it used to end in an empty list)
    with pytest.raises(ValueError, match="etp=3 itself does not divide gpus; valid etp: 1, 2, 4, 8$"):
        CostLayout(8, 8, ep=2, etp=3)
    with pytest.raises(ValueError, match="not a whole number of nodes"):
        CostLayout(12, 8)
    with pytest.raises(ValueError, match="topk=9 must be <= experts=8"):
        MoESpec(hidden=64, ffn=64, experts=8, topk=9, tokens=4)
    with pytest.raises(ValueError, match=r"ffn=14336 is not divisible by etp=3 \(valid etp: 1, 2, 4, 8\)"):
        check_fits(mixtral(), CostLayout(24, 8, etp=3))
    lay = CostLayout(32, 8, tp=16)
    assert "tp=16 > gpus_per_node=8" in lay.warnings()[0]


def _exact_fraction(E, K, ep):
    """Mean distinct EP ranks over every K-subset of the E experts, over K (the obvious way)."""
    import itertools
    L = E // ep
    subsets = list(itertools.combinations(range(E), K))
    return sum(len({e // L for e in s}) for s in subsets) / len(subsets) / K


@pytest.mark.parametrize("E,K,ep", [(8, 2, 2), (8, 3, 4), (12, 4, 3), (16, 4, 2), (10, 5, 5)])
def test_dedup_fraction_is_the_mean_over_every_expert_subset(E, K, ep):
    from moepar.cost.routes import dedup_fraction
    spec = MoESpec(hidden=8, ffn=8, experts=E, topk=K, tokens=64, dedup="on")
    assert dedup_fraction(spec, CostLayout(ep, 8, ep=ep)) == pytest.approx(_exact_fraction(E, K, ep), rel=1e-12)


def test_dedup_matches_the_layer_threshold_and_its_measured_rows():
    # The model's auto threshold is the layer's, and the fraction the model expects is what
    # the layer's own row count gives on uniform random top-8 of 64 routes (4096 tokens).
    import torch
    from moepar.cost.routes import DEDUP_MAX_FRACTION, dedup_fraction
    from moepar.moe.exchange import dedup
    assert DEDUP_MAX_FRACTION == dedup.DEDUP_MAX_FRACTION
    ids = torch.rand(4096, 64, generator=torch.Generator().manual_seed(0)).topk(8, dim=1).indices
    spec = MoESpec(hidden=8, ffn=8, experts=64, topk=8, tokens=4096, dedup="on")
    for ep in (2, 4):
        measured = int(dedup.dedup_rows(ids, None, 64 // ep, ep).sum()) / ids.numel()
        assert measured == pytest.approx(dedup_fraction(spec, CostLayout(4, 8, ep=ep)), abs=0.01)


def test_dedup_prices_fewer_token_bytes_and_a_side_message():
    # E=64, K=8: auto dedups at ep=2 (f = 0.25) but not at ep=4 (f = 0.46); "off" never, "on" always.
    spec = MoESpec(hidden=1024, ffn=512, experts=64, topk=8, tokens=4096, dtype="bf16")

    def a2a(spec, ep):
        return {c.name + "/" + c.phase: c.nbytes for c in layer_calls(spec, CostLayout(8, 8, ep=ep), H100)
                if c.op == "all_to_all" and c.name != "MoE counts"}
    full = 4096 * 8 * 1024 * 2
    off2 = a2a(spec.replace(dedup="off"), 2)
    assert off2 == {"MoE dispatch/fwd": full, "MoE combine/fwd": full,
                    "MoE combine grad/bwd": full, "MoE dispatch grad/bwd": full}
    auto2 = a2a(spec, 2)
    f = 2 * (1 - math.comb(32, 8) / math.comb(64, 8)) / 8     # the closed form checked above
    assert f < 0.3 and auto2["MoE dispatch/fwd"] == pytest.approx(full * f)
    assert auto2["MoE dedup side/fwd"] == pytest.approx(4096 * 8 * f * 2 * 8 * 4)
    assert len(auto2) == 6 and "MoE dedup side grad/bwd" in auto2
    assert a2a(spec, 4) == a2a(spec.replace(dedup="off"), 4)              # f = 0.46 > 0.3
    assert a2a(spec.replace(dedup="on"), 4)["MoE dispatch/fwd"] == pytest.approx(full * 4 * (1 - math.comb(48, 8) / math.comb(64, 8)) / 8)
    with pytest.raises(ValueError, match="dedup='yes' must be one of auto, on, off"):
        spec.replace(dedup="yes")

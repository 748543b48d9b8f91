"""Pricing: gradients across nodes on every NIC, ZeRO per micro-batch, FP8 wire
dtypes, the two overlap bounds, MFU, and what ``recommend`` ranks first for published
models (from the model's own pricing: no rule forces a layout)."""
import pytest

from moepar.cost.accounting import layer_calls, step_calls
from moepar.cost.pipeline import step_cost
from moepar.cost.architectures import MODELS
from moepar.cost.model import CostLayout, MoESpec, count_params
from moepar.cost.profiles import get_hardware
from moepar.cost.search import recommend

H100 = get_hardware("h100")


def mixtral(**kw):
    return MoESpec(**{**MODELS["mixtral-8x7b"], "tokens": 4096, **kw})


def deepseek_v3(**kw):
    # DeepSeek-V3's published shape (config.json of deepseek-ai/DeepSeek-V3) with the
    # fields MoESpec has: hidden 7168, 61 layers (all priced as MoE layers: the first 3 dense
    # ones, FFN 18432, are not expressible here), 256 routed experts of 2048 + 1 shared,
    # top-8, vocab 129280; MLA approximated by 128 full heads (4·D² attention parameters).
    return MoESpec(**{**dict(hidden=7168, ffn=2048, experts=256, topk=8, shared_experts=1, shared_ffn=2048,
                             layers=61, heads=128, vocab=129280, tokens=4096), **kw})


def test_dense_gradient_all_reduce_across_two_nodes_uses_the_nodes_nics():
    # report --model mixtral-8x7b --tokens 4096 --gpus 16 --tp 2 --ep 8: the dp=8 group is
    # ranks 0, 2, ..., 14, 4 per node: its ring runs at min(370, 4 x 47) GB/s. The old model
    # sent it through one NIC at 50 GB/s and printed 56 ms.
    spec, lay = mixtral(), CostLayout(16, 8, tp=2, ep=8)
    dense = [c for c in step_calls(spec, lay, H100) if c.name == "dense grads"][0]
    S = count_params(spec, lay).dense_rank * 2
    assert dense.nbytes == S and dense.group_size == 8 and dense.algo == "ring"
    hand = 8.4e-6 + (14 - 2) * 3.4e-6 + 2 * 14e-6 + 2 * 7 / 8 * S / (4 * 47e9)
    assert dense.seconds == pytest.approx(hand, rel=1e-9)
    assert dense.seconds < 56e-3 / 3


def test_zero_2_and_3_reduce_scatter_every_micro_batch():
    spec = mixtral(micro_batches=4)
    for zero, rs_count in ((1, 1), (2, 4), (3, 4)):
        calls = step_calls(spec, CostLayout(16, 8, ep=8, zero=zero), H100)
        rs = [c for c in calls if c.op == "reduce_scatter"]
        assert [c.count for c in rs] == [rs_count, rs_count], zero
    z2 = step_calls(spec, CostLayout(16, 8, ep=8, zero=2), H100)
    assert [c.count for c in z2 if c.op == "all_gather"] == [1, 1]     # updated weights once


def test_fp8_dispatches_fp8_and_combines_bf16():
    lay = CostLayout(16, 8, tp=2, ep=8)
    calls = {(c.name, c.phase): c for c in layer_calls(mixtral(dtype="fp8"), lay, H100)}
    R, D = 4096 // 2 * 2, 4096
    # FP8 rows out with one fp32 scale per 128 channels, as the layer sends them (moepar.moe.exchange.fp8)
    assert calls[("MoE dispatch", "fwd")].nbytes == R * (D + 4 * D // 128)
    assert calls[("MoE combine grad", "bwd")].nbytes == R * D * 2        # gradients in BF16
    assert calls[("MoE combine", "fwd")].nbytes == R * D * 2             # BF16 back
    assert calls[("MoE dispatch grad", "bwd")].nbytes == R * D * 2
    assert calls[("attention output", "fwd")].nbytes == 4096 * D * 2      # TP activations BF16
    grads = step_calls(mixtral(dtype="fp8"), lay, H100)
    assert grads[0].nbytes == count_params(mixtral(), lay).dense_rank * 2    # BF16 gradients
    over = {(c.name, c.phase): c for c in layer_calls(mixtral(dtype="bf16", dispatch_dtype="fp8",
                                                              combine_dtype="fp32"), lay, H100)}
    assert over[("MoE dispatch", "fwd")].nbytes == R * (D + 4 * D // 128)
    assert over[("MoE combine", "fwd")].nbytes == R * D * 4
    with pytest.raises(ValueError, match="dispatch_dtype='int4' is not known"):
        mixtral(dispatch_dtype="int4")
    # the layer's combine_grad_dtype="fp8": the combine's gradient goes back as FP8 rows too
    g8 = {(c.name, c.phase): c for c in layer_calls(mixtral(dtype="fp8", combine_grad_dtype="fp8"), lay, H100)}
    assert g8[("MoE combine grad", "bwd")].nbytes == R * (D + 4 * D // 128)
    assert g8[("MoE dispatch grad", "bwd")].nbytes == R * D * 2
    with pytest.raises(ValueError, match="combine_grad_dtype='bf16' must be None or 'fp8'"):
        mixtral(combine_grad_dtype="bf16")
    # weights and Adam state as BF16 training: FP8 changes no memory figure but activations' dtype
    assert step_cost(mixtral(dtype="fp8"), lay, H100).memory.weights == \
        step_cost(mixtral(), lay, H100).memory.weights


def test_overlap_bound_hides_gradients_behind_backward_and_all_to_all_behind_shared_experts():
    spec = mixtral(micro_batches=2, shared_experts=1, shared_ffn=4096)
    cost = step_cost(spec, CostLayout(16, 8, tp=2, ep=8), H100)
    assert cost.compute_efficiency == pytest.approx(794.5 / 989)   # H100's measured large BF16 GEMM, not 1.0
    rate = 989.5e12 * 794.5 / 989
    grads = sum(c.total_seconds for c in cost.step if "grads" in c.name)
    bwd_one = cost.compute.backward                             # ZeRO 0: the last micro-batch's backward
    assert cost.hidden_grad_reduction == pytest.approx(min(grads, bwd_one))
    # the layer computes the shared experts' forward while the dispatch all-to-all is in
    # flight: only that one call can hide them (not the combine, not the backward)
    shared_fwd = 2 * 4096 * cost.params.shared / 2 / rate
    dispatch = [c.total_seconds for c in cost.layer if c.name == "MoE dispatch"]
    assert len(dispatch) == 1
    assert cost.hidden_shared_experts == pytest.approx(min(dispatch[0], shared_fwd) * 32 * 2)
    assert cost.hidden_a2a == 0 and cost.weight_gathers == 0          # no --a2a-overlap; ZeRO 0 gathers nothing
    assert cost.step_time_overlapped == pytest.approx(cost.step_time - cost.hidden_grad_reduction
                                                      - cost.hidden_shared_experts)
    assert 0 < cost.step_time_overlapped < cost.step_time
    # MFU: model FLOPs (6·N_active per token) of the global batch over every GPU's peak
    tokens = 4096 * 8 * 2
    assert cost.tokens_per_step == tokens
    assert cost.mfu() == pytest.approx(cost.flops.per_token * tokens / (16 * 989.5e12 * cost.step_time))
    assert cost.tokens_per_second_per_gpu(True) == pytest.approx(tokens / cost.step_time_overlapped / 16)


def _first(cands):
    return cands[0].cost.layout


@pytest.mark.parametrize("gpus", [16, 64])
def test_recommend_keeps_mixtral_experts_in_one_node_with_etp_1(gpus):
    cands = recommend(mixtral(), gpus, H100)
    lay = _first(cands)
    assert cands[0].fits and lay.etp == 1 and lay.ep * lay.etp <= 8, lay.describe()
    assert lay.placement("ep").nodes == 1
    # ranked by the overlapped bound, ties by memory
    keys = [(round(float(f"{c.cost.step_time_overlapped:.3g}"), 12), c.cost.memory.total)
            for c in cands if c.fits]
    assert keys == sorted(keys)


def test_recommend_equal_times_put_less_memory_first():
    cands = [c for c in recommend(mixtral(), 16, H100, zero_stages=(0, 1)) if c.fits]
    seen = 0
    for a, b in zip(cands, cands[1:]):
        if f"{a.cost.step_time_overlapped:.3g}" == f"{b.cost.step_time_overlapped:.3g}":
            assert a.cost.memory.total <= b.cost.memory.total
            seen += 1
    assert seen


def test_recommend_deepseek_v3_on_256_h100_takes_etp_1():
    cands = recommend(deepseek_v3(), 256, H100, zero_stages=(1,))
    lay = _first(cands)
    assert cands[0].fits and lay.etp == 1, lay.describe()


def test_recommend_refuses_bad_values():
    with pytest.raises(ValueError, match="global_tokens=0 must be a positive integer"):
        recommend(mixtral(), 16, H100, global_tokens=0)
    with pytest.raises(ValueError, match="memory_bytes=0 must be"):
        recommend(mixtral(), 16, H100, memory_bytes=0)


def test_compute_efficiency_defaults_to_the_generations_gemm_rate_on_presets_and_1_on_measured_profiles():
    from moepar.cost.collectives import Hardware, Link
    from moepar.cost.profiles import Curve
    spec, lay = MoESpec(hidden=64, ffn=128, experts=4, topk=2, tokens=64), CostLayout(4, 4, ep=4)
    assert step_cost(spec, lay, H100).compute_efficiency == pytest.approx(794.5 / 989)
    assert step_cost(spec.replace(dtype="fp8"), lay, H100).compute_efficiency == pytest.approx(1402.6 / 1979)
    given = step_cost(spec, lay, H100, 0.45)                               # --compute-efficiency replaces it
    assert given.compute_efficiency == 0.45 and given.compute.dense_gemm > step_cost(spec, lay, H100).compute.dense_gemm
    link = Link("gloo measured", 1e9, 50e-6)
    curve = Curve("all_to_all", 4, (1024, 4096), (1e-4, 2e-4), 5e-5, 1e-8)
    measured = Hardware("gloo", "measured", link, link, 4, 1e10, 8e9, curves={("all_to_all", 4): curve})
    m = step_cost(spec, lay, measured)
    assert m.compute_efficiency == 1.0 and m.compute is None              # its rate is a measured matmul rate
    assert m.compute_per_step == pytest.approx(m.flops.rank_max / 1e10)   # FLOPs at that rate, as before
    with pytest.raises(ValueError, match="compute_efficiency=nan must be in"):
        step_cost(spec, lay, H100, float("nan"))

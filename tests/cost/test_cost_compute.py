"""The compute terms, each against a hand calculation: the generation's GEMM rate per dtype,
grouped GEMMs by rows per expert, flash attention (causal, sliding window), memory-bound
passes, recomputation, the optimizer step, MTP, and the step's overlap of the all-to-all and
the ZeRO weight gathers."""

import pytest

from moepar.cost.compute import (EFFICIENCY, GROUPED_GEMM_POINTS, gemm_efficiency, microbatch_compute,
                                 optimizer_seconds, rows_factor)
from moepar.cost.model import CostLayout, MoESpec, count_params
from moepar.cost.pipeline import step_cost
from moepar.cost.profiles import get_hardware
from moepar.cost.routes import routes_per_rank

H100, B200, GB300 = get_hardware("h100"), get_hardware("b200"), get_hardware("gb300-nvl72")
D, F, E, K, T, L, H = 1024, 512, 8, 2, 4096, 2, 8     # a small model, by hand below


def small(**kw):
    return MoESpec(**{**dict(hidden=D, ffn=F, experts=E, topk=K, tokens=T, layers=L, heads=H, seq_len=T), **kw})


def priced(spec, layout=None, hw=H100, eff=None):
    layout = layout or CostLayout(8, 8, ep=8)
    p, r = count_params(spec, layout), routes_per_rank(spec, layout)
    return microbatch_compute(spec, layout, hw, p, r, eff), p, r


def test_one_efficiency_per_generation_and_dtype_from_the_measured_table():
    assert gemm_efficiency(H100, "bf16") == pytest.approx(794.5 / 989)
    assert gemm_efficiency(get_hardware("h800"), "fp8") == pytest.approx(1402.6 / 1979)   # the generation's
    assert gemm_efficiency(B200, "mxfp8") == gemm_efficiency(get_hardware("gb200-nvl72"), "fp8") \
        == pytest.approx(3432.5 / 4500)
    assert gemm_efficiency(GB300, "bf16") == pytest.approx(1769 / 2250)
    assert gemm_efficiency(get_hardware("a100"), "fp8") == pytest.approx(271.2 / 312)   # no FP8: the BF16 rate
    assert get_hardware("a100").peak("fp8") == 312e12 and H100.peak("fp8") == 1979e12
    assert len({k[0] for k in EFFICIENCY}) == 4 and all(0.5 < v < 0.9 for v in EFFICIENCY.values())


def test_grouped_gemm_factor_is_deepgemms_table_interpolated_in_log2_rows():
    assert rows_factor(8192) == rows_factor(1e6) == 1.0
    assert rows_factor(256) == pytest.approx(873.5 / 1280) and rows_factor(512) == pytest.approx(978 / 1280)
    mid = rows_factor(256 * 2 ** 0.5)          # halfway in log2 between 256 and 512
    assert mid == pytest.approx((873.5 + 978) / 2 / 1280)
    assert rows_factor(32) == pytest.approx(291 / 1280 / 2)   # below 64 rows: a 64-row GEMM's time
    assert [rows_factor(m) for m, _ in GROUPED_GEMM_POINTS] == sorted(rows_factor(m) for m, _ in GROUPED_GEMM_POINTS)


def test_gemm_and_attention_seconds_by_hand():
    spec = small()
    c, p, r = priced(spec)
    rate_bf16 = 989.5e12 * 794.5 / 989
    # routed experts: each rank holds E/ep = 1 expert, and processes R = T·K = 8192 rows (balanced)
    assert r.max == T * K and c.rows_per_expert == 8192 and c.expert_rows_factor == 1.0
    assert c.expert_gemm == pytest.approx(6 * T * K * L * 3 * D * F / rate_bf16)
    # dense: attention projections (q, k, v, o: 4·D² with 8 heads of 128) on the T tokens; no vocab
    assert c.dense_gemm == pytest.approx((6 * T * L * 4 * D * D + 6 * T * L * D * E) / rate_bf16)
    # causal flash attention: s = seq/2 keys per token; forward 2·s·H·(qk+v), backward 2.5 x that
    fwd = 2 * (T / 2) * H * (128 + 128) * T * L
    assert c.attention == pytest.approx(3.5 * fwd / rate_bf16)
    # FP8: the GEMMs at the FP8 rate and efficiency, attention stays BF16
    c8, _, _ = priced(spec.replace(dtype="fp8"))
    assert c8.expert_gemm == pytest.approx(6 * T * K * L * 3 * D * F / (1979e12 * 1402.6 / 1979))
    assert c8.attention == pytest.approx(c.attention)


def test_few_rows_per_expert_slow_the_expert_gemms():
    spec = small(experts=64, tokens=1024, seq_len=1024)
    c, _, r = priced(spec)
    assert c.rows_per_expert == 1024 * 2 / 8 == 256          # R = 2,048 rows over 8 local experts
    rate = 989.5e12 * 794.5 / 989 * (873.5 / 1280)
    assert c.expert_gemm == pytest.approx(6 * r.max * L * 3 * D * F / rate)


def test_sliding_window_layers_attend_to_the_window():
    full, _, _ = priced(small())
    half, _, _ = priced(small(sliding_window=128, sliding_layers=1))
    per_layer = full.attention / 2
    assert half.attention == pytest.approx(per_layer + per_layer * 128 / (T / 2))


def test_memory_bound_passes_by_hand():
    spec = small()
    c, _, r = priced(spec)
    b, R = 2, T * K
    per_block = 10 * D * T * b                                  # 2 norms (2D) + 2 residual adds (3D)
    moe = (R * 2 * D + R * D + T * D) * b + R * 3 * F * b + T * E * 12   # permute, un-permute, SwiGLU, router
    assert c.memory == pytest.approx(3 * L * (per_block + moe) / 3.35e12)   # forward + twice that backward


def test_recomputation_repeats_forward_work():
    base, p, _ = priced(small())
    full, _, _ = priced(small(recompute="full"))
    attn_fwd = base.attention / 3.5
    assert full.recompute == pytest.approx(base.dense_gemm / 3 + base.expert_gemm / 3 + attn_fwd + base.memory / 3)
    sel, _, _ = priced(small(recompute="selective", recompute_modules=("core_attn", "layernorm")))
    assert sel.recompute == pytest.approx(attn_fwd + L * 4 * D * T * 2 / 3.35e12)
    assert priced(small(recompute="selective"))[0].recompute == pytest.approx(attn_fwd)   # Megatron's default
    with pytest.raises(ValueError, match="recompute_modules=\\('attn',\\): attn not among core_attn"):
        small(recompute="selective", recompute_modules=("attn",))
    with pytest.raises(ValueError, match="modules are for recompute='selective', not 'full'"):
        small(recompute="full", recompute_modules=("moe_act",))


def test_optimizer_step_reads_and_writes_the_shard():
    spec = small()
    lay = CostLayout(16, 8, ep=8, zero=1)
    p = count_params(spec, lay)
    shard = p.dense_rank / 16 + p.expert_rank / 2
    expected = (shard * (24 + 2 + 2) + p.rank * 2) / 3.35e12
    assert optimizer_seconds(lay, H100, p, 2, 2) == pytest.approx(expected)
    assert step_cost(spec, lay, H100).optimizer_time == pytest.approx(expected)


def test_mtp_module_trains_on_the_last_stage():
    spec = small(vocab=32000, mtp_layers=1)
    off, p, _ = priced(spec)
    on, _, _ = priced(spec.replace(train_mtp=True))
    rate = 989.5e12 * 794.5 / 989
    extra_dense = 6 * T * (p.attention + 2 * D * D) / rate + 6 * T * 32000 * D / rate + 6 * T * D * E / rate
    assert on.dense_gemm - off.dense_gemm == pytest.approx(extra_dense)
    assert on.expert_gemm == pytest.approx(off.expert_gemm * 3 / 2)   # one MoE block more than L = 2


def test_a2a_overlap_hides_each_layers_all_to_alls_behind_the_paired_micro_batch():
    spec = small(micro_batches=4, experts=16)
    lay = CostLayout(16, 8, ep=16)                     # EP over two nodes: all-to-all on the NICs
    plain = step_cost(spec, lay, H100)
    over = step_cost(spec, CostLayout(16, 8, ep=16, a2a_overlap=True), H100)
    a2a = plain.a2a_per_layer()
    per_layer = plain.compute_per_microbatch / L
    assert over.hidden_a2a == pytest.approx(min(a2a, per_layer) * L * 3)   # m - 1 = 3 steady micro-batches
    assert over.step_time_overlapped == pytest.approx(over.step_time - over.hidden)
    assert plain.hidden_a2a == 0 and over.step_time == pytest.approx(plain.step_time)
    assert sum(over.terms().values()) == pytest.approx(over.step_time_overlapped)
    piped = step_cost(spec, CostLayout(32, 8, ep=16, pp=2, a2a_overlap=True), H100)
    assert piped.overlapped_microbatches == 4 - 1     # m - (p - 1) with two stages
    assert "a2a overlap" in over.layout.describe()


def test_zero1_weight_gather_hides_behind_the_first_forward():
    spec = small(micro_batches=2)
    c = step_cost(spec, CostLayout(16, 8, ep=8, zero=1), H100)
    gathers = sum(x.total_seconds for x in c.step if "weights" in x.name)
    assert c.weight_gathers == pytest.approx(gathers) and gathers > 0
    assert c.hidden_weight_gathers == pytest.approx(min(gathers, c.compute.forward))
    z3 = step_cost(spec, CostLayout(16, 8, ep=8, zero=3), H100)
    assert z3.hidden_weight_gathers == pytest.approx(min(z3.weight_gathers, z3.compute_per_step))


def test_partial_nvlink_domain_64_of_72():
    with pytest.raises(ValueError, match="gpus=256 is not a whole number of nodes of gpus_per_node=72; a node "
                                         r"\(an NVLink domain\) can be used in part: gpus_per_node 64, 32, 16"):
        CostLayout(256, 72)
    nvl = get_hardware("gb200-nvl72").with_gpus_per_node(64)
    assert nvl.gpus_per_node == 64 and nvl.nic_share == 1.0 and nvl.domain == 72   # 64 used of the rack's 72
    lay = CostLayout(256, 64, ep=64)
    assert lay.nodes == 4 and lay.placement("ep").nodes == 1      # EP64 inside one rack's 64 GPUs
    c = step_cost(MoESpec(hidden=1024, ffn=512, experts=64, topk=2, tokens=1024), lay, nvl)
    assert all(x.algo != "node-limited" for x in c.layer)

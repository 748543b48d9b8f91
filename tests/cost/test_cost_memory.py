"""Saved activations tensor by tensor, with Megatron's recompute modules and FP8 caching, the
logits kept for one micro-batch, and node-limited routing's all-to-all, each by hand."""
import math

import pytest

from moepar.cost.memory import FP8_CACHED_BYTES, activation_memory, block_tensors
from moepar.cost.model import CostLayout, MoESpec
from moepar.cost.pipeline import step_cost
from moepar.cost.profiles import get_hardware
from moepar.cost.routes import node_limited_fraction, routes_per_rank

D, F, E, K, T, L, H = 1024, 512, 8, 2, 4096, 2, 8
LAY = CostLayout(8, 8, ep=8)


def small(**kw):
    return MoESpec(**{**dict(hidden=D, ffn=F, experts=E, topk=K, tokens=T, layers=L, heads=H, seq_len=T), **kw})


def per_block(spec):
    """One MoE block's tensors by hand, BF16 (R = T·K rows, 8 heads of 128 = D)."""
    R, b = T * K, 2
    return {"residual into norm 1": D * T * b, "norm 1 output": D * T * b, "q, k, v": T * 3 * D * b,
            "attention output": T * D * b, "residual into norm 2": D * T * b, "norm 2 output": D * T * b,
            "router logits and probabilities": T * E * 8, "dispatched rows": R * D * b,
            "expert gate/up output": R * 2 * F * b, "expert activation": R * F * b}


def test_block_tensors_by_hand():
    r = routes_per_rank(small(), LAY)
    got = {s.name: s.nbytes for s in block_tensors(small(), LAY, r, True)}
    assert got == per_block(small())
    a = activation_memory(small(), LAY, r)
    assert a.kept == pytest.approx(L * sum(per_block(small()).values())) and a.rebuilt == 0 and a.head == 0


def test_recompute_modules_drop_their_tensors():
    spec, hand = small(), per_block(small())
    r = routes_per_rank(spec, LAY)

    def kept(**kw):
        return activation_memory(small(**kw), LAY, r)
    lnorm = kept(recompute="selective", recompute_modules=("layernorm",))
    dropped = hand["norm 1 output"] + hand["norm 2 output"]
    assert lnorm.kept == pytest.approx(L * (sum(hand.values()) - dropped)) and lnorm.rebuilt == pytest.approx(dropped)
    act = kept(recompute="selective", recompute_modules=("moe_act",))
    assert act.kept == pytest.approx(L * (sum(hand.values()) - hand["expert activation"]))
    moe = kept(recompute="selective", recompute_modules=("moe",))
    inside = sum(hand[k] for k in ("router logits and probabilities", "dispatched rows", "expert gate/up output",
                                   "expert activation"))
    assert moe.kept == pytest.approx(L * (sum(hand.values()) - inside)) and moe.rebuilt == pytest.approx(inside)
    full = kept(recompute="full")      # the block's input only, one block rebuilt at a time
    assert full.kept == pytest.approx(L * hand["residual into norm 1"])
    assert full.rebuilt == pytest.approx(sum(hand.values()) - hand["residual into norm 1"])
    assert kept(recompute="selective", recompute_modules=("core_attn",)).total == pytest.approx(L * sum(hand.values()))


def test_fp8_recipes_keep_linear_inputs_in_fp8():
    spec = small(dtype="mxfp8")
    r = routes_per_rank(spec, LAY)
    hand = per_block(spec)
    cached = ("norm 1 output", "attention output", "norm 2 output", "dispatched rows", "expert activation")
    expected = sum(v * (FP8_CACHED_BYTES / 2 if k in cached else 1) for k, v in hand.items())
    assert activation_memory(spec, LAY, r).kept == pytest.approx(L * expected)
    assert FP8_CACHED_BYTES == 1 + 4 / 128


def test_logits_live_one_micro_batch_except_under_gpipe():
    spec = small(vocab=32000, layers=4, micro_batches=8)
    h100 = get_hardware("h100")
    head = (D * T + T * 32000) * 2
    last = step_cost(spec.replace(first_stage=False), CostLayout(8, 8, ep=8), h100).memory
    assert last.head == pytest.approx(head)
    f1b = [s for s in step_cost(spec, CostLayout(16, 8, ep=8, pp=2), h100).pipeline.stages if s.last][0]
    gpipe = [s for s in step_cost(spec, CostLayout(16, 8, ep=8, pp=2, schedule="gpipe"), h100).pipeline.stages
             if s.last][0]
    # the last stage keeps 1 micro-batch under 1F1B, all 8 under GPipe: 7 more of its blocks' and logits
    assert gpipe.memory - f1b.memory == pytest.approx(7 * (last.activations / 2 + head))


def test_node_limited_routing_sends_each_token_once_per_node():
    # DeepSeek-V3's routing at EP64 on 8 nodes of 8: 32 experts a node, K = 8 on at most M = 4 nodes
    spec = MoESpec(hidden=7168, ffn=2048, experts=256, topk=8, tokens=4096, max_nodes_per_token=4)
    lay = CostLayout(64, 8, ep=64)
    u = 4 * (1 - math.comb(96, 8) / math.comb(128, 8))         # distinct nodes per token, of the 4 allowed
    assert node_limited_fraction(spec, lay) == pytest.approx(u * 7 / 8 / 8)
    assert node_limited_fraction(spec.replace(max_nodes_per_token=None), lay) is None
    assert node_limited_fraction(spec, CostLayout(8, 8, ep=8)) is None        # one node: nothing to limit
    hw = get_hardware("h800")
    c = step_cost(spec, lay, hw)
    d = [x for x in c.layer if x.name == "MoE dispatch"][0]
    f = node_limited_fraction(spec, lay)
    S = 4096 * 8 * 7168 * 2
    assert d.algo == "node-limited"
    assert d.seconds == pytest.approx(8.4e-6 + 14e-6 + max(7 / 8 * S / 160e9, f * S / 47e9))
    plain = [x for x in step_cost(spec.replace(max_nodes_per_token=None), lay, hw).layer
             if x.name == "MoE dispatch"][0]
    assert d.seconds < plain.seconds / 1.8       # 2.2x fewer network bytes than 7 of 8 routes remote

"""Collective formulas against hand-worked numbers; curves, fits, hardware profiles."""
import json
import math

import pytest

from moepar.cost.presets import PRESETS
from moepar.cost.collectives import Hardware, Link, Placement, bus_factor, busbw, link_time, sent_bytes
from moepar.cost.profiles import Curve, fit_alpha_beta, get_hardware, isotonic, load_profile, save_profile
from moepar.cost.report import crossover_topk, ep_vs_tp, sweep

MiB = 2 ** 20
GB = 1e9
FAST = Link("test intra", 100 * GB, 0.0)      # 100 GB/s busbw, no latency
SLOW = Link("test inter", 25 * GB, 0.0)


def hw_of(intra=FAST, inter=SLOW, gpn=8, base=0.0):
    return Hardware("test", "test", intra, inter, gpn, 1e15, 80e9, base)


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)          # 1.75
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, 8) == pytest.approx(7 / 8)
    assert bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="valid: all_reduce"):
        bus_factor("broadcast", 4)


def test_ring_all_reduce_64MiB_over_8_ranks_at_100GBps():
    # Hand: each rank sends 2(n-1)/n x 64 MiB = 1.75 x 67,108,864 = 117,440,512 bytes;
    # at 100 GB/s that is 1.17440512 ms. algbw = 64 MiB / t = 57.14 GB/s, busbw = 100 GB/s.
    pl = Placement(8, 8)
    t = link_time("all_reduce", pl, 64 * MiB, FAST, SLOW)
    assert t == pytest.approx(1.17440512e-3, rel=1e-12)
    assert busbw("all_reduce", 8, 64 * MiB, t) == pytest.approx(100 * GB)
    assert 64 * MiB / t == pytest.approx(57.142857 * GB, rel=1e-6)
    assert sent_bytes("all_reduce", pl, 64 * MiB) == 117_440_512


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_to_all"])
def test_one_way_collectives_send_n_minus_1_over_n(op):
    # 7/8 x 64 MiB = 58,720,256 bytes at 100 GB/s = 0.58720256 ms
    t = link_time(op, Placement(8, 8), 64 * MiB, FAST, SLOW)
    assert t == pytest.approx(0.58720256e-3, rel=1e-12)


def test_latency_terms_count_algorithm_steps():
    lat = Link("lat", 100 * GB, 5e-6)
    pl = Placement(8, 8)
    # ring all-reduce: 2(n-1) = 14 steps; all-gather: n-1 = 7 steps; base latency once
    assert link_time("all_reduce", pl, 0, lat, lat, base_latency=1e-6) == pytest.approx(14 * 5e-6 + 1e-6)
    assert link_time("all_gather", pl, 0, lat, lat) == pytest.approx(7 * 5e-6)
    assert link_time("all_reduce", Placement(1, 1), 64 * MiB, lat, lat) == 0.0


def test_ring_across_nodes_runs_on_every_nic_of_the_node():
    # 2 nodes x 8 with one 25 GB/s NIC per GPU: the node's 8 NICs carry 200 GB/s, so the
    # 100 GB/s NVLink hops bound the ring: 2 x 15/16 x 64 MiB at 100 GB/s (the old model
    # priced it through one NIC, at 25 GB/s: 4x slower).
    S = 64 * MiB
    assert link_time("all_reduce", Placement(16, 8), S, FAST, SLOW, "ring") == \
        pytest.approx(2 * 15 / 16 * S / (100 * GB))
    # 2 NICs per 8-GPU node (nic_share 1/4): the node sends 50 GB/s, the ring runs at that
    assert link_time("all_reduce", Placement(16, 8), S, FAST, SLOW, "ring", nic_share=0.25) == \
        pytest.approx(2 * 15 / 16 * S / (50 * GB))
    # one rank per node (a dp group across tp=8 nodes): each GPU has its own NIC only
    assert link_time("all_reduce", Placement(4, 1), S, FAST, SLOW, "ring") == \
        pytest.approx(2 * 3 / 4 * S / (25 * GB))
    # all-gather across nodes: the same rate, (n-1)/n of S
    assert link_time("all_gather", Placement(16, 8), S, FAST, SLOW) == pytest.approx(15 / 16 * S / (100 * GB))


def test_efficiency_scales_the_line_rate():
    half = Link("half", 100 * GB, 0.0, efficiency=0.5)
    assert link_time("all_gather", Placement(8, 8), 64 * MiB, half, SLOW) == \
        pytest.approx(7 / 8 * 64 * MiB / (50 * GB))
    with pytest.raises(ValueError, match="efficiency=1.5 must be in"):
        Link("bad", 1e9, 0.0, efficiency=1.5)


def test_ring_latency_counts_intra_and_inter_node_steps_apart():
    nv, net = Link("nv", 100 * GB, 3e-6), Link("net", 100 * GB, 10e-6)
    # 4 nodes x 8: all-reduce 2(n-1) = 62 steps, 2(g-1) = 6 of them on the network
    assert link_time("all_reduce", Placement(32, 8), 0, nv, net, "ring") == pytest.approx(56 * 3e-6 + 6 * 10e-6)
    # all-gather: n-1 = 31 steps, g-1 = 3 of them on the network
    assert link_time("all_gather", Placement(32, 8), 0, nv, net) == pytest.approx(28 * 3e-6 + 3 * 10e-6)


def test_small_all_reduce_over_many_nodes_takes_the_tree():
    # 8 KiB over 256 H100 (32 nodes): the old ring-only model, every step at network latency,
    # printed 7.1 ms; NCCL's tuner takes the tree at this size: 2[7 x 3.4 + 5 x 14] + 8.4 us
    h100 = get_hardware("h100")
    pl = Placement(256, 8)
    t = h100.collective_time("all_reduce", pl, 8 * 1024)
    assert h100.resolve_algo("all_reduce", pl, 8 * 1024) == "tree"
    assert t == pytest.approx(8.4e-6 + 2 * (7 * 3.4e-6 + 5 * 14e-6) + 2 * 8192 / (370e9), rel=1e-6)
    assert t < 0.3e-3
    # at 1 GiB on 2 nodes the ring's 2(n-1)/n = 1.875 beats the tree's 2; on one node, NVLS
    assert h100.resolve_algo("all_reduce", Placement(16, 8), 2 ** 30) == "ring"
    assert h100.resolve_algo("all_reduce", Placement(8, 8), 2 ** 30) == "nvls"


def test_all_to_all_serves_peers_in_parallel():
    # the counts exchange at ep=64 (8 nodes), 6.5 KiB: one latency, not (n-m) of them
    # (the old model: 56 x 14 us + 8.4 us = 793 us)
    h100 = get_hardware("h100")
    S = 6.5 * 1024
    t = h100.collective_time("all_to_all", Placement(64, 8), S)
    b_x = 50e9 * 47 / 50
    assert t == pytest.approx(8.4e-6 + 14e-6 + 56 / 64 * S / b_x)
    assert t < 30e-6
    lat = Link("lat", 100 * GB, 5e-6)
    assert link_time("all_to_all", Placement(64, 64), 0, lat, lat) == pytest.approx(5e-6)
    assert link_time("all_to_all", Placement(8, 8), 0, lat, lat) == pytest.approx(5e-6)


def test_pairwise_all_to_all_uses_both_links_at_once():
    # 2 nodes x 4 ranks: 3/8 of S over 100 GB/s, 4/8 of S over 25 GB/s: the inter part wins
    S = 64 * MiB
    t = link_time("all_to_all", Placement(8, 4), S, FAST, SLOW)
    assert t == pytest.approx(max(3 / 8 * S / (100 * GB), 4 / 8 * S / (25 * GB)))


def test_hierarchical_all_to_all_two_levels():
    S = 64 * MiB
    # intra (m-1)/m S at 100 GB/s, then inter (g-1)/g S at 25 GB/s
    t = link_time("all_to_all", Placement(32, 8), S, FAST, SLOW, "hierarchical")
    assert t == pytest.approx(7 / 8 * S / (100 * GB) + 3 / 4 * S / (25 * GB))
    # on one node it is the flat all-to-all
    one = Placement(8, 8)
    assert link_time("all_to_all", one, S, FAST, SLOW, "hierarchical") == \
        pytest.approx(link_time("all_to_all", one, S, FAST, SLOW))


def test_hierarchical_all_to_all_sends_the_same_inter_node_bytes_in_g_messages():
    lat_i, lat_x = Link("i", 450 * GB, 3.4e-6), Link("x", 50 * GB, 14e-6)
    pl = Placement(64, 8)
    S = 64 * MiB
    two = link_time("all_to_all", pl, S, lat_i, lat_x, "hierarchical")
    assert two == pytest.approx(3.4e-6 + 7 / 8 * S / (450 * GB) + 14e-6 + 7 / 8 * S / (50 * GB))
    # the flat one overlaps its NVLink share with the network: never slower here
    assert link_time("all_to_all", pl, S, lat_i, lat_x) < two


def test_tree_all_reduce_latency_is_logarithmic_across_nodes():
    lat = Link("x", 100 * GB, 10e-6)
    ring = link_time("all_reduce", Placement(64, 1), 0, lat, lat, "ring")
    tree = link_time("all_reduce", Placement(64, 1), 0, lat, lat, "tree")
    assert link_time("all_reduce", Placement(64, 1), 0, lat, lat) == tree     # auto: the faster
    assert ring == pytest.approx(2 * 63 * 10e-6)
    assert tree == pytest.approx(2 * 6 * 10e-6)            # ceil(log2 64) = 6
    with pytest.raises(ValueError, match="valid: auto, ring, tree, nvls"):
        link_time("all_reduce", Placement(4, 4), 1, lat, lat, "pairwise")
    with pytest.raises(ValueError, match="algo='nvls' needs one node"):
        link_time("all_reduce", Placement(4, 4), 1, lat, lat, "nvls")


@pytest.mark.parametrize("k", [1, 2, 8])
def test_ep_moves_k_over_2n_of_tp_bytes_at_equal_global_batch(k):
    # 8 GPUs with 1024 tokens each: EP sends each rank's t·K rows, TP all-reduces the
    # group's 8·t tokens (replicated on its ranks); the old table compared T·K·D against
    # T·D, i.e. TP with 8x fewer tokens, and printed "EP/TP = K/2"
    c = ep_vs_tp(hw_of(), hidden=4096, tokens=1024, topk=k, group_size=8)
    assert c.ep_sent / c.tp_sent == pytest.approx(k / 16)
    assert c.ep_bytes == 1024 * k * 4096 * 2 and c.tp_bytes == 8 * 1024 * 4096 * 2
    # with no latency on one link, time follows bytes
    assert c.ep_time / c.tp_time == pytest.approx(k / 16)


def test_crossover_topk_is_2n_on_a_pure_bandwidth_link_and_capped_at_E():
    assert crossover_topk(hw_of(), hidden=1024, tokens=1024, group_size=8) == pytest.approx(16.0, rel=1e-6)
    assert crossover_topk(hw_of(), hidden=1024, tokens=1024, group_size=2) == pytest.approx(4.0, rel=1e-6)
    # 8 experts: a token cannot pick more than 8, and EP is faster up to 16: no crossover
    assert crossover_topk(hw_of(), hidden=1024, tokens=1024, group_size=8, experts=8) == math.inf
    assert crossover_topk(hw_of(), hidden=1024, tokens=1024, group_size=8, experts=64) == \
        pytest.approx(16.0, rel=1e-6)


def test_sweep_locates_the_token_crossover():
    lat = Link("lat", 100 * GB, 20e-6)
    rows, notes = sweep(hw_of(lat, lat), "tokens", [2 ** i for i in range(4, 20)], hidden=1024,
                        tokens=1, topk=32, group_size=8)
    # K=32 > 2n moves more bytes than TP, but with one latency per all-to-all against the
    # ring's 14: EP wins small t, TP large t.
    assert rows[0].winner == "EP" and rows[-1].winner == "TP"
    assert len(notes) == 1 and "tokens crossover" in notes[0]
    t_star = float(notes[0].split("at ")[1].split(":")[0])
    # hand, a = 20 us, b = 2, D = 1024, n = 8, per step (x4): EP a + 7/8·32·t·D·b/B,
    # TP (ring) 14a + 14/8·8t·D·b/B  =>  13a = 14·t·D·b/B  =>  t* = 13a·B/(14·D·b) = 906.7
    assert t_star == pytest.approx(13 * 20e-6 * 100e9 / (14 * 2048), rel=1e-3)


def test_isotonic_and_curve_interpolation():
    assert isotonic([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    c = Curve("all_reduce", 4, (100, 200, 400), (1.0, 2.0, 4.0), 0.0, 0.01)
    assert c.predict(200) == 2.0
    assert c.predict(300) == pytest.approx(3.0)            # linear between neighbours
    assert c.predict(800) == pytest.approx(8.0)            # last segment's slope
    noisy = Curve("all_reduce", 4, (100, 200, 400), (2.0, 1.0, 4.0), 0.0, 0.01)
    assert noisy.predict(150) == pytest.approx(1.5)        # the dip is pooled: 1.5, 1.5, 4
    with pytest.raises(ValueError, match="strictly increasing"):
        Curve("all_reduce", 4, (200, 100), (1.0, 2.0), 0.0, 0.0)


def test_fit_alpha_beta_recovers_a_line():
    sizes = [2 ** i for i in range(16, 27)]
    alpha, beta = fit_alpha_beta(sizes, [30e-6 + s / 50e9 for s in sizes])
    assert alpha == pytest.approx(30e-6, rel=1e-6) and beta == pytest.approx(1 / 50e9, rel=1e-6)
    c = Curve("all_to_all", 4, tuple(sizes), tuple(30e-6 + s / 50e9 for s in sizes), alpha, beta)
    assert c.busbw == pytest.approx(0.75 * 50e9, rel=1e-6)


def test_placement_of_layout_ranks():
    assert Placement.of_ranks([0, 8, 16, 24], 8) == Placement(4, 1)
    assert Placement.of_ranks(list(range(16)), 8).nodes == 2
    with pytest.raises(ValueError, match="unequal"):
        Placement.of_ranks([0, 1, 8], 8)


def test_presets_and_unknown_hardware_message():
    h100 = get_hardware("H100")
    assert h100.intra.bandwidth == 450 * GB and h100.inter.bandwidth == 50 * GB
    assert h100.intra.achievable == pytest.approx(370 * GB) and h100.inter.achievable == pytest.approx(47 * GB)
    assert h100.flops == pytest.approx(989.5e12) and h100.gpus_per_node == 8 and h100.nics == 8
    assert h100.memory_bytes / 2 ** 30 == pytest.approx(79.6, abs=0.05)          # 81,559 MiB
    assert get_hardware("a100").intra.bandwidth == 300 * GB
    assert get_hardware("h200").memory_bytes / 2 ** 30 == pytest.approx(140.4, abs=0.05)
    assert get_hardware("h800").intra.achievable == pytest.approx(160 * GB)      # DeepSeek-V3's figure
    nvl72 = get_hardware("gb200-nvl72")
    assert nvl72.gpus_per_node == 72 and nvl72.nics == 72 and nvl72.intra.bandwidth == 900 * GB
    assert get_hardware("b200").flops == pytest.approx(2250e12)
    for hw in PRESETS.values():
        assert hw.sources and hw.intra.source and hw.inter.source and hw.memory_bandwidth > 0
    with pytest.raises(ValueError) as e:
        get_hardware("tpu-v5")
    for name in PRESETS:
        assert name in str(e.value)
    assert "calibrate" in str(e.value)
    # another node size keeps the NICs per GPU
    assert h100.with_gpus_per_node(4).nics == 4 and h100.with_gpus_per_node(4, 8).nic_share == 2


@pytest.mark.parametrize("gpus, published_busbw", [
    (8, 476e9),    # NVIDIA, nccl-tests #290: 476 GB/s on one H100 node "in the expected range"
    (16, 376e9),   # 2 nodes x 8 NICs: 8 x 46-48 GB/s per 400G NIC (nccl-tests #290)
])
def test_1GiB_all_reduce_on_h100_within_20_percent_of_nccl_tests(gpus, published_busbw):
    h100 = get_hardware("h100")
    t = h100.collective_time("all_reduce", Placement(gpus, 8), 2 ** 30)
    assert busbw("all_reduce", gpus, 2 ** 30, t) == pytest.approx(published_busbw, rel=0.2)


def test_profile_round_trip_and_bad_files(tmp_path):
    c = Curve("all_reduce", 2, (1024, 4096), (1e-3, 2e-3), 0.5e-3, 1e-7)
    hw = hw_of().replace(curves={("all_reduce", 2): c}, meta={"backend": "gloo"})
    path = tmp_path / "p.json"
    save_profile(hw, str(path))
    back = load_profile(str(path))
    assert back.curves == hw.curves and back.intra == hw.intra and back.meta["backend"] == "gloo"
    assert get_hardware(str(path)).name == "test"
    # the calibrated curve prices that (op, n) on one node; others use the link model
    assert back.collective_time("all_reduce", Placement(2, 2), 2560) == pytest.approx(1.5e-3)
    assert back.collective_time("all_reduce", Placement(4, 4), 4096) == \
        pytest.approx(link_time("all_reduce", Placement(4, 4), 4096, FAST, SLOW))
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="format"):
        load_profile(str(tmp_path / "bad.json"))
    assert math.isinf(Curve("all_reduce", 2, (1,), (1.0,), 1.0, 0.0).busbw)

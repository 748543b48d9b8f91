"""Benchmark modes on tiny shapes: each runs and emits valid JSON; the plain-torch reference
MoE equals moepar's layer on the same weights; the skew and peak-memory helpers measure
what they claim."""
import json
import math

import pytest
import torch

from moepar.bench import dispatch as bench_dispatch
from moepar.bench import fsdp as bench_fsdp
from moepar.bench import layer as bench_layer
from moepar.bench.common import step_peak_bytes
from moepar.bench.peers import deepspeed_status, megatron_status
from moepar.bench.reference_moe import ReferenceMoE
from moepar.moe.layer import MoE
from moepar.parallel.groups import ParallelState
from tests.helpers.multiproc import run_ranks

TINY = "48:16:24:4:2"           # T:D:F:E:K
TINY_SKEW = "48:16:24:4:2:1.6"  # ... busiest expert 1.6x the mean load


def _moe(**kw):
    kw.setdefault("ffn_hidden", 12)
    return MoE(kw.pop("hidden", 8), kw.pop("num_experts", 5), k=kw.pop("k", 2), init_seed=11,
               state=ParallelState.single(), **kw)


def _grads(mod, x, g, aux):
    y = mod(x)
    params = [p for p in mod.parameters() if p.requires_grad]
    return y, torch.autograd.grad([y, aux(mod)], [x] + params, [g, torch.ones(())])


@pytest.mark.parametrize("activation,k,T,kw,cf", [
    ("gelu", 2, 29, {}, None),
    ("swiglu", 3, 1, {}, None),                     # one token: most experts get nothing
    ("relu", 1, 40, {}, None),
    ("gelu", 2, 33, {"capacity_factor": 0.5, "drop_policy": "position", "min_capacity": 1}, 0.5),
])
def test_reference_moe_equals_moepar_layer(activation, k, T, kw, cf):
    moe = _moe(activation=activation, k=k, **kw)
    ref = ReferenceMoE.from_moepar(moe, capacity_factor=cf)
    x = torch.randn(T, 8, requires_grad=True)
    g = torch.randn(T, 8)
    y, got = _grads(moe, x, g, lambda m: m.aux_loss)
    y_ref, want = _grads(ref, x, g, lambda m: m.aux_loss)
    assert torch.allclose(y, y_ref, atol=1e-5)
    assert torch.allclose(moe.aux_loss, ref.aux_loss, atol=1e-6)
    # Same order of parameters: gate, w1, (w3), w2 in both (router weight first in moepar).
    names = [n for n, p in moe.named_parameters()]
    ref_by_name = dict(zip(["x"] + [n for n, _ in ref.named_parameters()], want))
    mapping = {"router.weight": "gate", "experts.w1": "w1", "experts.w2": "w2", "experts.w3": "w3"}
    assert torch.allclose(got[0], want[0], atol=1e-5)
    for n, gr in zip(names, got[1:]):
        assert torch.allclose(gr, ref_by_name[mapping[n]], atol=1e-5), n
    if cf is not None:
        assert moe.stats.dropped_fraction > 0
        assert ref.last_capacity == max(math.ceil(T * k / 5 * cf), 1)   # moepar's capacity rule


def test_reference_moe_bf16_close_to_moepar():
    moe = _moe(dtype=torch.bfloat16)
    ref = ReferenceMoE.from_moepar(moe)
    x = torch.randn(21, 8, dtype=torch.bfloat16)
    y, y_ref = moe(x), ref(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert torch.allclose(y.float(), y_ref.float(), atol=3e-2, rtol=3e-2)


def test_reference_moe_rejects_what_it_does_not_model():
    with pytest.raises(ValueError, match="expert bias"):
        ReferenceMoE.from_moepar(_moe(bias=True))
    with pytest.raises(ValueError, match="k=6"):
        ReferenceMoE(8, 5, k=6)


def test_skew_input_shift_reaches_the_target_load():
    gate = torch.randn(8, 32) / 32 ** 0.5
    x = torch.randn(4096, 32)
    u, s = bench_layer.skew_input_shift(gate, x, 2, 2.5)
    assert s > 0
    offset = gate @ u
    assert torch.allclose(offset, -s * torch.log1p(torch.arange(8.0)), atol=1e-4)
    counts = torch.bincount(torch.topk((x + u) @ gate.t(), 2).indices.flatten(), minlength=8).float()
    assert abs(float(counts.max() / counts.mean()) - 2.5) < 0.05


def test_step_peak_bytes_sees_a_64_mib_temporary():
    def step():
        t = torch.empty(16 << 20, dtype=torch.float32)   # 64 MiB, touched
        t.fill_(1.0)
        return float(t[-1])
    peak, method = step_peak_bytes(step)
    assert 60 << 20 <= peak <= 200 << 20, (peak, method)


def test_layer_bench_json_every_row_and_check():
    out = bench_layer.run(bench_layer.parse_args(
        ["--configs", f"{TINY},{TINY_SKEW}", "--rounds", "1", "--warmup", "0", "--no-matmul", "--no-memory"]))
    json.loads(json.dumps(out, default=str))
    assert [c["config"] for c in out["configs"]] == [TINY, TINY_SKEW]
    for c in out["configs"]:
        impls = {r["impl"] for r in c["rows"]}
        assert {bench_layer.MOEPAR, bench_layer.REFERENCE, c["floor_impl"]} <= impls
        assert c["floor_impl"].startswith(bench_layer.FLOOR_PREFIX)
        assert all(r["ms"] > 0 and r["tokens/s"] > 0 for r in c["rows"])
        floor_row = next(r for r in c["rows"] if r["impl"] == c["floor_impl"])
        assert floor_row["x floor"] == 1.0
    skewed = out["configs"][1]
    assert skewed["load_max_over_mean"] > 1.3 and skewed["zipf_s"] > 0
    assert out["checks"][TINY][0]["check"].startswith("moepar / floor")
    ds_ok, ds_why = deepspeed_status()
    assert out["deepspeed"] == ds_why
    assert out["megatron"] == megatron_status()[1]
    if not ds_ok:
        assert ds_why.startswith("not importable")
        assert all(r["impl"] != bench_layer.DEEPSPEED for c in out["configs"] for r in c["rows"])
    else:   # DeepSpeed importable (a side environment): its rows and checks are there
        for c in out["configs"]:
            ds_row = next(r for r in c["rows"] if r["impl"] == bench_layer.DEEPSPEED)
            assert ds_row["ms"] > 0 and ds_row["x deepspeed"] == 1.0
        assert any("DeepSpeed" in ch["check"] for ch in out["checks"][TINY])


def test_layer_bench_cli_with_peak_memory(capsys):
    rc = bench_layer.main(["--configs", TINY, "--rounds", "1", "--warmup", "0", "--no-matmul", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["impl"]: r for r in out["configs"][0]["rows"]}
    assert rows[bench_layer.MOEPAR]["peak MB"] > 0
    assert rows[bench_layer.REFERENCE]["peak MB"] > 0
    assert out["configs"][0]["memory_method"]


def test_layer_bench_rejects_unknown_config():
    with pytest.raises(SystemExit):
        bench_layer.parse_args(["--configs", "Z"])
    with pytest.raises(ValueError, match="K=5 must be <= E=4"):
        bench_layer.parse_config("8:4:4:4:5")


def test_routing_and_local_modes_emit_json(tmp_path, capsys):
    from moepar.bench import main as bench_main
    path = tmp_path / "routing.json"
    assert bench_main(["routing", "--tokens", "256", "--experts", "8", "--k", "2", "--repeats", "1",
                       "--device", "cpu", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["rows"][0]["E"] == 8 and data["rows"][0]["reference_us"] > 0
    capsys.readouterr()
    assert bench_main(["local", "--configs", "64:16:32:4:2", "--rounds", "1", "--warmup", "0", "--no-matmul",
                       "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert local["configs"][0]["N"] == 128


def _dispatch_on_ranks(dedup="auto"):
    args = bench_dispatch.parse_args(["--ep", "2", "--configs", TINY, "--layer-config", TINY_SKEW,
                                      "--rounds", "1", "--warmup", "0", "--dedup", dedup]
                                     + (["--no-layer"] if dedup == "on" else []))
    return bench_dispatch.run(args)


def test_dispatch_bench_on_two_gloo_ranks():
    outs = run_ranks(_dispatch_on_ranks, 2)
    out = outs[0]
    json.loads(json.dumps(out))
    (row,) = out["dispatch"]
    assert row["ep"] == 2 and row["correct"] is True
    assert row["dispatch_ms"] > 0 and row["raw_ms"] > 0 and row["bytes_per_rank_max"] > 0
    assert row["passes_ms"] > 0 and row["counts_ms"] > 0
    assert row["a2a"] != "one, dedup" and row["raw_routes_ms"] == row["raw_ms"]
    assert row["floor_ms"] > 0 and row["floor_ratio"] == row["floor_ms"] / row["raw_ms"]
    assert row["floor_moe_ms"] > 0 and row["floor_moe_ratio"] == row["floor_moe_ms"] / row["raw_ms"]
    (layer,) = out["layer"]
    assert layer["moepar_ms"] > 0 and layer["load_max_over_mean"] > 1.2
    assert ("ratio" in layer) == deepspeed_status()[0]


def test_dispatch_bench_with_dedup_compares_both_byte_counts():
    # Forced dedup: the identity-expert round trip is still exact, and the row also times the
    # raw calls of one row per route (the bytes without dedup), which the floor is set against.
    (row,) = run_ranks(_dispatch_on_ranks, 2, "on")[0]["dispatch"]
    assert row["a2a"] == "one, dedup" and row["correct"] is True
    assert row["raw_routes_ms"] > 0 and row["ratio_routes"] == row["dispatch_ms"] / row["raw_routes_ms"]
    assert row["floor_ratio"] == row["floor_ms"] / row["raw_routes_ms"]
    assert row["floor_moe_ratio"] == row["floor_moe_ms"] / row["raw_routes_ms"]


def _fsdp_main_on_ranks():
    import contextlib
    import io
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        rc = bench_fsdp.main(["--tp", "1", "--ep", "2", "--layers", "1", "--hidden", "16", "--experts", "4",
                              "--batch", "1"])
    return rc, text.getvalue()


def test_fsdp_bench_prints_both_ways_on_two_gloo_ranks():
    (rc0, text), (rc1, other) = run_ranks(_fsdp_main_on_ranks, 2)
    assert rc0 == rc1 == 0 and other == ""   # rank 0 prints
    head, cols, *rows = text.splitlines()
    assert head == "world 2: tp 1 ep 2 (dp 2, edp 1); GPT layers 1 hidden 16 experts 4"
    assert cols.split()[:5] == ["way", "params", "grads", "optimizer", "total"]
    mib = {r.split()[0]: [float(v) for v in r.split()[1:]] for r in rows}
    assert list(mib) == ["fully_shard", "allreduce_gradients"]
    for params, grads, opt, total in mib.values():
        assert params == grads > 0 and abs(opt - 2 * params) <= 0.011 and abs(total - 4 * params) <= 0.021
    # dp 2: fully_shard holds about half the dense state of allreduce_gradients (edp 1: the
    # experts are split by EP only, the same bytes both ways).
    assert mib["fully_shard"][3] < mib["allreduce_gradients"][3]


def test_fsdp_bench_wants_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        bench_fsdp.parse_args([])


def _argmax_rounds(key, k):
    """The obvious top-k with lower-index ties: k rounds of argmax (first maximal index)."""
    key = key.clone()
    ids = []
    for _ in range(k):
        i = key.argmax(-1, keepdim=True)
        ids.append(i)
        key.scatter_(1, i, float("-inf"))
    return torch.cat(ids, 1)


@pytest.mark.parametrize("E,k", [(5, 1), (8, 2), (8, 8), (64, 8)])
def test_router_cpu_path_ties_go_to_the_lower_index(E, k):
    from moepar_kernels import routing as rk
    gen = torch.Generator().manual_seed(E * k)
    logits = torch.randint(0, 3, (257, E), generator=gen).float()   # many exact ties
    logits[0] = 1.0                                                    # a row of equal keys
    ids, w, hist = rk.routing_reference(logits, k)
    assert torch.equal(ids, _argmax_rounds(logits, k))
    assert torch.equal(hist, torch.bincount(ids.flatten(), minlength=E))
    assert torch.allclose(w, torch.softmax(logits, -1).gather(1, ids))


@pytest.mark.parametrize("activation,bias", [("gelu", False), ("swiglu", True), ("relu", True)])
@pytest.mark.parametrize("path", ["loop", "grouped_mm", "bmm"])
def test_experts_in_many_segments_match_per_expert_autograd(monkeypatch, activation, bias, path):
    from moepar.moe import cpu
    from moepar.moe.experts import function as experts_fn
    from moepar.moe.experts.grouped import GroupedExperts
    monkeypatch.setattr(cpu, "SEGMENT_BYTES", 1)    # every expert a segment of its own
    counts = [3, 0, 7, 1, 0, 5]
    m = GroupedExperts(6, 8, 16, activation, bias, init_seed=3, gemm_path=path)
    assert len(experts_fn.expert_segments(counts, 16 * 4, cpu.SEGMENT_BYTES)) == 6
    x = torch.randn(sum(counts), 8, requires_grad=True)
    g = torch.randn(sum(counts), 8)
    params = list(m.parameters())
    if path == "grouped_mm" and not hasattr(torch.nn.functional, "grouped_mm"):   # torch 2.8, 2.9
        with pytest.raises(ValueError, match="has no torch.nn.functional.grouped_mm"):
            m(x, counts)
        return
    got = torch.autograd.grad(m(x, counts), [x] + params, g)
    outs, s = [], 0
    for e, c in enumerate(counts):
        xe = x[s:s + c]
        s += c
        h1 = xe @ m.w1[e] + (m.b1[e] if bias else 0)
        if activation == "swiglu":
            a = torch.nn.functional.silu(h1) * (xe @ m.w3[e] + (m.b3[e] if bias else 0))
        else:
            a = torch.nn.functional.gelu(h1) if activation == "gelu" else torch.relu(h1)
        outs.append(a @ m.w2[e] + (m.b2[e] if bias else 0))
    want = torch.autograd.grad(torch.cat(outs), [x] + params, g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)


def test_bench_entry_usage_and_unknown_mode(capsys, monkeypatch):
    from moepar import bench
    assert bench.main(["--help"]) == 0
    assert "no mode" in capsys.readouterr().out
    assert bench.main(["nope"]) == 2
    ran = []
    monkeypatch.setattr(bench, "_run", lambda mode, argv: ran.append(mode) or 0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert bench.main([]) == 0 and ran == list(bench.SINGLE_PROCESS)
    ran.clear()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert bench.main([]) == 0 and ran == ["dispatch"]
    assert "fsdp" in bench.MODES and "fsdp" not in bench.SINGLE_PROCESS

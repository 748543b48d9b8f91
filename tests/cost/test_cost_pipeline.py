"""Pipeline stages in the cost model: the schedules' bubbles against their published formulas,
the point-to-point sends and receives against a slow hand count, where a stage boundary
runs (NVLink or the network), stage memory, bad input, recommend's pp search, and the run
report of one stage fed with the model's own events."""
import dataclasses

import pytest

from moepar.cost import CostLayout, MoESpec, get_hardware, step_cost
from moepar.cost import cli
from moepar.cost.search import recommend
from moepar.cost.pipeline import boundary_placement, p2p_calls, stage_cost, stage_spec
from moepar.cost.run_report import compare_run
from moepar.cost.schedules import (SCHEDULES, bubble_fraction, bubble_units, check_pipeline, in_flight)

H100 = get_hardware("h100")


def spec(**kw):
    base = dict(hidden=256, ffn=512, experts=8, topk=2, tokens=1024, layers=8, heads=8, vocab=1000,
                micro_batches=8)
    return MoESpec(**{**base, **kw})


# ---- bubbles: the formulas written out again ---------------------------------------------

@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (8, 32), (16, 120)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    for s in ("gpipe", "1f1b"):
        assert bubble_fraction(s, p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 3)])
def test_interleaved_bubble_time_is_1f1b_over_v(p, m, v):
    assert bubble_units("interleaved", p, v) == pytest.approx(bubble_units("1f1b", p) / v)
    assert bubble_fraction("interleaved", p, m, v) == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))


def test_zero_bubble_and_dualpipev_follow_their_papers():
    # ZB-H1 (Qi et al.): (p-1)(F + B - W) with F = B = W = t/3; interleaved: over v
    for p, v in ((4, 1), (4, 2), (8, 2)):
        t = 1.0
        F = B = W = t / 3
        assert bubble_units("zb", p, v) == pytest.approx((p - 1) * (F + B - W) / v)
    # DualPipe README / DeepSeek-V3 table 2: (PP/2 - 1)(F&B + B - 3W), PP = 2p chunks of t/2
    for p in (2, 4, 16):
        PP = 2 * p
        F, Bfull, W = 1 / 6, 1 / 3, 1 / 6
        assert bubble_units("dualpipev", p, 2) == pytest.approx((PP / 2 - 1) * ((F + Bfull) + Bfull - 3 * W))
    assert bubble_units("dualpipev", 16, 2) < bubble_units("1f1b", 16)
    assert bubble_units("zbv", 8, 2) == 0   # ZB-V: zero with T_F = T_B = T_W (Sea AI Lab's README)


def test_step_time_adds_the_bubble_of_the_slowest_stage():
    lay = CostLayout(16, 8, ep=2, pp=2)
    c = step_cost(spec(), lay, H100)
    assert c.pipeline.bubble_fraction == pytest.approx(1 / 9)
    assert c.bubble_time == pytest.approx(1 * c.microbatch_time)
    assert c.step_time == pytest.approx(c.comm_per_step + c.compute_per_step + c.bubble_time + c.optimizer_time)
    assert c.microbatch_time == max(s.microbatch_time for s in c.pipeline.stages)


# ---- point-to-point: a slow hand count ----------------------------------------------------

def hand_p2p(p, v, schedule, stage, nbytes):
    """(op, phase, nbytes) per micro-batch, from a list of every chunk's rank."""
    chunks = p * v
    if schedule in ("dualpipev", "zbv"):
        owner = list(range(p)) + list(reversed(range(p)))   # a V
    else:
        owner = [k % p for k in range(chunks)]
    out = []
    for k in range(chunks):
        if owner[k] != stage:
            continue
        if k > 0 and owner[k - 1] != stage:
            out += [("recv", "fwd", nbytes), ("send", "bwd", nbytes)]
        if k < chunks - 1 and owner[k + 1] != stage:
            out += [("send", "fwd", nbytes), ("recv", "bwd", nbytes)]
    return sorted(out)


@pytest.mark.parametrize("pp,vp,schedule", [(2, 1, "1f1b"), (4, 1, "gpipe"), (2, 2, "interleaved"),
                                            (4, 2, "zb"), (4, 2, "dualpipev"), (2, 2, "dualpipev"),
                                            (4, 2, "zbv")])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_p2p_calls_and_bytes_match_a_hand_count(pp, vp, schedule, tp, sp):
    s = spec(micro_batches=16)
    lay = CostLayout(8 * pp, 8, tp=tp, ep=2, sp=sp, pp=pp, vp=vp, schedule=schedule)
    nbytes = 1024 * 256 * 2 // (tp if sp else 1)   # T·D·b, T/tp with sequence parallelism
    total = 0
    for stage in range(pp):
        got = sorted((c.op, c.phase, c.nbytes) for c in p2p_calls(stage_spec(s, lay, stage), lay, H100, stage))
        assert got == hand_p2p(pp, vp, schedule, stage, nbytes)
        total += len(got)
    # every boundary between two ranks: 4 calls (2 on each side); DualPipeV's turn is local
    boundaries = pp * vp - 1 - (1 if schedule in ("dualpipev", "zbv") else 0)
    assert total == 4 * boundaries


def test_p2p_counts_per_step_are_micro_batches_times_calls():
    s = spec(micro_batches=6)
    lay = CostLayout(16, 8, ep=2, pp=2)
    c = stage_cost(s, lay, H100, 0)
    from moepar.cost.accounting import calls_per_step
    assert [calls_per_step(x, c.spec) for x in c.p2p] == [6, 6]


def test_boundary_runs_on_nvlink_inside_a_node_and_on_the_network_across():
    # 8 GPUs per node, 4 per stage: stages 0 and 1 share node 0; stages 1 and 2 do not
    lay = CostLayout(16, 8, pp=4)
    assert boundary_placement(lay, 0, 1).nodes == 1
    assert boundary_placement(lay, 1, 2).nodes == 2
    # a full node per stage: every boundary crosses the network, and costs more
    lay8 = CostLayout(16, 8, pp=2)
    assert boundary_placement(lay8, 0, 1).nodes == 2
    s = spec(micro_batches=4)
    near = p2p_calls(stage_spec(s, lay, 0), lay, H100, 0)
    far = p2p_calls(stage_spec(s, lay8, 0), lay8, H100, 0)
    assert all("NVLink" in c.name for c in near) and all("network" in c.name for c in far)
    assert near[0].seconds < far[0].seconds


# ---- stages, memory ---------------------------------------------------------------------

def test_stages_hold_their_blocks_and_the_model_ends():
    s = spec(layers=8, dense_layers=4, moe_layer_ids=(1, 3, 5, 7))
    lay = CostLayout(16, 8, pp=2)
    first, last = stage_spec(s, lay, 0), stage_spec(s, lay, 1)
    assert (first.layers, first.moe_layers, first.first_stage, first.last_stage) == (4, 2, True, False)
    assert (last.layers, last.moe_layers, last.first_stage, last.last_stage) == (4, 2, False, True)
    # DualPipeV: rank 0 holds the first and the last chunk
    v = stage_spec(s.replace(micro_batches=8), CostLayout(16, 8, pp=2, vp=2, schedule="dualpipev"), 0)
    assert v.first_stage and v.last_stage


def test_1f1b_keeps_p_micro_batches_on_the_first_stage_and_params_split():
    s = spec(micro_batches=16)
    assert [in_flight("1f1b", 4, 16, 1, st) for st in range(4)] == [4, 3, 2, 1]
    assert in_flight("gpipe", 4, 16) == 16
    lay1, lay4 = CostLayout(32, 8, ep=2), CostLayout(32, 8, ep=2, pp=4)
    c1 = step_cost(s, lay1, H100)
    st0 = stage_cost(s, lay4, H100, 0)
    st3 = stage_cost(s, lay4, H100, 3)
    from moepar.cost.step import price_stage
    one = price_stage(stage_spec(s, lay4, 0), lay4, H100, 0.45)   # one micro-batch's activations
    assert st0.memory.activations == pytest.approx(4 * one.memory.activations)
    assert st3.memory.activations < st0.memory.activations
    assert st0.params.expert_rank == c1.params.expert_rank // 4
    # the whole model's FLOPs per token (MFU), not one stage's
    assert step_cost(s, lay4, H100).flops.per_token == c1.flops.per_token


# ---- bad input: the value and the rule ------------------------------------------------------

@pytest.mark.parametrize("kw,words", [
    (dict(gpus=12, gpus_per_node=4, pp=8), ["gpus=12", "pp=8", "valid pp: 1, 2, 3, 4, 6, 12"]),
    (dict(gpus=16, pp=2, schedule="looped"), ["schedule='looped'", "gpipe, 1f1b, interleaved, zb, zbv, dualpipev"]),
    (dict(gpus=16, pp=2, vp=2, schedule="1f1b"), ["vp=2", "one stage per rank"]),
    (dict(gpus=16, pp=2, vp=3, schedule="dualpipev"), ["vp=3", "exactly 2"]),
])
def test_bad_layouts_name_the_value_and_the_rule(kw, words):
    with pytest.raises(ValueError) as e:
        CostLayout(**kw)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("schedule,pp,m,vp,words", [
    ("1f1b", 4, 3, 1, ["micro_batches=3 < pp=4"]),
    ("dualpipev", 4, 6, 2, ["micro_batches=6 < 2 x pp = 8"]),
    ("interleaved", 4, 9, 2, ["micro_batches=9", "rounds"]),
    ("interleaved", 4, 3, 2, ["micro_batches=3 < pp=4"]),
])
def test_too_few_micro_batches_for_the_schedule(schedule, pp, m, vp, words):
    with pytest.raises(ValueError) as e:
        step_cost(spec(micro_batches=m), CostLayout(8 * pp, 8, pp=pp, vp=vp, schedule=schedule), H100)
    assert all(w in str(e.value) for w in words), str(e.value)
    check_pipeline(pp, 1, "gpipe", 1)   # GPipe runs any number


def test_layers_must_cover_every_chunk_and_the_run_report_needs_an_even_split():
    with pytest.raises(ValueError, match=r"pp x vp = 4 x 2 = 8 model chunks > layers=6"):
        step_cost(spec(layers=6), CostLayout(32, 8, pp=4, vp=2, schedule="interleaved"), H100)
    with pytest.raises(ValueError, match=r"layers=6 is not divisible by pp x vp = 4 x 1 = 4"):
        compare_run(spec(layers=6), CostLayout(32, 8, pp=4), H100, [], 1)
    with pytest.raises(ValueError, match=r"pipeline_stage=2 must be a stage index in 0..1"):
        compare_run(spec(), CostLayout(16, 8, pp=2), H100, [], 1, pipeline_stage=2)


def test_cli_report_prices_the_pipeline_and_refuses_bad_values(capsys):
    assert cli.report_main(["--hidden", "256", "--ffn", "512", "--experts", "8", "--topk", "2", "--layers", "4",
                            "--gpus", "16", "--pp", "2", "--microbatches", "4", "--schedule", "gpipe"]) == 0
    out = capsys.readouterr().out
    assert "Point-to-point per micro-batch" in out and "Pipeline stages (gpipe, pp=2" in out
    assert cli.report_main(["--hidden", "256", "--ffn", "512", "--experts", "8", "--topk", "2", "--layers", "4",
                            "--gpus", "16", "--pp", "2", "--microbatches", "1", "--schedule", "1f1b"]) == 2
    assert "micro_batches=1 < pp=2" in capsys.readouterr().err


# ---- recommend searches pp -------------------------------------------------------------------

def test_recommend_searches_pipeline_sizes():
    s = spec(layers=8, tokens=1024, micro_batches=1)
    cands = recommend(s, 16, H100, zero_stages=(1,), pp_sizes=(1, 2, 4), global_tokens=64 * 1024)
    pps = {c.cost.layout.pp for c in cands}
    assert pps == {1, 2, 4}
    for c in cands:
        if c.cost.layout.pp > 1:
            assert c.cost.spec.micro_batches * 0 == 0 and c.cost.pipeline.micro_batches >= c.cost.layout.pp


def test_recommend_cli_find_prints_the_rank(capsys):
    argv = ["--hidden", "256", "--ffn", "512", "--experts", "8", "--topk", "2", "--layers", "8", "--tokens", "1024",
            "--gpus", "16", "--zero", "1", "--pp", "1,2", "--global-tokens", "65536", "--find", "pp=2,ep=8"]
    assert cli.recommend_main(argv) == 0
    out = capsys.readouterr().out
    assert "--find pp=2,ep=8: the best such layout ranks #" in out and " pp " in out.splitlines()[1]
    assert cli.recommend_main(argv[:-2] + ["--pp", "3"]) == 2
    assert "valid: 1, 2, 4, 8" in capsys.readouterr().err


# ---- the run report of one stage ---------------------------------------------------------------

@dataclasses.dataclass
class Event:
    op: str
    group_size: int
    nbytes: float
    seconds: float
    backward: bool
    wait_seconds: float = 0.0


def model_events(s, lay, stage, steps):
    """The events a rank of ``stage`` would record if the run issued what the model lists."""
    from moepar.cost.accounting import calls_per_step
    c = stage_cost(s, lay, H100, stage)
    out = []
    for call in c.layer + c.step + list(c.p2p):
        for _ in range(calls_per_step(call, c.spec) * steps):
            out.append(Event(call.op, call.group_size, call.nbytes, 1e-4, call.phase == "bwd"))
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_compare_run_at_each_stage_is_exact_with_the_models_events(stage):
    s = spec(layers=4, tokens=512, micro_batches=4, clip_grad=True, loss_allreduce=True, qkv_linears=3)
    lay = CostLayout(4, 8, tp=1, ep=2, pp=2, schedule="gpipe")
    rows = compare_run(s, lay, H100, model_events(s, lay, stage, 2), 2, pipeline_stage=stage)
    assert {r.op for r in rows} >= {"send", "recv", "all_to_all"}
    for r in rows:
        assert (r.calls, r.nbytes) == (r.model_calls, r.model_bytes), r
    p2p = {(r.op, r.phase): r.calls for r in rows if r.op in ("send", "recv")}
    # stage 0 sends activations and receives their gradients; stage 1 the mirror; m = 4, 2 steps
    expect = {("send", "fwd"): 8, ("recv", "bwd"): 8} if stage == 0 else {("recv", "fwd"): 8, ("send", "bwd"): 8}
    assert p2p == expect
    # the other stage's events do not match this stage's model
    other = compare_run(s, lay, H100, model_events(s, lay, 1 - stage, 2), 2, pipeline_stage=stage)
    assert any((r.calls, r.nbytes) != (r.model_calls, r.model_bytes) for r in other)


def test_recommend_find_says_why_a_pipelined_layout_was_not_ranked(capsys):
    argv = ["--hidden", "256", "--ffn", "512", "--experts", "8", "--topk", "2", "--layers", "8", "--tokens", "1024",
            "--gpus", "16", "--zero", "1", "--pp", "1,8", "--global-tokens", "8192", "--find", "pp=8,tp=1,ep=2"]
    assert cli.recommend_main(argv) == 0
    out = capsys.readouterr().out
    assert "pipelined layouts left out" in out
    assert "--find pp=8,tp=1,ep=2: not ranked" in out and "runs 4 micro-batch(es) of 1024 tokens" in out
    assert "micro_batches=4 < pp=8" in out


def test_every_schedule_has_a_bubble_and_a_memory_rule():
    for s in SCHEDULES:
        vp = 2 if s in ("interleaved", "zb", "zbv", "dualpipev") else 1
        assert 0 <= bubble_fraction(s, 4, 8, vp) < 1
        assert 1 <= in_flight(s, 4, 8, vp, 0) <= 8


def test_report_json_and_measured_vs_predicted_carry_the_stage_boundaries(tmp_path):
    import json
    from moepar.cost.report import build_report, to_json
    from moepar.cost.run_report import measured_vs_predicted
    s = spec(layers=4, tokens=512, micro_batches=4)
    lay = CostLayout(16, 8, ep=2, pp=2, schedule="gpipe")
    rep = json.loads(to_json(build_report(step_cost(s, lay, H100))))
    assert rep["pipeline"]["bubble_fraction"] == pytest.approx(1 / 5)
    assert [s_["stage"] for s_ in rep["pipeline"]["stages"]] == [0, 1]
    assert {c["op"] for c in rep["p2p"]} == {"send", "recv"}
    assert rep["time"]["bubble"] > 0 and rep["layout"]["pp"] == 2
    text = measured_vs_predicted(s, lay, H100, model_events(s, lay, 0, 1), steps=1)
    assert "send" in text and "recv" in text


# ---- against torch's schedules: what moepar's Pipeline records ----------------------------------

MB_ROWS, SEQ, D_TINY, L_TINY = 2, 3, 8, 4


def _runtime_events(schedule, v, micro, tp):
    """One step of a 4-block linear model on torch's schedule through moepar's Pipeline: the
    send/recv events it records, and the pipeline-group all-reduces."""
    import torch

    import moepar
    from moepar.parallel import comm, pipeline
    state = moepar.init_parallel(tp, 1, pipeline_parallel_size=2, virtual_pipeline_size=v)
    num = pipeline.check_pipeline(schedule, 2, micro, L_TINY, v)
    ids = pipeline.stage_ids(state.pp_rank, 2, schedule, v)
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(D_TINY, D_TINY) for _ in range(L_TINY)]
    chunks = [pipeline.cut_blocks(blocks, i, num) for i in ids]
    # static shapes: a gradient crosses every boundary backwards (requires_grad), not into chunk 0
    hidden = torch.zeros(MB_ROWS, SEQ, D_TINY, requires_grad=True)
    inputs = [torch.zeros(MB_ROWS, SEQ, D_TINY) if i == 0 else hidden for i in ids]
    pipe = pipeline.Pipeline(chunks, schedule, micro, lambda out, target: ((out - target) ** 2).mean(),
                             inputs, [hidden] * len(chunks), state)
    x = torch.randn(micro * MB_ROWS, SEQ, D_TINY)
    with comm.track() as tracked:
        pipe.step(x, torch.zeros_like(x))
    return state.pp_rank, sorted((e.op, e.group_size, e.nbytes, e.backward) for e in tracked.events
                                 if e.op in ("send", "recv") or e.group_size == 2 and e.op == "all_reduce"
                                 and tp == 1)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 2), ("zbv", 2),
                                        ("dualpipev", 2)])
def test_the_models_p2p_calls_are_what_torchs_schedules_send(schedule, v):
    from moepar.cost.accounting import calls_per_step
    from ..helpers.multiproc import run_ranks
    micro = 4
    results = run_ranks(_runtime_events, 2, schedule, v, micro, 1)
    s = spec(hidden=D_TINY, tokens=MB_ROWS * SEQ, layers=L_TINY, dtype="fp32", micro_batches=micro, vocab=0,
             heads=None)
    lay = CostLayout(2, 8, pp=2, vp=v, schedule=schedule)
    for stage, events in results:
        c = stage_cost(s, lay, H100, stage)
        want = []
        for call in list(c.p2p) + [x for x in c.step if x.group == "pp"]:
            want += [(call.op, call.group_size, call.nbytes, call.phase == "bwd")] * calls_per_step(call, c.spec)
        assert events == sorted(want), (stage, schedule)

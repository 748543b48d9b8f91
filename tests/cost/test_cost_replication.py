"""Pricing expert replication (``moepar.cost.replication``): the copies a rank sends
and receives, the replica all-to-alls' bytes and time, the received rows, the memory, against
slow obvious references; ``report`` and ``recommend`` with replication on DeepSeek-V3; bad
input; the run report's replica rows fed a synthetic placement."""
import dataclasses
import math

import pytest

from moepar.__main__ import main
from moepar.cost import CostLayout, MoESpec, get_hardware, step_cost
from moepar.cost.accounting import calls_per_step
from moepar.cost.architectures import MODELS
from moepar.cost.routes import imbalance_from_counts, routes_per_rank
from moepar.cost.replication import (expert_slice_params, receive_cap_drops, replica_copies_per_forward,
                                     replica_plan, replica_received, replica_sent, zipf_loads)
from moepar.cost.run_report import compare_run
from moepar.moe.replication.placement import plan_placement

H100 = get_hardware("h100")
LOADS = (40.0, 3, 2, 1, 9, 1, 1, 1, 12, 2, 2, 2, 5, 5, 5, 5)


def small(**kw):
    base = dict(hidden=64, ffn=96, experts=16, topk=2, tokens=512, layers=3, expert_loads=LOADS,
                redundant_experts=4)
    return MoESpec(**{**base, **kw})


def _sent_reference(p, rank):
    """Slow and obvious: walk every copy, count those of rank's home experts held elsewhere."""
    L = p.num_experts // p.ep_size
    return sum(1 for e in range(p.num_experts) for c in p.copies[e] if e // L == rank and c.rank != rank)


def _received_reference(p, rank):
    L = p.num_experts // p.ep_size
    return sum(1 for e in range(p.num_experts) for c in p.copies[e] if c.rank == rank and e // L != rank)


@pytest.mark.parametrize("E, R, ep, loads", [(16, 4, 4, LOADS), (16, 8, 4, zipf_loads(16, 1.5)),
                                             (8, 8, 2, [1] * 8), (12, 6, 3, list(range(12))), (8, 0, 4, [3] * 8)])
def test_copies_sent_and_received_equal_a_walk_over_the_copies(E, R, ep, loads):
    p = plan_placement(loads, E, R, ep)
    sent = [replica_sent(p, r) for r in range(ep)]
    got = [replica_received(p, r) for r in range(ep)]
    assert sent == [_sent_reference(p, r) for r in range(ep)]
    assert got == [_received_reference(p, r) for r in range(ep)]
    assert sum(sent) == sum(got)           # every remote copy leaves one rank and reaches another
    assert replica_copies_per_forward([p, None, p], 0) == 2 * sent[0]
    if R == 0:
        assert sum(sent) == 0


def test_expert_slice_params_by_hand():
    assert expert_slice_params(small(), 1) == 3 * 64 * 96
    assert expert_slice_params(small(), 2) == 3 * 64 * 48
    assert expert_slice_params(small(gated=False), 4) == 2 * 64 * 24
    assert expert_slice_params(small(expert_bias=True), 2) == 3 * 64 * 48 + 2 * 48 + 64   # b1, b3 sliced; b2 whole


def test_received_rows_follow_the_plan_and_r0_equals_the_contiguous_imbalance():
    lay = CostLayout(4, 8, ep=4)
    plan = replica_plan(small(), lay)
    ref = plan_placement(LOADS, 16, 4, 4)
    assert plan.imbalance == pytest.approx(max(ref.rank_loads()) / (sum(ref.rank_loads()) / 4))
    assert routes_per_rank(small(), lay).max == pytest.approx(512 * 2 * plan.imbalance)
    r0 = routes_per_rank(small(redundant_experts=0), lay)
    assert r0.max == pytest.approx(512 * 2 * imbalance_from_counts(LOADS, 4))
    assert plan.imbalance_unreplicated == pytest.approx(imbalance_from_counts(LOADS, 4))
    assert plan.imbalance < plan.imbalance_unreplicated


@pytest.mark.parametrize("etp", [1, 2])
def test_replica_calls_bytes_time_and_memory_by_hand(etp):
    spec, lay = small(), CostLayout(4 * etp, 8, ep=4, etp=etp)
    cost = step_cost(spec, lay, H100)
    plan = replica_plan(spec, lay)
    busiest = max(max(plan.sent), max(plan.received))
    slice_bytes = expert_slice_params(spec, etp) * 2                      # bf16 weights
    rows = {c.name: c for c in cost.layer if "replica" in c.name}
    assert set(rows) == {"MoE replica weights", "MoE replica grads"}
    pl = lay.placement("ep")
    for c in rows.values():
        assert (c.op, c.group, c.group_size, c.nbytes) == ("all_to_all", "ep", 4, busiest * slice_bytes)
        assert c.sent == pytest.approx(busiest * slice_bytes)            # nothing to itself
        assert c.seconds == pytest.approx(H100.collective_time("all_to_all", pl, busiest * slice_bytes * 4 / 3))
        assert calls_per_step(c, spec.replace(micro_batches=5)) == 3 * 5   # every MoE layer, every micro-batch
    m = cost.memory
    assert m.replica_weights == 3 * max(plan.received) * slice_bytes
    assert m.replica_grads == max(plan.received) * slice_bytes
    base = step_cost(spec.replace(redundant_experts=0), lay, H100)
    assert m.total - base.memory.total == pytest.approx(m.replica_weights + m.replica_grads
                                                        + m.activations - base.memory.activations)
    assert not [c for c in base.layer if "replica" in c.name]


def test_receive_cap_drops_by_hand():
    # ranks of 4 experts: 46, 12, 18, 20 (total 96, mean 24); f = 1.2 caps at 28.8
    assert receive_cap_drops(LOADS, 4, 1.2) == pytest.approx((46 - 28.8) / 96)
    assert receive_cap_drops(LOADS, 4, 2.0) == 0.0
    assert receive_cap_drops([1] * 8, 2, 1.0) == 0.0


DSV3 = ["--model", "deepseek-v3", "--hardware", "h800", "--tokens", "4096", "--seq-len", "4096", "--dtype", "fp8"]


def test_report_with_replication_on_deepseek_v3(capsys):
    args = ["report", *DSV3, "--gpus", "256", "--ep", "64", "--zero", "1", "--zipf", "0.3", "--redundant-experts", "64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "redundant experts=64" in out and "== Expert replication: X=64" in out
    assert "MoE replica weights" in out and "MoE replica grads" in out
    spec = MoESpec(tokens=4096, seq_len=4096, dtype="fp8", **MODELS["deepseek-v3"],
                   expert_loads=tuple(zipf_loads(256, 0.3)), redundant_experts=64)
    plan = replica_plan(spec, CostLayout(256, 8, ep=64, zero=1))
    assert plan.imbalance < 1.01 < 2.9 < plan.imbalance_unreplicated     # Zipf 0.3: rank 0 holds the 4 hottest
    assert f"{plan.imbalance_unreplicated:.3g}" in out


def test_recommend_compares_replication_with_the_alternatives(capsys):
    args = ["recommend", *DSV3, "--gpus", "256", "--zero", "1", "--pp", "1", "--zipf", "0.3",
            "--redundant-experts", "64", "--top", "3", "--memory-gib", "200"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "replication against the alternatives" in out
    for needle in ("replication X=64 on", "X=0", "receive cap f=", "best expert-TP, X=0", "dropped"):
        assert needle in out, needle
    assert " X " in out.splitlines()[1] and "max/mean" in out.splitlines()[1]


MIX = ["--model", "mixtral-8x7b", "--tokens", "4096", "--gpus", "16"]


@pytest.mark.parametrize("args, needle", [
    (["report", *MIX, "--ep", "8", "--redundant-experts", "4"],
     "redundant_experts=4 is not divisible by ep_size=8 (every EP rank holds the same number of extra slots)"),
    (["report", *MIX, "--ep", "2", "--redundant-experts", "10"],
     "redundant_experts=10 > num_experts x (ep_size - 1) = 8 x 1"),
    (["report", *MIX, "--ep", "8", "--imbalance", "1.3", "--redundant-experts", "8"],
     "--imbalance 1.3 cannot be combined with --redundant-experts 8"),
    (["report", *MIX, "--ep", "8", "--zipf", "-1"], "--zipf -1.0 must be a finite number >= 0"),
    (["report", *MIX, "--ep", "8", "--zipf", "1", "--routing-counts", "1,2,3,4,5,6,7,8"],
     "pass --routing-counts or --zipf, not both"),
    (["report", *MIX, "--ep", "8", "--redundant-experts", "-8"], "--redundant-experts '-8' must be integers >= 0"),
    (["report", *MIX, "--ep", "8", "--redundant-experts", "8,16"], "report prices one R"),
])
def test_bad_replication_input_exits_2_with_one_line(capsys, args, needle):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


@dataclasses.dataclass
class Event:   # the fields of moepar.parallel.comm.CommEvent that the run report reads
    op: str
    group_size: int
    backward: bool
    nbytes: float
    seconds: float = 1e-3
    wait_seconds: float = 0.0


def _events(cost, steps, copies_per_forward):
    """What a rank would record: the model's calls, the replica ones carrying its own copies."""
    slice_bytes = expert_slice_params(cost.spec, cost.layout.etp) * cost.spec.b
    out = []
    for c in cost.layer + cost.step:
        nbytes = copies_per_forward // cost.spec.moe_layers * slice_bytes if "replica" in c.name else c.nbytes
        out += [Event(c.op, c.group_size, c.phase == "bwd", nbytes)] * (calls_per_step(c, cost.spec) * steps)
    return out


def test_run_report_accounts_the_replica_rows_exactly_from_a_placement():
    spec = small(expert_loads=None, dtype="fp32", micro_batches=2, layers=2)
    lay, steps = CostLayout(4, 8, ep=4), 3
    p = plan_placement(LOADS, 16, 4, 4)          # the run's (synthetic) placement, every layer alike
    cost = step_cost(spec, lay, H100)
    for rank in range(4):
        per_forward = replica_copies_per_forward([p, p], rank)
        total = per_forward * spec.micro_batches * steps
        rows = compare_run(spec, lay, H100, _events(cost, steps, per_forward), steps, replica_copies=total)
        assert all((r.calls, r.nbytes) == (r.model_calls, r.model_bytes) for r in rows), (rank, rows)
        a2a = [r for r in rows if r.op == "all_to_all"]
        assert a2a and all(math.isfinite(r.model_seconds) and r.model_seconds > 0 for r in a2a)
    # another rank's count does not match: the replica bytes are in the all-to-all rows
    sent = [replica_sent(p, r) for r in range(4)]
    a, b = max(range(4), key=sent.__getitem__), min(range(4), key=sent.__getitem__)
    assert sent[a] != sent[b]
    rows = compare_run(spec, lay, H100, _events(cost, steps, 2 * sent[a]), steps,
                       replica_copies=2 * sent[b] * spec.micro_batches * steps)
    assert any((r.calls, r.nbytes) != (r.model_calls, r.model_bytes) for r in rows)
    with pytest.raises(ValueError, match="replica_copies=5 needs spec.redundant_experts > 0"):
        compare_run(spec.replace(redundant_experts=0), lay, H100, [], 1, replica_copies=5)

"""The layer's collectives table (``moepar.moe.traffic``) against what the layer records.

Four gloo ranks; per layout and option, every collective a forward and its backward issue
(op, group size, phase, bytes) as ``moe.stats.comm`` records them equals the table's list,
computed from the rows this rank actually sent (its EP group's counts, in ``moe.stats.load``)
and the rows its expert-TP group gathered; the cost model prices the same table.
"""
import collections

import pytest
import torch.distributed as dist


from moepar.moe.exchange.dedup import dedup_rows
from moepar.moe.routing.router import capacity_of
from moepar.moe.traffic import LayerShape, layer_collectives, message_bytes
from moepar.parallel import init_parallel

from ..helpers import moe_ref
from ..helpers.multiproc import run_ranks

TOKENS = 6

CASES = {
    "ep4": ((1, 4, 1, False), {}),
    "ep4 shared": ((1, 4, 1, False), dict(num_shared_experts=1)),
    "tp2 ep2 shared": ((2, 2, 1, False), dict(num_shared_experts=1)),
    "tp2 ep2 SP shared": ((2, 2, 1, True), dict(num_shared_experts=1)),
    "ep2 etp2 shared bias": ((1, 2, 2, False), dict(num_shared_experts=1, bias=True)),
    "tp2 ep2 etp2": ((2, 2, 2, False), {}),
    "tp2": ((2, 1, 1, False), {}),
    "ep2 dedup": ((1, 2, 1, False), dict(num_experts=8, dedup="on")),
    "ep4 padded": ((1, 4, 1, False), dict(capacity_factor=1.0, min_capacity=1, pad_to_capacity=True)),
    "ep2 global aux, z": ((1, 2, 1, False), dict(aux_loss_scope="global", z_loss_coeff=1e-3)),
    "ep2 etp2 fp8 dispatch": ((1, 2, 2, False), dict(dispatch_dtype="fp8", num_shared_experts=1)),
    "ep4 dedup fp8 dispatch": ((1, 4, 1, False), dict(num_experts=8, dedup="on", dispatch_dtype="fp8")),
    "tp2 ep2 fp8 dispatch and combine grad": ((2, 2, 1, False), dict(dispatch_dtype="fp8", combine_grad_dtype="fp8")),
}


def _run(name):
    (tp, ep, etp, sp), kw = CASES[name]
    state = init_parallel(tp, ep, etp, verbose=False)
    moe = moe_ref.build(state, k=2, sequence_parallel=sp, **kw)
    x, g = moe_ref.replica_input(state.dp_rank, TOKENS * (tp if sp else 1))
    if sp:   # this rank's slice of its replica's tokens
        x, g = x.chunk(tp)[state.tp_rank], g.chunk(tp)[state.tp_rank]
    y = moe(x.requires_grad_())
    (y * g).sum().backward()
    events = sorted((e.op, e.group_size, "bwd" if e.backward else "fwd", e.nbytes) for e in moe.stats.comm.events)
    L, E = moe.num_local_experts, moe.num_experts
    load = moe.stats.load
    if moe.pad_to_capacity:
        capacity = capacity_of(moe.router.config, x.shape[0], True)
        rows = received = E // ep * capacity * ep    # every slot of every expert, each way
    elif kw.get("dedup") == "on":
        routing = moe.router(x.detach())
        per_peer = dedup_rows(routing.expert_ids, None, L, ep).tolist()   # rows to each EP peer
        everyone = [None] * ep
        dist.all_gather_object(everyone, per_peer, group=state.ep_group)
        rows, received = sum(per_peer), sum(row[state.ep_rank] for row in everyone)
    else:
        me = state.ep_rank
        rows = int(load.load_PE[me].sum()) if load is not None else TOKENS * 2
        received = int(load.received_P[me]) if load is not None else rows
    gathered = [None] * etp
    if etp > 1:
        dist.all_gather_object(gathered, received, group=state.etp_group)
    aux_group = {"global": "world" if sp else "dp", "local": "tp" if sp else None}[moe.aux_loss_scope]
    shape = dict(tp=tp, ep=ep, etp=etp, sp=sp, T=TOKENS * (tp if sp else 1), D=moe_ref.D,
                 K=2, E=E, rows=rows, received=received, etp_rows=sum(gathered) if etp > 1 else rows, b=4, b_dispatch=4,
                 b_combine=4, dedup=kw.get("dedup") == "on", padded=moe.pad_to_capacity,
                 shared=bool(kw.get("num_shared_experts")), aux_group=aux_group,
                 z_loss=kw.get("z_loss_coeff", 0) > 0, fp8_dispatch=kw.get("dispatch_dtype") == "fp8",
                 fp8_combine_grad=kw.get("combine_grad_dtype") == "fp8")
    sizes = {"dp": state.dp_size, "world": state.world_size}
    return events, shape, sizes


@pytest.mark.parametrize("names", [list(CASES)[:6], list(CASES)[6:]])
def test_recorded_collectives_equal_the_table(names):
    for name in names:
        for events, shape, sizes in run_ranks(_run, 4, name):
            s = LayerShape(**shape)
            table = layer_collectives(s, sizes)
            size_of = {"moe": s.block, "ep": s.ep, "etp": s.etp, "tp": s.tp, **sizes}
            want = sorted((c.op, size_of[c.group], c.phase, int(c.nbytes)) for c in table)
            assert collections.Counter(events) == collections.Counter(want), (name, events, want)


# ---- expert replication: the two replica rows -----------------------------------------

def replica_shape(placement, ep_rank: int, expert_slice_numel: int, param_bytes: int) -> dict:
    """The LayerShape fields of a layer with redundant experts, for EP rank ``ep_rank``: pass
    them with the rest (``LayerShape(**shape, **replica_shape(moe.placement, state.ep_rank,
    numel, 4))``). ``expert_slice_numel``: parameters of one expert's slice on this rank (w1,
    w3 if gated, w2, biases); ``placement``: ``moe.placement`` (None: no replication)."""
    if placement is None:
        return {}
    from moepar.cost.replication import replica_received, replica_sent
    return dict(redundant_experts=placement.redundant_experts, replica_sent=replica_sent(placement, ep_rank),
                replica_received=replica_received(placement, ep_rank),
                expert_bytes=expert_slice_numel * param_bytes)


def _shape(**kw):
    base = dict(tp=1, ep=4, etp=1, sp=False, T=6, D=8, K=2, E=8, rows=12, etp_rows=12, b=4, b_dispatch=4,
                b_combine=4)
    return LayerShape(**{**base, **kw})


@pytest.mark.parametrize("extra", [dict(), dict(tp=2, shared=True), dict(etp=2, etp_rows=24), dict(dedup=True)])
def test_replication_adds_exactly_two_rows_and_keeps_every_other(extra):
    from moepar.moe.replication.placement import plan_placement
    plain = layer_collectives(_shape(**extra))
    p = plan_placement([8, 1, 1, 1, 4, 1, 1, 1], 8, 4, 4)
    rep_fields = replica_shape(p, 0, expert_slice_numel=3 * 8 * 16, param_bytes=4)
    rep = layer_collectives(_shape(**extra, **rep_fields))
    # the counts message counts the E + X slots; every other row is unchanged
    kept = [c for c in rep if not c.name.startswith("MoE replica")]
    assert [c for c in kept if c.name != "MoE counts"] == [c for c in plain if c.name != "MoE counts"]
    for c in kept:
        if c.name == "MoE counts":
            shape = _shape(**extra)
            assert c.nbytes == message_bytes(8 + 4, shape.ep, shape.block)
    added = [c for c in rep if c.name.startswith("MoE replica")]
    sent, held = rep_fields["replica_sent"], rep_fields["replica_received"]
    assert sent >= 1   # expert 0, the hottest, lives on rank 0 and is copied elsewhere
    assert [(c.name, c.op, c.group, c.phase, c.step, c.nbytes) for c in added] == [
        ("MoE replica weights", "all_to_all", "ep", "fwd", "8", sent * 3 * 8 * 16 * 4),
        ("MoE replica grads", "all_to_all", "ep", "bwd", "8", held * 3 * 8 * 16 * 4)]
    # in the order they run: after the dispatch (and ETP gather), before the combine
    names = [c.name for c in rep if c.phase == "fwd"]
    assert names.index("MoE dispatch") < names.index("MoE replica weights") < names.index("MoE combine")


def test_replication_rows_are_issued_with_zero_bytes_and_not_without_an_ep_group():
    rows = layer_collectives(_shape(redundant_experts=4, replica_sent=0, expert_bytes=1000))
    assert [(c.name, c.nbytes) for c in rows if "replica" in c.name] == [("MoE replica weights", 0.0),
                                                                           ("MoE replica grads", 0.0)]
    assert not [c for c in layer_collectives(_shape(ep=1, redundant_experts=4, replica_sent=2, expert_bytes=10))
                if "replica" in c.name]
    assert replica_shape(None, 0, 10, 4) == {}


# docs/moe.md's summary table of the layer's collectives, per mode: (forward, backward) as
# {(op, group): count}. The table is prose; this keeps it equal to the data it summarizes.
_SUMMARY = [
    (dict(ep=1, tp=2, sp=True), {("all_gather", "moe"): 1}, {}),   # a block > 1 rank, no token exchange
    (dict(), {("all_gather", "moe"): 1, ("all_to_all", "ep"): 2}, {("all_to_all", "ep"): 2}),
    (dict(dedup=True), {("all_gather", "moe"): 1, ("all_to_all", "ep"): 3}, {("all_to_all", "ep"): 3}),
    (dict(ep=2, etp=2, etp_rows=24), {("all_gather", "moe"): 1, ("all_to_all", "ep"): 2, ("all_gather", "etp"): 1,
                                      ("reduce_scatter", "etp"): 1},
     {("all_to_all", "ep"): 2, ("all_gather", "etp"): 1, ("reduce_scatter", "etp"): 1}),
    (dict(ep=1, tp=2), {("all_gather", "moe"): 1, ("all_gather", "tp"): 1}, {("all_gather", "tp"): 2}),
    (dict(ep=1, tp=2, shared=True), {("all_gather", "moe"): 1, ("all_gather", "tp"): 1, ("all_reduce", "tp"): 1},
     {("all_gather", "tp"): 2, ("all_reduce", "tp"): 1}),
    (dict(ep=1, tp=2, sp=True, shared=True), {("all_gather", "moe"): 1, ("all_gather", "tp"): 1,
                                               ("reduce_scatter", "tp"): 1},
     {("all_gather", "tp"): 1, ("reduce_scatter", "tp"): 1}),
    (dict(padded=True), {("all_to_all", "ep"): 2}, {("all_to_all", "ep"): 2}),
    (dict(ep=1), {}, {}),
]


@pytest.mark.parametrize("extra, fwd, bwd", _SUMMARY)
def test_the_docs_summary_table_counts_what_the_table_lists(extra, fwd, bwd):
    calls = layer_collectives(_shape(**extra))
    for phase, want in (("fwd", fwd), ("bwd", bwd)):
        got = collections.Counter((c.op, c.group) for c in calls if c.phase == phase)
        assert dict(got) == want, (extra, phase)

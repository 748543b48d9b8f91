"""The rest of the Megatron + DeepSpeed recipe over moepar's layers: DeepSpeed's activation
checkpointing configured with moepar's state as its mpu, the engine's checkpoints, and its
flops profiler beside ``moepar report``. 4 gloo ranks, DeepSpeed's CPU accelerator."""
import pytest
import torch

import moepar

from ..helpers.multiproc import run_ranks
from .net import Net, batch, config, loss_of, make_optimizer, max_diff, quiet_deepspeed, reference, train_engine

pytest.importorskip("deepspeed")

STEPS = 3


def _recompute_on_ranks(tp, ep, partition):
    deepspeed = quiet_deepspeed()
    import moepar.deepspeed as mds
    state = moepar.init_parallel(tp, ep)
    deepspeed.init_distributed(dist_backend="gloo")   # DeepSpeed's comm over the gloo world
    deepspeed.checkpointing.configure(state, partition_activations=partition)
    out = {}
    init, ref, _ = reference(state, "adamw", STEPS)
    plain = Net(state)
    plain.load_state_dict(init)
    loss_of(plain, plain, *batch(0, state)).backward()
    for name, flavour in (("reentrant", deepspeed.checkpointing.checkpoint),
                          ("non-reentrant", deepspeed.checkpointing.non_reentrant_checkpoint)):
        model = Net(state, recompute=flavour)
        model.load_state_dict(init)
        # one forward and backward: every gradient, the aux loss and the counts against no recompute
        loss = loss_of(model, model, *batch(0, state))
        loss.backward()
        grads = max(float((p.grad - q.grad).abs().max())
                    for p, q in zip(model.parameters(), plain.parameters()))
        counted = torch.equal(model.moe.stats.tokens_per_expert, plain.moe.stats.tokens_per_expert)
        model.zero_grad(set_to_none=True)   # (no step taken: the weights are still init's)
        engine, *_ = mds.initialize(model=model, optimizer=make_optimizer("adamw", model.parameters()),
                                    config=config(2), mpu=state)
        train_engine(engine, STEPS)
        out[name] = grads, counted, max_diff(ref, engine.module)
    out["replay"] = _replay_orders(state, init, deepspeed.checkpointing.checkpoint)
    return out


def _replay_orders(state, init, flavour):
    """Gradients against no recompute (max abs difference) when another forward of the same
    token count runs between the checkpointed forward's routing and its recompute: a no_grad
    forward of another batch before the step, and two micro-batches forwarded before one
    backward of their summed losses."""
    def grads(recompute, run):
        model = Net(state, recompute=recompute)
        model.load_state_dict(init)
        run(model)
        return [p.grad.clone() for p in model.parameters()]

    def no_grad_first(model):
        with torch.no_grad():
            model(batch(7, state)[0])
        loss_of(model, model, *batch(0, state)).backward()

    def two_forwards(model):
        first = loss_of(model, model, *batch(0, state))
        (first + loss_of(model, model, *batch(1, state))).backward()

    return {name: max(float((a - b).abs().max()) for a, b in zip(grads(flavour, run), grads(None, run)))
            for name, run in (("no_grad forward first", no_grad_first), ("two forwards, one backward", two_forwards))}


@pytest.mark.parametrize("tp,ep,partition", [(1, 2, False), (2, 2, True)], ids=["tp1ep2", "tp2ep2-partitioned"])
def test_deepspeed_activation_checkpointing_is_exact_and_counts_once(tp, ep, partition):
    # DeepSpeed's checkpoint (its reentrant Function and its non-reentrant flavour) around the
    # block holding the MoE layer, configured with moepar's ParallelState as the mpu (and
    # partitioning the saved input over the TP group): the recompute routes as the forward
    # did and counts nothing twice, so gradients and a ZeRO-2 run equal no recompute.
    for rank, out in enumerate(_results(tp, ep, partition)):
        for name in ("reentrant", "non-reentrant"):
            grads, counted, trained = out[name]
            assert grads <= 1e-6 and counted, (rank, name, grads, counted)
            assert trained <= 1e-5, (rank, name, trained)


_RESULTS = {}


def _results(*case):
    if case not in _RESULTS:
        _RESULTS[case] = run_ranks(_recompute_on_ranks, 4, *case)
    return _RESULTS[case]


@pytest.mark.parametrize("order", ["no_grad forward first", "two forwards, one backward"])
def test_deepspeed_activation_checkpointing_replays_the_right_routing(order):
    # Another forward of the same token count between a checkpointed forward and its
    # recompute: DeepSpeed's reentrant checkpoint replays each forward's own routing (the
    # oldest-record rule moepar had gave 0.14 and 0.27 here).
    for rank, out in enumerate(_results(1, 2, False)):
        assert out["replay"][order] <= 1e-6, (rank, order, out["replay"][order])


def _perturbed(state):
    """A model whose every parameter differs from the initial one's: a load that missed a
    parameter shows."""
    model = Net(state)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


def _checkpoints_on_ranks(tp, ep, folder):
    quiet_deepspeed()
    import moepar.deepspeed as mds
    state = moepar.init_parallel(tp, ep)
    init, full, _ = reference(state, "adamw", 2 * STEPS)
    saved, out = {}, {}
    for stage in (0, 1, 2):   # STEPS steps, then the engine's checkpoint
        model = Net(state)
        model.load_state_dict(init)
        engine, *_ = mds.initialize(model=model, optimizer=make_optimizer("adamw", model.parameters()),
                                    config=config(stage), mpu=state)
        train_engine(engine, STEPS)
        engine.save_checkpoint(folder, tag=f"zero{stage}")
        saved[stage] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for before, after in ((0, 0), (1, 1), (2, 2), (1, 2), (2, 1)):   # load, then STEPS more steps
        model = _perturbed(state)
        engine, *_ = mds.initialize(model=model, optimizer=make_optimizer("adamw", model.parameters()),
                                    config=config(after), mpu=state)
        path, _ = engine.load_checkpoint(folder, tag=f"zero{before}")
        loaded = max_diff(saved[before], model)
        train_engine(engine, STEPS, start=STEPS)
        out[before, after] = path is not None, loaded, max_diff(full, model)
    if (tp, ep) == (1, 2):   # the same 4 ranks at ep4: a checkpoint of ep2's experts is refused by name
        state = moepar.init_parallel(1, 4)
        model = Net(state)
        engine, *_ = mds.initialize(model=model, optimizer=make_optimizer("adamw", model.parameters()),
                                    config=config(0), mpu=state)
        try:
            engine.load_checkpoint(folder, tag="zero0")
            out["other layout"] = None
        except ValueError as e:
            out["other layout"] = str(e)
    if (tp, ep) == (2, 2):   # tp2·ep1: DeepSpeed would leave TP rank 1's files unwritten; refused at save
        state = moepar.init_parallel(2, 1)
        model = Net(state)
        engine, *_ = mds.initialize(model=model, optimizer=make_optimizer("adamw", model.parameters()),
                                    config=config(1), mpu=state)
        try:
            engine.save_checkpoint(folder, tag="tp2ep1")
            out["tp not dividing ep"] = None
        except ValueError as e:
            out["tp not dividing ep"] = str(e)
    return out


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2), (1, 4)], ids=["tp1ep2", "tp2ep2", "tp1ep4"])
def test_engine_checkpoints_load_back_exactly_across_zero_stages(tp, ep, tmp_path):
    # DeepSpeed writes the module from data-parallel rank 0 only and every rank reads it
    # back: a rank whose experts are not that rank's would load another rank's experts. The
    # engine also keeps each expert slice, so that a load (into a model whose every weight
    # was moved) restores every rank's weights, AdamW's state with them (ZeRO-1 and 2 load
    # each other's files), and the run continues as if never stopped.
    for rank, out in enumerate(run_ranks(_checkpoints_on_ranks, 4, tp, ep, str(tmp_path))):
        for key, value in out.items():
            if key == "other layout":
                assert value is not None and "ep_size=2" in value and "ep_size=4" in value, value
                continue
            if key == "tp not dividing ep":
                assert value is not None and "tp=2, ep=1" in value and "moepar.checkpoint.save" in value, value
                continue
            found, loaded, continued = value
            assert found and loaded == 0.0, (rank, key, loaded)
            assert continued <= 1e-5, (rank, f"ZeRO-{key[0]} -> ZeRO-{key[1]}", continued)


def _number(text: str, label: str) -> float:
    """A figure DeepSpeed's profile summary prints after ``label`` ("7.71 K" -> 7710.0)."""
    line = next(row for row in text.splitlines() if row.startswith(label))
    value, *unit = line[len(label):].split()
    return float(value) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[unit[0] if unit else ""]


def _profile_on_ranks(tp, ep):
    import argparse
    import contextlib
    import io

    from deepspeed.profiling.flops_profiler import FlopsProfiler

    import moepar.deepspeed as mds
    from examples.gpt_moe import GPT, GPTConfig
    from examples.train_gpt_moe import run_spec
    from moepar.cost import CostLayout, get_hardware
    from moepar.cost.pipeline import step_cost
    from moepar.cost.report import build_report
    quiet_deepspeed()
    state = moepar.init_parallel(tp, ep)
    cfg = GPTConfig(vocab_size=32, context=8, layers=2, hidden=16, heads=2, experts=4, topk=2, expert_ffn=16,
                    dense_ffn=16, init_seed=7)
    model = GPT(cfg, state)
    engine, *_ = mds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                config=config(1, train_micro_batch_size_per_gpu=2), mpu=state)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))   # the same on every rank
    profiler = FlopsProfiler(model, ds_engine=engine)
    profiler.start_profile()
    engine(x, torch.roll(x, -1, 1))
    profiler.stop_profile()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        profiler.print_model_profile(profile_step=1, module_depth=0, top_modules=1)
    per_gpu = profiler.get_total_params()
    profiler.end_profile()
    spec = run_spec(argparse.Namespace(batch_size=2 * state.dp_size, microbatches=1), cfg, state, model)
    report = build_report(step_cost(spec, CostLayout(gpus=4, gpus_per_node=8, tp=tp, ep=ep), get_hardware("h100")))
    text = printed.getvalue()
    return {"per_gpu": per_gpu, "model": _number(text, "params of model:"),
            "fwd_model": _number(text, "fwd flops of model = fwd flops per GPU * mp_size:"),
            "report": report["params"]}


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)], ids=["tp1ep2", "tp2ep2"])
def test_deepspeed_flops_profiler_beside_moepar_report(tp, ep):
    # DeepSpeed's profiler on the example GPT-MoE under moepar.deepspeed's engine: it counts
    # the same parameters per rank as moepar's cost report; with the experts tagged it
    # multiplies them by ep (right), and everything else by mp_size, which counts a
    # TP-replicated parameter (router, norms) tp times; and its "fwd flops of model" scales
    # each rank's own forward by mp_size, so ranks that ran the same model on the same
    # tokens print different FLOPs: their experts received different routes.
    results = run_ranks(_profile_on_ranks, 4, tp, ep)
    for out in results:
        rep = out["report"]
        assert out["per_gpu"] == rep["rank"]
        mp_scaled = rep["rank_dense"] * tp + rep["rank_expert"] * ep
        assert abs(out["model"] - mp_scaled) <= 0.005 * mp_scaled
        assert (mp_scaled == rep["total"]) == (tp == 1), (mp_scaled, rep["total"])
    fwd = [out["fwd_model"] for out in results]
    assert len(set(fwd)) > 1, fwd

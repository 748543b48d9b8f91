"""Plain ``deepspeed.initialize(mpu=state)`` on a moepar model trains exactly as moepar's own
data-parallel path or refuses at once, naming the fix.

Each layout runs in one call on 4 gloo ranks: moepar's own path (the reference, in the same
processes), then DeepSpeed's engine on the same model.
"""
import pytest

import moepar

from ..helpers.multiproc import run_ranks
from .net import Net, config, make_optimizer, max_diff, quiet_deepspeed, reference, train_engine

pytest.importorskip("deepspeed")

LAYOUTS = [(1, 2), (2, 2), (1, 4)]   # (tp, ep) on 4 ranks
STEPS = 5


def _plain(state, init, ref, stage):
    """Plain deepspeed.initialize(mpu=state) with SGD: ("refused", message) or ("trained", max diff)."""
    deepspeed = quiet_deepspeed()
    model = Net(state)
    model.load_state_dict(init)
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer("sgd", model.parameters()),
                                          config=config(stage), mpu=state)
    except ValueError as e:
        return "refused", str(e)
    train_engine(engine, STEPS)
    # ZeRO-3 leaves each rank a partition of every parameter: it cannot have trained exactly
    return "trained", max_diff(ref, engine.module) if stage < 3 else float("inf")


def _layout_on_ranks(tp, ep):
    quiet_deepspeed()
    state = moepar.init_parallel(tp, ep)
    init, ref, _ = reference(state, "sgd", STEPS)
    return {"plain": {stage: _plain(state, init, ref, stage) for stage in (0, 1, 2, 3)}}


@pytest.mark.parametrize("tp,ep", LAYOUTS, ids=[f"tp{tp}ep{ep}" for tp, ep in LAYOUTS])
def test_plain_deepspeed_initialize_trains_exactly_or_refuses_at_once(tp, ep):
    # DeepSpeed's engine knows only its own MoE layer: given moepar's state as the mpu it
    # averaged moepar's experts over data-parallel ranks that hold other experts (0.4-1.6
    # off after 3 SGD steps, no warning). It must train exactly or refuse while it is built,
    # on every rank, naming the fix.
    results = run_ranks(_layout_on_ranks, 4, tp, ep)
    for rank, out in enumerate(results):
        for stage, (what, detail) in out["plain"].items():
            if what == "refused":
                assert "moepar.deepspeed.initialize" in detail and f"ep={ep}" in detail, (stage, detail)
            else:
                assert detail <= 1e-5, (tp, ep, rank, f"ZeRO-{stage}", detail)

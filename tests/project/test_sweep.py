"""The random sweep (its cases: tests/helpers/sweep_cases.py): every drawn case is a valid
layer that must take its drawn exchange form, and a few fixed-seed cases pass. The timed
random sweep itself is marked slow (left out of the default run):

    python -m pytest -m slow tests/project/test_sweep.py -s --sweep-seconds 600 --sweep-seed 0 --sweep-world 4

It draws cases (layouts (tp, ep, etp), the token exchange form each must take, router and
expert options, capacities, the receive guard, nonzero expert biases, token counts 5, 0, 3,
7 per replica or 6 each, fp32, float64 and bf16, hidden sizes, sequence parallelism), runs
each on the world's gloo processes, and checks that the exchange took the drawn form and
that outputs, input gradients, every weight gradient and the dropped-route counts match the
single-process layer within tests/helpers/tolerances.py's tolerance of the case's dtype.
Run it after changing the dispatcher, the router or the layouts."""
import random

import pytest

from ..helpers.multiproc import run_ranks
from ..helpers.sweep_cases import FORMS, build_config, check, draw, form_that_runs, run_case, sweep


def test_fixed_seed_cases_pass():
    # The first case of each exchange form from a fixed seed: 5 cases on 4 gloo ranks.
    rng, first = random.Random(2026), {}
    while len(first) < len(FORMS):
        case = draw(rng)
        first.setdefault(case["form"], case)
    for case in first.values():
        check(case, run_ranks(run_case, 4, case))


def test_every_drawn_case_is_valid_and_its_form_must_run():
    # Single process, no collectives: each case's MoEConfig builds (its own validation), and
    # the form the dispatcher's rules give for it is the drawn one (never "may fall back").
    rng = random.Random(0)
    cases = [draw(rng) for _ in range(2000)]
    for case in cases:
        cfg = build_config(case)
        tp, ep, etp = case["layout"]
        assert form_that_runs(cfg, ep, etp) == case["form"], case
        assert not (case["sp"] and cfg.router.capacity_factor is not None), case
        bias = case["expert_bias"]
        assert (bias is not None) == cfg.router.expert_bias, case
        assert bias is None or (len(bias) == cfg.num_experts and all(b != 0 for b in bias)), case
    assert {c["form"] for c in cases} == set(FORMS)
    assert {c["dtype"] for c in cases} == {"float32", "float64", "bfloat16"}
    assert any(c["sp"] for c in cases) and any("receive_capacity_factor" in c["layer"] for c in cases)
    assert any(c["layer"]["gemm_path"] == "grouped_mm" for c in cases)


def test_form_rules_name_the_fallbacks():
    # Where the group may legitimately decide against dedup, the rules say so (None).
    case = draw(random.Random(1))
    case.update(layout=(1, 2, 1), form="dedup", sp=False)
    case["layer"].update(k=2, num_experts=8, dedup="auto", pad_to_capacity=False)
    assert form_that_runs(build_config(case), 2, 1) is None
    case["layer"].update(dedup="on", receive_capacity_factor=1.0)
    assert form_that_runs(build_config(case), 2, 1) is None
    case["layer"].update(receive_capacity_factor=2.0)
    assert form_that_runs(build_config(case), 2, 1) == "dedup"
    with pytest.raises(ValueError, match="pad_to_capacity"):
        case["layer"].update(pad_to_capacity=True, capacity_factor=None)
        build_config(case)


@pytest.mark.slow
@pytest.mark.timeout(0)   # bounded by --sweep-seconds and each case's own rank timeout
def test_random_sweep(request):
    opt = request.config.getoption
    passed, failed = sweep(opt("sweep_seconds"), opt("sweep_seed"), opt("sweep_world"), opt("sweep_cases"))
    assert failed == 0 and passed > 0, f"{failed} of {passed + failed} sweep cases failed (printed above)"

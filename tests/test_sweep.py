"""The random sweep (tests/sweep.py) runs: a few fixed-seed cases, every one passing."""
import io

from .sweep import draw, sweep


def test_sweep_cases_pass():
    out = io.StringIO()
    ok, bad = sweep(seconds=120, seed=2026, world=4, cases=4, out=out)
    assert (ok, bad) == (4, 0), out.getvalue()


def test_draws_cover_the_forms_and_dtypes():
    import random
    rng = random.Random(0)
    cases = [draw(rng) for _ in range(300)]
    assert {c["mode"] for c in cases} >= {"regroup", "source", "dedup"}
    assert {c["dtype"] for c in cases} == {"float32", "float64", "bfloat16"}
    assert any(c["sp"] for c in cases) and any("capacity_factor" in c["layer"] for c in cases)
    assert not any(c["sp"] and "capacity_factor" in c["layer"] for c in cases)

"""Shared test setup: Triton runs in its interpreter on CPU (set before any kernel is
defined, and inherited by the gloo worker processes), few threads, fixed seeds."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# (tests/__init__.py sends every CPU buffer of moepar's ops through the reuse pool.)

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_addoption(parser):
    g = parser.getgroup("moepar sweep", "the random sweep (tests/project/test_sweep.py, -m slow)")
    g.addoption("--sweep-seconds", type=float, default=600, help="how long to draw cases")
    g.addoption("--sweep-seed", type=int, default=0)
    g.addoption("--sweep-world", type=int, default=4, help="gloo processes per case")
    g.addoption("--sweep-cases", type=int, default=None, help="stop after this many cases")


@pytest.fixture(autouse=True)
def _reset_moepar_state():
    from moepar.parallel import groups
    groups.reset_parallel_state()
    torch.manual_seed(0)
    yield
    groups.reset_parallel_state()


@pytest.fixture(autouse=True, scope="session")
def _gloo_workers_exit_cleanly():
    """At the end of the session, stop the shared gloo worker pools and fail (as an error in
    the last test's teardown) if any worker did not exit 0 (a finished job must
    exit cleanly; tests/helpers/multiproc.py)."""
    yield
    from .helpers.multiproc import check_exits
    check_exits()

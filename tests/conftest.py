"""Shared test setup: Triton runs in its interpreter on CPU (set before any kernel is
defined, and inherited by the gloo worker processes), few threads, fixed seeds."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# (tests/__init__.py sends every CPU buffer of moepar's ops through the reuse pool.)

import pytest  # noqa: E402
import torch  # noqa: E402


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

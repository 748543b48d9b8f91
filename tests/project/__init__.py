"""Tests of the repository around the package: docs (names, reference block, reading
lists), the example (examples/), the random sweep (test_sweep.py, its timed run marked slow)."""

"""Tests of the repository around the package: docs (names, reference block, reading
lists), the example (examples/), the random sweep (scripts/sweep.py)."""

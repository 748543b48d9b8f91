"""Helpers shared by the tests (and by scripts/gpu_discipline.py): no tests
here. See tests/README.md for what each module is."""

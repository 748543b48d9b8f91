"""Tests of moepar/cost/: the cost model, pricing, CLI, calibrate/validate, run report."""

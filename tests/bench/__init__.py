"""Tests of moepar/bench/: the benchmark modes and the plain-torch reference MoE."""

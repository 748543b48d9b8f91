"""Tests of moepar/hf/: transformers MoE blocks, drop-in swaps, whole models and checkpoints."""

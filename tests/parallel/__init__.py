"""Tests of moepar/parallel/ (groups, comm, tensor parallel, FSDP, pipeline, faults, teardown),
checkpoints (moepar/checkpoint.py), and GPU discipline under the fake-CUDA instrument."""

"""Tests of moepar/moe/: the layer, router, experts, dispatch, dedup, receive guard, recompute,
replicas and placement, FP8 dispatch, traffic table, local path, options, CPU buffer pool."""

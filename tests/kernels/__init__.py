"""Tests of kernels/ (imported as moepar_kernels): routing, permute, permute_fp8, the name."""

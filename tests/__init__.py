"""Every CPU buffer of moepar's ops, however small, goes through the reuse pool
(moepar/moe/cpu.py) in every test process (pytest's and the gloo workers', which import
this package to find their function), so that any reuse of a buffer still in use would show
up as a wrong result somewhere."""
from moepar.moe import cpu as _cpu

_cpu.POOL.min_bytes = 0

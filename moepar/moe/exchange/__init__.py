"""Steps 2-7 and 9-11: the dispatcher (the TP share, the counts exchange and its one host
read) and the exchange forms it runs: one row per route (``rows``), one per token and
destination (``dedup``), fixed capacity slots (``padded``), FP8 rows, the receive guard.
``dedup_policy`` imports without torch (the cost model reads it)."""

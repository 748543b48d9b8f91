"""Expert replication (``redundant_experts``): the slots and the copies' exchange
(``replicas``), the planner (``placement``, with ``placement_pack`` and
``placement_split``; torch-free) and ``moepar.rebalance`` (``rebalance``)."""

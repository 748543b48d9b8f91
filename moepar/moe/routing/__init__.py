"""Step 1 of the forward: the router (scores, top-k, the aux and z losses), capacity drops
(an option) and what a training forward keeps for an activation recompute."""

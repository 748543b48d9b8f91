"""Examples: the GPT-MoE model, its data and its training script."""

"""What a training run needs that is not the recipe, a module per concern; none imports train_gpt2
(support/common.py, which every script shares, imports no torch)."""

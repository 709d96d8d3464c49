"""What a training run needs that is not the recipe, a module per concern; none imports a script
(train_gpt2.py, fineweb.py, hellaswag.py, bench.py). support/common.py, which every script shares,
and support/shards.py, the token shards fineweb.py writes, import no torch."""

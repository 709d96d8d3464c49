"""What a training run needs that is not the recipe, a module per concern; none imports a script
(train_gpt2.py, fineweb.py, hellaswag.py, bench.py). The modules fineweb.py uses (cli.py, files.py,
offline.py, documents.py, shards.py) import no torch."""

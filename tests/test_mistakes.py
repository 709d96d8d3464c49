"""Ordinary user mistakes thrown at train_gpt2.py (the rules in docs/reliability.md): each is refused
in one line before any training step, or works as the user meant; nothing that existed in the
folders is gone or changed. Rule 1 (--export-hf) lives in test_export.py, rule 6 in test_fineweb.py."""

import os

from helpers import cli

# ----------------------------------------------------------------------------------------------
# Rule 8: friction


def test_help_shows_defaults_and_the_usage_examples_intact():
    r = cli("--help", env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0
    assert "python fineweb.py && torchrun --standalone --nproc_per_node=8 train_gpt2.py   # the full recipe" in r.stdout
    assert "-T 64 \\\n        --total-batch-size 4096" in r.stdout  # a continued line stays one to copy
    flat = " ".join(r.stdout.split())
    for text in ("(default: 64)", "(default: 524288)", "(default: 0.0006)", "(default: 715)", "(default: log)"):
        assert text in flat, text

"""The rows lm-eval's tasks in this folder score: hellaswag.py's HellaSwag jsonl, read from disk so
that the tasks run offline. The file is `--metadata '{"hellaswag_data": "path/to/hellaswag_val.jsonl"}'`,
else hellaswag.py's cache (~/.cache/gpt2-repro/hellaswag/hellaswag_val.jsonl, which
`python hellaswag.py -m gpt2_ours --limit 10` fills once, online, from the Hugging Face Hub's Rowan/hellaswag)."""

import json
import os

import datasets

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "gpt2-repro", "hellaswag", "hellaswag_val.jsonl")


def hellaswag_rows(hellaswag_data=None, **metadata):
    """{"validation": the jsonl's rows} for a task's custom_dataset; metadata (the task's version,
    other tasks' keys) is not ours."""
    path = os.path.expanduser(hellaswag_data or CACHE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no HellaSwag jsonl at {path}: run `python hellaswag.py -m gpt2_ours --limit 10` once online "
            f'to cache it, or pass --metadata \'{{"hellaswag_data": "path/to/hellaswag_val.jsonl"}}\''
        )
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)})


def lm_eval_process_docs(dataset):
    """lm-eval's own hellaswag preprocessing (the installed lm-eval's function, not a copy)."""
    from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: PLC0415  lm-eval is only here when it runs us

    return process_docs(dataset)

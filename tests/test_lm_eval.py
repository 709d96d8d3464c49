"""lm-evaluation-harness on an export, offline (docs/evaluation.md): the completion-style HellaSwag
task that the docs give scores each example as hellaswag.py scores the checkpoint, and lm-eval's
own hellaswag task, run on the same local rows, rewrites the context and normalizes acc_norm by
characters, as the docs say. The task YAMLs are read out of docs/evaluation.md, so a reader who
copies them gets what is tested. One lm-eval run (both tasks, 200 examples) serves every test."""

import json
import os
import re

import numpy as np
import pytest
import torch

import hellaswag
from helpers import ROOT

pytestmark = pytest.mark.slow  # lm-eval's run on the CPU: half a minute
N = 200  # 150 ActivityNet rows, 50 WikiHow ones, 3 of them longer than the tiny model's window of 128


def docs_yaml(task, **paths):
    """The YAML block of docs/evaluation.md that defines task, its placeholder paths replaced."""
    text = (ROOT / "docs" / "evaluation.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if f"\ntask: {task}\n" in f"\n{b}"]
    assert len(blocks) == 1, f"docs/evaluation.md has no single YAML for {task}"
    block = blocks[0]
    for placeholder, path in paths.items():
        assert placeholder in block
        block = block.replace(placeholder, str(path))
    return block


@pytest.fixture(scope="module")
def harness(shakespeare_export, shared_data, tmp_path_factory, enc):
    import lm_eval  # noqa: PLC0415  seconds to import: only this module's fixture runs it
    from lm_eval.tasks import TaskManager  # noqa: PLC0415  as above

    ckpt, export = shakespeare_export
    tmp = tmp_path_factory.mktemp("lm_eval")
    lines = (shared_data / "hellaswag" / "hellaswag_val.jsonl").read_text(encoding="utf-8").splitlines()
    lines = lines[:150] + [line for line in lines if '"source_id": "wikihow' in line][:50]
    (tmp / "hellaswag_val.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp / "tasks").mkdir()
    own_yaml = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "hellaswag", "hellaswag.yaml")
    data = {"/path/to/hellaswag_val.jsonl": tmp / "hellaswag_val.jsonl"}
    completion = docs_yaml("hellaswag_completion", **data)
    own = docs_yaml("hellaswag_local", **data, **{"/path/to/lm_eval/tasks/hellaswag/hellaswag.yaml": own_yaml})
    for name, text in (("completion", completion), ("own", own)):
        # datasets' copy of the rows in tmp, not in the user's ~/.cache/huggingface (a new one a run)
        text = text.replace("\n  data_files:", f"\n  cache_dir: {tmp / 'datasets_cache'}\n  data_files:", 1)
        (tmp / "tasks" / f"{name}.yaml").write_text(text)
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},dtype=float32",
        tasks=["hellaswag_completion", "hellaswag_local"],
        task_manager=TaskManager(include_path=str(tmp / "tasks"), include_defaults=False),
        device="cpu",
        batch_size=32,
        log_samples=True,
    )
    examples = [json.loads(line) for line in lines]
    prepared = hellaswag.prepare(examples, enc)
    losses = {  # hellaswag.py's summed loss of each ending, on the checkpoint and on its export
        which: hellaswag.ending_losses(hellaswag.load_model(str(path), "cpu"), prepared, "cpu")
        for which, path in (("ckpt", ckpt), ("export", export))
    }
    return {"out": out, "examples": examples, "losses": losses}


def samples(harness, task):
    """lm-eval's per-example log of task, in example order."""
    rows = sorted(harness["out"]["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in rows] == list(range(N))
    return rows


def log_likelihoods(rows):
    return torch.tensor([[ll for ll, _ in s["filtered_resps"]] for s in rows], dtype=torch.float64)


def test_completion_task_scores_every_example_as_hellaswag_py(harness):
    rows, examples = samples(harness, "hellaswag_completion"), harness["examples"]
    for s, ex in zip(rows, examples, strict=True):  # the text scored: the context, an ending after a space
        assert [tuple(a) for a in s["arguments"]] == [(ex["ctx"], " " + e) for e in ex["endings"]]
    ll = log_likelihoods(rows)
    (ckpt, n_tokens), (export, _) = harness["losses"]["ckpt"], harness["losses"]["export"]
    # the same weights, two scorers: the same log-probabilities up to float rounding
    assert torch.allclose(-ll, export.double(), atol=1e-3, rtol=0)
    # the checkpoint's softmax also spreads over its 47 padding rows, which the export leaves out
    gap = (-ll - ckpt.double()).abs().max().item()
    assert gap < 0.1, gap
    # hellaswag.py's prediction on the checkpoint, example by example, and so the same acc
    pred = ckpt.argmin(1).tolist()
    labels = [ex["label"] for ex in examples]
    assert [s["acc"] for s in rows] == [float(p == y) for p, y in zip(pred, labels, strict=True)]
    results = harness["out"]["results"]["hellaswag_completion"]
    assert results["acc,none"] == pytest.approx(sum(p == y for p, y in zip(pred, labels, strict=True)) / N)
    # its acc_norm: the log-likelihood over the ending's characters, where hellaswag.py's is over tokens
    chars = torch.tensor([[len(e) for e in ex["endings"]] for ex in examples], dtype=torch.float64)
    assert [s["acc_norm"] for s in rows] == [
        float(p == y) for p, y in zip((ll / chars).argmax(1).tolist(), labels, strict=True)
    ]
    tokens_pred = (ckpt / n_tokens).argmin(1).tolist()
    assert tokens_pred != (ll / chars).argmax(1).tolist()  # the two normalizations pick differently here


def test_lm_evals_own_hellaswag_rewrites_the_context(harness):
    rows, examples = samples(harness, "hellaswag_local"), harness["examples"]
    contexts = [s["arguments"][0][0] for s in rows]
    # activity label first, then ctx_a and ctx_b (capitalized); hellaswag.py scores ctx as it is
    for context, ex in zip(contexts, examples, strict=True):
        assert context.startswith(ex["activity_label"].strip() + ": ")
        assert context != ex["ctx"]
    wikihow = [i for i, ex in enumerate(examples) if "[title]" in ex["ctx"] or "[step]" in ex["ctx"]]
    assert len(wikihow) == 50 and not any("[" in contexts[i] for i in wikihow)  # its markers dropped
    # acc_norm: each ending's log-likelihood over its characters (its own preprocessed text)
    ll = log_likelihoods(rows)
    chars = torch.tensor([[len(c) for c in s["doc"]["choices"]] for s in rows], dtype=torch.float64)
    labels = [ex["label"] for ex in examples]
    assert [s["acc_norm"] for s in rows] == [
        float(p == y) for p, y in zip((ll / chars).argmax(1).tolist(), labels, strict=True)
    ]
    assert np.mean([s["acc"] for s in rows]) == harness["out"]["results"]["hellaswag_local"]["acc,none"]

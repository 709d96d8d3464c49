"""lm-evaluation-harness on an export with the shipped task files (README's lm_eval line): the completion
task scores as hellaswag.py does; lm-eval's own hellaswag rewrites the context, as docs/evaluation.md says."""

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import hellaswag
from helpers import ROOT

N = 200  # 150 ActivityNet rows, 50 WikiHow ones, 3 of them longer than the tiny model's window of 128
TASKS = ROOT / "lm_eval_tasks"


def task_utils():
    """lm_eval_tasks/utils.py, loaded by its path as lm-eval loads it (`!function utils.<name>`)."""
    spec = importlib.util.spec_from_file_location("lm_eval_tasks_utils", TASKS / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_task(path):
    """A task YAML as data; lm-eval's `!function` tag read as ("!function", its name)."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: ("!function", loader.construct_scalar(node)))
    return yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)


def test_tasks_read_hellaswag_pys_cache_by_default_or_the_jsonl_their_metadata_names(tmp_path, assets):
    utils = task_utils()
    assert utils.CACHE == os.path.join(hellaswag.DEFAULT_CACHE_DIR, hellaswag.CACHE_NAME)
    lines = assets.hellaswag.read_text(encoding="utf-8").splitlines()[:3]
    (tmp_path / "hs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    # lm-eval passes every task's metadata (its version, the model's arguments) along with ours
    rows = utils.hellaswag_rows(hellaswag_data=str(tmp_path / "hs.jsonl"), version=1.0, pretrained="x")
    assert list(rows) == ["validation"]
    assert [dict(r) for r in rows["validation"]] == [json.loads(line) for line in lines]


def test_tasks_without_the_jsonl_say_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        task_utils().hellaswag_rows(hellaswag_data=str(tmp_path / "none.jsonl"))
    assert "python hellaswag.py -m gpt2_ours --limit 10" in str(e.value) and "hellaswag_data" in str(e.value)


def test_local_task_is_lm_evals_own_but_for_its_data():
    installed = Path(importlib.util.find_spec("lm_eval").origin).parent  # not imported: seconds to import
    theirs = read_task(installed / "tasks" / "hellaswag" / "hellaswag.yaml")
    ours = read_task(TASKS / "hellaswag_local.yaml")
    assert ours.pop("custom_dataset") == ("!function", "utils.hellaswag_rows")
    assert ours.pop("process_docs") == ("!function", "utils.lm_eval_process_docs")
    assert theirs.pop("process_docs") == ("!function", "utils.process_docs")
    for name in ("task", "tag", "dataset_path", "dataset_name", "training_split"):  # the data, its name
        theirs.pop(name, None), ours.pop(name, None)
    assert ours == theirs


@pytest.fixture(scope="module")
def harness(shakespeare_export, assets, tmp_path_factory, enc):
    import lm_eval  # noqa: PLC0415  seconds to import: only this module's fixture runs it
    from lm_eval.tasks import TaskManager  # noqa: PLC0415  as above

    ckpt, export = shakespeare_export
    tmp = tmp_path_factory.mktemp("lm_eval")
    lines = assets.hellaswag.read_text(encoding="utf-8").splitlines()
    lines = lines[:150] + [line for line in lines if '"source_id": "wikihow' in line][:50]
    (tmp / "hellaswag_val.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},dtype=float32",
        tasks=["hellaswag_completion", "hellaswag_local"],
        task_manager=TaskManager(
            include_path=str(TASKS),
            include_defaults=False,
            metadata={"hellaswag_data": str(tmp / "hellaswag_val.jsonl")},
        ),
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


@pytest.mark.slow  # lm-eval's run on the CPU: half a minute
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


@pytest.mark.slow
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

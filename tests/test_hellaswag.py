"""hellaswag.py: tokens, the fast scorer (shared contexts, head at the scored positions only)
against a plain one-row-per-forward loop, sharding, stopping, the download from the Hub (its one call
replaced by local rows in the Hub's shape) checked against the original, offline detection and refusing
bad data; in training, a HellaSwag file it cannot use is one warning, in the log's header too, and the
run goes on."""

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.nn import functional as F

import hellaswag
import train_gpt2
from helpers import ROOT, cli, read_log, save_tiny_hf_gpt2, signal_on, tiny_args
from support import offline
from support.cli import UserError
from train_gpt2 import GPT


@pytest.fixture(scope="module")
def val_path(assets):
    return assets.hellaswag


@pytest.fixture(scope="module")
def examples(val_path):
    return hellaswag.load_examples(str(val_path))


@pytest.fixture(scope="module")
def reference(assets):
    return assets.reference


def plain_losses(logits_of, enc, example, block_size):
    """The summed and mean loss of each ending, scored the plain way: one row per forward pass."""
    ctx = enc.encode(example["ctx"])
    sums, means = [], []
    for ending in example["endings"]:
        end = enc.encode(" " + ending)
        row = (ctx + end)[-(block_size + 1) :]  # the documented cut: keep the last block_size+1
        n_end = min(len(end), len(row) - 1)  # ending tokens that have a token before them
        logits = logits_of(torch.tensor([row[:-1]]))[0]  # position t predicts token t + 1
        logp = F.log_softmax(logits[len(row) - 1 - n_end :].float(), dim=-1)
        sums.append(-logp[torch.arange(n_end), torch.tensor(row[-n_end:])].sum().item())
        means.append(sums[-1] / n_end)
    return sums, means


def argmin(values):
    return min(range(len(values)), key=values.__getitem__)


def counts_by_hand(examples, preds, preds_norm):
    labels = [ex["label"] for ex in examples]
    correct = sum(p == label for p, label in zip(preds, labels, strict=True))
    correct_norm = sum(p == label for p, label in zip(preds_norm, labels, strict=True))
    return {"n": len(examples), "correct": correct, "correct_norm": correct_norm}


# ----------------------------------------------------------------------------------------------
# Data and tokens


def test_gpt2_124m_is_quoted_everywhere_as_the_number_this_scoring_reproduces(reference):
    """OpenAI GPT-2 124M's acc_norm over all 10,042 rows (hellaswag.py's docstring), not another run's."""
    acc_norm = reference["hellaswag_gpt2_reference_accuracy"]["gpt2_124M"]["completion_style_this_script"]["acc_norm"]
    for path in ("hellaswag.py", "README.md", "play.ipynb", "docs/evaluation.md", "docs/reproduction.md"):
        assert set(re.findall(r"0\.29\d+", (ROOT / path).read_text())) == {str(acc_norm)}, path


def test_render_example_zero(examples, enc, reference):
    ref = reference["hellaswag_val"]["first_example"]
    ctx_tokens, ending_tokens = hellaswag.render_example(examples[0], enc)
    assert ctx_tokens == ref["ctx_tokens"] == [32, 582, 318, 5586, 319, 257, 9753, 13, 339]
    assert [len(e) for e in ending_tokens] == ref["ending_token_lengths_with_leading_space"] == [11, 6, 8, 9]
    assert ending_tokens[3] == enc.encode(" starts pulling up roofing on a roof.")


GOOD = {"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 0, "split_type": "indomain"}


def row(**change):
    """A jsonl line: GOOD with fields changed (None: left out)."""
    return json.dumps({k: v for k, v in {**GOOD, **change}.items() if v is not None})


@pytest.mark.parametrize(
    "text, message",
    [
        (row() + '\n{"ctx": "cut off', r"h\.jsonl line 2 is not valid JSON"),
        (row(label="3"), r"h\.jsonl line 1: label '3' is not an int from 0 to 3"),  # the Hub's string label
        (row(label=4), r"line 1: label 4 is not an int from 0 to 3"),
        (row(label=-1), r"line 1: label -1 is not an int"),
        (row(label=True), r"line 1: label True is not an int"),
        (row(label=None), r"line 1: label None is not an int"),
        (row(endings=["a", "b", "c"]), r"line 1: not a HellaSwag example \(a list of 4 endings\)"),
        ("", r"h\.jsonl holds no examples"),
        (None, r"h\.jsonl cannot be read: No such file or directory"),
    ],
    ids=["cut", "string-label", "label-4", "label-minus-1", "bool-label", "no-label", "3-endings", "empty", "missing"],
)
def test_a_file_it_cannot_score_is_named_in_one_line(tmp_path, text, message):
    if text is not None:
        (tmp_path / "h.jsonl").write_text(text + "\n")
    with pytest.raises(UserError, match=message) as e:
        hellaswag.load_examples(str(tmp_path / "h.jsonl"))
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------
# Downloads from the Hub, with tests/assets' rows shaped as the Hub gives them in place of the network

# digests() of tests/assets' 450 rows: its first 300 rows are the original's, so the first 9 (rows 1, 2, ..., 256)
# are the original's too (hellaswag.ORIGINAL_DIGESTS); the 10th covers all 450
DIGESTS_450 = (
    "df40a5928da24b1f bbc545cc7dc70a42 a83eed1f11dc59bf f4dbabdbdc965073 90571e07ef69e9cc 09e2d87d091d5844 "
    "a5d2a0b058ac5998 2f1c3e46cea3b4b7 ccced27d9d3a7fad 022a5a5531c34b8c"
).split()
ORIGINAL_SHA256 = "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"  # rowanz/hellaswag's val file
HUB_COLUMNS = ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split", "split_type", "label")


def hub_rows(path, change=None):
    """path's rows as the Hub's Rowan/hellaswag gives them: a datasets.Dataset, its columns in the Hub's
    order and label a string; change(rows) edits the list of rows first."""
    import datasets  # noqa: PLC0415  (half a second: only these tests need it)

    rows = [{k: str(r[k]) if k == "label" else r[k] for k in HUB_COLUMNS} for r in map(json.loads, open(path))]
    if change:
        change(rows)
    return datasets.Dataset.from_list(rows)


def never(*args, **kwargs):
    raise AssertionError("no download may be tried here")


@pytest.fixture
def hub(monkeypatch):
    """serve(dataset): the Hub reachable (conftest's offline variables unset, the probe answered) and
    datasets.load_dataset returning dataset; the calls made are listed in serve.calls."""
    import datasets  # noqa: PLC0415

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(offline, "unreachable", lambda url, timeout=3.0: None)

    def serve(dataset, rows=450, digests=DIGESTS_450):
        monkeypatch.setattr(hellaswag, "ORIGINAL_ROWS", rows)  # the test's rows are the original here
        monkeypatch.setattr(hellaswag, "ORIGINAL_DIGESTS", digests)

        def load_dataset(name, *args, **kwargs):
            serve.calls.append((name, *args, kwargs))
            return dataset

        monkeypatch.setattr(datasets, "load_dataset", load_dataset)

    serve.calls = []
    return serve


def test_the_450_rows_give_their_pinned_digests_and_the_originals_first_ones(val_path):
    assert hellaswag.digests(hellaswag.load_examples(str(val_path))) == DIGESTS_450
    assert hellaswag.ORIGINAL_DIGESTS[:9] == DIGESTS_450[:9]  # rows 1..256: the original's, as the asset's README says


def test_hellaswag_py_fills_the_cache_with_the_original_file_from_the_hub_and_reads_it_next_time(
    tmp_path, short_run, val_path, hub, capsys, monkeypatch
):
    import datasets  # noqa: PLC0415

    hub(hub_rows(val_path))
    # on a CPU it keeps freed memory, as a CPU training run evaluates (what the call does: test_device.py)
    calls = []
    monkeypatch.setattr(hellaswag, "keep_freed_memory", lambda: calls.append("called"))
    cache = tmp_path / "cache"
    args = ["-m", str(short_run[1] / "ckpt_000002.pt"), "--cache-dir", str(cache), "--limit", "20", "-d", "cpu"]
    hellaswag.main(args)
    assert hub.calls == [("Rowan/hellaswag", {"split": "validation"})] and calls == ["called"]
    # the cache is the original jsonl byte for byte (label an int, the original's field order), alone
    assert (
        os.listdir(cache) == [hellaswag.CACHE_NAME]
        and (cache / hellaswag.CACHE_NAME).read_bytes() == val_path.read_bytes()
    )
    from_hub = capsys.readouterr().out
    monkeypatch.setattr(datasets, "load_dataset", never)  # the second time reads the cache
    hellaswag.main(args)
    assert capsys.readouterr().out == from_hub and "acc_norm 0." in from_hub


def change_ending(rows, i):
    rows[i]["endings"] = [*rows[i]["endings"][:3], rows[i]["endings"][3] + "!"]


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda rows: change_ending(rows, 299), "differs from the original first between rows 257 and 450"),
        (lambda rows: rows[0].update(label="2"), "differs from the original first at row 1"),
        (lambda rows: rows[1].update(ctx=rows[1]["ctx"] + " "), "differs from the original first at row 2"),
        (lambda rows: rows.reverse(), "differs from the original first at row 1"),
        (lambda rows: rows.pop(), "has 449 rows, not the original's 450"),
    ],
    ids=["ending-row-300", "label-row-1", "ctx-row-2", "order", "a-row-less"],
)
def test_a_copy_that_differs_from_the_original_is_one_line_and_not_cached(tmp_path, val_path, hub, change, said):
    hub(hub_rows(val_path, change))
    with pytest.raises(UserError) as e:
        hellaswag.load_examples(cache_dir=str(tmp_path))
    assert (
        str(e.value)
        == f"Rowan/hellaswag's validation split {said} (not cached); pass --data path/to/hellaswag_val.jsonl"
    )
    assert os.listdir(tmp_path) == []


def not_found(val_path):
    raise FileNotFoundError("Couldn't find a dataset script at /x/hellaswag/hellaswag.py or any data file\nmore")


@pytest.mark.parametrize(
    "served, said",
    [
        (not_found, "Couldn't find a dataset script"),
        (lambda v: hub_rows(v, lambda rows: rows[3].update(label="")), "invalid literal for int"),  # the test split's
        (lambda v: hub_rows(v).remove_columns("source_id"), "'source_id'"),
    ],
    ids=["not-found", "empty-label", "a-column-less"],
)
def test_a_datasets_error_is_one_line_and_not_cached(tmp_path, monkeypatch, val_path, hub, served, said):
    import datasets  # noqa: PLC0415

    hub(None)
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: served(val_path))
    with pytest.raises(UserError) as e:
        hellaswag.load_examples(cache_dir=str(tmp_path))
    assert re.fullmatch(rf"cannot download HellaSwag \(Rowan/hellaswag: .*{said}.*\); pass --data \S+", str(e.value))
    assert os.listdir(tmp_path) == []


def test_the_whole_original_converted_from_the_hub_s_form_is_itself_and_gives_the_pinned_digests(
    full_hellaswag, tmp_path, hub, reference
):
    hub(hub_rows(full_hellaswag), rows=10042, digests=hellaswag.ORIGINAL_DIGESTS)
    ref, examples = reference["hellaswag_val"], hellaswag.load_examples(cache_dir=str(tmp_path))
    written = (tmp_path / hellaswag.CACHE_NAME).read_bytes()
    assert hashlib.sha256(written).hexdigest() == ORIGINAL_SHA256
    assert len(examples) == ref["num_examples"] == 10042
    assert dict(Counter(str(ex["label"]) for ex in examples)) == ref["label_counts"]
    assert dict(Counter(ex["split_type"] for ex in examples)) == ref["split_type_counts"]
    assert examples[0]["ind"] == 24 and examples[0]["label"] == 3


@pytest.mark.online
def test_online_the_hub_s_hellaswag_is_the_original(tmp_path):
    """The real download: all 10,042 rows, the pinned digests (or it refuses), cached as the original file."""
    assert len(hellaswag.load_examples(cache_dir=str(tmp_path))) == 10042
    written = (tmp_path / hellaswag.CACHE_NAME).read_bytes()
    assert hashlib.sha256(written).hexdigest() == ORIGINAL_SHA256


def test_a_cache_dir_that_is_a_file_is_one_line_before_any_download(tmp_path, monkeypatch, hub):
    import datasets  # noqa: PLC0415

    hub(None)
    monkeypatch.setattr(datasets, "load_dataset", never)
    (tmp_path / "a_file").write_text("mine")
    for cache_dir, said in (("a_file", "a_file"), ("a_file/sub", "a_file/sub: {tmp}/a_file")):
        with pytest.raises(UserError, match=f"--cache-dir {tmp_path}/{said.format(tmp=tmp_path)} is a file, not a"):
            hellaswag.load_examples(cache_dir=str(tmp_path / cache_dir))


@pytest.mark.parametrize(
    "env, probe, url, reason",
    [
        ({"HF_HUB_OFFLINE": "1"}, None, "https://huggingface.co", "HF_HUB_OFFLINE is set"),
        ({"HF_DATASETS_OFFLINE": "1"}, None, "https://huggingface.co", "HF_DATASETS_OFFLINE is set"),
        ({}, ("huggingface.co", 443), "https://huggingface.co", "No route"),
        # behind a proxy the proxy is what must answer; a mirror named by HF_ENDPOINT is what is probed
        ({"https_proxy": "http://proxy.example:3128"}, ("proxy.example", 3128), "https://huggingface.co", "No route"),
        ({"HF_ENDPOINT": "https://hf.example"}, ("hf.example", 443), "https://hf.example", "No route"),
    ],
    ids=["hub-offline", "datasets-offline", "no-network", "proxy", "mirror"],
)
def test_offline_or_without_network_it_fails_at_once_after_one_quick_probe(
    tmp_path, monkeypatch, env, probe, url, reason
):
    import datasets  # noqa: PLC0415

    for v in "HF_HUB_OFFLINE HF_DATASETS_OFFLINE HF_ENDPOINT https_proxy HTTPS_PROXY all_proxy ALL_PROXY".split():
        monkeypatch.delenv(v, raising=False)
    for v, value in env.items():
        monkeypatch.setenv(v, value)
    tried = []

    def create_connection(address, timeout=None):
        tried.append((address, timeout))
        raise OSError("No route")

    monkeypatch.setattr(offline.socket, "create_connection", create_connection)
    monkeypatch.setattr(datasets, "load_dataset", never)
    with pytest.raises(UserError) as e:
        hellaswag.load_examples(cache_dir=str(tmp_path / "c"))
    assert str(e.value) == f"cannot download HellaSwag from {url} ({reason}); pass --data path/to/hellaswag_val.jsonl"
    assert tried == ([(probe, 3.0)] if probe else []) and not (tmp_path / "c").exists()


# ----------------------------------------------------------------------------------------------
# Scoring


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random transformers GPT-2 saved locally; n_embd 32 keeps the 50257-way output layer cheap."""
    pytest.importorskip("transformers")
    return save_tiny_hf_gpt2(tmp_path_factory.mktemp("hf_hellaswag"), n_embd=32)  # LayerNorms, biases moved off 1 / 0


@pytest.fixture(scope="module")
def small(hf_dir, examples, enc):
    """Our model of hf_dir and the plain losses of the first 40 examples of the file."""
    ours = GPT.from_pretrained(str(hf_dir)).eval()
    exs = examples[:40]
    with torch.no_grad():
        plain = [plain_losses(lambda x: ours(x)[0], enc, ex, 128) for ex in exs]
    return {"ours": ours, "examples": exs, "plain": plain}


def test_a_checkpoint_scores_standalone_as_in_training_and_as_the_plain_rows(short_run, examples, enc):
    """A tiny checkpoint as hellaswag.py loads it (transformers') and as training does (our GPT), on 100 short
    ActivityNet examples (packed), 50 WikiHow ones (many too long for block size 64: cut), an ending longer
    than the window, packed segments of no cells (one-token endings) and a row of one cell (a one-token
    context): the same losses, which are those of the plain one-row-per-forward scoring, for a share too."""
    path = str(short_run[1] / "ckpt_000002.pt")
    hf, ours = hellaswag.load_model(path, "cpu"), train_gpt2.load_model(path).eval()
    wikihow = [ex for ex in examples if ex["source_id"].startswith("wikihow")]
    exs = examples[:100] + wikihow[:50] + [dict(examples[0], endings=["word " * 100, "a", "b c", "d e f"])]
    exs += [dict(examples[0], endings=["a", "b c", "d e f", "."]), dict(examples[1], ctx="x", endings=[*"yzwv"])]
    prepared = hellaswag.prepare(exs, enc)
    assert prepared.end_len[-3, 0] > 65 and prepared.ctx_len[-1] == 1 and prepared.end_len[-2:].min() == 1
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert hf.lm_head.weight.shape == ours.lm_head.weight.shape  # the padded vocabulary kept: the same softmax
    batches, _ = hellaswag._batches(prepared, range(len(prepared)), 64, 2000, "cpu")
    assert any("seg" in b for b in batches) and any("seg" not in b for b in batches)  # both paths run
    theirs, n_tokens = hellaswag.ending_losses(hf, prepared, "cpu", batch_tokens=2000)
    reference, n_reference = hellaswag.ending_losses(ours, prepared, "cpu", batch_tokens=2000)
    assert torch.equal(n_tokens, n_reference)
    assert torch.allclose(theirs, reference, rtol=1e-5, atol=1e-4)
    with torch.no_grad():  # short rows, cut rows and the long ending: summed and mean loss, by the definition
        plain = torch.tensor([plain_losses(lambda x: ours(x)[0], enc, ex, 64) for ex in exs[90:]])
    assert torch.allclose(reference[90:], plain[:, 0], rtol=1e-4, atol=1e-4)
    assert torch.allclose((reference / n_tokens)[90:], plain[:, 1], rtol=1e-4, atol=1e-4)
    share = range(1, len(exs), 3)  # a rank's share: its examples' losses in its order
    shard, n_shard = hellaswag.ending_losses(ours, prepared, "cpu", share, batch_tokens=700)
    assert torch.equal(n_shard, n_tokens[share]) and torch.allclose(shard, reference[share], rtol=1e-5, atol=1e-4)
    preds, preds_norm = reference.argmin(1).tolist(), (reference / n_tokens).argmin(1).tolist()
    for i in range(len(prepared)):  # each example picks the same ending, by summed and by mean loss
        assert theirs[i].argmin() == preds[i] and (theirs[i] / n_tokens[i]).argmin() == preds_norm[i], i
    counts = hellaswag.evaluate(hf, prepared, "cpu", batch_tokens=2000)
    assert counts == counts_by_hand(exs, preds, preds_norm)


def test_evaluate_counts_and_shards_sum_to_the_whole(small, enc):
    model, exs, plain = small["ours"], small["examples"], small["plain"]
    prepared = hellaswag.prepare(exs, enc)
    preds, preds_norm = [argmin(s) for s, _ in plain], [argmin(m) for _, m in plain]
    assert preds != preds_norm  # the two scores pick differently here, so both are really checked
    by_hand = counts_by_hand(exs, preds, preds_norm)
    whole = hellaswag.evaluate(model, prepared, "cpu")
    assert whole == by_hand and whole["n"] == 40
    parts = [hellaswag.evaluate(model, prepared, "cpu", rank, 3, batch_tokens=700) for rank in range(3)]
    assert [p["n"] for p in parts] == [14, 13, 13]
    assert {k: sum(p[k] for p in parts) for k in whole} == whole
    # a rank with no examples returns every key, as zeros, so the ranks can be summed
    assert hellaswag.evaluate(model, prepared, "cpu", rank=45, world_size=48) == dict.fromkeys(whole, 0)


def test_should_stop_ends_the_eval_between_batches(small, examples, enc):
    asked = []

    def should_stop():
        asked.append(1)
        return len(asked) > 3

    prepared = hellaswag.prepare(examples[:300], enc)
    assert hellaswag.evaluate(small["ours"], prepared, "cpu", should_stop=should_stop, batch_tokens=2000) is None
    assert len(asked) == 4  # asked before each batch; stopped before the fourth of many
    assert hellaswag.evaluate(small["ours"], prepared, "cpu", should_stop=lambda: True) is None


def test_prepare_names_an_example_that_cannot_be_tokenized(examples, enc):
    bad = dict(examples[1], ctx="a <|endoftext|> in the text")
    with pytest.raises(UserError, match=r"example 1 \(ind \d+\) cannot be tokenized: .*endoftext"):
        hellaswag.prepare([examples[0], bad], enc)
    with pytest.raises(UserError, match=r"example 0 .*cannot be tokenized: 'ctx'"):
        hellaswag.prepare([{k: v for k, v in examples[0].items() if k != "ctx"}], enc)


# ----------------------------------------------------------------------------------------------
# Command line


@pytest.mark.parametrize("said", ["import torch", "import transformers"])
def test_ctrl_c_while_it_starts_is_one_line(short_run, val_path, said):
    # importing torch, or loading the model (into transformers): one line, exit 130, never a traceback
    args = ("-m", short_run[1], "--data", val_path, "-d", "cpu")
    proc, out, err = signal_on(said, *args, script="hellaswag.py")
    assert proc.returncode == 130 and err.strip() == "interrupted", err


def test_cli_prints_accuracy(hf_dir, small, val_path):
    r = cli("-m", hf_dir, "-d", "cpu", "--data", val_path, "--limit", 20, "--batch-tokens", 300, script="hellaswag.py")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"HellaSwag {hf_dir}: 20 examples, float32\n")
    plain = small["plain"][:20]
    c = counts_by_hand(small["examples"][:20], [argmin(s) for s, _ in plain], [argmin(m) for _, m in plain])
    assert f"acc      {c['correct'] / 20:.4f}  ({c['correct']}/20)" in r.stdout
    assert f"acc_norm {c['correct_norm'] / 20:.4f}  ({c['correct_norm']}/20)" in r.stdout


def test_import_needs_neither_transformers_nor_the_trainer():
    code = "import sys, hellaswag; print([m for m in ('transformers', 'train_gpt2', 'datasets') if m in sys.modules])"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------------------
# HellaSwag in training: a file it cannot use is one warning naming training's flag, and
# training goes on


@pytest.mark.parametrize(
    "content, said",
    [
        ("", "{tmp}/hs.jsonl cannot be read: No such file or directory"),  # "": the file not written
        ('{"ctx": "no endings here"}\n', "{tmp}/hs.jsonl line 1: not a HellaSwag example (a list of 4 endings)"),
        # no --hellaswag-data, an empty cache, offline (conftest): the message names training's flag
        (
            None,
            "cannot download HellaSwag from https://huggingface.co (HF_HUB_OFFLINE is set); pass --hellaswag-data "
            "path/to/hellaswag_val.jsonl",
        ),
    ],
    ids=["missing", "broken", "no-data"],
)
def test_hellaswag_data_it_cannot_use_is_one_warning_kept_in_the_log_and_training_goes_on(
    data, tmp_path, capsys, monkeypatch, content, said
):
    """What the warning said at start is still there later, where the user looks: the log (and play.ipynb)."""
    monkeypatch.setattr(hellaswag, "DEFAULT_CACHE_DIR", str(tmp_path / "cache"))
    out, said = tmp_path / "out", said.format(tmp=tmp_path)
    args = tiny_args(data, out, "--max-steps", 2, "--hellaswag-every", 1, "--eval-every", 0)
    if content is not None:
        args += ["--hellaswag-data", str(tmp_path / "hs.jsonl")]
        if content:
            (tmp_path / "hs.jsonl").write_text(content)
    assert train_gpt2.main(args) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "HellaSwag evaluation is off" in line]
    assert warnings == [f"warning: HellaSwag evaluation is off for this run: {said}"]
    records, steps = read_log(out)
    assert sorted(steps) == [0, 1] and not any("hellaswag" in r for r in records)
    (header,) = [r for r in records if r.get("event") == "header"]
    assert header["config"]["hellaswag_off"] == said

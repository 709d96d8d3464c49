"""support/model_files.py through the scripts: a run's folder as the model means its newest checkpoint
that loads (said in a note), as --resume takes it; a folder with no model, or a mistyped name, is one line."""

import shutil

import pytest
import torch
from transformers import GPT2LMHeadModel

import export_hf
import hellaswag
import sample
import train_gpt2
from helpers import read_log, tiny_args, torch_loads, user_error


def test_init_from_a_run_folder_starts_from_its_newest_checkpoint(short_run, tmp_path):
    data, out = short_run
    loss = {}
    for name, spec in (("folder", out), ("newest", out / "ckpt_000002.pt"), ("older", out / "ckpt_000001.pt")):
        args = tiny_args(data, tmp_path / name, "--max-steps", 1, "--eval-every", 0, "--init-from", spec)
        assert train_gpt2.main(args) == 0
        loss[name] = read_log(tmp_path / name)[1][0]["train_loss"]
    assert loss["folder"] == loss["newest"] != loss["older"]


def test_a_folder_with_no_model_in_it_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    msg = user_error([tmp_path], sample.main)
    assert "neither a transformers model" in msg and "ckpt_*.pt" in msg


def test_a_mistyped_checkpoint_names_the_ones_its_folder_holds(short_run, tmp_path):
    out = short_run[1]
    msg = user_error([out / "ckpt_000009.pt"], sample.main)
    assert "ckpt_000009.pt' does not exist" in msg and msg.endswith(f"{out} holds ckpt_000002.pt, ckpt_000001.pt")
    msg = user_error([tmp_path / "gtp2"], sample.main)  # nothing beside it to suggest
    assert "does not exist, and is not a GPT-2 name (gpt2, " in msg and msg.endswith(
        f"{tmp_path} holds no checkpoint (ckpt_*.pt)"
    )


def skipped(err):
    """The one warning line a loader prints for a checkpoint it passes over."""
    (line,) = err.strip().splitlines()
    assert line.startswith("warning: skipping ") and "ckpt_000002.pt" in line, line
    return line


def test_every_loader_of_a_run_folder_falls_back_past_a_cut_short_newest_checkpoint(short_run, tmp_path, capsys):
    # as --resume does: the newest that loads, ckpt_000001.pt, said in one warning naming the file passed over
    out, older = tmp_path / "run", tmp_path / "run" / "ckpt_000001.pt"
    shutil.copytree(short_run[1], out)
    raw = (out / "ckpt_000002.pt").read_bytes()
    (out / "ckpt_000002.pt").write_bytes(raw[: len(raw) // 2])  # the newest checkpoint cut short
    capsys.readouterr()
    args = ["--prompt", "Hi", "--num-samples", "1", "--max-new-tokens", "4", "--device", "cpu"]
    assert sample.main([str(out), *args]) == 0
    said = capsys.readouterr()
    assert "cannot be loaded safely" in skipped(said.err) and f"using its newest checkpoint, {older}" in said.out
    assert sample.main([str(older), *args]) == 0
    assert said.out.splitlines()[1:] == capsys.readouterr().out.splitlines()  # the same samples
    assert export_hf.main([str(out), str(tmp_path / "hf")]) == 0
    skipped(capsys.readouterr().err)
    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").state_dict()["lm_head.weight"]
    ours = train_gpt2.load_model(str(older)).state_dict()["lm_head.weight"]
    assert torch.equal(exported, ours[: len(exported)])  # the export drops the padded vocabulary's rows
    capsys.readouterr()
    model = hellaswag.load_model(str(out), "cpu")  # hellaswag.py -m
    skipped(capsys.readouterr().err)
    assert torch.equal(model.state_dict()["lm_head.weight"], ours)  # hellaswag.py keeps the vocabulary as it is


def test_a_loader_passes_over_another_runs_checkpoint_in_a_run_folder(short_run, data, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(short_run[1], out)
    other = tmp_path / "other"
    assert train_gpt2.main(tiny_args(data, other, "--max-steps", 1, "--seed", 7, "--eval-every", 0)) == 0
    shutil.copy(other / "ckpt_000001.pt", out / "ckpt_000009.pt")  # the newest name, another run
    shutil.copy(other / "meta_000001.json", out / "meta_000009.json")  # with its meta: whose it is
    capsys.readouterr()
    weights = train_gpt2.load_model(str(out)).state_dict()["lm_head.weight"]
    said = capsys.readouterr()
    assert "ckpt_000009.pt: it holds run " in said.err and "not this folder's run" in said.err
    assert said.out.strip().endswith(f"using its newest checkpoint, {out / 'ckpt_000002.pt'}")
    assert torch.equal(weights, train_gpt2.load_model(str(out / "ckpt_000002.pt")).state_dict()["lm_head.weight"])


@pytest.mark.parametrize("reader", ["sample.py", "hellaswag.py -m", "export_hf.py"])
def test_a_run_folder_is_read_once_its_weights_mapped(short_run, tmp_path, monkeypatch, reader):
    """The checkpoint a run's folder means is the one loaded: one torch.load, its tensors mapped (only the weights
    are read, the optimizer's state never)."""
    out = short_run[1]
    loads = torch_loads(monkeypatch)
    if reader == "sample.py":
        assert sample.main([str(out), "--max-new-tokens", "1", "--device", "cpu"]) == 0
    elif reader == "hellaswag.py -m":
        hellaswag.load_model(str(out), "cpu")
    else:
        assert export_hf.main([str(out), str(tmp_path / "hf")]) == 0
    assert loads == [(str(out / "ckpt_000002.pt"), True)]

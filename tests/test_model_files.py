"""support/model_files.py, through real runs of train_gpt2.py: a run's folder where a model is
expected (--sample-from, --init-from) means its newest checkpoint, said in a note; a folder with no
model in it, or a mistyped checkpoint, is one line naming what the folder holds; a checkpoint that
is not there is one line through the command line too."""

import subprocess
import sys

import torch

import train_gpt2
from helpers import ROOT, read_log, tiny_args, user_error


def test_a_run_folder_as_the_model_means_its_newest_checkpoint(short_run, capsys):
    out = short_run[1]  # ckpt_000001.pt and ckpt_000002.pt
    args = ["--prompt", "Hi", "--num-samples", "1", "--max-new-tokens", "4", "--device", "cpu"]
    assert train_gpt2.main(["--sample-from", str(out), *args]) == 0
    note, *from_folder = capsys.readouterr().out.splitlines()
    assert note.endswith(f"using its newest checkpoint, {out / 'ckpt_000002.pt'}")
    assert train_gpt2.main(["--sample-from", str(out / "ckpt_000002.pt"), *args]) == 0
    assert from_folder == capsys.readouterr().out.splitlines()
    weights = lambda spec: train_gpt2.load_model(str(spec)).state_dict()["lm_head.weight"]  # noqa: E731
    assert torch.equal(weights(out), weights(out / "ckpt_000002.pt"))
    assert not torch.equal(weights(out), weights(out / "ckpt_000001.pt"))  # the newest, not any


def test_init_from_a_run_folder_starts_from_its_newest_checkpoint(short_run, tmp_path):
    data, out = short_run
    loss = {}
    for name, spec in (("folder", out), ("newest", out / "ckpt_000002.pt"), ("older", out / "ckpt_000001.pt")):
        assert (
            train_gpt2.main(tiny_args(data, tmp_path / name, "--max-steps", 1, "--eval-every", 0, "--init-from", spec))
            == 0
        )
        loss[name] = read_log(tmp_path / name)[1][0]["train_loss"]
    assert loss["folder"] == loss["newest"] != loss["older"]


def test_a_folder_with_no_model_in_it_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    msg = user_error(["--sample-from", tmp_path])
    assert "neither a transformers model" in msg and "ckpt_*.pt" in msg


def test_a_mistyped_checkpoint_names_the_ones_its_folder_holds(short_run, tmp_path):
    out = short_run[1]
    msg = user_error(["--sample-from", out / "ckpt_000009.pt"])
    assert "ckpt_000009.pt' does not exist" in msg and msg.endswith(f"{out} holds ckpt_000002.pt, ckpt_000001.pt")
    msg = user_error(["--sample-from", tmp_path / "gtp2"])  # nothing beside it to suggest
    assert "does not exist, and is not a GPT-2 name (gpt2, " in msg and "holds" not in msg


def test_sample_cli_bad_model_is_one_line_error(tmp_path):
    r = subprocess.run(
        [sys.executable, "train_gpt2.py", "--sample-from", str(tmp_path / "missing.pt"), "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error:")

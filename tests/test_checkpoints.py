"""support/checkpoints.py, through real runs of train_gpt2.py: a failed checkpoint write stops the
run in one line, the earlier checkpoints whole; non-finite weights are never saved; pruning removes
only this run's checkpoints, beyond its newest; a truncated checkpoint, or one that carries pickled
code, is refused when loaded."""

import errno
import math
import os
import pathlib
import shutil

import numpy as np
import pytest
import torch

import sample
import train_gpt2
from helpers import fail_nth_write, random_shards, read_log, same_weights, tiny_args, user_error
from support import checkpoints, files
from support.checkpoints import load_checkpoint, load_training_checkpoint
from support.cli import UserError

# ----------------------------------------------------------------------------------------------
# A checkpoint write that fails


def fail_nth_open(monkeypatch, n, code, reason):
    """The n-th checkpoint file train_gpt2 opens for writing fails with OSError(code, reason)."""
    opened = []

    def open_(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".pt.tmp"):
            opened.append(path)
            if len(opened) == n:
                raise OSError(code, reason, str(path))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(files, "open", open_, raising=False)  # files.write_atomic writes the checkpoints
    return opened


@pytest.mark.parametrize(
    "fault, reason", [("disk-full", "No space left on device"), ("read-only", "Read-only file system")]
)
def test_failing_checkpoint_write_stops_in_one_line_and_keeps_the_previous(tmp_path, monkeypatch, fault, reason):
    data = random_shards(tmp_path / "data")
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 4, "--ckpt-every", 1, "--eval-every", 0)
    if fault == "disk-full":
        fail_nth_write(monkeypatch, files, ".pt.tmp", 3, room=100_000)  # torch.save fails inside a tensor
    else:
        fail_nth_open(monkeypatch, 3, errno.EROFS, reason)
    msg = user_error(args)
    assert reason in msg and "ckpt_000003.pt" in msg
    assert sorted(os.listdir(out)) == ["ckpt_000001.pt", "ckpt_000002.pt", "log.jsonl"]  # no partial file left
    assert max(read_log(out)[1]) == 2  # stopped at the failed write, not after more steps
    previous = load_training_checkpoint(str(out / "ckpt_000002.pt"))
    monkeypatch.undo()  # the disk has room again: the run continues from the previous checkpoint
    assert (
        train_gpt2.main(tiny_args(data, out, "--max-steps", 4, "--ckpt-every", 1, "--eval-every", 0, "--resume")) == 0
    )
    ref = tmp_path / "ref"
    assert train_gpt2.main(tiny_args(data, ref, "--max-steps", 4, "--ckpt-every", 1, "--eval-every", 0)) == 0
    assert same_weights(previous["model"], load_checkpoint(str(ref / "ckpt_000002.pt"))["model"])
    assert same_weights(
        load_checkpoint(str(out / "ckpt_000004.pt"))["model"], load_checkpoint(str(ref / "ckpt_000004.pt"))["model"]
    )


def test_a_failed_first_checkpoint_write_does_not_claim_earlier_ones(data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    fail_nth_open(monkeypatch, 1, errno.ENOSPC, "No space left on device")
    msg = user_error(tiny_args(data, out, "--max-steps", 4, "--ckpt-every", 2, "--eval-every", 0))
    assert f"no earlier checkpoint is in {tmp_path / 'out'}" in msg and "intact" not in msg
    assert "start the run again in a new --out-dir" in msg
    monkeypatch.undo()  # room again: the advice, a new --out-dir, starts the run again and finishes it
    assert (
        train_gpt2.main(tiny_args(data, tmp_path / "new", "--max-steps", 4, "--ckpt-every", 2, "--eval-every", 0)) == 0
    )
    assert (tmp_path / "new" / "ckpt_000004.pt").exists()


# ----------------------------------------------------------------------------------------------
# What is kept: finite weights only, and pruning removes only this run's checkpoints


def test_weights_that_are_not_finite_are_never_saved(data, tmp_path, short_run):
    """A checkpoint of non-finite weights is refused by save_training_state itself, in one line."""
    model = train_gpt2.load_model(str(short_run[1] / "ckpt_000002.pt"))
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = math.inf
    out = tmp_path / "out"
    out.mkdir()
    args, _ = train_gpt2.parse_args(tiny_args(data, out))
    ckpt = {"model": model.state_dict(), "step": 3, "val_loss": None, "train_config": vars(args)}
    with pytest.raises(
        UserError, match=r"the weights after 3 steps are not finite \(transformer.h.0.mlp.c_fc.weight\)"
    ):
        checkpoints.save_training_state(ckpt, str(out), 3, master_process=True, ddp=False, stop=None)
    assert os.listdir(out) == []


def test_pruning_removes_only_this_runs_checkpoints(data, tmp_path):
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 2, "--ckpt-every", 1, "--eval-every", 0)) == 0
    # another run's checkpoint lands in the folder (copied there by hand); this run then resumes
    other = tmp_path / "other"
    assert train_gpt2.main(tiny_args(data, other, "--max-steps", 1, "--seed", 7, "--eval-every", 0)) == 0
    shutil.copy(other / "ckpt_000001.pt", out / "ckpt_000000.pt")
    foreign = (out / "ckpt_000000.pt").read_bytes()
    args = tiny_args(data, out, "--max-steps", 5, "--ckpt-every", 1, "--keep-ckpts", 2, "--eval-every", 0, "--resume")
    assert train_gpt2.main(args) == 0
    names = sorted(p.name for p in out.glob("ckpt_*.pt"))
    assert names == ["ckpt_000000.pt", "ckpt_000004.pt", "ckpt_000005.pt"]  # this run's newest 2, and theirs
    assert (out / "ckpt_000000.pt").read_bytes() == foreign


# ----------------------------------------------------------------------------------------------
# Loading: a checkpoint cut short, or one that carries code, is refused


def test_truncated_checkpoint(short_run, tmp_path):
    data, out = short_run
    raw = (out / "ckpt_000002.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) // 2])
    msg = user_error(tiny_args(data, tmp_path / "out", "--resume", tmp_path / "cut.pt"))
    assert "cut.pt" in msg and "cannot be loaded" in msg


def test_pickle_carrying_code_is_refused(short_run, tmp_path):
    data, _ = short_run
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    torch.save({"model": Evil(), "model_config": {}}, tmp_path / "evil.pt")
    msg = user_error(tiny_args(data, tmp_path / "out", "--resume", tmp_path / "evil.pt"))
    assert "evil.pt" in msg and not marker.exists()
    torch.load(tmp_path / "evil.pt", weights_only=False)  # the file really does carry code:
    assert marker.exists()  # loaded unsafely, it runs


@pytest.mark.parametrize("model_config", [{"n_layer": 2}, [2, 2, 32]], ids=["keys missing", "not a dict"])
def test_a_checkpoint_whose_model_config_is_no_gpts_is_refused_when_loaded(tmp_path, model_config):
    """Checked once in load_checkpoint, for every reader (training, hellaswag.py, sample.py, export_hf.py)."""
    torch.save({"model": {}, "model_config": model_config}, tmp_path / "ckpt.pt")
    with pytest.raises(
        UserError, match=r"ckpt\.pt is not a train_gpt2\.py checkpoint \(no model / GPT model_config\)$"
    ):
        load_checkpoint(str(tmp_path / "ckpt.pt"))


@pytest.mark.parametrize("spec", ["a numpy scalar", "an object"])
def test_a_refused_pickle_says_what_the_file_is_not_and_what_works(tmp_path, hf_tiny_dir, spec):
    # a file torch.load(weights_only=True) refuses: one line saying it is no train_gpt2.py
    # checkpoint, never torch's "weights_only=False will likely succeed" for a file no one vouched for
    path = tmp_path / "model.pt"
    torch.save({"model": np.float64(1.0) if spec == "a numpy scalar" else pathlib.PurePath("x")}, path)
    args = ["--prompt", "Hi", "--num-samples", "1", "--max-new-tokens", "2", "--device", "cpu"]
    msg = user_error([path, *args], sample.main)
    assert msg.startswith(f"{path} is not a checkpoint written by train_gpt2.py (or is one of an older format)")
    assert "weights_only" not in msg and "\x1b" not in msg  # torch's advice and its terminal colours
    assert "a transformers GPT-2 as its folder (config.json beside its weights, as save_pretrained writes it)" in msg
    assert sample.main([str(hf_tiny_dir), *args]) == 0  # the advice: such a folder loads

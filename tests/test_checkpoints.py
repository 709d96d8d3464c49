"""support/checkpoints.py, the checkpoint's file format: a truncated checkpoint, a flipped bit, one
that carries pickled code or is no GPT's, is refused in one line when loaded. (Writing and pruning
them: test_run_folder.py.)"""

import pathlib

import numpy as np
import pytest
import torch

import sample
from helpers import tiny_args, user_error
from support.checkpoints import load_checkpoint
from support.cli import UserError

# ----------------------------------------------------------------------------------------------
# Loading: a checkpoint cut short, or one that carries code, is refused


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


def test_a_flipped_bit_in_a_weight_is_refused_when_mapped_too(short_run, tmp_path):
    """torch.load never checks the zip's CRCs: load_checkpoint does, its tensors mapped as read
    (read: tests/test_resume.py's corrupt checkpoint)."""
    path, flipped = short_run[1] / "ckpt_000002.pt", tmp_path / "flipped.pt"
    raw = bytearray(path.read_bytes())
    weight = load_checkpoint(str(path))["model"]["transformer.h.0.mlp.c_fc.weight"].numpy().tobytes()
    at = raw.find(weight)  # the tensor's bytes, wherever the zip put them
    assert at > 0
    raw[at + len(weight) // 2] ^= 1
    flipped.write_bytes(raw)
    torch.load(flipped, weights_only=True)  # torch alone loads it, the bit flipped
    with pytest.raises(UserError, match=r"flipped\.pt is corrupt: its \S+/data/\d+ fails the zip CRC check$"):
        load_checkpoint(str(flipped), mmap=True)


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

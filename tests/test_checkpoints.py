"""support/checkpoints.py, the checkpoint's file format: a truncated checkpoint, a flipped bit, one
that carries pickled code or is no GPT's, is refused in one line when loaded. (Writing and pruning
them: test_run_folder.py.)"""

import pathlib

import numpy as np
import pytest
import torch

import sample
from helpers import user_error
from support.checkpoints import load_checkpoint
from support.cli import UserError

# ----------------------------------------------------------------------------------------------
# Loading: a checkpoint cut short, or one that carries code, is refused


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


@pytest.mark.parametrize("spec", ["a numpy scalar", "an object", "code"])
def test_a_refused_pickle_says_what_the_file_is_not_and_what_works(tmp_path, hf_tiny_dir, spec):
    # a file torch.load(weights_only=True) refuses, code it would run included, runs none: one line saying
    # it is no train_gpt2.py checkpoint, never torch's "weights_only=False will likely succeed"
    path, marker = tmp_path / "model.pt", tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    stored = {"a numpy scalar": np.float64(1.0), "an object": pathlib.PurePath("x"), "code": Evil()}[spec]
    torch.save({"model": stored}, path)
    args = ["--prompt", "Hi", "--num-samples", "1", "--max-new-tokens", "2", "--device", "cpu"]
    msg = user_error([path, *args], sample.main)
    assert msg.startswith(f"{path} is not a checkpoint written by train_gpt2.py (or is one of an older format)")
    assert "weights_only" not in msg and "\x1b" not in msg  # torch's advice and its terminal colours
    assert "a transformers GPT-2 as its folder (config.json beside its weights, as save_pretrained writes it)" in msg
    assert sample.main([str(hf_tiny_dir), *args]) == 0  # the advice: such a folder loads
    assert not marker.exists()
    if spec == "code":  # the file really does carry code: loaded unsafely, it runs
        torch.load(path, weights_only=False)
        assert marker.exists()

"""torch.compile on the CPU: the losses of eager, with evals, samples and checkpoints; where it cannot
work (a C++ compiler that fails), the default trains eager with a note (--compile there is one line:
test_device.py)."""

import os

import pytest
import torch

import train_gpt2
from helpers import cli, read_log, tiny_args
from support.checkpoints import load_checkpoint
from support.device import compile_problem


@pytest.mark.slow
def test_compiled_run_matches_eager_and_evaluates(data, tmp_path, assets):
    flags = "--max-steps 3 --eval-every 3 --hellaswag-every 3 --hellaswag-limit 4 --sample-every 3 --num-samples 1"
    common = (*flags.split(), "--max-new-tokens", 6, "--hellaswag-data", assets.hellaswag)
    assert train_gpt2.main(tiny_args(data, tmp_path / "eager", *common, "--no-compile")) == 0
    assert compile_problem("cpu") is None  # the start-up check's graph: compiled (and its answer kept) before counting
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert train_gpt2.main(tiny_args(data, tmp_path / "compiled", *common, "--compile")) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it really compiled

    eager, eager_steps = read_log(tmp_path / "eager")
    compiled, compiled_steps = read_log(tmp_path / "compiled")
    assert compiled[0]["config"]["compile"] is True and eager[0]["config"]["compile"] is False
    assert sorted(compiled_steps) == [0, 1, 2]
    for s in range(3):
        assert compiled_steps[s]["train_loss"] == pytest.approx(eager_steps[s]["train_loss"], rel=1e-4)
    for key in ("val_loss", "hellaswag", "samples"):
        a = [(r["step"], r[key]) for r in compiled if key in r]
        b = [(r["step"], r[key]) for r in eager if key in r]
        assert [s for s, _ in a] == [s for s, _ in b] and a
        if key == "val_loss":
            assert [v for _, v in a] == pytest.approx([v for _, v in b], rel=1e-4)
    # the checkpoint holds the plain module's names and loads into a plain GPT
    ckpt = load_checkpoint(str(tmp_path / "compiled" / "ckpt_000003.pt"))
    assert set(ckpt["model"]) == set(train_gpt2.GPT(train_gpt2.GPTConfig(**ckpt["model_config"])).state_dict())
    train_gpt2.load_model(str(tmp_path / "compiled" / "ckpt_000003.pt"))


# --- where compile cannot work ------------------------------------------------------------------


def broken_compiler(tmp_path):
    """The environment of a process whose C++ compiler (Inductor's CXX) fails, with an empty kernel cache."""
    cxx = tmp_path / "cxx"
    cxx.write_text("#!/bin/sh\nexit 1\n")
    cxx.chmod(0o755)
    return {**os.environ, "CXX": str(cxx), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor_cache")}


# train_gpt2.py with compile the default on the CPU, as on CUDA
DEFAULT_COMPILE_ON_CPU = """
import sys
import support.device
support.device.COMPILE_BY_DEFAULT = ("cuda", "cpu")
import train_gpt2
from support.cli import run_cli
run_cli(lambda: train_gpt2.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_default_compile_with_a_broken_compiler_notes_it_and_trains_eager(data, tmp_path):
    extra = ("--max-steps", 2, "--eval-every", 2)
    args = tiny_args(data, tmp_path / "fallback", *extra)
    r = cli(DEFAULT_COMPILE_ON_CPU, *args, script="-c", env=broken_compiler(tmp_path))  # python -c SCRIPT args
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    notes = [line for line in r.stdout.splitlines() if "torch.compile" in line]
    assert len(notes) == 1 and notes[0].startswith("note: torch.compile does not work on this cpu"), r.stdout
    assert "C++ compiler" in notes[0]
    # eager: the header says so, and every loss is the --no-compile run's, bit for bit
    assert train_gpt2.main(tiny_args(data, tmp_path / "eager", *extra, "--no-compile")) == 0
    fallback, fallback_steps = read_log(tmp_path / "fallback")
    eager, eager_steps = read_log(tmp_path / "eager")
    assert fallback[0]["config"]["compile"] is False
    assert [fallback_steps[s]["train_loss"] for s in (0, 1)] == [eager_steps[s]["train_loss"] for s in (0, 1)]
    assert [r["val_loss"] for r in fallback if "val_loss" in r] == [r["val_loss"] for r in eager if "val_loss" in r]

"""torch.compile on the CPU (inductor): the same losses as eager, and val loss, HellaSwag,
sampling and checkpoints all work while it is on. One compile: the first costs ~25 s cold."""

import pytest
import torch

import train_gpt2
from conftest import random_shards, read_log, tiny_args
from support.checkpoints import load_checkpoint


def test_compiled_run_matches_eager_and_evaluates(tmp_path, shared_data):
    data = random_shards(tmp_path / "data")
    common = (
        "--max-steps",
        3,
        "--eval-every",
        3,
        "--hellaswag-every",
        3,
        "--hellaswag-limit",
        4,
        "--hellaswag-data",
        shared_data / "hellaswag" / "hellaswag_val.jsonl",
        "--sample-every",
        3,
        "--num-samples",
        1,
        "--max-new-tokens",
        6,
    )
    assert train_gpt2.main(tiny_args(data, tmp_path / "eager", *common, "--no-compile")) == 0
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

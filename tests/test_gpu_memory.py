"""The micro-batch a GPU's memory fits, from the recipe's peak measured on an H100 (41.2 GiB at
B 64, T 1024): the arithmetic against numbers worked by hand, and the out-of-memory message that
names the -B it gives. No GPU needed: the device's size is what the message reads from torch."""

from types import SimpleNamespace

import pytest
import torch

from support.machine import fitting_B, training_memory
from support.out_of_memory import oom_phase, training_out_of_memory
from train_gpt2 import GPTConfig, parse_args

GiB = 2**30

# Worked by hand: the fixed part is 16 bytes (fp32 weight, gradient, AdamW's two moments) x
# 124,475,904 parameters = 1.855 GiB; the rest of 41.2 GiB over B 64 is (41.2 - 1.855) / 64 =
# 0.6148 GiB a row of 1,024 tokens. So B 8 needs 6.77 GiB, B 16 11.69, B 32 21.53, B 64 41.2,
# each held against 90% of the card.


def test_memory_estimate_is_the_measured_peak_at_B_64():
    assert training_memory(64, 1024) == pytest.approx(41.2 * GiB)
    assert training_memory(16, 1024) / GiB == pytest.approx(11.69, abs=0.01)


@pytest.mark.parametrize(
    "B, T, memory_gib, expected",
    [
        (64, 1024, 80, 64),  # 72 GiB usable: B 64 fits
        (64, 1024, 40, 32),  # 36 usable < 41.2
        (64, 1024, 24, 32),  # 21.6 usable >= 21.53
        (64, 1024, 23.65, 16),  # 21.29 usable < 21.53: a 24 GB card as CUDA reports it
        (64, 1024, 16, 16),  # 14.4 usable
        (64, 1024, 8, 8),  # 7.2 usable >= 6.77
        (48, 1024, 24, 24),  # 32 does not divide 48 (the total batch would not stay whole); 24 needs 16.61
        (64, 2048, 24, 16),  # a row of 2,048 tokens is two of 1,024: B 16 needs 21.53
        (64, 1024, 2, None),  # 1.8 usable: not even the fixed 1.855
    ],
)
def test_memory_estimate_picks_the_largest_divisor_of_B_that_fits(B, T, memory_gib, expected):
    assert fitting_B(B, T, memory_gib * GiB) == expected


def first_step_error(tmp_path, config, autocast_dtype, *flags):
    """The error of a run that ran out of GPU memory in its first step, as run_cli gets it."""
    args, _ = parse_args(["--out-dir", str(tmp_path / "out"), *flags])
    run = SimpleNamespace(
        args=args, model=SimpleNamespace(config=config), device="cuda:0", autocast_dtype=autocast_dtype
    )
    with pytest.raises(torch.OutOfMemoryError) as raised, oom_phase("training step", run=run, step=0, first=True):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return raised.value


def test_out_of_gpu_memory_names_the_B_the_memory_estimate_fits_where_it_holds(tmp_path, monkeypatch):
    asked = []

    def properties(device):
        asked.append(device)
        return SimpleNamespace(total_memory=int(23.65 * GiB))

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    recipe = GPTConfig(vocab_size=50304)
    line = training_out_of_memory(first_step_error(tmp_path, recipe, torch.bfloat16))
    assert asked == ["cuda:0"]
    assert line == (
        "in the first training step (-B 64 rows of -T 1024): lower -B (e.g. -B 16, which this GPU's 23.6 GiB "
        "should fit, see docs/gpus.md: the total batch stays 524,288 tokens, accumulated over more micro-steps); "
        "no checkpoint was written yet: --resume -B 16 starts the run again"
    )
    assert "e.g. -B 16, which" in training_out_of_memory(first_step_error(tmp_path, recipe, torch.float16))
    # where the estimate does not hold, the advice halves -B: fp32 (no autocast), another model,
    # and a -B the estimate says fits but that has just run out (an eager run, another process)
    halved = "lower -B (e.g. -B 32: the total batch"
    assert halved in training_out_of_memory(first_step_error(tmp_path, recipe, None))
    wider = GPTConfig(vocab_size=50304, n_layer=24, n_head=16, n_embd=1024)
    assert halved in training_out_of_memory(first_step_error(tmp_path, wider, torch.bfloat16))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GiB))
    assert halved in training_out_of_memory(first_step_error(tmp_path, recipe, torch.bfloat16))

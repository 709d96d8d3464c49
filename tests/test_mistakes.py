"""Ordinary user mistakes thrown at train_gpt2.py (the rules in docs/reliability.md): each is refused
in one line before any training step, or works as the user meant; nothing that existed in the
folders is gone or changed. Rule 1 (--export-hf) lives in test_export.py, rule 6 in test_fineweb.py."""

import json
import os
import signal
import time

import pytest

import train_gpt2
from helpers import assert_one_line_error, cli, random_shards, read_log, start_run, tiny_args

# ----------------------------------------------------------------------------------------------
# Rule 4: what runs mid-training is exercised before step 0


def test_a_broken_hellaswag_file_warns_at_start_and_training_goes_on(data, tmp_path, capsys):
    bad = tmp_path / "hs.jsonl"
    bad.write_text('{"ctx": "no endings here"}\n')
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 2, "--hellaswag-every", 1, "--hellaswag-data", bad, "--eval-every", 0)
    assert train_gpt2.main(args) == 0
    assert "HellaSwag evaluation is off" in capsys.readouterr().err
    assert sorted(read_log(out)[1]) == [0, 1]


# ----------------------------------------------------------------------------------------------
# Rule 7: Ctrl-C is prompt and clean


@pytest.mark.parametrize("delay", [0.3, 1.5, 4.0])
def test_ctrl_c_during_start_up_is_one_line(data, tmp_path, delay):
    proc = start_run(*tiny_args(data, tmp_path / "out", "--max-steps", 100000, "--warmup-steps", 1))
    time.sleep(delay)  # importing torch, building the model, reading the data, or the first steps
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    said = [line for line in err.strip().splitlines() if not line.startswith("warning: this run trains on")]
    assert "Traceback" not in err and len(said) <= 1, err


def test_a_second_ctrl_c_stops_at_once_in_one_line(data, tmp_path):
    proc = start_run(
        *tiny_args(
            data, tmp_path / "out", "--max-steps", 100000, "--warmup-steps", 1, "--eval-every", 1, "--val-tokens", 512
        )
    )
    for line in proc.stdout:
        if line.startswith("step     2/"):
            break
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    said = [line for line in err.strip().splitlines() if not line.startswith("warning: this run trains on")]
    assert "Traceback" not in err and len(said) <= 1, err


def ctrl_c_during_step_0_eval(proc, out, delay):
    """Ctrl-C `delay` s into step 0's evaluation (it starts right after log.jsonl appears), then a
    clean exit 130 with no traceback. -> (stderr, seconds the stop took)."""
    deadline = time.time() + 120
    while not (out / "log.jsonl").exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(delay)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    return err, time.time() - t0


def test_ctrl_c_during_a_long_val_eval_stops_promptly_with_a_checkpoint(tmp_path):
    data = random_shards(tmp_path / "data", train_lengths=(5000,), val_length=3_000_000)  # an eval of minutes
    out = tmp_path / "out"
    proc = start_run(
        *tiny_args(
            data,
            out,
            "--max-steps",
            100,
            "--warmup-steps",
            1,
            "--eval-every",
            1,
            "--val-tokens",
            2_900_000,
            "-B",
            64,
            "--total-batch-size",
            1024,
        )
    )
    err, waited = ctrl_c_during_step_0_eval(proc, out, delay=11)  # past the first progress line (every 10 s)
    assert waited < 60, f"the stop request waited {waited:.0f} s for the eval"  # the whole eval takes minutes
    assert (out / "ckpt_000000.pt").exists() and "val_loss" not in (out / "log.jsonl").read_text()
    assert "val loss: batch " in err  # the long eval said where it was


def test_ctrl_c_during_an_in_training_hellaswag_eval_stops_promptly_with_a_checkpoint(tmp_path, shared_data):
    # the full HellaSwag set with the padded 50,304-wide head: an eval of about a minute on 2 cores
    data = random_shards(tmp_path / "data", train_lengths=(5000,), val_length=2000)
    out = tmp_path / "out"
    proc = start_run(
        *tiny_args(
            data,
            out,
            "--max-steps",
            100,
            "--warmup-steps",
            1,
            "--eval-every",
            0,
            "--hellaswag-every",
            1,
            "--hellaswag-data",
            shared_data / "hellaswag" / "hellaswag_val.jsonl",
        )
    )
    err, waited = ctrl_c_during_step_0_eval(proc, out, delay=3)
    assert waited < 20, f"the stop request waited {waited:.0f} s for the HellaSwag eval"
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert (out / "ckpt_000000.pt").exists() and not any("hellaswag" in r for r in records)


# ----------------------------------------------------------------------------------------------
# Rule 8: friction


def test_help_shows_defaults_and_the_usage_examples_intact():
    r = cli("--help", env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0
    assert "python fineweb.py && torchrun --standalone --nproc_per_node=8 train_gpt2.py   # the full recipe" in r.stdout
    assert "-T 64 \\\n        --total-batch-size 4096" in r.stdout  # a continued line stays one to copy
    flat = " ".join(r.stdout.split())
    for text in ("(default: 64)", "(default: 524288)", "(default: 0.0006)", "(default: 715)", "(default: log)"):
        assert text in flat, text


def test_a_write_error_that_is_not_a_full_disk_does_not_say_make_room(data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.jsonl").mkdir()  # the log cannot be opened: not a question of space
    r = cli(*tiny_args(data, out, "--resume"))
    line = assert_one_line_error(r, "log.jsonl")
    assert "make room" not in line
    json.dumps(line)

"""support/run_log.py, through real runs of train_gpt2.py: a failed log.jsonl write stops the run in
one line; the log begins with the run's header, and each step line shows the ETA. (Never opened
through a symbolic link: test_run_folder.py; read back by strict JSON readers: test_divergence.py,
test_notebook.py.)"""

import os
import re

import train_gpt2
from helpers import fail_nth_write, read_log, tiny_args, user_error
from support import run_log
from support.checkpoints import load_training_checkpoint


def test_failing_log_write_stops_in_one_line(data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    fail_nth_write(monkeypatch, run_log, "log.jsonl", 1, room=3000)  # room for the header and a few steps
    msg = user_error(tiny_args(data, out, "--max-steps", 50, "--ckpt-every", 1, "--eval-every", 0))
    assert "log.jsonl" in msg and "No space left on device" in msg and "--resume" in msg
    last = max(read_log(out)[1])  # the record cut short is skipped
    assert 0 < last < 49
    # stopped at once: the checkpoints on disk are those of the steps before the failed record
    assert sorted(n for n in os.listdir(out) if n[:5] != "meta_")[-2:] == [f"ckpt_{last + 1:06d}.pt", "log.jsonl"]
    load_training_checkpoint(str(out / f"ckpt_{last + 1:06d}.pt"))


def test_the_eta_counts_the_steps_and_each_eval_apart():
    clock = [100.0]  # time.monotonic's seconds, moved on by hand
    eta = run_log.StepClock(10, {"val_loss": 5, "hellaswag": 0, "samples": 4}, now=lambda: clock[0])
    for record, seconds in [  # each record logged that many seconds after the one before it
        ({"event": "header"}, 0.0),
        ({"step": 0, "val_loss": 5.0}, 30.0),  # an eval runs before its step's training step
        ({"step": 0, "dt_ms": 60_000.0}, 60.0),  # the process's first step (its compile): left out
        ({"step": 1, "dt_ms": 1000.0}, 1.0),
        ({"step": 2, "dt_ms": 2000.0}, 2.0),
        ({"step": 3, "samples": ["..."]}, 7.0),
        ({"step": 3, "dt_ms": 1000.0}, 1.0),
    ]:
        clock[0] += seconds
        eta.saw(record)
    # the median step is 1 s (of 1, 2 and 1 s). Left after step 3: steps 4..9; val loss at 5 and 10
    # (30 s each), samples at 4, 8 and 10 (7 s each); after step 9: val loss and samples at 10
    assert eta.elapsed_and_eta(3) == "elapsed 1m41s | eta 1m27s"  # 6 x 1 + 2 x 30 + 3 x 7 = 87 s
    assert eta.elapsed_and_eta(9).endswith("| eta 37s")  # 30 + 7
    assert [run_log.duration(s) for s in (45, 725, 10920)] == ["45s", "12m05s", "3h02m"]


def test_the_log_begins_with_the_header_and_the_step_line_shows_the_eta(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert train_gpt2.main(tiny_args(data, out, "--eval-every", 2)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if re.match(r"step +\d+/6 ", line)]
    assert len(lines) == 6 and lines[0].endswith("| eta --")  # no step timed yet
    assert all(re.search(r"\| elapsed \d+s \| eta \d+s$", line) for line in lines[1:])
    records, steps = read_log(out)
    assert records[0]["event"] == "header" and records[0]["config"]["max_steps"] == 6 and records[0]["versions"]
    assert all(
        set(r) == {"step", "train_loss", "lr", "grad_norm", "dt_ms", "tok_per_sec", "mfu", "tokens", "epoch"}
        for r in steps.values()
    )

"""support/run_log.py, through a real run of train_gpt2.py: a log.jsonl write that fails (a full
disk) stops the run at once in one line naming the log and --resume, the checkpoints of the steps
logged before it whole. (The log read back by strict JSON readers: a NaN val loss in
test_divergence.py, play.ipynb in test_notebook.py.)"""

import os

from helpers import fail_nth_write, random_shards, read_log, tiny_args, user_error
from support import run_log
from support.checkpoints import load_training_checkpoint


def test_failing_log_write_stops_in_one_line(tmp_path, monkeypatch):
    data = random_shards(tmp_path / "data")
    out = tmp_path / "out"
    fail_nth_write(monkeypatch, run_log, "log.jsonl", 1, room=3000)  # room for the header and a few steps
    msg = user_error(tiny_args(data, out, "--max-steps", 50, "--ckpt-every", 1, "--eval-every", 0))
    assert "log.jsonl" in msg and "No space left on device" in msg and "--resume" in msg
    last = max(read_log(out)[1])  # the record cut short is skipped
    assert 0 < last < 49
    # stopped at once: the checkpoints on disk are those of the steps before the failed record
    assert sorted(os.listdir(out))[-2:] == [f"ckpt_{last + 1:06d}.pt", "log.jsonl"]
    load_training_checkpoint(str(out / f"ckpt_{last + 1:06d}.pt"))

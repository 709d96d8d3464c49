"""support/run_log.py, through real runs of train_gpt2.py: a failed log.jsonl write stops the run in
one line; the log is never opened through a symbolic link; a log deleted mid-run is written again
after the run's header; another user's log is named as theirs. (Read back by strict JSON readers:
test_divergence.py, test_notebook.py.)"""

import errno
import os
import re
import subprocess

import pytest

import train_gpt2
from helpers import as_typed, at_step, fail_nth_write, random_shards, read_log, state_of, tiny_args, user_error
from support import files, run_log
from support.checkpoints import load_training_checkpoint
from support.files import LinkedName
from support.out_dir import LOCK_FILE, log_runs


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


# ----------------------------------------------------------------------------------------------
# log.jsonl deleted while the run trains


def test_a_log_deleted_mid_run_is_written_again_at_its_path(data, tmp_path, monkeypatch, capsys):
    """Noticed at the next record (one fstat), said in one warning; a fresh header, then every later record."""
    out = tmp_path / "out"
    log = out / "log.jsonl"
    at_step(monkeypatch, {3: log.unlink})
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 6)) == 0
    err = capsys.readouterr().err
    assert sum(line.startswith("warning:") and "log.jsonl" in line for line in err.splitlines()) == 1
    assert f"warning: {log} was deleted while this run trained" in err
    records, steps = read_log(out)
    assert sorted(steps) == [3, 4, 5]  # the records from step 3 on, none lost
    heads = [r for r in records if r.get("event") == "header"]
    assert len(heads) == 1 and heads[0]["reopened"] and heads[0]["config"]
    assert records[0] is heads[0]  # the header comes first: resume and play.ipynb read it as the run
    assert log_runs(str(log)) == [heads[0]["run_id"]]


def test_a_log_of_another_user_in_a_writable_folder_names_its_owner_and_the_copy_that_resumes(
    data, tmp_path, monkeypatch
):
    """The owner and the copy that resumes, in one line (the refusal simulated for root; the advice run for real)."""
    nobody = pytest.importorskip("pwd").getpwnam("nobody")
    out = tmp_path / "run"
    args = tiny_args(data, out, "--max-steps", 2, "--ckpt-every", 2, "--eval-every", 0)
    assert train_gpt2.main(args) == 0
    os.chown(out / "log.jsonl", nobody.pw_uid, nobody.pw_gid)

    def not_mine(self):
        raise PermissionError(errno.EACCES, "Permission denied", self.path)

    monkeypatch.setattr(run_log.RunLog, "open", not_mine)
    msg = user_error([*args, "--max-steps", 4, "--resume"])
    monkeypatch.undo()
    mine = f"{out}_mine"
    assert msg == (
        f"{out / 'log.jsonl'} belongs to nobody and this user may not write it: the run is theirs to continue; "
        f"to continue it as yours, copy its folder to one of your own and resume there (cp -r {out} {mine} && "
        f"python train_gpt2.py --resume --out-dir {mine})"
    )
    assert not (out / LOCK_FILE).exists() and len(read_log(out)[1]) == 2  # the folder as it was
    assert as_typed(re.search(r"\((cp -r .+)\)$", msg)[1], "--max-steps", 4).returncode == 0
    assert sorted(read_log(mine)[1]) == [0, 1, 2, 3] and (tmp_path / "run_mine" / "ckpt_000004.pt").exists()


def test_a_log_path_that_cannot_be_written_again_stops_in_one_line(data, tmp_path, monkeypatch):
    """log.jsonl deleted and a folder put at its name: the run stops at its next record in one line."""
    out = tmp_path / "out"
    log = out / "log.jsonl"

    def block():
        log.unlink()
        log.mkdir()

    at_step(monkeypatch, {3: block})
    msg = user_error(tiny_args(data, out, "--max-steps", 6))
    assert str(log) in msg and "--resume" in msg


# ----------------------------------------------------------------------------------------------
# log.jsonl is never written through a symbolic link


@pytest.mark.parametrize("nofollow", [True, False], ids=["O_NOFOLLOW", "no O_NOFOLLOW"])
@pytest.mark.parametrize("to", ["a file", "nothing"])
def test_a_run_log_is_never_opened_through_a_symlink(tmp_path, monkeypatch, to, nofollow):
    """With O_NOFOLLOW or (Windows) a check: refused in one line, the file it names untouched or not made."""
    if not nofollow:
        monkeypatch.setattr(files, "NOFOLLOW", 0)
    out, target = tmp_path / "out", tmp_path / "mine.txt"
    out.mkdir()
    if to == "a file":
        target.write_bytes(b"the user's file\n")
    (out / "log.jsonl").symlink_to(target)
    before = state_of(target)
    with pytest.raises(LinkedName) as e:
        run_log.RunLog(str(out), True, 6)
    assert str(e.value).startswith(f"{out / 'log.jsonl'} is a symbolic link (to {target})")
    assert state_of(target) == before and (out / "log.jsonl").is_symlink()


@pytest.mark.parametrize("to", ["a file of the user's", "nothing"])
def test_a_log_replaced_by_a_symlink_mid_run_stops_the_run_and_what_it_names_is_untouched(
    data, tmp_path, monkeypatch, to
):
    """No record is written through it: one line at the next record; the advised `rm`, then --resume, finishes."""
    out, target = tmp_path / "out", tmp_path / "elsewhere.jsonl"
    log = out / "log.jsonl"

    def relink():
        log.unlink()
        if to == "a file of the user's":
            target.write_bytes(b"the user's file\n")
        log.symlink_to(target)

    at_step(monkeypatch, {3: relink})
    args = tiny_args(data, out, "--max-steps", 6, "--ckpt-every", 2)
    msg = user_error(args)
    assert msg.startswith(f"{log} is a symbolic link (to {target}): this run writes that file itself"), msg
    before = state_of(target)
    if to == "a file of the user's":
        assert before[0] == b"the user's file\n"
    else:
        assert before is None  # no file made where the link points
    monkeypatch.undo()
    subprocess.run(f"rm {re.search(r'[(]rm (.+?); ', msg)[1]}", shell=True, check=True)
    assert train_gpt2.main(args + ["--resume"]) == 0
    assert state_of(target) == before and max(read_log(out)[1]) == 5


def test_the_eta_counts_the_steps_and_each_eval_apart():
    clock = [100.0]  # time.monotonic's seconds, moved on by hand
    eta = run_log.StepClock(max_steps=10, now=lambda: clock[0])
    eta.cadences = {"val_loss": 5, "hellaswag": 0, "samples": 4}
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


def test_the_step_line_shows_the_eta_and_the_log_keeps_its_fields(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert train_gpt2.main(tiny_args(data, out, "--eval-every", 2)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if re.match(r"step +\d+/6 ", line)]
    assert len(lines) == 6 and lines[0].endswith("| eta --")  # no step timed yet
    assert all(re.search(r"\| elapsed \d+s \| eta \d+s$", line) for line in lines[1:])
    steps = read_log(out)[1]
    assert all(
        set(r) == {"step", "train_loss", "lr", "grad_norm", "dt_ms", "tok_per_sec", "mfu", "tokens", "epoch"}
        for r in steps.values()
    )

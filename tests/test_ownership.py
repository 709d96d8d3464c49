"""One run per folder, one dataset per run (docs/reliability.md, rules 16, 17, 18 and 20): a
running run holds a lock on its --out-dir that a second process (new run or --resume, plain or
torchrun) is refused by, in one line naming the holder; a checkpoint continues only into its own
run's folder or a new one; a checkpoint continues only on the shards its run started on, and a
folder fineweb.py has not finished is refused; a start that fails leaves the folder as it found it."""

import signal
import socket
import time

import pytest

import train_gpt2
from helpers import (
    assert_one_line_error,
    cli,
    headers,
    random_shards,
    read_log,
    run_ids,
    snapshot,
    start_run,
    tiny_args,
    torchrun,
    user_error,
    wait_for_step,
)
from support.out_dir import LOCK_FILE

# ----------------------------------------------------------------------------------------------
# Rule 16: a running run holds its folder


@pytest.mark.parametrize("second", ["new run", "--resume"])
def test_a_second_process_into_a_running_runs_folder_is_refused_naming_it(data, tmp_path, second):
    out = tmp_path / "out"
    first = start_run(*tiny_args(data, out, "--max-steps", 100000, "--ckpt-every", 2))
    try:
        wait_for_step(first, out, 3)  # it has written checkpoints: a --resume would take one
        extra = ["--resume"] if second == "--resume" else []
        r = cli(*tiny_args(data, out, "--max-steps", 100000, *extra))
        line = assert_one_line_error(r, f"--out-dir {out} is in use by another run (pid {first.pid} on ")
        assert "python train_gpt2.py --data-dir" in line and "pass another --out-dir" in line
        assert first.poll() is None  # the first run goes on, untouched
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 128 + signal.SIGTERM, err
    assert len(headers(out)) == 1 and len(run_ids(out)) == 1  # the refused process wrote nothing
    assert not (out / LOCK_FILE).exists()  # given back at the end
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", max(read_log(out)[1]) + 3, "--resume")) == 0  # free


def test_a_killed_run_leaves_no_lock_to_clean_by_hand(data, tmp_path):
    out = tmp_path / "out"
    first = start_run(*tiny_args(data, out, "--max-steps", 100000, "--ckpt-every", 2))
    try:
        wait_for_step(first, out, 3)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    assert (out / LOCK_FILE).exists()  # the file stays; its lock went with the process
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 8, "--resume")) == 0
    assert sorted(read_log(out)[1]) == list(range(8)) and len(run_ids(out)) == 1


@pytest.mark.slow
def test_two_runs_started_at_once_into_one_new_folder_make_one_run(data, tmp_path):
    out = tmp_path / "new" / "out"
    args = tiny_args(data, out, "--max-steps", 300, "--ckpt-every", 100, "--eval-every", 0)
    procs = [start_run(*args) for _ in range(2)]
    results = [(p.communicate(timeout=300), p.returncode)[::-1] for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], [err[-2000:] for _, (_, err) in results]
    _, (_, err) = next(r for r in results if r[0] == 1)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "is in use by another run" in lines[0] or "holds another run" in lines[0]  # refused while or after
    assert len(headers(out)) == 1 and len(run_ids(out)) == 1
    assert sorted(read_log(out)[1]) == list(range(300))


@pytest.mark.slow
def test_under_torchrun_the_job_locks_once_and_a_second_job_is_refused(data, tmp_path):
    out = tmp_path / "out"
    job = start_run(*tiny_args(data, out, "--max-steps", 100000, "--ckpt-every", 2), torchrun=True)
    try:
        wait_for_step(job, out, 3)  # both ranks train: rank 1 did not trip over rank 0's lock
        plain = cli(*tiny_args(data, out, "--max-steps", 100000, "--resume"))
        assert_one_line_error(plain, "is in use by another run (pid ", "(rank 0 of a torchrun job)")
        second = torchrun(*tiny_args(data, out, "--max-steps", 100000, "--resume"))
        said = [line for line in (second.stdout + second.stderr).splitlines() if line.startswith("error: ")]
        assert second.returncode != 0 and len(said) == 1 and "is in use by another run" in said[0], second.stderr
        assert job.poll() is None
        job.send_signal(signal.SIGINT)  # torchrun passes it on: every rank stops with a checkpoint
        job.communicate(timeout=120)
    finally:
        job.kill()
    assert len(headers(out)) == 1 and len(run_ids(out)) == 1
    assert not (out / LOCK_FILE).exists()


# ----------------------------------------------------------------------------------------------
# Rule 20: a start that fails leaves the folder as it found it


def crash_at_the_first_step(monkeypatch):
    """The first training step fails as a too-large batch does, after step 0's val loss is logged."""

    def clip(*args, **kwargs):
        raise MemoryError("out of memory")

    monkeypatch.setattr(train_gpt2.torch.nn.utils, "clip_grad_norm_", clip)


@pytest.mark.parametrize("folder", ["new", "the user's", "empty"])
def test_a_start_that_crashes_before_its_first_step_leaves_the_folder_as_it_was(data, tmp_path, monkeypatch, folder):
    out = tmp_path / "out"
    if folder != "new":
        out.mkdir()
    if folder == "the user's":
        (out / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    args = tiny_args(data, out, "--max-steps", 3)  # val loss at step 0 (--eval-every 4): logged, then the crash
    crash_at_the_first_step(monkeypatch)
    with pytest.raises(MemoryError):
        train_gpt2.main(args)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before and out.exists() == (folder != "new")
    assert train_gpt2.main(args) == 0  # the same command again, no --resume: not "another run"
    assert len(headers(out)) == 1 and sorted(read_log(out)[1]) == [0, 1, 2]


def test_a_resume_that_crashes_before_its_first_step_leaves_the_log_as_it_was(data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 2, "--ckpt-every", 1)) == 0
    before = snapshot(out)
    crash_at_the_first_step(monkeypatch)
    with pytest.raises(MemoryError):
        train_gpt2.main(tiny_args(data, out, "--max-steps", 4, "--resume"))
    assert snapshot(out) == before


@pytest.mark.slow
def test_out_of_memory_in_the_first_step_then_a_smaller_batch_in_the_same_folder(tmp_path):
    """A real out-of-memory (an address-space cap) with the recipe's flags: the folder the run made
    is gone again, and the same command with a smaller -B, without --resume, trains there."""
    from test_limits import limited

    data = random_shards(tmp_path / "data", train_lengths=(20000,), val_length=5000)
    out = tmp_path / "out"
    args = tiny_args(data, out, "-B", 64, "-T", 64, "--total-batch-size", 4096, "--max-steps", 2, "--eval-every", 0)
    assert_one_line_error(limited(400, *args), "out of host memory in the first training step")
    assert not out.exists()
    r = cli(*args, "-B", 8)  # a later flag wins; without the cap: the folder is what is tested here
    assert r.returncode == 0, r.stderr
    assert len(headers(out)) == 1 and sorted(read_log(out)[1]) == [0, 1]


def test_a_run_killed_before_its_first_step_is_not_another_run(tmp_path, capsys):
    """SIGKILL during step 0's long val eval leaves a log with a header and no step (nothing could
    clean up): the folder counts as empty, and the same command's retry runs there, said."""
    data = random_shards(tmp_path / "data", train_lengths=(5000,), val_length=3_000_000)
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 2, "--eval-every", 1, "-B", 64, "--total-batch-size", 1024)
    proc = start_run(*args, "--val-tokens", 2_900_000)
    try:
        deadline = time.time() + 120
        log = out / "log.jsonl"
        while time.time() < deadline and "\n" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert len(headers(out)) == 1 and not read_log(out)[1] and not list(out.glob("ckpt_*.pt"))
    assert train_gpt2.main([*map(str, args), "--val-tokens", "4096"]) == 0
    assert "holds only the start of a run that never trained a step" in capsys.readouterr().out
    assert len(headers(out)) == 2 and sorted(read_log(out)[1]) == [0, 1]
    assert "holds another run" in user_error([*args, "--val-tokens", 4096])  # now it holds a run: a new one is refused


def test_lock_file_names_its_holder_while_held(data, tmp_path):
    out = tmp_path / "out"
    proc = start_run(*tiny_args(data, out, "--max-steps", 100000))
    try:
        wait_for_step(proc, out, 1)
        holder = (out / LOCK_FILE).read_text()
        assert holder.startswith(f"pid {proc.pid} on {socket.gethostname()}, since ")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and not (out / LOCK_FILE).exists()

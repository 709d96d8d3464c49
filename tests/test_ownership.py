"""One run per folder, one dataset per run (docs/reliability.md, rules 16, 17, 18 and 20): a
running run holds a lock on its --out-dir that a second process (new run or --resume, plain or
torchrun) is refused by, in one line naming the holder; a checkpoint continues only into its own
run's folder or a new one; a checkpoint continues only on the shards its run started on, and a
folder fineweb.py has not finished is refused; a start that fails leaves the folder as it found it."""

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

import fineweb
import train_gpt2
from helpers import (
    ROOT,
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
    write_shard,
)
from support.checkpoints import load_checkpoint
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
# Rule 18: a run's data is the data it started on


@pytest.fixture
def run_on(tmp_path):
    """(data folder, run folder) of 2 steps on its own random shards, checkpoints at 1 and 2."""
    data = random_shards(tmp_path / "data", train_lengths=(600, 600), val_length=600, seed=3)
    out = tmp_path / "run"
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 2, "--ckpt-every", 1, "--eval-every", 0)) == 0
    return data, out


def regenerate(data, lengths, val_length=600, seed=3):
    shutil.rmtree(data)
    random_shards(data, train_lengths=lengths, val_length=val_length, seed=seed)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: regenerate(d, (700, 500)), "rand_train_000001.npy is 1,528 bytes, the run's was 1,328"),
        (lambda d: regenerate(d, (600, 600), seed=4), "rand_train_000001.npy holds other tokens than the run's"),
        (lambda d: regenerate(d, (600, 600, 600)), "rand_train_000003.npy is new"),
        (lambda d: (d / "rand_train_000002.npy").unlink(), "rand_train_000002.npy is missing"),
        (lambda d: write_shard(d / "rand_val_000000.npy", range(900)), "rand_val_000000.npy is 1,928 bytes"),
    ],
    ids=["another-shard-size", "other-tokens", "a-shard-added", "a-shard-removed", "another-val-set"],
)
def test_resume_on_other_data_is_refused_naming_the_first_shard(run_on, change, words):
    data, out = run_on
    change(data)
    before = snapshot(out)
    line = user_error(tiny_args(data, out, "--max-steps", 4, "--resume"))
    assert f"--data-dir {data} is not the data " in line and words in line
    assert f"--init-from {out / 'ckpt_000002.pt'} in a new --out-dir" in line
    assert snapshot(out) == before
    # the way out it names: a new run from those weights, on the data as it is now
    fresh = out.parent / "fresh"
    assert train_gpt2.main(tiny_args(data, fresh, "--max-steps", 2, "--init-from", out / "ckpt_000002.pt")) == 0
    assert headers(fresh)[0]["config"]["init_from"] == str(out / "ckpt_000002.pt")


def test_the_same_shards_in_another_folder_are_the_same_data(run_on, tmp_path):
    data, out = run_on
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    shutil.rmtree(data)
    assert train_gpt2.main(tiny_args(moved, out, "--max-steps", 4, "--resume")) == 0
    assert sorted(read_log(out)[1]) == [0, 1, 2, 3]


def test_the_checkpoint_records_each_shards_size_and_sampled_bytes(run_on):
    data, out = run_on
    identity = load_checkpoint(str(out / "ckpt_000002.pt"))["data_identity"]
    assert [name for name, _, _ in identity["train"]] == ["rand_train_000001.npy", "rand_train_000002.npy"]
    assert [name for name, _, _ in identity["val"]] == ["rand_val_000000.npy"]
    for name, size, _ in identity["train"] + identity["val"]:
        assert size == os.path.getsize(data / name)


@pytest.fixture
def tiny_text(tmp_path, shared_data):
    """The first 40,000 characters of tiny shakespeare as its own input file."""
    text = tmp_path / "tiny.txt"
    text.write_text((shared_data / "tinyshakespeare" / "input.txt").read_text()[:40000])
    return text


def test_a_folder_fineweb_has_not_finished_is_refused_naming_the_command(tmp_path, tiny_text, monkeypatch):
    shards = tmp_path / "shards"
    args = ["--input", str(tiny_text), "--out-dir", str(shards), "--shard-size", "2000", "--workers", "1"]
    real, written = fineweb.write_shard, []

    def write_then_stop(path, tokens, fmt="npy"):  # stopped (Ctrl-C, a kill) after 3 shards
        real(path, tokens, fmt)
        written.append(path)
        if len(written) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(fineweb, "write_shard", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        fineweb.main(args)
    monkeypatch.undo()
    out = tmp_path / "run"
    before = snapshot(tmp_path)
    r = cli(*tiny_args(shards, out, "--max-steps", 2))
    line = assert_one_line_error(r, f"--data-dir {shards} is unfinished", "fineweb.py has not written all")
    command = line.split("`")[1]
    assert command == f"python fineweb.py --input {tiny_text} --out-dir {shards} --shard-size 2000"
    assert snapshot(tmp_path) == before and not out.exists()
    # the command it names finishes the folder, as fineweb.py's own uninterrupted run would write it;
    # its `python` is the one running the tests, whatever is first on PATH
    argv = shlex.split(command)
    assert argv[0] == "python"
    done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    whole = tmp_path / "whole"
    fineweb.main(["--input", str(tiny_text), "--out-dir", str(whole), "--shard-size", "2000", "--workers", "1"])
    names = sorted(p.name for p in whole.iterdir())
    assert sorted(p.name for p in shards.iterdir()) == names
    assert all((shards / n).read_bytes() == (whole / n).read_bytes() for n in names)
    assert train_gpt2.main(tiny_args(shards, out, "--max-steps", 2)) == 0


def test_a_folder_stopped_where_max_tokens_asked_is_finished_as_asked(tmp_path, tiny_text):
    shards = tmp_path / "shards"
    args = ["--input", str(tiny_text), "--out-dir", str(shards), "--shard-size", "2000", "--workers", "1"]
    summary = fineweb.main([*args, "--max-tokens", "5000"])
    assert not summary["complete"] and summary["tokens"] == 5000
    assert train_gpt2.main(tiny_args(shards, tmp_path / "run", "--max-steps", 2, "--eval-every", 0)) == 0


def test_fineweb_command_uses_a_glob_for_a_whole_folder_and_hub_flags(tmp_path):
    from support.shards import fineweb_command

    files = [tmp_path / f"part_{i}.jsonl" for i in range(5)]
    for f in files:
        f.write_text('{"text": "x"}\n')
    config = {"source": {"input": [{"path": str(f)} for f in files]}, "shard_size": 100_000_000, "prefix": "p"}
    assert fineweb_command(config, "d") == f"python fineweb.py --input '{tmp_path}/*.jsonl' --out-dir d --prefix p"
    files[-1].unlink()  # the glob would miss nothing but the folder no longer holds all: name them
    assert fineweb_command(config, "d").count("part_") == 5
    hub = {"source": {"dataset": "HuggingFaceFW/fineweb", "name": None, "split": "train"}, "shard_size": 10}
    assert (
        fineweb_command(hub, "d")
        == "python fineweb.py --dataset HuggingFaceFW/fineweb --name '' --out-dir d --shard-size 10"
    )


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

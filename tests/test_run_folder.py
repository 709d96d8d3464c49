"""support/run_folder.py, through real runs of train_gpt2.py: one run per --out-dir, a running run
locks its folder (an `rm` of its lock file does not undo it), a start that fails leaves no run
behind, links at the names a run writes reach no file, each checkpoint has its meta and pruning
removes the two, a failed checkpoint write stops the run in one line, the earlier ones whole, and
what a user trips on there is one line whose advice works. (The lock itself: test_files.py; which
checkpoint --resume takes, and what it sets aside: test_resume.py.)"""

import builtins
import json
import os
import re
import shutil
import signal
import socket
import subprocess

import pytest

import train_gpt2
from helpers import (
    assert_one_line_error,
    at_step,
    cli,
    fail_nth_write,
    headers,
    read_log,
    refused_before_step_0,
    run_ids,
    same_weights,
    snapshot,
    start_run,
    tiny_args,
    torchrun,
    user_error,
    wait_for_step,
)
from support import files
from support.checkpoints import load_checkpoint, load_training_checkpoint
from support.run_folder import LOCK_FILE, save_checkpoint


def test_a_run_reads_its_log_once_at_start(short_run, tmp_path, monkeypatch):
    """log.jsonl is read whole once, as the run claims its folder: whose it is, which checkpoint --resume
    takes, and which checkpoints trained without a NaN (what pruning keeps) come from that read and the
    records the run writes since, not from reading the file again at each checkpoint."""
    out = tmp_path / "run"
    shutil.copytree(short_run[1], out)
    reads, real_open = [], builtins.open

    def counted(file, mode="r", *args, **kwargs):
        if str(file) == str(out / "log.jsonl") and mode == "r":  # a read as text (RunLog appends; reads a byte)
            reads.append(file)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counted)
    args = ["--resume", "--out-dir", str(out), "--max-steps", 6, "--ckpt-every", 1, "--keep-ckpts", 2]
    assert train_gpt2.main([*args, "--device", "cpu"]) == 0
    assert len(reads) == 1
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_000005.pt", "ckpt_000006.pt"]  # pruned


@pytest.mark.parametrize("existing", ["ckpt_000004.pt", "log.jsonl"])
def test_a_new_run_in_another_runs_out_dir_is_refused(data, tmp_path, existing):
    out = tmp_path / "out"
    out.mkdir()
    another_run = b'{"event": "header", "run_id": "theirs"}\n{"step": 0, "train_loss": 10.9}\n'  # a log with a step
    (out / existing).write_bytes(another_run if existing == "log.jsonl" else b"PK\x03\x04 another run's file")
    (out / "notes.txt").write_text("the user's notes")
    refused_before_step_0(tiny_args(data, out), out, "--out-dir", "holds another run", "--resume")


def test_a_folder_holding_only_the_users_files_is_fine_and_kept(data, tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("the user's notes")
    (out / "sub" / "ckpt_000001.pt").write_bytes(b"not in the out-dir itself")
    before = snapshot(out)
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 2, "--eval-every", 0)) == 0
    after = snapshot(out)
    assert {k: after[k] for k in before} == before and "ckpt_000002.pt" in after


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_it_cannot_write_is_refused_when_claimed_with_advice_that_fits(
    data, tmp_path, monkeypatch, capsys, resume
):
    """A read-only folder, or another user's, as os.access says it to a user who is not root (root
    writes through a folder's mode): refused at the claim, before the model is built and the data
    read (a killed write's temporary file there too); on --resume the advice continues the run in a
    folder of the user's, and works."""
    out = tmp_path / "out"
    out.mkdir()
    args = tiny_args(data, out, "--max-steps", 2, "--ckpt-every", 2, "--eval-every", 0)
    if resume:
        assert train_gpt2.main(args) == 0
        args += ["--max-steps", 4, "--resume"]
        (out / ".ckpt_000004.pt.tmp").write_bytes(b"PK\x03\x04cut short")  # a killed write's, left
    access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode, **kw: access(path, mode, **kw) and not (mode & os.W_OK and path == str(out))
    )
    capsys.readouterr()
    msg = refused_before_step_0(args, out, f"--out-dir {out} is read-only or another user's: make it writable, or ")
    assert "model:" not in capsys.readouterr().out
    if not resume:
        assert msg.endswith("or pass another --out-dir")
        return
    ckpt = out / "ckpt_000002.pt"
    assert msg.endswith(f"or continue the run elsewhere with --resume {ckpt} --out-dir NEW_DIR")
    assert (
        train_gpt2.main(tiny_args(data, tmp_path / "new", "--max-steps", 4, "--eval-every", 0, "--resume", ckpt)) == 0
    )
    assert sorted(read_log(tmp_path / "new")[1]) == [2, 3]


def test_a_second_process_into_a_running_runs_folder_is_refused_naming_it(data, tmp_path):
    """A new run, its dry run, a --resume, and a --resume after a user's `rm` of the lock file (the folder
    itself is locked: the refusal then cannot name the holder); the running run goes on untouched, and
    once killed leaves no lock behind."""
    out = tmp_path / "out"
    first = start_run(*tiny_args(data, out, "--max-steps", 100000, "--ckpt-every", 2))
    try:
        wait_for_step(first, out, 3)  # it has written checkpoints: a --resume would take one
        assert (out / LOCK_FILE).read_text().startswith(f"pid {first.pid} on {socket.gethostname()}, since ")
        for extra in ([], ["--dry-run"], ["--resume"], ["--resume"]):
            r = cli(*tiny_args(data, out, "--max-steps", 100000, *extra), timeout=60)
            if (out / LOCK_FILE).exists():
                line = assert_one_line_error(r, f"--out-dir {out} is in use by another run (pid {first.pid} on ")
                assert "python train_gpt2.py --data-dir" in line and line.endswith(", or pass another --out-dir")
            else:
                line = assert_one_line_error(r)
                assert (
                    line
                    == f"error: --out-dir {out} is in use by another run: wait for it to end, or pass another --out-dir"
                )
            if "--resume" in extra:
                (out / LOCK_FILE).unlink(missing_ok=True)  # "a stale lock", as a user takes it
        assert first.poll() is None  # the first run goes on, untouched
    finally:
        first.kill()  # killed: its lock goes with the process, nothing to clean by hand
        first.communicate()
    assert len(headers(out)) == 1 and len(run_ids(out)) == 1  # the refused processes wrote nothing
    end = max(read_log(out)[1]) + 3
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", end, "--resume")) == 0  # free
    assert sorted(read_log(out)[1]) == list(range(end)) and len(run_ids(out)) == 1


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
        plain = cli(*tiny_args(data, out, "--max-steps", 100000, "--resume"), timeout=60)
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


def test_a_run_refused_at_start_leaves_no_empty_out_dir(tmp_path):
    # the folders the run would have made go again; a folder the user made (empty) stays
    missing = tmp_path / "new" / "out"
    user_error(tiny_args(tmp_path / "no_such_data", missing))
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    user_error(tiny_args(tmp_path / "no_such_data", mine))
    assert mine.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def crash_at_the_first_step(monkeypatch):
    """The first training step fails as a too-large batch does, after step 0's val loss is logged."""

    def clip(*args, **kwargs):
        raise MemoryError("out of memory")

    monkeypatch.setattr(train_gpt2.torch.nn.utils, "clip_grad_norm_", clip)


@pytest.mark.parametrize("folder", ["new", "the user's", "empty", "a run's, resumed"])
def test_a_start_that_crashes_before_its_first_step_is_no_run_and_the_same_command_runs(
    data, tmp_path, monkeypatch, folder
):
    """The header it logged is no run (nothing cleans up after a crash, as after a kill): the same command
    again runs, without --resume for a new run (not "another run"), and a --resume resumes again."""
    out = tmp_path / "out"
    if folder != "new":
        out.mkdir()
    if folder == "the user's":
        (out / "notes.txt").write_text("mine")
    args = tiny_args(data, out, "--max-steps", 3)  # val loss at step 0 (--eval-every 4): logged, then the crash
    if folder == "a run's, resumed":
        assert train_gpt2.main(tiny_args(data, out, "--max-steps", 2, "--ckpt-every", 1)) == 0
        args += ["--max-steps", 4, "--resume"]
    crash_at_the_first_step(monkeypatch)
    with pytest.raises(MemoryError):
        train_gpt2.main(args)
    monkeypatch.undo()
    assert train_gpt2.main(args) == 0
    assert len(run_ids(out)) == 1 and sorted(read_log(out)[1]) == list(range(4 if "--resume" in args else 3))
    assert folder != "the user's" or (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_log_whose_header_is_damaged_is_refused_and_moving_it_aside_resumes(data, tmp_path, damage):
    """Refused before a second run is appended after its steps; the advised `mv`, then --resume, runs."""
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 4, "--ckpt-every", 2)) == 0
    log = out / "log.jsonl"
    first, rest = log.read_text().split("\n", 1)
    header = json.loads(first)
    broken = {"truncated": first[: len(first) // 2], "garbage": "\x00\x00\x00\x00 not json", "empty": ""}[damage]
    log.write_text(broken + "\n" + rest)
    for args in (tiny_args(data, out, "--max-steps", 6), tiny_args(data, out, "--max-steps", 6, "--resume")):
        msg = refused_before_step_0(args, out, f"{log} is not this run's (its first line is not a run's header)")
    assert f"mv {log} {log}.aside" in msg
    subprocess.run(f"mv {log} {log}.aside", shell=True, check=True)  # the advice, as given
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 6, "--resume")) == 0
    assert sorted(read_log(out)[1]) == [4, 5] and {h["run_id"] for h in headers(out)} == {header["run_id"]}


def test_links_at_the_names_a_run_writes_are_replaced_never_written_through(data, tmp_path):
    out, mine, nothing = tmp_path / "out", [tmp_path / "mine0.txt", tmp_path / "mine1.txt"], tmp_path / "nothing"
    out.mkdir()
    for path in mine:
        path.write_text("the user's file\n")
    (out / LOCK_FILE).symlink_to(mine[0])
    os.link(mine[1], out / ".ckpt_000002.pt.tmp")  # a hard link: a second name of the user's file
    (out / "log.jsonl").symlink_to(nothing)
    args = tiny_args(data, out, "--max-steps", 2, "--ckpt-every", 1, "--eval-every", 0)
    assert user_error(args).startswith(f"cannot write {out / 'log.jsonl'} (Too many levels of symbolic links)")
    assert not nothing.exists()
    (out / "log.jsonl").unlink()
    assert train_gpt2.main(args) == 0
    assert all(path.read_text() == "the user's file\n" for path in mine)
    assert sorted(os.listdir(out)) == [
        "ckpt_000001.pt",
        "ckpt_000002.pt",
        "log.jsonl",
        "meta_000001.json",
        "meta_000002.json",
    ]


@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("mine", ["my notes\n", ""])
def test_a_file_at_a_checkpoints_name_that_is_none_is_refused_and_setting_it_aside_runs(data, tmp_path, resume, mine):
    """A user's text, or a copy killed before its first byte, at a checkpoint's name: said to be no
    checkpoint, with the `mv` that sets it aside; that, then the same command, runs and keeps the file aside."""
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 2, "--ckpt-every", 2, "--eval-every", 0)
    if resume:
        assert train_gpt2.main(args) == 0
        args += ["--max-steps", 4, "--resume"]
    out.mkdir(exist_ok=True)
    (out / "ckpt_000004.pt").write_text(mine)
    msg = refused_before_step_0(
        args, out, f"{out / 'ckpt_000004.pt'} is no checkpoint of train_gpt2.py", "move it aside (mv "
    )
    assert "another run" not in msg and "--resume" not in msg
    subprocess.run(re.search(r"\((mv [^)]+)\)", msg)[1], shell=True, check=True)  # the advice, as given
    assert train_gpt2.main(args) == 0 and sorted(read_log(out)[1]) == list(range(4 if resume else 2))
    assert (out / "ckpt_000004.pt.aside").read_text() == mine


def test_an_empty_out_dir_is_refused_by_name(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = user_error(tiny_args(data, "", "--max-steps", 2))
    assert msg.startswith("--out-dir '' names no folder") and os.listdir(tmp_path) == []


@pytest.mark.parametrize("how", ["moved", "deleted"])
def test_a_run_folder_moved_or_deleted_mid_run_stops_in_one_line_at_its_next_checkpoint(
    data, tmp_path, monkeypatch, how
):
    """`mv RUN RUN_old` or `rm -rf RUN` mid-run (not guarded against): the disk error's one line, and
    the run continues where its folder went (moved) or starts again (deleted)."""
    out, moved = tmp_path / "run", tmp_path / "run_old"
    at_step(monkeypatch, {3: lambda: out.rename(moved) if how == "moved" else shutil.rmtree(out)})
    args = tiny_args(data, out, "--max-steps", 6, "--ckpt-every", 2, "--eval-every", 0)
    assert user_error(args).startswith(f"cannot write checkpoint {out / 'ckpt_000004.pt'} (No such file or directory)")
    monkeypatch.undo()
    if how == "moved":
        assert train_gpt2.main(tiny_args(data, moved, "--max-steps", 6, "--resume")) == 0
        assert sorted(read_log(moved)[1]) == list(range(6)) and not out.exists()
    else:
        assert train_gpt2.main(args) == 0 and sorted(read_log(out)[1]) == list(range(6))


# ----------------------------------------------------------------------------------------------
# A checkpoint write that fails


def test_failing_checkpoint_write_stops_in_one_line_and_keeps_the_previous(data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 4, "--ckpt-every", 1, "--eval-every", 0)
    fail_nth_write(monkeypatch, files, ".pt.tmp", 3, room=100_000)  # torch.save fails inside a tensor
    msg = user_error(args)
    assert "No space left on device" in msg and "ckpt_000003.pt" in msg
    names = ["ckpt_000001.pt", "ckpt_000002.pt", "log.jsonl", "meta_000001.json", "meta_000002.json"]
    assert sorted(os.listdir(out)) == names  # no partial file left, no meta of the checkpoint not written
    assert max(read_log(out)[1]) == 2  # stopped at the failed write, not after more steps
    previous = load_training_checkpoint(str(out / "ckpt_000002.pt"))
    monkeypatch.undo()  # the disk has room again: the run continues from the previous checkpoint
    assert (
        train_gpt2.main(tiny_args(data, out, "--max-steps", 4, "--ckpt-every", 1, "--eval-every", 0, "--resume")) == 0
    )
    ref = tmp_path / "ref"
    assert train_gpt2.main(tiny_args(data, ref, "--max-steps", 4, "--ckpt-every", 1, "--eval-every", 0)) == 0
    assert same_weights(previous["model"], load_checkpoint(str(ref / "ckpt_000002.pt"))["model"])
    assert same_weights(
        load_checkpoint(str(out / "ckpt_000004.pt"))["model"], load_checkpoint(str(ref / "ckpt_000004.pt"))["model"]
    )


def test_a_failed_first_checkpoint_write_does_not_claim_earlier_ones(data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    fail_nth_write(monkeypatch, files, ".pt.tmp", 1, room=100_000)
    msg = user_error(tiny_args(data, out, "--max-steps", 4, "--ckpt-every", 2, "--eval-every", 0))
    assert f"no earlier checkpoint is in {tmp_path / 'out'}" in msg and "intact" not in msg
    assert "start the run again in a new --out-dir" in msg
    monkeypatch.undo()  # room again: the advice, a new --out-dir, starts the run again and finishes it
    assert (
        train_gpt2.main(tiny_args(data, tmp_path / "new", "--max-steps", 4, "--ckpt-every", 2, "--eval-every", 0)) == 0
    )
    assert (tmp_path / "new" / "ckpt_000004.pt").exists()


# ----------------------------------------------------------------------------------------------
# Each checkpoint has its meta; pruning removes the two together


def test_each_checkpoint_has_its_meta_and_pruning_removes_the_two_together(data, tmp_path):
    """meta_<step>.json beside each checkpoint holds what identifies it, as the checkpoint does: its run,
    its step and the run's flags; pruning (--keep-ckpts 2) removes a checkpoint's meta with it."""
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 5, "--ckpt-every", 1, "--keep-ckpts", 2)) == 0
    names = ["ckpt_000004.pt", "ckpt_000005.pt", "log.jsonl", "meta_000004.json", "meta_000005.json"]
    assert sorted(os.listdir(out)) == names
    for step in (4, 5):
        ckpt = load_checkpoint(str(out / f"ckpt_00000{step}.pt"))
        meta = json.loads((out / f"meta_00000{step}.json").read_text())
        assert meta == {"run_id": ckpt["run_id"], "step": step, "train_config": ckpt["train_config"]}


@pytest.mark.parametrize("meta", [None, "another-run"])
def test_pruning_keeps_a_checkpoint_put_in_the_folder_while_the_run_trains(tmp_path, meta):
    """A checkpoint copied into a running run's folder, with no meta or another run's, is never pruned:
    pruning reads each older checkpoint's meta and deletes only the run's own."""
    out, trained = str(tmp_path), {step: True for step in range(5)}

    def state(step, run_id="this-run"):
        return {"run_id": run_id, "step": step, "train_config": {}}

    save_checkpoint(state(2), out, 1, trained)
    save_checkpoint(state(1, meta or "another-run"), out, 9, trained)  # the copy, at an older step
    if meta is None:
        os.remove(tmp_path / "meta_000001.json")
    save_checkpoint(state(3), out, 1, trained)
    kept = ["ckpt_000001.pt", "ckpt_000003.pt", "meta_000003.json"] + (["meta_000001.json"] if meta else [])
    assert sorted(os.listdir(out)) == sorted(kept)

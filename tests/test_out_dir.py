"""support/out_dir.py, through real runs of train_gpt2.py: one run per --out-dir (a new run into
another run's folder is refused, the user's own files there are kept, a log holding only the start
of a run that never trained a step is no run); a running run locks its folder, a second process
into it (a new run or --resume, plain or torchrun) is refused in one line naming the holder, and a
killed run leaves no lock to clean; a lock file that is a folder or a symbolic link is named,
never written through; a start that is refused or crashes before its first step leaves the
folder as it found it; a symbolic link at a name the run writes (the log, a checkpoint, a
checkpoint's temporary file) is refused before step 0, never followed. (The lock itself:
test_file_lock.py.)"""

import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest

import train_gpt2
from helpers import (
    assert_one_line_error,
    cli,
    headers,
    random_shards,
    read_log,
    refused_before_step_0,
    run_ids,
    snapshot,
    start_run,
    state_of,
    tiny_args,
    torchrun,
    user_error,
    wait_for_step,
)
from support.out_dir import LOCK_FILE, undo_failed_start

# ----------------------------------------------------------------------------------------------
# One run per folder


@pytest.mark.parametrize("existing", ["ckpt_000004.pt", "log.jsonl"])
def test_a_new_run_in_another_runs_out_dir_is_refused(data, tmp_path, existing):
    out = tmp_path / "out"
    out.mkdir()
    (out / existing).write_bytes(b"another run's file")
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


# ----------------------------------------------------------------------------------------------
# A running run holds its folder


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
# The lock file: deleted or taken, a folder or a symbolic link at its name


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_where_the_lock_file_goes_is_named_and_moving_it_runs(data, tmp_path, resume):
    """A .train_gpt2.lock that is a folder is not a permission problem ("make --out-dir writable"
    would not help): the line names the folder, and once it is moved the same command runs."""
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 2, "--eval-every", 0)
    if resume:
        assert train_gpt2.main(args + ["--ckpt-every", 1]) == 0
        args += ["--max-steps", 3, "--resume"]
    (out / ".train_gpt2.lock").mkdir(parents=True)
    msg = refused_before_step_0(args, out, f"--out-dir {out} holds a folder named .train_gpt2.lock")
    assert msg.endswith("rename or remove that folder, then " + ("continue with --resume" if resume else "start again"))
    assert "writable" not in msg
    (out / ".train_gpt2.lock").rename(tmp_path / "moved")
    assert train_gpt2.main(args) == 0


@pytest.mark.parametrize("resume", [False, True])
def test_a_symlink_where_the_lock_file_goes_is_refused_and_what_it_names_is_untouched(data, tmp_path, resume):
    """A .train_gpt2.lock that is a symbolic link is never followed: the lock would write its
    holder's text into the file it names (here a checkpoint of another folder). One line naming the
    link; that file as it was; the link removed, the same command runs."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    args = tiny_args(data, out, "--max-steps", 2, "--eval-every", 0)
    assert train_gpt2.main(tiny_args(data, elsewhere, "--max-steps", 1, "--eval-every", 0)) == 0
    target = next(elsewhere.glob("ckpt_*.pt"))
    if resume:
        assert train_gpt2.main(args + ["--ckpt-every", 1]) == 0
        args += ["--max-steps", 3, "--resume"]
    out.mkdir(exist_ok=True)
    (out / ".train_gpt2.lock").symlink_to(target)
    before = target.read_bytes()
    msg = refused_before_step_0(args, out, f"{out / '.train_gpt2.lock'} is a symbolic link (to {target}): this run")
    assert "\n" not in msg and msg.endswith("what it points to is kept), or use another --out-dir")
    assert target.read_bytes() == before
    (out / ".train_gpt2.lock").unlink()
    assert train_gpt2.main(args) == 0
    assert target.read_bytes() == before


# ----------------------------------------------------------------------------------------------
# A start that fails leaves the folder as it found it


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


# ----------------------------------------------------------------------------------------------
# A damaged log is refused, not appended to


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "no run_id"])
def test_a_log_whose_header_is_damaged_is_refused_and_moving_it_aside_resumes(data, tmp_path, damage):
    """A log.jsonl whose first line is not a run's header while later lines hold steps would get a
    second run appended after them: refused in one line, before anything is written; the advised
    `mv` then `--resume` continues the run into a fresh log."""
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 4, "--ckpt-every", 2)) == 0
    log = out / "log.jsonl"
    first, rest = log.read_text().split("\n", 1)
    header = json.loads(first)
    broken = {
        "truncated": first[: len(first) // 2],
        "garbage": "\x00\x00\x00\x00 not json",
        "empty": "",
        "no run_id": json.dumps({k: v for k, v in header.items() if k != "run_id"}),
    }[damage]
    log.write_text(broken + "\n" + rest)
    for args in (tiny_args(data, out, "--max-steps", 6, "--resume"), tiny_args(data, out, "--max-steps", 6)):
        msg = refused_before_step_0(args, out, f"{log}: its first line is not a run's header (damaged?)")
    assert f"mv {log} {log}.bad" in msg and "--resume" in msg
    subprocess.run(f"mv {log} {log}.bad", shell=True, check=True)  # the advice, as given
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 6, "--resume")) == 0
    assert sorted(read_log(out)[1]) == [4, 5] and {h["run_id"] for h in headers(out)} == {header["run_id"]}


def test_a_log_of_only_a_header_is_still_no_run(data, tmp_path):
    """The start of a run that never trained a step (its header alone) is not a damaged log."""
    first, out = tmp_path / "first", tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, first, "--max-steps", 1)) == 0
    out.mkdir()
    (out / "log.jsonl").write_text((first / "log.jsonl").read_text().split("\n", 1)[0] + "\n")
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 2)) == 0
    assert sorted(read_log(out)[1]) == [0, 1]


# ----------------------------------------------------------------------------------------------
# A data folder is never a run's folder, and a run's folder never a data folder


def test_resume_of_a_shard_folder_says_it_is_one_and_writes_nothing_there(tmp_path):
    shards = random_shards(tmp_path / "shards")
    before = snapshot(shards)
    for extra in (["--data-dir", shards], ["--out-dir", tmp_path / "out"]):  # --data-dir the same folder, or not
        args = [*tiny_args(shards, tmp_path / "out", "--max-steps", 2), "--resume", shards, *extra]
        msg = refused_before_step_0(args, shards, f"--resume {shards} holds token shards")
        assert "a run's folder" not in msg and "--data-dir" in msg
        assert snapshot(shards) == before  # no log, no lock, no checkpoint


@pytest.mark.parametrize("holds", ["shards", "a fineweb manifest"])
@pytest.mark.parametrize("resume", [False, True])
def test_an_out_dir_that_is_a_data_folder_is_refused(data, tmp_path, holds, resume):
    folder = tmp_path / "folder"
    if holds == "shards":
        random_shards(folder)
    else:
        folder.mkdir()
        (folder / "edu_fineweb_manifest.json").write_text(json.dumps({"complete": True}))
    args = tiny_args(data, folder, "--max-steps", 2, *(["--resume"] if resume else []))
    before = snapshot(folder)
    refused_before_step_0(args, folder, f"--out-dir {folder} holds", "data folder", "another --out-dir")
    assert snapshot(folder) == before


def test_the_same_folder_for_data_and_out_is_refused(tmp_path):
    shards = random_shards(tmp_path / "shards")
    before = snapshot(shards)
    refused_before_step_0(tiny_args(shards, shards, "--max-steps", 2), shards, "data folder")
    assert snapshot(shards) == before


@pytest.mark.parametrize("run_file", ["ckpt_000002.pt", "log.jsonl"])
def test_a_data_dir_that_holds_a_runs_files_is_refused(data, tmp_path, run_file):
    """Shards beside a run's log or checkpoints: a run's folder is not a data folder."""
    shards = random_shards(tmp_path / "shards")
    (shards / run_file).write_bytes(b"")
    out = tmp_path / "out"
    msg = refused_before_step_0(tiny_args(shards, out, "--max-steps", 2), shards, f"--data-dir {shards}", run_file)
    assert "run's folder" in msg
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# A symbolic link at a name the run writes is never followed, nor replaced


def rm_from(msg):
    """The `rm` a LinkedName message advises, as written there (shell-quoted)."""
    return re.search(r"\(rm (.+?); what it points to is kept\)", msg)[1]


@pytest.mark.parametrize(
    "name, resume, to",
    [
        ("log.jsonl", False, "a file"),
        ("log.jsonl", True, "a file"),
        ("log.jsonl", False, "nothing"),
        ("log.jsonl", True, "nothing"),
        ("ckpt_000002.pt", False, "a file"),  # the checkpoint this run writes
        ("ckpt_000003.pt", False, "nothing"),
        ("ckpt_000009.pt", True, "a file"),  # a later step's name, one this run would reach in time
        (".ckpt_000001.pt.tmp", False, "a file"),  # a checkpoint's temporary file
        (".ckpt_000003.pt.tmp", True, "nothing"),
    ],
)
def test_a_symlink_at_a_name_the_run_writes_is_refused_before_step_0_and_its_target_untouched(
    data, tmp_path, name, resume, to
):
    """Rule 26: log.jsonl, a checkpoint (of any step) or a checkpoint's temporary file that is a
    symbolic link is refused at start in one line naming the link and where it points: the log
    would be appended to the file it names, a dangling one would create a file outside the folder,
    and a checkpoint's rename would delete the link. Nothing is written or removed, the link
    included; the `rm` the line advises removes the link alone, and the same command then runs."""
    out, target = tmp_path / "out", tmp_path / "elsewhere" / "mine.txt"
    args = tiny_args(data, out, "--max-steps", 2, "--ckpt-every", 1, "--eval-every", 0)
    if resume:
        assert train_gpt2.main(args) == 0
        args += ["--max-steps", 3, "--resume"]
    out.mkdir(exist_ok=True)
    target.parent.mkdir()
    if to == "a file":
        target.write_bytes(b"the user's file, not a log\n" if not resume or name != "log.jsonl" else b"")
        if resume and name == "log.jsonl":  # the run's own log, moved elsewhere and linked back
            os.replace(out / "log.jsonl", target)
    elif resume and name == "log.jsonl":
        (out / "log.jsonl").unlink()
    link = out / name
    link.symlink_to(target)
    before, folder = state_of(target), sorted(os.listdir(out))
    time.sleep(0.01)  # a write would move the mtime
    msg = user_error(args)
    assert msg.startswith(f"{link} is a symbolic link (to {target}): this run writes that file itself"), msg
    assert msg.endswith("what it points to is kept), or use another --out-dir"), msg
    assert state_of(target) == before and sorted(os.listdir(out)) == folder  # no file made where a dangling one points
    assert link.is_symlink() and os.readlink(link) == str(target)  # the user's link stays
    assert not (out / LOCK_FILE).exists()
    subprocess.run(f"rm {rm_from(msg)}", shell=True, check=True)  # the advice, as a user types it
    assert not os.path.lexists(link) and state_of(target) == before
    assert train_gpt2.main(args) == 0
    assert state_of(target) == before


@pytest.mark.parametrize("before", [None, 10])
def test_undoing_a_failed_start_never_truncates_or_removes_a_link_at_the_logs_name(tmp_path, before):
    """A start that failed cuts log.jsonl back to what it held (rule 20); a link put at its name
    since is not the run's log: the file it names keeps its bytes, the link stays."""
    out, target = tmp_path / "out", tmp_path / "mine.txt"
    out.mkdir()
    target.write_bytes(b'{"event": "header", "run_id": "x"}\n' + b"the user's text\n")
    (out / "log.jsonl").symlink_to(target)
    state = state_of(target)
    undo_failed_start({"out_dir": str(out), "log": before, "checkpoints": set()})
    assert state_of(target) == state and (out / "log.jsonl").is_symlink()


# A leftover at a checkpoint's temporary name is removed only when a write of this program left it


@pytest.mark.parametrize("resume", [False, True])
def test_a_users_file_at_a_temporary_checkpoint_name_is_kept_and_named(data, tmp_path, resume):
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 2, "--ckpt-every", 2, "--eval-every", 0)) == 0
    if not resume:
        for path in out.iterdir():
            path.unlink()
    tmp = out / ".ckpt_000004.pt.tmp"
    tmp.write_text("the user's file, not a checkpoint write cut short")
    args = tiny_args(
        data, out, "--max-steps", 4, "--ckpt-every", 2, "--eval-every", 0, *(["--resume"] if resume else [])
    )
    msg = refused_before_step_0(args, out, f"{tmp} is not a checkpoint write of train_gpt2.py's cut short")
    assert tmp.read_text() == "the user's file, not a checkpoint write cut short"
    subprocess.run(re.search(r"\((mv [^)]+)\)", msg).group(1), shell=True, check=True)  # the advice
    assert train_gpt2.main(args) == 0 and (out / "ckpt_000004.pt").exists()
    assert (out / ".ckpt_000004.pt.tmp.aside").read_text() == "the user's file, not a checkpoint write cut short"

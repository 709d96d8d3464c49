"""support/files.py: atomic writes are durable (write_atomic fsyncs the temporary file before the
rename and the folder after it, seen through os.fsync and os.replace themselves, by the identity
(device, inode) of what each fsync reached: a write that skips one fails here), and a link at
the name write_atomic writes is replaced, never written through; the folder lock refuses a second
holder on each mechanism, an `rm` of its file notwithstanding; a failed write's line says "make
room" only when the disk is full; a file where a folder goes is one line in every script; jsonl_rows
names a bad line. (train_gpt2.py's use of the lock:
test_run_folder.py; fineweb.py's: test_fineweb.py; without fcntl: test_portable.py.)"""

import contextlib
import errno
import json
import os
import socket
import sys

import pytest

import fineweb
import train_gpt2
from helpers import assert_one_line_error, cli, snapshot, tiny_args, user_error
from support import files
from support.cli import UserError
from support.files import jsonl_rows, lock_folder, unlock_folder, write_atomic
from support.run_folder import LOCK_FILE, claim_out_dir

# ----------------------------------------------------------------------------------------------
# Atomic writes are durable


def identity(st):
    return st.st_dev, st.st_ino


def test_write_atomic_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    calls, fsync, replace = [], os.fsync, os.replace  # the identity of what each fsync reached; each rename's target

    def recording_fsync(fd):
        calls.append(identity(os.fstat(fd)))
        return fsync(fd)

    def recording_replace(src, dst):
        calls.append(os.fspath(dst))
        return replace(src, dst)

    monkeypatch.setattr(files.os, "fsync", recording_fsync)
    monkeypatch.setattr(files.os, "replace", recording_replace)
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"old")
    write_atomic(str(path), lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new"
    rename = calls.index(str(path))
    assert identity(os.stat(path)) in calls[:rename]  # the new file's inode, before its rename
    assert identity(os.stat(tmp_path)) in calls[rename + 1 :]  # the rename is an entry of the folder


# ----------------------------------------------------------------------------------------------
# A failed write's line


def test_a_write_error_that_is_not_a_full_disk_does_not_say_make_room(data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.jsonl").mkdir()  # the log cannot be opened: not a question of space
    r = cli(*tiny_args(data, out, "--resume"))
    line = assert_one_line_error(r, "log.jsonl")
    assert "make room" not in line
    json.dumps(line)


@pytest.mark.parametrize(
    "main, flags",
    [
        (train_gpt2.main, ["--out-dir", "f"]),
        (train_gpt2.main, ["--out-dir", "f/run"]),
        (train_gpt2.main, ["--data-dir", "f"]),
        (train_gpt2.main, ["--resume", "f/ckpt_000004.pt"]),
        (fineweb.main, ["--input", "in.txt", "--out-dir", "f"]),
    ],
    ids=["--out-dir", "--out-dir under it", "--data-dir", "--resume under it", "fineweb.py --out-dir"],
)
def test_a_file_where_a_folder_goes_is_one_line_naming_it(tmp_path, monkeypatch, main, flags):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("a file of mine")
    before = snapshot(tmp_path)
    msg = user_error(tiny_args("data", "out", *flags) if main is train_gpt2.main else flags, main)
    assert msg.startswith(f"{flags[-2]} {flags[-1]}") and "f is a file, not a folder" in msg
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------------------------
# A link at the name write_atomic writes is replaced, never written through


@pytest.mark.parametrize("link", [os.symlink, os.link], ids=["symbolic link", "hard link"])
def test_write_atomic_replaces_a_link_and_leaves_what_it_names_alone(tmp_path, link):
    folder, theirs = tmp_path / "run", tmp_path / "theirs.txt"
    folder.mkdir()
    theirs.write_bytes(b"the user's file\n")
    link(theirs, folder / "out.json")
    write_atomic(str(folder / "out.json"), lambda f: f.write(b"new"))
    assert theirs.read_bytes() == b"the user's file\n" and os.listdir(folder) == ["out.json"]
    assert (folder / "out.json").read_bytes() == b"new" and not (folder / "out.json").is_symlink()


# ----------------------------------------------------------------------------------------------
# The folder lock


class WindowsLikeMsvcrt:
    """msvcrt.locking as Windows documents it, on top of flock (a lock per open file, as a Windows
    handle's is): fails with EACCES when another handle holds the byte."""

    LK_NBLCK = 2

    def __init__(self):
        self.fcntl = pytest.importorskip("fcntl")  # the stand-in needs flock; Windows has the real msvcrt

    def locking(self, fd, mode, nbytes):
        assert mode == self.LK_NBLCK and nbytes == 1  # a run never waits for the lock
        try:
            self.fcntl.flock(fd, self.fcntl.LOCK_EX | self.fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(errno.EACCES, "Permission denied") from None


@pytest.mark.parametrize("mechanism", ["flock", "msvcrt"])
def test_a_second_holder_is_refused_naming_the_first_even_after_an_rm_of_its_file(tmp_path, monkeypatch, mechanism):
    """Locks conflict between two opens in one process as between processes (flock, Windows' handles)."""
    if mechanism == "msvcrt":
        monkeypatch.setattr(files, "fcntl", None)
        monkeypatch.setattr(files, "msvcrt", WindowsLikeMsvcrt())
    else:
        pytest.importorskip("fcntl")
    lock = lock_folder(str(tmp_path), ".x.lock", "run", " (rank 0 of a torchrun job)")
    try:
        text = (tmp_path / ".x.lock").read_text()
        assert text.startswith(f"pid {os.getpid()} (rank 0 of a torchrun job) on {socket.gethostname()}, since ")
        command = "python " + " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
        # a long command line (pytest given many files) is cut to 157 characters and "..."
        assert text.endswith(": " + (command if len(command) <= 160 else command[:157] + "..."))
        for named in (f" ({text})", ""):
            with pytest.raises(UserError) as refused:
                lock_folder(str(tmp_path), ".x.lock", "run")
            assert str(refused.value) == (
                f"--out-dir {tmp_path} is in use by another run{named}: wait for it to end, or pass another --out-dir"
            )
            (tmp_path / ".x.lock").unlink(missing_ok=True)  # "a stale lock", as a user takes it: still held
    finally:
        unlock_folder(lock)
    assert os.listdir(tmp_path) == []  # given back: its files removed
    unlock_folder(lock_folder(str(tmp_path), ".x.lock", "run"))  # free again


@pytest.mark.parametrize("holder", ["train_gpt2.py", "fineweb.py"])
def test_a_folder_held_by_one_script_is_refused_by_the_other_naming_the_real_holder(data, tmp_path, holder):
    """Both scripts lock a folder the same way (flock on it), each writing its holder to a file of its own
    name: the one refused names the script that holds it, not itself."""
    out, text = tmp_path / "out", tmp_path / "a.txt"
    out.mkdir()
    text.write_text("Some text to tokenize.\n" * 50)
    on_exit = contextlib.ExitStack()  # a training run's, which gives its --out-dir back as it ends
    if holder == "train_gpt2.py":
        claim_out_dir(str(out), None, on_exit)  # as a training run holds its --out-dir
        lock, pid_file = None, out / LOCK_FILE
    else:
        lock, pid_file = lock_folder(str(out), fineweb.FOLDER_LOCK, "fineweb.py"), out / fineweb.FOLDER_LOCK
    try:
        if holder == "train_gpt2.py":
            msg = user_error(["--input", text, "--out-dir", out], main=fineweb.main)
        else:
            msg = user_error(tiny_args(data, out, "--max-steps", 1))
        assert msg == (
            f"--out-dir {out} is in use by a {holder} run ({pid_file.read_text()}): wait for it to end, or pass "
            f"another --out-dir"
        )
    finally:
        on_exit.close()
        unlock_folder(lock)


def test_a_file_system_without_locks_is_said_not_an_error_of_the_disk(tmp_path, monkeypatch, capsys):
    """flock failing for another reason than a holder (an NFS mount without its lock manager): one
    warning, and the script goes on unlocked."""
    fcntl = pytest.importorskip("fcntl")

    class NoFlock:
        LOCK_EX, LOCK_NB = fcntl.LOCK_EX, fcntl.LOCK_NB

        @staticmethod
        def flock(fd, op):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(files, "fcntl", NoFlock)
    assert lock_folder(str(tmp_path), ".x.lock", "run") is None
    assert capsys.readouterr().err == (
        f"warning: cannot lock --out-dir {tmp_path} ({os.strerror(errno.ENOLCK)}): a second run started into it "
        f"would not be stopped\n"
    )


# ----------------------------------------------------------------------------------------------
# jsonl read line by line


def test_jsonl_rows_names_the_first_bad_line_or_passes_bad_lines_over():
    lines = ['{"a": 1}\n', "\n", '{"a": 2\n', "x\0y\n", "[3]\n"]
    with pytest.raises(UserError, match=r"^f line 3 is not valid JSON \(Expecting ',' delimiter\)$"):
        list(jsonl_rows(lines, "f"))
    with pytest.raises(UserError, match=r"^f line 2 holds NUL characters: not UTF-8 text \(UTF-16\? binary\?\)$"):
        list(jsonl_rows([lines[0], lines[3]], "f"))
    assert list(jsonl_rows(lines, "f", error=None)) == [(1, {"a": 1}), (5, [3])]  # as log_records reads our log

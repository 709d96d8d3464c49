"""support/files.py: atomic writes are durable (write_atomic fsyncs the temporary file before the
rename and the folder after it; write_dir_atomic fsyncs every file and folder it wrote before the
swap and the parent after it; seen through os.fsync and os.replace themselves, by the identity
(device, inode) of what each fsync reached: a write that skips one fails here), and write_atomic
never writes through, nor renames over, a symbolic link, nor into a file a hard link shares; a
failed write's line says "make room" only when the disk is full; jsonl_rows names a bad line."""

import json
import os
import time

import pytest

from helpers import assert_one_line_error, cli, state_of, tiny_args
from support import files
from support.cli import UserError
from support.files import jsonl_rows, write_atomic, write_dir_atomic

# ----------------------------------------------------------------------------------------------
# Atomic writes are durable


@pytest.fixture
def calls(monkeypatch):
    """The fsyncs and renames support.files makes, in order: ("fsync", identity of the fd's file or
    folder) and ("replace", identity of what is renamed, destination)."""
    seen, fsync, replace = [], os.fsync, os.replace

    def identity(st):
        return st.st_dev, st.st_ino

    def recording_fsync(fd):
        seen.append(("fsync", identity(os.fstat(fd))))
        return fsync(fd)

    def recording_replace(src, dst):
        seen.append(("replace", identity(os.stat(src)), os.fspath(dst)))
        return replace(src, dst)

    monkeypatch.setattr(files.os, "fsync", recording_fsync)
    monkeypatch.setattr(files.os, "replace", recording_replace)
    return seen


def identity(path):
    st = os.stat(path)
    return st.st_dev, st.st_ino


def test_write_atomic_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, calls):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"old")
    write_atomic(str(path), lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new"
    (rename,) = [i for i, call in enumerate(calls) if call[0] == "replace" and call[2] == str(path)]
    assert ("fsync", identity(path)) in calls[:rename]  # the new file's inode, before its rename
    assert ("fsync", identity(tmp_path)) in calls[rename + 1 :]  # the rename is an entry of the folder


def test_write_dir_atomic_fsyncs_every_file_and_folder_before_the_swap_and_the_parent_after(tmp_path, calls):
    out = tmp_path / "export"

    def write(folder):  # a file in the folder and one in a subfolder, written without any fsync
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write("{}")
        os.mkdir(os.path.join(folder, "sub"))
        with open(os.path.join(folder, "sub", "model.safetensors"), "wb") as f:
            f.write(b"x" * 100)

    write_dir_atomic(str(out), write, "the export")
    (swap,) = [i for i, call in enumerate(calls) if call[0] == "replace" and call[2] == str(out)]
    before = calls[:swap]
    for path in (out / "config.json", out / "sub" / "model.safetensors", out / "sub", out):
        assert ("fsync", identity(path)) in before, path  # the same inodes, under their final names
    assert ("fsync", identity(tmp_path)) in calls[swap + 1 :]


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


# ----------------------------------------------------------------------------------------------
# write_atomic never follows a symbolic link, nor replaces one


@pytest.mark.parametrize("nofollow", [True, False], ids=["O_NOFOLLOW", "no O_NOFOLLOW"])
@pytest.mark.parametrize("at", ["the temporary file's name", "the final name"])
@pytest.mark.parametrize("to", ["a file", "nothing"])
def test_write_atomic_refuses_a_symlink_and_leaves_it_and_its_target_alone(tmp_path, monkeypatch, at, to, nofollow):
    """A link at the temporary or the final name is refused in one line, nothing written (without
    O_NOFOLLOW, as on Windows, O_EXCL alone keeps the temporary file's open off a link)."""
    if not nofollow:
        monkeypatch.setattr(files, "NOFOLLOW", 0)
    folder, target = tmp_path / "run", tmp_path / "mine.txt"
    folder.mkdir()
    if to == "a file":
        target.write_bytes(b"the user's file\n")
    path = folder / "ckpt_000001.pt"
    link = folder / ".ckpt_000001.pt.tmp" if at == "the temporary file's name" else path
    link.symlink_to(target)
    before = state_of(target)
    time.sleep(0.01)  # a write would move the mtime
    with pytest.raises(files.LinkedName) as e:
        write_atomic(str(path), lambda f: f.write(b"new"))
    assert str(e.value).startswith(f"{link} is a symbolic link (to {target}): ") and "\n" not in str(e.value)
    assert state_of(target) == before and os.readlink(link) == str(target)
    assert sorted(os.listdir(folder)) == [link.name]  # nothing made beside it, the link kept


def test_write_atomic_writes_no_file_a_leftover_temporary_name_shares(tmp_path):
    """A hard link at the temporary name: write_atomic makes its own file, the user's bytes stay."""
    folder, theirs = tmp_path / "run", tmp_path / "theirs.txt"
    folder.mkdir()
    theirs.write_bytes(b"the user's file\n")
    os.link(theirs, folder / ".out.json.tmp")
    before = state_of(theirs)
    write_atomic(str(folder / "out.json"), lambda f: f.write(b"new"))
    assert (folder / "out.json").read_bytes() == b"new" and state_of(theirs) == before
    assert sorted(os.listdir(folder)) == ["out.json"]


# ----------------------------------------------------------------------------------------------
# jsonl read line by line


def test_jsonl_rows_names_the_first_bad_line_or_passes_bad_lines_over():
    lines = ['{"a": 1}\n', "\n", '{"a": 2\n', "x\0y\n", "[3]\n"]
    with pytest.raises(UserError, match=r"^f line 3 is not valid JSON \(Expecting ',' delimiter\)$"):
        list(jsonl_rows(lines, "f"))
    with pytest.raises(UserError, match=r"^f line 2 holds NUL characters: not UTF-8 text \(UTF-16\? binary\?\)$"):
        list(jsonl_rows([lines[0], lines[3]], "f"))
    assert list(jsonl_rows(lines, "f", error=None)) == [(1, {"a": 1}), (5, [3])]  # as log_records reads our log

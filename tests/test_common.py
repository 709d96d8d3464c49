"""Atomic writes are durable: write_atomic fsyncs the temporary file before the rename and the
folder after it; write_dir_atomic fsyncs every file and folder it wrote before the swap and the
parent after it. Seen through os.fsync and os.replace themselves, by the identity (device, inode)
of what each fsync reached: a write that skips one fails here."""

import os

import pytest

from support import common
from support.common import write_atomic, write_dir_atomic


@pytest.fixture
def calls(monkeypatch):
    """The fsyncs and renames support.common makes, in order: ("fsync", identity of the fd's file or
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

    monkeypatch.setattr(common.os, "fsync", recording_fsync)
    monkeypatch.setattr(common.os, "replace", recording_replace)
    return seen


def identity(path):
    st = os.stat(path)
    return st.st_dev, st.st_ino


def test_write_atomic_fsyncs_the_file_before_the_rename(tmp_path, calls):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"old")
    write_atomic(str(path), lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new"
    renames = [i for i, call in enumerate(calls) if call[0] == "replace" and call[2] == str(path)]
    assert len(renames) == 1
    assert ("fsync", identity(path)) in calls[: renames[0]]  # the new file's inode, before its rename


def test_write_atomic_fsyncs_the_folder_after_the_rename(tmp_path, calls):
    path = tmp_path / "manifest.json"
    write_atomic(str(path), lambda f: f.write(b"{}"))
    (rename,) = [i for i, call in enumerate(calls) if call[0] == "replace"]
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

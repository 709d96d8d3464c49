"""support/common.py: atomic writes are durable (write_atomic fsyncs the temporary file before the
rename and the folder after it; write_dir_atomic fsyncs every file and folder it wrote before the
swap and the parent after it; seen through os.fsync and os.replace themselves, by the identity
(device, inode) of what each fsync reached: a write that skips one fails here); a failed write's
line says "make room" only when the disk is full; run_cli prints a mistake as one `error:` line (a
flag argparse cannot parse too, in every script) and an interrupt as its own words; and the
one-line out-of-memory report tells GPU memory from host memory."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, assert_one_line_error, cli, tiny_args
from support import common
from support.common import UserError, out_of_memory_line, said_on_interrupt, write_atomic, write_dir_atomic

# ----------------------------------------------------------------------------------------------
# Atomic writes are durable


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
# run_cli: a mistake is one line, an interrupt its own words


def test_a_flag_argparse_cannot_parse_is_one_line_not_the_usage(tmp_path):
    r = cli(*tiny_args(tmp_path / "data", tmp_path / "out", "--keep-ckpts", 1.5))
    line = assert_one_line_error(r, "argument --keep-ckpts: invalid int value: '1.5'")
    assert line.endswith("(see python train_gpt2.py --help)") and "usage" not in r.stderr


@pytest.mark.parametrize(
    "script, parse, argv, words",
    [
        ("train_gpt2.py", "parse_args", ["--keep-ckpts", "1.5"], "argument --keep-ckpts: invalid int value: '1.5'"),
        ("train_gpt2.py", "parse_args", ["--max-st", "3"], "unrecognized arguments: --max-st 3"),
        ("train_gpt2.py", "parse_args", ["--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
        ("train_gpt2.py", "parse_args", ["--export-hf", "x"], "argument --export-hf: expected 2 arguments"),
        ("fineweb.py", "parse_args", ["--format", "txt"], "argument --format: invalid choice: 'txt'"),
        ("hellaswag.py", "main", ["--limit", "ten"], "argument --limit: invalid int value: 'ten'"),
        ("hellaswag.py", "main", ["--modle", "gpt2"], "unrecognized arguments: --modle gpt2"),
        ("bench.py", "parse_args", ["--peak-flops", "lots"], "argument --peak-flops: invalid float value: 'lots'"),
        ("bench.py", "parse_args", ["--tiyn"], "unrecognized arguments: --tiyn"),
    ],
)
def test_every_script_says_an_argparse_mistake_in_one_line(script, parse, argv, words, capsys):
    parse = getattr(importlib.import_module(script.removesuffix(".py")), parse)
    with pytest.raises(UserError) as e:
        parse(argv)
    message = str(e.value)
    assert message.startswith(words) and message.endswith(f" (see python {script} --help)"), message
    assert capsys.readouterr().err == ""  # no usage printed before it


def test_run_cli_prints_an_interrupts_own_words():
    code = (
        "from support.common import run_cli\ndef main():\n    raise KeyboardInterrupt('its own words')\nrun_cli(main)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 130 and r.stderr.strip() == "its own words"


def test_said_on_interrupt_keeps_a_message_it_has():
    with pytest.raises(KeyboardInterrupt) as e, said_on_interrupt("the job's words"):
        raise KeyboardInterrupt("its own words")
    assert str(e.value) == "its own words"


# ----------------------------------------------------------------------------------------------
# The one-line out-of-memory report


def test_gpu_out_of_memory_reads_as_gpu_memory_with_the_allocators_size():
    """The CUDA allocator's error (raised here by hand, as torch raises it) is GPU memory, its
    multi-line statistics cut to the size that did not fit; one outside every marked phase keeps
    the words."""
    e = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.2 GiB "
        "is free. Of the allocated memory 70 GiB is allocated by PyTorch\nmore lines"
    )
    assert common.memory_kind(e) == "GPU memory"
    assert out_of_memory_line(e, "GPU memory") == "out of GPU memory (CUDA out of memory. Tried to allocate 12.00 GiB)"
    assert common.memory_kind(ValueError("shapes differ")) is None
    wrapped = RuntimeError("compile failed")
    wrapped.__cause__ = MemoryError()
    assert common.memory_kind(wrapped) == "host memory"

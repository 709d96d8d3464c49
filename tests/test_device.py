"""support/device.py: whether torch.compile is used (the compile check stubbed; whole compiled
runs: test_train_compile.py), and glibc's allocator keeping freed memory on a CPU run."""

import os
import platform
import sys

import pytest

from helpers import assert_one_line_error, cli, heap_after, random_shards, read_log, tiny_args
from support.cli import UserError
from support.device import choose_compile

# ----------------------------------------------------------------------------------------------
# torch.compile: checked only where it would be on; one that cannot work is a note by default,
# an error when asked for


def test_default_compile_that_cannot_work_is_a_note_and_eager(capsys):
    asked = []

    def broken(device):
        asked.append(device)
        return "InvalidCxxCompiler: No working C++ compiler found"

    assert choose_compile(None, "cuda", problem=broken) is False
    assert asked == ["cuda"]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("note: torch.compile does not work on this cuda"), lines
    assert "(InvalidCxxCompiler: No working C++ compiler found)" in lines[0]
    assert choose_compile(None, "cuda", verbose=False, problem=broken) is False  # another rank: rank 0 says it
    assert capsys.readouterr().out == ""


def test_compile_is_checked_only_where_it_would_be_on():
    asked = []
    works = lambda device: asked.append(device)  # noqa: E731  (None: compile works)
    assert choose_compile(None, "cuda", problem=works) is True
    assert choose_compile(True, "cpu", problem=works) is True
    assert asked == ["cuda", "cpu"]
    assert choose_compile(None, "cpu", problem=works) is False  # off by default on a CPU (and on MPS)
    assert choose_compile(None, "mps", problem=works) is False
    assert choose_compile(False, "cuda", problem=works) is False
    assert asked == ["cuda", "cpu"]


def test_compile_asked_for_that_cannot_work_is_a_user_error():
    with pytest.raises(UserError) as e:
        choose_compile(True, "cpu", problem=lambda device: "InvalidCxxCompiler: No working C++ compiler found")
    assert str(e.value) == (
        "--compile: torch.compile does not work on this cpu (InvalidCxxCompiler: No working C++ compiler found); "
        "run with --no-compile"
    )
    assert e.value.every_rank  # torchrun: rank 0 alone says it


# A TORCHINDUCTOR_CACHE_DIR that is no writable folder: the variable is named, not the device. The
# real compile on the CPU, in a process of its own (the check's answer is kept per process)


def bad_cache(tmp_path, where):
    (tmp_path / "a_file").write_text("")
    return str(tmp_path / "a_file" / "sub" if where == "under a file" else tmp_path / "a_file")


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_cache_dir_compile_cannot_write_is_blamed_not_the_cpu(tmp_path, where):
    data, cache = random_shards(tmp_path / "data"), bad_cache(tmp_path, where)
    r = cli(*tiny_args(data, tmp_path / "out", "--compile"), env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    why = "is a file, not a folder" if where == "a file" else f"is under {tmp_path / 'a_file'}, a file"
    assert_one_line_error(
        r,
        f"error: --compile: torch.compile cannot write its cache: TORCHINDUCTOR_CACHE_DIR={cache} {why}: unset "
        "TORCHINDUCTOR_CACHE_DIR, or point it at a writable folder",
    )
    assert "this cpu" not in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_cache_dir_fixes_it_names_train_compiled(tmp_path):
    data = random_shards(tmp_path / "data")
    for name, env in [
        ("unset", {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}),
        ("writable", {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}),
    ]:
        r = cli(*tiny_args(data, tmp_path / name, "--compile", "--max-steps", 1, "--eval-every", 0), env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert read_log(tmp_path / name)[0][0]["config"]["compile"] is True
    assert os.listdir(tmp_path / "cache")  # the kernels went where it was pointed


def test_a_default_compile_a_bad_cache_dir_stops_names_the_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", bad_cache(tmp_path, "a file"))
    assert choose_compile(None, "cuda", problem=lambda device: "FileExistsError: [Errno 17] File exists") is False
    [note] = capsys.readouterr().out.splitlines()
    assert note == (
        "note: torch.compile cannot write its cache, so this run trains without it (slower): "
        f"TORCHINDUCTOR_CACHE_DIR={tmp_path / 'a_file'} is a file, not a folder: unset TORCHINDUCTOR_CACHE_DIR, "
        "or point it at a writable folder"
    )
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "new" / "cache"))  # made when needed: fine
    assert choose_compile(None, "cuda", verbose=False, problem=lambda device: "another failure") is False
    with pytest.raises(UserError, match=r"does not work on this cpu \(another failure\)"):
        choose_compile(True, "cpu", problem=lambda device: "another failure")


# ----------------------------------------------------------------------------------------------
# glibc's allocator keeps freed memory in the heap on a CPU run


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_cpu_run_keeps_freed_memory_in_the_heap(tmp_path):
    # glibc's default maps each big block on its own and unmaps it when freed: every step of a CPU
    # run would fault its activations in again (half the step time of a small model)
    data = random_shards(tmp_path / "data")
    got = {
        mode: heap_after("train_gpt2", mode, tiny_args(data, tmp_path / mode, "--max-steps", 1, "--eval-every", 0))
        for mode in ("on", "off")
    }
    assert got["off"][0] >= 64  # the reference: glibc mapped the 64 MiB on its own
    mapped, heap_after_free = got["on"]
    assert mapped < 64 and heap_after_free >= 64, got  # from the heap, and kept there once freed

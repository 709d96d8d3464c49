"""support/device.py: whether torch.compile is used (the compile check stubbed; whole compiled
runs: test_train_compile.py), and glibc's allocator keeping freed memory on a CPU run."""

import platform
import sys

import pytest

from helpers import heap_before_and_after, tiny_args
from support.cli import UserError
from support.device import choose_compile


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
    assert e.value.every_rank  # torchrun: each node's first process alone says it


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_cpu_run_keeps_freed_memory_in_the_heap(data, tmp_path):
    # glibc's default maps a big block on its own, unmapped when freed: each step would fault it in again
    before, after = heap_before_and_after("train_gpt2", tiny_args(data, tmp_path, "--max-steps", 1, "--eval-every", 0))
    assert before[0] >= 64  # the reference: before main(), glibc mapped the 64 MiB on its own
    mapped, heap_after_free = after
    assert mapped < 64 and heap_after_free >= 64, (before, after)  # from the heap, and kept there once freed

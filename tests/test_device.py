"""support/device.py: whether torch.compile is used (the compile check stubbed; whole compiled
runs: test_train_compile.py), and glibc's allocator keeping freed memory on a CPU run."""

import platform
import sys

import pytest

from helpers import heap_before_and_after, tiny_args
from support.cli import UserError
from support.device import choose_compile

BROKEN = "InvalidCxxCompiler: No working C++ compiler found"


@pytest.mark.parametrize(
    "requested, device_type, works, compiles, checked",
    [
        (None, "cuda", True, True, True),  # on by default on CUDA
        (True, "cpu", True, True, True),  # asked for
        (None, "cpu", True, False, False),  # off by default on a CPU and on MPS: not even checked
        (None, "mps", True, False, False),
        (False, "cuda", True, False, False),
        (None, "cuda", False, False, True),  # on by default but cannot work: a note, and eager
    ],
)
def test_compile_where_asked_or_by_default_checked_only_there(capsys, requested, device_type, works, compiles, checked):
    asked = []
    problem = lambda device: asked.append(device) or (None if works else BROKEN)  # noqa: E731
    assert choose_compile(requested, device_type, problem=problem) is compiles
    assert asked == [device_type] * checked
    note = f"note: torch.compile does not work on this cuda ({BROKEN}): training without it (slower)\n"
    assert capsys.readouterr().out == ("" if works else note)
    assert choose_compile(requested, device_type, verbose=False, problem=problem) is compiles  # another rank
    assert capsys.readouterr().out == ""  # rank 0 says it


def test_compile_asked_for_that_cannot_work_is_a_user_error():
    with pytest.raises(UserError) as e:
        choose_compile(True, "cpu", problem=lambda device: BROKEN)
    assert str(e.value) == f"--compile: torch.compile does not work on this cpu ({BROKEN}); run with --no-compile"
    assert e.value.every_rank  # torchrun: each node's first process alone says it


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_cpu_run_keeps_freed_memory_in_the_heap(data, tmp_path):
    # glibc's default maps a big block on its own, unmapped when freed: each step would fault it in again
    before, after = heap_before_and_after("train_gpt2", tiny_args(data, tmp_path, "--max-steps", 1, "--eval-every", 0))
    assert before[0] >= 64  # the reference: before main(), glibc mapped the 64 MiB on its own
    mapped, heap_after_free = after
    assert mapped < 64 and heap_after_free >= 64, (before, after)  # from the heap, and kept there once freed

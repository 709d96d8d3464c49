"""support/cli.py: run_cli prints a mistake as one `error:` line (a flag argparse cannot parse too,
in every script) and an interrupt as its own words; the one-line out-of-memory report tells GPU
memory from host memory."""

import importlib
import subprocess
import sys

import pytest
import torch

from helpers import ROOT
from support.cli import UserError, memory_kind, out_of_memory_line

# ----------------------------------------------------------------------------------------------
# run_cli: a mistake is one line, an interrupt its own words


@pytest.mark.parametrize(
    "script, parse, argv, words",
    [
        ("train_gpt2.py", "parse_args", ["--keep-ckpts", "1.5"], "argument --keep-ckpts: invalid int value: '1.5'"),
        ("train_gpt2.py", "parse_args", ["--max-st", "3"], "unrecognized arguments: --max-st 3"),
        ("train_gpt2.py", "parse_args", ["--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
        ("sample.py", "main", ["gpt2", "--top-k", "some"], "argument --top-k: invalid int value: 'some'"),
        ("export_hf.py", "main", ["log/ckpt_000001.pt"], "the following arguments are required: DIR"),
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
    code = "from support.cli import run_cli\ndef main():\n    raise KeyboardInterrupt('its own words')\nrun_cli(main)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 130 and r.stderr.strip() == "its own words"


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
    assert memory_kind(e) == "GPU memory"
    assert out_of_memory_line(e, "GPU memory") == "out of GPU memory (CUDA out of memory. Tried to allocate 12.00 GiB)"
    assert memory_kind(ValueError("shapes differ")) is None
    wrapped = RuntimeError("compile failed")
    wrapped.__cause__ = MemoryError()
    assert memory_kind(wrapped) == "host memory"

"""Shared fixtures and helpers: the offline data in ../shared/data, the tokenizer cache, tiny
models and tiny training runs, the one log reader and the one-line-error checks."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _find_shared_data():
    for base in (ROOT, *ROOT.parents):
        candidate = base / "shared" / "data"
        if (candidate / "tiktoken_cache").is_dir():
            return candidate
    env = os.environ.get("SHARED_DATA")
    if env and Path(env, "tiktoken_cache").is_dir():
        return Path(env)
    raise RuntimeError("cannot find shared/data beside the repository (set SHARED_DATA to its path)")


SHARED_DATA = _find_shared_data()
# tiktoken reads its gpt2 files from here instead of downloading them; subprocesses inherit it
os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED_DATA / "tiktoken_cache")
# never reach for the network in tests
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def shared_data():
    return SHARED_DATA


@pytest.fixture(scope="session")
def enc():
    from support.shards import get_tokenizer

    return get_tokenizer()


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory):
    """A random small transformers GPT2LMHeadModel saved with save_pretrained."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = GPT2LMHeadModel(config)
    # random init leaves LayerNorms at 1/0 and biases at 0; perturb them so the test sees every weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf_tiny")
    model.save_pretrained(path)
    return path


@pytest.fixture
def tiny_config():
    from train_gpt2 import GPTConfig

    return GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=4, n_embd=32)


# ----------------------------------------------------------------------------------------------
# Tiny training runs


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_process():
    """Other test runs share these cores: with 2 threads a step often waits for a descheduled
    sibling thread, and runs 3-5x slower than with one. Subprocesses inherit OMP_NUM_THREADS."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if env is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = env


def write_shard(path, tokens):
    """A shard written by the test itself, independently of fineweb.py: np.save of uint16 (.npy),
    or the llm.c layout (.bin): 256 little-endian int32 (magic 20240520, version 1, token count,
    zeros), then uint16 tokens."""
    tokens = np.asarray(tokens, dtype=np.uint16)
    if str(path).endswith(".bin"):
        header = np.zeros(256, dtype="<i4")
        header[0], header[1], header[2] = 20240520, 1, len(tokens)
        with open(path, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype("<u2").tobytes())
    else:
        np.save(path, tokens)


def random_shards(folder, train_lengths=(600, 600), val_length=600, seed=0):
    """Shards of random GPT-2 token ids: train shards and one val shard."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_shard(folder / "rand_val_000000.npy", rng.integers(0, 50257, val_length))
    for i, n in enumerate(train_lengths, start=1):
        write_shard(folder / f"rand_train_{i:06d}.npy", rng.integers(0, 50257, n))
    return folder


def tiny_args(data_dir, out_dir, *extra):
    """A 2-layer, 32-wide model on the CPU; later flags override earlier ones."""
    return [
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(out_dir),
        "--device",
        "cpu",
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--block-size",
        "64",
        "-B",
        "2",
        "-T",
        "16",
        "--total-batch-size",
        "64",
        "--max-steps",
        "6",
        "--warmup-steps",
        "3",
        "--max-lr",
        "3e-3",
        "--eval-every",
        "4",
        "--val-tokens",
        "256",
        "--hellaswag-every",
        "0",
        "--sample-every",
        "0",
        "--ckpt-every",
        "0",
        *map(str, extra),
    ]


def read_log(out_dir):
    """(all records, {step: the last record of that step}) of out_dir/log.jsonl. A resumed run
    repeats steps: the last one counts. A line cut short by a kill is skipped. A step record is
    a trained step (train_loss), a skipped one (skipped) or one fp16's loss scaler skipped (scaler_skipped)."""
    records = []
    for line in open(os.path.join(out_dir, "log.jsonl")):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    steps = {r["step"]: r for r in records if "train_loss" in r or "skipped" in r or "scaler_skipped" in r}
    return records, steps


def hangup_default():
    """preexec_fn of a child a test sends SIGHUP: SIGHUP's default action there, also when the tests
    run under nohup (which ignores SIGHUP, and a child inherits that)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def cli(*args, script="train_gpt2.py", timeout=300, **kwargs):
    """Run one of the scripts as a user would; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, script, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs
    )


# After a script's main() on the CPU, in the same interpreter: how many MiB of a live 64 MiB tensor
# glibc mapped on its own (mmap) and how many MiB the heap still holds once it is freed. "off"
# stands in glibc's defaults for the script's keep_freed_memory (support.machine's), as the reference
# a check must tell apart from "on" (the script as it is).
MALLOC_PROBE = """
import ctypes, importlib, sys, torch
script = importlib.import_module(sys.argv[2])
if sys.argv[1] == "off":
    script.keep_freed_memory = lambda: False
assert script.main(sys.argv[3:]) in (0, None)
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
x = torch.ones(16 * 2**20)
mapped = libc.mallinfo2().hblkhd >> 20
del x
print(mapped, libc.mallinfo2().arena >> 20)
"""


def heap_after(script, mode, args):
    """(MiB mapped on its own, MiB the heap keeps) after `script`.main(args), "on" or "off"; see MALLOC_PROBE."""
    proc = subprocess.run(
        [sys.executable, "-c", MALLOC_PROBE, mode, script, *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [int(v) for v in proc.stdout.split()[-2:]]


def user_error(args):
    """train_gpt2.main(args) must stop with a one-line UserError; returns its message."""
    import train_gpt2
    from support.common import UserError

    with pytest.raises(UserError) as e:
        train_gpt2.main([str(a) for a in args])
    assert "\n" not in str(e.value)
    return str(e.value)


def assert_one_line_error(proc, *words):
    """A refused input as the user sees it: exit 1, one `error:` line naming the problem, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def snapshot(folder):
    """{relative path: bytes} of every file under folder: nothing that existed may go or change."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def read_only(tmp_path):
    """make(folder): folder, bind-mounted read-only onto itself (root writes through chmod);
    skipped where mounting is not allowed."""
    mounted = []

    def make(folder):
        if shutil.which("mount") is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
            pytest.skip("a read-only bind mount needs root")
        for cmd in (["mount", "--bind", folder, folder], ["mount", "-o", "remount,bind,ro", folder, folder]):
            r = subprocess.run([*map(str, cmd)], capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot mount read-only here: {r.stderr.strip()}")
            if cmd[1] == "--bind":
                mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture(scope="session")
def short_run(tmp_path_factory):
    """Two steps with a checkpoint after each: checkpoints to break (copy them before changing)."""
    import train_gpt2

    tmp = tmp_path_factory.mktemp("short")
    data = random_shards(tmp / "data")
    assert train_gpt2.main(tiny_args(data, tmp / "out", "--max-steps", 2, "--ckpt-every", 1, "--eval-every", 0)) == 0
    return data, tmp / "out"

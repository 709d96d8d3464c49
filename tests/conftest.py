"""The fixtures, and the tests' environment, set here at import: the offline data in
../shared/data, tiktoken's cache (for the reference tokenizer), no network. The helpers the tests
share are in helpers.py."""

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import train_gpt2
from fake_gpu import faked
from helpers import ROOT, random_shards, save_tiny_hf_gpt2, tiny_args, write_shard
from support.shards import get_tokenizer
from train_gpt2 import GPTConfig


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
# tiktoken.get_encoding("gpt2"), the reference the shipped tokenizer is tested against, reads its
# files from here instead of downloading them; the scripts need none (support/gpt2_bpe/)
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
    return get_tokenizer()


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory):
    """A random small transformers GPT2LMHeadModel saved with save_pretrained."""
    return save_tiny_hf_gpt2(tmp_path_factory.mktemp("hf_tiny"))


@pytest.fixture
def fake_gpu():
    """fake_gpu(gpu="H100", count=1): count faked CUDA GPUs of fake_gpu.GPUS[gpu] ("H100" 9.0 80 GB,
    "A100" 8.0 40 GB, "A100 80GB", "RTX 3090" 8.6 24 GB, "A4000" 8.6 16 GB, "T4" 7.5 16 GB) for the
    rest of the test, in this process and the ones it starts; undone after it. Returns the FakeGPU,
    which records what the program asked of it."""
    with contextlib.ExitStack() as stack:
        yield lambda gpu="H100", count=1: stack.enter_context(faked(gpu, count))


@pytest.fixture
def tiny_config():
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
    tmp = tmp_path_factory.mktemp("short")
    data = random_shards(tmp / "data")
    assert train_gpt2.main(tiny_args(data, tmp / "out", "--max-steps", 2, "--ckpt-every", 1, "--eval-every", 0)) == 0
    return data, tmp / "out"


@pytest.fixture(scope="session")
def shakespeare_export(tmp_path_factory, shared_data, enc):
    """(checkpoint, its --export-hf folder) of a tiny model (tiny_args: 2 layers, 32 wide, vocabulary
    padded to 50,304; block size 128, which holds every HellaSwag ending, as lm-eval requires)
    trained 40 steps on Tiny Shakespeare: real text, real tokens. Read, never changed."""
    tmp = tmp_path_factory.mktemp("shakespeare")
    tokens = [enc.eot_token] + enc.encode_ordinary((shared_data / "tinyshakespeare" / "input.txt").read_text())
    (tmp / "data").mkdir()
    write_shard(tmp / "data" / "ts_val_000000.npy", tokens[:4096])
    write_shard(tmp / "data" / "ts_train_000001.npy", tokens[4096:])
    args = tiny_args(tmp / "data", tmp / "run", "--block-size", 128, "--max-steps", 40, "--warmup-steps", 4)
    assert train_gpt2.main([*args, "--ckpt-every", 40, "--eval-every", 0]) == 0
    ckpt = tmp / "run" / "ckpt_000040.pt"
    assert train_gpt2.main(["--export-hf", str(ckpt), str(tmp / "hf")]) == 0
    return ckpt, tmp / "hf"


def pytest_configure(config):
    """Files go to pytest-xdist's workers in the order collected (pytest_collection_modifyitems),
    not sorted by their number of tests, which would put test_readme.py's one slow test last."""
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --loadscope-reorder
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """test_readme.py's tests first: its fresh clone trains the README's laptop run, the slow tier's
    longest test by far, so that on 2 xdist workers (--dist loadfile) the other files run beside it."""
    items.sort(key=lambda item: item.path.name != "test_readme.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A test module's shards of random token ids (random_shards): read, never changed."""
    return random_shards(tmp_path_factory.mktemp("data"))


@pytest.fixture
def run4_with_val_loss(data, tmp_path):
    """4 steps done with checkpoints after 2 and 4, val loss every 2 steps."""
    out = tmp_path / "run"
    args = tiny_args(data, out, "--max-steps", 4, "--warmup-steps", 2, "--ckpt-every", 2, "--eval-every", 2)
    assert train_gpt2.main(args) == 0
    return out

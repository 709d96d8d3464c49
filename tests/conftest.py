"""The fixtures, and the tests' environment (no network). The data the tests read ships in the
repository (tests/assets/README.md); the helpers the tests share are in helpers.py."""

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import export_hf
import train_gpt2
from fake_gpu import faked
from helpers import ROOT, random_shards, save_tiny_hf_gpt2, tiny_args, write_shard
from support.shards import get_tokenizer
from train_gpt2 import GPTConfig

ASSETS = Path(__file__).parent / "assets"
GPT2_BPE = ROOT / "support" / "gpt2_bpe" / "vocab.bpe"
# tiktoken's "gpt2" files: where it downloads them from, and their sha256 as tiktoken_ext/openai_public.py pins them
TIKTOKEN_GPT2 = {
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe": (
        GPT2_BPE,
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    ),
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json": (
        ASSETS / "encoder.json",
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    ),
}


@pytest.fixture(scope="session", autouse=True)
def tiktoken_cache(tmp_path_factory):
    """tiktoken's GPT-2 files (the reference tokenizer's) in its cache folder, named by the sha1 of their
    URL: the shipped ones, checked against tiktoken's hashes, so that it downloads nothing."""
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    for url, (path, sha256) in TIKTOKEN_GPT2.items():
        data = path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha256, f"{path} is not GPT-2's published file"
        (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(data)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="session")
def assets():
    """The data the tests read, shipped in the repository (tests/assets/README.md)."""
    return SimpleNamespace(
        hellaswag=ASSETS / "hellaswag_val_450.jsonl",  # HellaSwag val's first 300 rows and first 150 WikiHow ones
        fineweb=ASSETS / "fineweb_batch_000001.parquet",  # 100 FineWeb documents, 174,082 tokens
        shakespeare=ROOT / "data" / "tinyshakespeare.txt",  # Tiny Shakespeare's first 999,985 bytes
        encoder_json=ASSETS / "encoder.json",  # GPT-2's, with support/gpt2_bpe/vocab.bpe
        vocab_bpe=GPT2_BPE,
        reference=json.loads((ASSETS / "reference_numbers.json").read_text()),
    )


@pytest.fixture(scope="session")
def full_hellaswag():
    """HellaSwag's whole val set (too large to ship) in GPT2_TEST_DATA/hellaswag/; skipped without it."""
    folder = os.environ.get("GPT2_TEST_DATA")
    path = Path(folder or "", "hellaswag", "hellaswag_val.jsonl")
    if not folder or not path.is_file():
        pytest.skip(
            f"needs all of HellaSwag's val set: hellaswag/hellaswag_val.jsonl in GPT2_TEST_DATA ({folder or 'unset'})"
        )
    return path


@pytest.fixture(scope="session")
def enc():
    return get_tokenizer()


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory):
    """A random small transformers GPT2LMHeadModel saved with save_pretrained."""
    return save_tiny_hf_gpt2(tmp_path_factory.mktemp("hf_tiny"))


@pytest.fixture
def fake_gpu():
    """fake_gpu(gpu="H100", count=1): count faked GPUs of fake_gpu.GPUS[gpu] for the rest of the test, in
    this process and the ones it starts; the FakeGPU, which records what the program asked of it."""
    with contextlib.ExitStack() as stack:
        yield lambda gpu="H100", count=1: stack.enter_context(faked(gpu, count))


@pytest.fixture
def tiny_config():
    return GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_process():
    """Other test runs share these cores: with 2 threads a step often waits for a descheduled sibling
    thread, 3-5x slower than with one. Subprocesses inherit OMP_NUM_THREADS."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(threads)


@pytest.fixture
def read_only(tmp_path):
    """make(folder, writable=False): folder, bind-mounted onto itself, read-only (root writes through
    chmod) unless writable; skipped where mounting is not allowed."""
    mounted = []

    def make(folder, writable=False):
        if shutil.which("mount") is None or os.geteuid() != 0:
            pytest.skip("a bind mount needs root")
        for options in (["--bind"], ["-o", "remount,bind,ro"])[: 1 if writable else 2]:
            r = subprocess.run(["mount", *options, str(folder), str(folder)], capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot mount read-only here: {r.stderr.strip()}")
            if options == ["--bind"]:
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
def shakespeare_export(tmp_path_factory, assets, enc):
    """(checkpoint, its export_hf.py folder) of a tiny model (block size 128: every HellaSwag ending fits,
    as lm-eval requires) trained 40 steps on Tiny Shakespeare. Read, never changed."""
    tmp = tmp_path_factory.mktemp("shakespeare")
    tokens = [enc.eot_token] + enc.encode_ordinary(assets.shakespeare.read_text())
    (tmp / "data").mkdir()
    write_shard(tmp / "data" / "ts_val_000000.npy", tokens[:4096])
    write_shard(tmp / "data" / "ts_train_000001.npy", tokens[4096:])
    args = tiny_args(tmp / "data", tmp / "run", "--block-size", 128, "--max-steps", 40, "--warmup-steps", 4)
    assert train_gpt2.main([*args, "--ckpt-every", 40, "--eval-every", 0]) == 0
    ckpt = tmp / "run" / "ckpt_000040.pt"
    assert export_hf.main([str(ckpt), str(tmp / "hf")]) == 0
    return ckpt, tmp / "hf"


def pytest_configure(config):
    """Tests never reach for the network, but for the online ones (marked online: they check the sources
    outside the repository that the scripts read), which only `-m online` runs (README): then the Hub's
    clients are not told to stay offline (they read these variables once, when imported). pytest-xdist's
    workers get the files in the order collected, not sorted by their number of tests."""
    config.online = config.getoption("markexpr") == "online"
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if config.online:
            os.environ.pop(var, None)
        else:
            os.environ[var] = "1"
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --loadscope-reorder
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """test_readme.py first: its laptop run is the slow tier's longest test, the other files run beside it.
    The tiers skip the online tests, saying how to run them."""
    items.sort(key=lambda item: item.path.name != "test_readme.py")
    for item in items:
        if "online" in item.keywords and not config.online:
            item.add_marker(pytest.mark.skip(reason="reads the Hugging Face Hub: run online, alone: pytest -m online"))


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

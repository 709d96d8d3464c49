"""Shared fixtures: the offline data in ../shared/data, the tokenizer cache, tiny models."""

import os
import sys
from pathlib import Path

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
    from train_gpt2 import get_tokenizer

    return get_tokenizer()


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory):
    """A random small transformers GPT2LMHeadModel saved with save_pretrained."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
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

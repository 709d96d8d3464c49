"""support/hf_interop.py: an export is what transformers' own tools load as GPT-2, a fault in its write
leaves everything as it was, a Hub name fails at once in one line without the Hub, and a transformers
folder is read in exactly or refused (which targets an export refuses: test_export_hf.py)."""

import errno
import os
import shutil
import socket
import stat
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import torch
import transformers
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, pipeline

import hellaswag
import sample
import train_gpt2
from helpers import UNICODE_TEXTS, assert_one_line_error, cli, read_log, snapshot, tiny_args
from support import files, hf_interop
from support.checkpoints import load_checkpoint
from support.cli import UserError
from support.hf_interop import save_hf_gpt2
from support.sampling import generate
from support.shards import GPT2_VOCAB
from train_gpt2 import GPT, load_model


def test_every_exported_file_has_a_new_files_mode(shakespeare_export):
    # safetensors writes its file private (0600): a teammate on a shared machine could not read the weights
    umask = os.umask(0)
    os.umask(umask)
    export = shakespeare_export[1]
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in export.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_autotokenizer_on_an_export_is_tiktokens_gpt2(shakespeare_export, assets, enc):
    # written from the shipped vocab.bpe: OpenAI's encoder.json and vocab.bpe, byte for byte
    export = shakespeare_export[1]
    assert (export / "vocab.json").read_bytes() == assets.encoder_json.read_bytes()
    assert (export / "merges.txt").read_bytes() == assets.vocab_bpe.read_bytes()
    texts = UNICODE_TEXTS + ["Hello world", assets.shakespeare.read_text()[:20000]]
    for use_fast in (True, False):
        tok = AutoTokenizer.from_pretrained(export, use_fast=use_fast)
        assert len(tok) == GPT2_VOCAB and tok.model_max_length == 128  # the model's window
        assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<|endoftext|>", 50256, 50256)
        for text in texts:
            ids = tok(text)["input_ids"]
            assert ids == enc.encode_ordinary(text), text
            assert tok.decode(ids) == text
        assert tok("<|endoftext|>")["input_ids"] == [enc.eot_token]  # a special token, as tiktoken allows it


def test_pipeline_greedy_continuation_is_the_models_own(short_run, export, tmp_path, enc):
    ckpt = short_run[1] / "ckpt_000002.pt"
    export(tmp_path / "hf")
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")).__name__ == "GPT2LMHeadModel"
    pipe = pipeline("text-generation", model=str(tmp_path / "hf"), device="cpu")
    model, continued = load_model(str(ckpt)).eval(), set()
    for prompt in ("Hello, I'm a language model,", "ROMEO:\n", "naïve 東京 🤖"):
        out = pipe(prompt, max_new_tokens=24, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
        # our own greedy decode of the checkpoint
        idx = torch.tensor([enc.encode(prompt)])
        ours = generate(model, idx, 24, temperature=0.0)[0].tolist()
        assert out == ours
        assert pipe(prompt, max_new_tokens=24, do_sample=False)[0]["generated_text"] == enc.decode(ours)
        continued |= set(ours[idx.size(1) :])
    assert len(continued) >= 5  # continuations of many tokens, not one repeated


def test_a_tokenizer_transformers_builds_wrong_is_refused(export, tmp_path, monkeypatch):
    # a transformers that reads GPT2TokenizerFast's arguments otherwise builds it without GPT-2's merges
    real_init = transformers.GPT2TokenizerFast.__init__

    def init_without_merges(self, vocab=None, merges=None, **kwargs):
        real_init(self, vocab=vocab, merges=[], **kwargs)

    monkeypatch.setattr(transformers.GPT2TokenizerFast, "__init__", init_without_merges)
    with pytest.raises(UserError, match=r"did not build GPT-2's tokenizer.*pip install -U transformers") as e:
        export(tmp_path / "hf")
    assert "\n" not in str(e.value)
    assert os.listdir(tmp_path) == []


@pytest.fixture
def export(short_run):
    """export(target): save_hf_gpt2 of a tiny run's last checkpoint to target."""
    ckpt = load_checkpoint(str(short_run[1] / "ckpt_000002.pt"))
    return lambda target: save_hf_gpt2(ckpt["model_config"], ckpt["model"], target)


@pytest.mark.parametrize("earlier", [False, True], ids=["new", "over_earlier_export"])
@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),  # its words
    ],
    ids=["disk_full", "safetensors_disk_full"],
)
def test_a_full_disk_mid_write_leaves_everything_as_it_was(export, tmp_path, monkeypatch, error, earlier):
    """(Ctrl-C mid-write: test_export_hf.py's test_ctrl_c_during_an_export_says_nothing_was_exported.)"""
    target = tmp_path / "hf" if earlier else tmp_path / "new" / "hf"
    if earlier:
        export(target)
    before = snapshot(tmp_path)

    def save_pretrained(self, folder, *args, **kwargs):  # config.json and part of the weights, then the fault
        (Path(folder) / "config.json").write_text("{}")
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1000)
        raise error

    monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", save_pretrained)
    with pytest.raises(UserError, match=r"No space left on device\): nothing was changed") as e:
        export(target)
    assert "\n" not in str(e.value)
    assert snapshot(tmp_path) == before  # the parent it made is gone too


def test_a_failed_move_leaves_no_config_json_and_a_rerun_finishes(export, tmp_path, monkeypatch):
    """A rename that fails as the new files take their places: no config.json, so no mix of old and
    new files loads as a model; the line says to run again, which writes the export."""
    target = tmp_path / "hf"
    export(target)
    real_replace = os.replace

    def replace(src, dst):
        if os.path.basename(dst) == "model.safetensors":
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(UserError, match="has no config.json yet: run the command again"):
        export(target)
    assert "config.json" not in os.listdir(target) and not any(n.startswith(".tmp_") for n in os.listdir(target))
    (target / "config.json.orig").write_text("{}")  # a file no export writes: a user's, refused
    with pytest.raises(UserError, match="not an earlier export"):
        export(target)
    (target / "config.json.orig").unlink()
    monkeypatch.setattr(files.os, "replace", real_replace)
    export(target)
    export(tmp_path / "again")
    assert sorted(os.listdir(target)) == sorted(os.listdir(tmp_path / "again"))
    for name in os.listdir(target):
        assert (target / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def sample_cli(spec, env, cwd):
    """sample.py spec in a process of its own: huggingface_hub reads its variables (env) at import."""
    return cli(spec, "--num-samples", 2, "--max-new-tokens", 4, script="sample.py", cwd=cwd, env=env)


def hub_env(tmp_path, **extra):
    """No offline flags, an empty HF cache, and a Hub endpoint that refuses connections."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HUB_CACHE=str(tmp_path / "hf_cache"), HF_ENDPOINT="http://127.0.0.1:9", **extra)
    return env


def test_offline_hub_name_not_cached_is_one_line(tmp_path):
    r = sample_cli("gpt2", hub_env(tmp_path, HF_HUB_OFFLINE="1"), tmp_path)
    words = ("'gpt2' is not in the local Hugging Face cache", "HF_HUB_OFFLINE", "local transformers GPT-2 directory")
    assert_one_line_error(r, *words)


def test_a_hub_name_without_the_hub_fails_at_once_and_transformers_is_never_asked(monkeypatch):
    """TRANSFORMERS_OFFLINE alone is offline use: no probe; else one probe of a few seconds, where
    transformers would retry for half a minute."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "yes")
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)  # it read the flags at import
    monkeypatch.setattr(hf_interop, "hub_name_is_cached", lambda name: False)
    timeouts = []

    def create_connection(address, timeout=None):
        timeouts.append(timeout)
        raise TimeoutError("timed out")

    def never(*args, **kwargs):
        raise AssertionError("transformers was asked to download")

    monkeypatch.setattr(socket, "create_connection", create_connection)
    monkeypatch.setattr(GPT2LMHeadModel, "from_pretrained", never)
    with pytest.raises(UserError, match=r"not in the local Hugging Face cache and .*\(TRANSFORMERS_OFFLINE is set\)"):
        train_gpt2.GPT.from_pretrained("gpt2-xl")
    assert timeouts == []
    monkeypatch.delenv("TRANSFORMERS_OFFLINE")
    with pytest.raises(UserError, match=r"the Hub \(http.*\) cannot be asked \(timed out\)") as e:
        train_gpt2.GPT.from_pretrained("gpt2")
    assert "\n" not in str(e.value)
    assert len(timeouts) == 1 and 0 < timeouts[0] <= 5


@pytest.mark.slow  # a process of its own (the Hub's variables are read at import): ~7 s of transformers
def test_cached_hub_name_loads_without_the_network(tmp_path, hf_tiny_dir):
    # a tiny model under the name gpt2, no offline flag, an unreachable Hub: it loads from the cache,
    # laid out as huggingface_hub downloads: models--<name>/snapshots/<rev>/ and refs/main
    shutil.copytree(hf_tiny_dir, tmp_path / "hf_cache" / "models--gpt2" / "snapshots" / ("0" * 40))
    (tmp_path / "hf_cache" / "models--gpt2" / "refs").mkdir()
    (tmp_path / "hf_cache" / "models--gpt2" / "refs" / "main").write_text("0" * 40)
    r = sample_cli("gpt2", hub_env(tmp_path), tmp_path)
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.startswith("sample ")]) == 2


def test_init_from_a_transformers_dir(data, tmp_path, hf_tiny_dir):
    args = tiny_args(data, tmp_path / "out", "--init-from", hf_tiny_dir, "--max-steps", 1, "--eval-every", 1)
    assert train_gpt2.main(args) == 0
    records, _ = read_log(tmp_path / "out")
    hf_shape = {"block_size": 128, "vocab_size": 50257, "n_layer": 2, "n_head": 4, "n_embd": 64}  # not the flags
    assert records[0]["config"]["model_config"] == hf_shape
    # step 0's val loss is the pretrained model's: recompute it with transformers itself
    hf = GPT2LMHeadModel.from_pretrained(hf_tiny_dir).eval()
    val = torch.from_numpy(np.load(data / "rand_val_000000.npy")[: 256 + 1].astype(np.int64))
    with torch.no_grad():
        logits = hf(val[:-1].view(16, 16)).logits
        expected = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), val[1:]).item()
    assert records[1] == {"step": 0, "val_loss": pytest.approx(expected, rel=1e-5)}


def test_a_transformers_folder_that_is_not_a_whole_gpt2_is_refused(tmp_path, hf_tiny_dir):
    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_tiny_dir, hf_dir)
    weights = load_file(hf_dir / "model.safetensors")
    del weights["transformer.h.1.mlp.c_fc.weight"]  # transformers would fill it with random numbers
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="transformer.h.1.mlp.c_fc.weight is missing"):
        GPT.from_pretrained(str(hf_dir))
    bad = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=4, n_embd=64, n_positions=128, activation_function="relu"))
    bad.save_pretrained(tmp_path / "relu")
    with pytest.raises(UserError, match="activation"):
        GPT.from_pretrained(str(tmp_path / "relu"))


class RunsCode:
    """Pickled as a call of os.system: unpickling it would run the command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_pytorch_model_bin_that_pickles_code_is_refused_and_nothing_runs(data, tmp_path, hf_tiny_dir, assets):
    """hellaswag.py -m, sample.py and --init-from: one line pointing to safetensors; the marker is never made."""
    hf_dir, marker = tmp_path / "hf", tmp_path / "MARKER"
    shutil.copytree(hf_tiny_dir, hf_dir)
    weights = load_file(hf_dir / "model.safetensors")
    weights["transformer.wte.weight"] = RunsCode(f"touch {marker}")
    torch.save(weights, hf_dir / "pytorch_model.bin")
    (hf_dir / "model.safetensors").unlink()
    commands = {
        "sample.py": lambda: sample.main([str(hf_dir), "--device", "cpu"]),
        "--init-from": lambda: train_gpt2.main(tiny_args(data, tmp_path / "out", "--init-from", hf_dir)),
        "hellaswag.py -m": lambda: hellaswag.main(["-m", str(hf_dir), "--data", str(assets.hellaswag), "--limit", "4"]),
    }
    for name, run in commands.items():
        with pytest.raises(UserError) as e:
            run()
        message = str(e.value)
        assert message.startswith(f"{hf_dir}: its pytorch_model.bin holds more than tensors, which loading"), name
        assert "nothing in it ran; use the model as safetensors (model.safetensors" in message, name
        assert "\n" not in message and "weights_only" not in message, name
        assert not marker.exists(), name
    assert not (tmp_path / "out").exists()


@pytest.mark.online
@pytest.mark.parametrize(
    "name, n_layer, n_head, n_embd",
    [("gpt2", 12, 12, 768), ("gpt2-medium", 24, 16, 1024), ("gpt2-large", 36, 20, 1280), ("gpt2-xl", 48, 25, 1600)],
)
def test_online_the_gpt2_names_are_openai_s_gpt2_on_the_hub(name, n_layer, n_head, n_embd):
    """What sample.py, hellaswag.py -m and train_gpt2.py --init-from fetch: OpenAI's GPT-2 sizes (the GPT-2
    paper's table 2), in the form load_hf_gpt2 takes, with tensors-only weights."""
    hf_interop.check_hub_reachable(name)  # the scripts' own first question to the Hub
    c = GPT2Config.from_pretrained(name)
    assert (c.n_layer, c.n_head, c.n_embd, c.n_positions, c.vocab_size) == (n_layer, n_head, n_embd, 1024, 50257)
    assert (c.activation_function, c.layer_norm_epsilon) == ("gelu_new", 1e-5)
    assert "model.safetensors" in huggingface_hub.list_repo_files(name)

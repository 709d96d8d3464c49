"""The training run: schedule, optimizer groups, FLOPs, a tiny overfit run with its evaluations, log and
checkpoint, --help, --dry-run and --val-tokens 0 (gradient accumulation: test_recipe.py, bit for bit)."""

import math
import re

import numpy as np
import pytest
import torch

import hellaswag
import train_gpt2
from helpers import ROOT, cli, help_entries, read_log, strict_records, tiny_args, user_error, write_shard
from support.checkpoints import load_checkpoint
from support.sampling import sample_text
from train_gpt2 import GPT, GPTConfig, flops_per_token, get_lr, load_model


def test_lr_schedule():
    lr = lambda step: get_lr(step, 6e-4, 6e-5, 715, 19073)  # noqa: E731
    assert lr(0) == pytest.approx(6e-4 / 715)  # not 0
    assert lr(357) == pytest.approx(6e-4 * 358 / 715)
    assert lr(714) == pytest.approx(6e-4)  # end of warmup
    assert lr(715) == pytest.approx(6e-4)  # cosine starts at the top
    assert lr(715 + (19073 - 715) // 2) == pytest.approx((6e-4 + 6e-5) / 2)  # half way down
    assert lr(19072) == pytest.approx(6e-5, rel=1e-6)
    assert lr(19073) == lr(19074) == lr(50000) == 6e-5


def test_weight_decay_only_on_matrices_and_counts_printed(capsys):
    model = GPT(GPTConfig(vocab_size=50304))  # GPT-2 124M as trained
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, device_type="cpu")
    decay, no_decay = opt.param_groups  # which tensors: test_recipe's reference groups them by dim
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8 and decay["fused"] is True
    # the counts build-nanogpt printed for this model
    out = capsys.readouterr().out
    assert "decayed tensors: 50, with 124,354,560 parameters" in out
    assert "non-decayed tensors: 98, with 121,344 parameters" in out


def test_flops_per_token_gpt2_124m():
    config = GPTConfig(vocab_size=50304)
    with torch.device("meta"):
        model = GPT(config)
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    assert flops_per_token(config, 1024) == 6 * n + 12 * 12 * 12 * 64 * 1024
    assert round(flops_per_token(config, 1024) / 1e6) == 855


OVERFIT_STEPS = 150


@pytest.fixture(scope="module")
def overfit_run(tmp_path_factory, assets, enc):
    data = tmp_path_factory.mktemp("shakespeare")
    text = assets.shakespeare.read_text()
    encode = lambda s: [enc.eot_token] + enc.encode_ordinary(s)  # noqa: E731  (as fineweb.py writes)
    write_shard(data / "ts_val_000000.npy", encode(text[:4000]))
    train = encode(text[4000:12000])  # about 2,400 tokens: a model this small can memorise them
    write_shard(data / "ts_train_000001.npy", train[: len(train) // 2])
    write_shard(data / "ts_train_000002.npy", train[len(train) // 2 :])
    out = tmp_path_factory.mktemp("overfit")
    flags = f"--max-steps {OVERFIT_STEPS} --warmup-steps 10 --max-lr 0.01 -B 4 -T 32 --total-batch-size 128"
    flags += f" --eval-every 75 --val-tokens 1024 --hellaswag-every {OVERFIT_STEPS} --hellaswag-limit 8"
    flags += f" --sample-every {OVERFIT_STEPS} --num-samples 2 --max-new-tokens 12 --peak-flops 1e12"
    args = tiny_args(data, out, *flags.split(), "--hellaswag-data", assets.hellaswag)
    assert train_gpt2.main(args) == 0
    return data, out


def test_tiny_model_overfits(overfit_run):
    data, out = overfit_run
    records, steps = read_log(out)
    assert sorted(steps) == list(range(OVERFIT_STEPS))
    losses = [steps[s]["train_loss"] for s in range(OVERFIT_STEPS)]
    assert abs(losses[0] - math.log(50257)) < 0.3  # starts at chance
    final_train = sum(losses[-10:]) / 10
    vals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(vals) == [0, 75, 150]
    assert final_train < losses[0] - 4  # well below its start ...
    assert final_train < vals[150] - 1  # ... and below the loss on unseen text: memorised
    assert steps[OVERFIT_STEPS - 1]["epoch"] >= 5  # ~2,300 usable tokens, 128 a step: repeated


def test_logged_evals_and_samples_are_the_final_models(overfit_run, assets, enc):
    data, out = overfit_run
    records, _ = read_log(out)
    model = load_model(str(out / f"ckpt_{OVERFIT_STEPS:06d}.pt")).eval()
    logged = [r["val_loss"] for r in records if r.get("step") == OVERFIT_STEPS and "val_loss" in r][0]
    tokens = torch.from_numpy(np.load(data / "ts_val_000000.npy").astype(np.int64))
    n_seq = min(1024, len(tokens) - 1) // 32  # --val-tokens 1024 in sequences of T=32
    with torch.no_grad():
        x = tokens[: n_seq * 32].view(n_seq, 32)
        y = tokens[1 : n_seq * 32 + 1].view(n_seq, 32)
        _, loss = model(x, y)
    assert logged == pytest.approx(loss.item(), rel=1e-5)
    hs = [r for r in records if "hellaswag" in r]
    assert [r["step"] for r in hs] == [0, OVERFIT_STEPS] and hs[-1]["hellaswag_n"] == 8
    examples = hellaswag.load_examples(str(assets.hellaswag), limit=8)
    counts = hellaswag.evaluate(model, hellaswag.prepare(examples, enc), "cpu")
    assert hs[-1]["hellaswag"] == counts["correct_norm"] / 8 and hs[-1]["hellaswag_acc"] == counts["correct"] / 8
    samples = [r["samples"] for r in records if "samples" in r]
    assert samples == [sample_text(model, enc, "Hello, I'm a language model,", 2, 12, seed=42)]


def test_step_records_tokens_throughput_mfu(overfit_run):
    _, out = overfit_run
    records, steps = read_log(out)
    header = records[0]
    assert header["event"] == "header" and header["resumed_from"] is None
    assert header["config"]["max_steps"] == OVERFIT_STEPS and header["versions"]["torch"] == torch.__version__
    config = GPTConfig(**header["config"]["model_config"])
    for s, r in steps.items():
        assert r["tokens"] == (s + 1) * 128
        assert r["tok_per_sec"] == pytest.approx(128 / (r["dt_ms"] / 1000))
        assert r["mfu"] == pytest.approx(flops_per_token(config, 32) * r["tok_per_sec"] / 1e12)


def test_checkpoint_has_the_training_state(overfit_run):
    _, out = overfit_run
    ckpt = load_checkpoint(str(out / f"ckpt_{OVERFIT_STEPS:06d}.pt"))
    assert ckpt["step"] == OVERFIT_STEPS and ckpt["optimizer"]["state"]
    assert ckpt["data"]["shards"] == ["ts_train_000001.npy", "ts_train_000002.npy"]
    assert ckpt["val_loss"] == [r for r in read_log(out)[0] if "val_loss" in r][-1]["val_loss"]
    assert ckpt["train_config"]["max_steps"] == OVERFIT_STEPS


def test_help_shows_every_flags_default_and_the_usage_examples_intact(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the width argparse wraps the help at
    r = cli("--help")
    assert r.returncode == 0
    assert "python fineweb.py && torchrun --standalone --nproc_per_node=8 train_gpt2.py   # the full recipe" in r.stdout
    assert "python train_gpt2.py @configs/laptop.txt --max-steps 400   # a laptop's" in r.stdout
    entries = help_entries(r.stdout)
    _, defaults = train_gpt2.command_line()
    for name, default in defaults.items():
        assert f"(default: {default})" in entries["--" + name.replace("_", "-")], name


def test_the_flag_table_of_docs_training_md_is_the_parsers():
    """Every flag, with its default: a number or a name as the parser has it, words for None and off."""
    _, parsers = train_gpt2.command_line()  # {flag: its default}
    table = {}
    for flags, defaults in re.findall(r"^\| (`-.*?) \| (.*?) \|", (ROOT / "docs" / "training.md").read_text(), re.M):
        for flag, shown in zip(flags.split(" / "), defaults.split(" / "), strict=True):  # a default a flag
            table[re.match(r"`--([\w-]+)", flag)[1].replace("-", "_")] = shown.strip('`"')
    assert sorted(table) == sorted(parsers)
    for name, shown in table.items():
        default, number = parsers[name], re.fullmatch(r"[\d,.e+-]+", shown)
        if default in (None, False):
            assert not number, name
        else:
            assert (float(shown.replace(",", "")) if number else shown) == default, name


def test_dry_run_runs_the_start_up_checks_and_writes_nothing(data, tmp_path, capsys):
    out = tmp_path / "new" / "out"
    args = tiny_args(data, out, "--sample-every", 2, "--eval-every", 2)
    assert train_gpt2.main(args + ["--dry-run"]) == 0
    assert "dry run: the flags, the data, --out-dir and the sampling check are fine" in capsys.readouterr().out
    assert not (tmp_path / "new").exists()
    assert "--prompt" in user_error(args + ["--dry-run", "--prompt", "word " * 100])  # the sampling check ran
    assert "does not exist" in user_error(tiny_args(tmp_path / "no_data", out, "--dry-run"))  # the data checks ran
    assert not (tmp_path / "new").exists()


def test_val_tokens_0_turns_the_val_loss_off(data, tmp_path):
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, out, "--val-tokens", 0, "--eval-every", 2, "--max-steps", 2)) == 0
    records = strict_records(out)
    assert not any("val_loss" in x for x in records) and sorted(read_log(out)[1]) == [0, 1]

"""sample.py: each kind of model, greedy at a tiny temperature, torch's whole seed range, the window said;
a mistake is one line before anything is sampled, and --dry-run checks without loading or sampling."""

import pytest

import sample
import train_gpt2
from helpers import assert_one_line_error, cli, help_entries
from support import sampling


def sample_lines(capsys, *args):
    """The `sample N: ...` lines sample.main(args) prints."""
    assert sample.main([str(a) for a in args]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("sample ")]


@pytest.mark.parametrize("model", ["run", "transformers"])
def test_the_default_prompt_at_a_tiny_temperature_is_greedy_whatever_the_seed(short_run, hf_tiny_dir, capsys, model):
    flags = [short_run[1] if model == "run" else hf_tiny_dir, "--num-samples", 2, "--max-new-tokens", 8]
    greedy = sample_lines(capsys, *flags, "--temperature", 0, "--seed", -(2**63))
    assert len(greedy) == 2 and all("Hello, I'm a language model," in line for line in greedy)
    assert sample_lines(capsys, *flags, "--temperature", 1e-40, "--seed", 2**64 - 1) == greedy
    assert not any(line.endswith("!!!!!!!!") for line in greedy)


def test_it_says_where_samples_stop_at_the_window(short_run, enc, capsys):
    prompt = "word " * 39 + "word"  # the run's window is 64 tokens
    n_prompt = len(enc.encode(prompt))
    args = [short_run[1], "--prompt", prompt, "--num-samples", 1, "--device", "cpu", "--max-new-tokens"]
    assert sample.main([str(a) for a in [*args, 50]]) == 0
    said = capsys.readouterr().out
    assert f"{64 - n_prompt} new tokens after the {n_prompt}-token prompt, not --max-new-tokens 50" in said
    assert sample.main([str(a) for a in [*args, 64 - n_prompt]]) == 0
    assert "window" not in capsys.readouterr().out  # it fits: nothing to say


@pytest.fixture
def nothing_sampled(monkeypatch):
    """Sampling fails the test; so does loading weights, once the function returned is called."""
    monkeypatch.setattr(sampling, "sample_text", lambda *a, **k: pytest.fail("sampled"))
    return lambda: monkeypatch.setattr(train_gpt2, "load_model", lambda *a, **k: pytest.fail("loaded weights"))


@pytest.mark.parametrize("dry_run", [False, True], ids=["sampling", "dry_run"])
@pytest.mark.parametrize(
    "model, flags, words",
    [
        ("run", ["--prompt", "word " * 100], "--prompt is 101 tokens, the model reads at most 63"),
        ("gtp2", [], "gtp2' does not exist, and is not a GPT-2 name (gpt2, "),
        ("run", ["--seed", 2**64], f"--seed: must be between {-(2**63)} and 18,446,744,073,709,551,615, not {2**64}"),
        ("config_json_alone", [], "model.safetensors"),  # a dry run: "holds a config.json but no weights (...)"
    ],
)
def test_a_mistake_is_one_line_before_anything_is_sampled(
    short_run, tmp_path, nothing_sampled, dry_run, model, flags, words
):
    if dry_run:
        nothing_sampled()  # forbid loading too
    spec = short_run[1] if model == "run" else tmp_path / model
    if model == "config_json_alone":
        spec.mkdir()
        (spec / "config.json").write_text('{"model_type": "gpt2"}')
    r = cli(spec, "--device", "cpu", *flags, *(["--dry-run"] if dry_run else []), script="sample.py")
    assert_one_line_error(r, words)


@pytest.mark.parametrize("model", ["run", "checkpoint", "transformers"])
def test_a_dry_run_checks_the_model_and_prompt_and_samples_nothing(
    short_run, hf_tiny_dir, capsys, nothing_sampled, model
):
    nothing_sampled()
    spec = {"run": short_run[1], "checkpoint": short_run[1] / "ckpt_000001.pt", "transformers": hf_tiny_dir}[model]
    assert sample.main([str(spec), "--device", "cpu", "--dry-run", "--max-new-tokens", "200"]) == 0
    out = capsys.readouterr().out
    assert f"dry run: {spec}, the prompt and the sampling flags are fine; nothing was sampled" in out
    assert "note: samples stop at the model's" in out  # the run's block_size 64 (the tiny HF model's 128)


def test_help_shows_every_flags_default():
    entries = help_entries(cli("--help", script="sample.py").stdout)
    assert entries["--num-samples"].endswith("(default: 4)") and entries["--device"].endswith("(default: None)")
    assert [flag for flag, entry in entries.items() if "(default: " not in entry] == ["-h", "--help"]

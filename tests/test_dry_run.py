"""--dry-run (support/dry_run.py for the jobs besides training) writes nothing and computes nothing
expensive, for every job the command line has: training runs its start-up checks; --export-hf and
--sample-from make the checks their job makes before its slow part (the model found and readable,
the prompt, the export's folder) and load no weights, sample nothing and write nothing. A Ctrl-C
during an export says what it left, not how to resume training."""

import pytest
from transformers import GPT2LMHeadModel

import train_gpt2
from helpers import snapshot, tiny_args, user_error
from support import sampling
from support.cli import run_cli


@pytest.fixture
def nothing_expensive(monkeypatch):
    """A dry run that loads weights, samples or exports fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a dry run loaded weights, sampled or wrote")

    monkeypatch.setattr(train_gpt2, "load_model", forbidden)
    monkeypatch.setattr(sampling, "sample_text", forbidden)
    monkeypatch.setattr(train_gpt2.GPT, "export_hf", forbidden)
    monkeypatch.setattr(sampling, "generate", forbidden)


def test_export_dry_run_checks_the_checkpoint_and_target_and_writes_nothing(
    short_run, tmp_path, capsys, nothing_expensive
):
    ckpt, target = short_run[1] / "ckpt_000002.pt", tmp_path / "new" / "hf"
    before = snapshot(short_run[1])
    assert train_gpt2.main(["--export-hf", ckpt, target, "--dry-run"]) == 0
    assert f"dry run: {ckpt} can be exported to {target}; nothing was written" in capsys.readouterr().out
    assert not (tmp_path / "new").exists() and snapshot(short_run[1]) == before


def test_export_dry_run_refuses_what_the_export_would(short_run, tmp_path, nothing_expensive):
    ckpt = short_run[1] / "ckpt_000002.pt"
    (tmp_path / "notes.txt").write_text("mine")
    assert "is a file, not a folder" in user_error(["--export-hf", ckpt, tmp_path / "notes.txt", "--dry-run"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("mine")
    assert "not empty and not an earlier export" in user_error(["--export-hf", ckpt, tmp_path / "full", "--dry-run"])
    msg = user_error(["--export-hf", short_run[1] / "ckpt_000009.pt", tmp_path / "hf", "--dry-run"])
    assert "ckpt_000009.pt' does not exist" in msg
    cut = tmp_path / "cut.pt"
    cut.write_bytes(ckpt.read_bytes()[:5000])
    assert "cannot be loaded safely" in user_error(["--export-hf", cut, tmp_path / "hf", "--dry-run"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.pt", "full", "notes.txt"]


def test_sample_dry_run_checks_the_model_and_prompt_and_samples_nothing(short_run, hf_tiny_dir, capsys, monkeypatch):
    for model in (short_run[1], short_run[1] / "ckpt_000001.pt", hf_tiny_dir):
        monkeypatch.setattr(train_gpt2, "load_model", lambda *a, **k: pytest.fail("loaded weights"))
        monkeypatch.setattr(sampling, "generate", lambda *a, **k: pytest.fail("sampled"))
        args = ["--sample-from", model, "--device", "cpu", "--dry-run", "--max-new-tokens", 200]
        assert train_gpt2.main(args) == 0
        out = capsys.readouterr().out
        assert f"dry run: {model}, the prompt and the sampling flags are fine; nothing was sampled" in out
        assert "sample 0:" not in out
        assert "note: samples stop at the model's" in out  # the run's block_size 64 (the tiny HF model's 128)


def test_sample_dry_run_refuses_what_sampling_would(short_run, tmp_path, nothing_expensive):
    msg = user_error(["--sample-from", short_run[1], "--prompt", "word " * 100, "--dry-run"])
    assert "--prompt is 101 tokens, the model reads at most 63" in msg
    assert "does not exist" in user_error(["--sample-from", tmp_path / "gtp2", "--dry-run"])
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "gpt2"}')
    assert "holds a config.json but no weights" in user_error(["--sample-from", tmp_path / "hf", "--dry-run"])


def test_ctrl_c_during_an_export_says_nothing_was_exported_not_resume(short_run, tmp_path, monkeypatch, capsys):
    """Ctrl-C while save_pretrained writes: the target is as it was, and the line says so."""

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", interrupted)
    target = tmp_path / "hf"
    argv = ["--export-hf", str(short_run[1] / "ckpt_000002.pt"), str(target)]
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: train_gpt2.main(argv), interrupted="interrupted (the script's default)")
    assert e.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err == f"interrupted: nothing was exported ({target} is as it was); run the command again"
    assert not target.exists() and sorted(tmp_path.iterdir()) == []


def test_dry_run_runs_the_start_up_checks_and_writes_nothing(data, tmp_path, capsys):
    out = tmp_path / "new" / "out"
    args = tiny_args(data, out, "--sample-every", 2, "--eval-every", 2)
    assert train_gpt2.main(args + ["--dry-run"]) == 0
    assert "dry run: the flags, the data, --out-dir and the sampling check are fine" in capsys.readouterr().out
    assert not (tmp_path / "new").exists()
    assert "--prompt" in user_error(args + ["--dry-run", "--prompt", "word " * 100])  # the sampling check ran
    assert "does not exist" in user_error(tiny_args(tmp_path / "no_data", out, "--dry-run"))  # the data checks ran
    assert not (tmp_path / "new").exists()

"""support/signals.py through runs of train_gpt2.py: SIGTERM and SIGHUP stop at the next step with a
checkpoint, Ctrl-C is one line, a stop during an eval or sampling comes within a batch or a token."""

import itertools
import json
import os
import signal
import time
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
import torch

import train_gpt2
from helpers import at_step, hangup_default, headers, random_shards, read_log, signal_on, tiny_args
from support import sampling, signals
from support.checkpoints import load_checkpoint
from support.cli import run_cli
from support.signals import StopRequest


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])  # a scheduler; a closed terminal
def test_sigterm_or_sighup_writes_a_usable_checkpoint(data, tmp_path, signum):
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 100000)
    proc, stdout, stderr = signal_on("step     2/", *args, signum=signum, preexec_fn=hangup_default)
    assert proc.returncode == 128 + signum, stderr
    assert f"caught {signum.name}" in stdout and "Traceback" not in stderr
    _, steps = read_log(out)
    last = max(steps)
    path = out / f"ckpt_{last + 1:06d}.pt"
    ckpt = load_checkpoint(str(path))  # the training state, as every checkpoint's (its data position: test_recipe)
    assert ckpt["step"] == last + 1 and ckpt["optimizer"]["state"]
    assert train_gpt2.main([*args, "--resume", "--max-steps", last + 2]) == 0  # and the run goes on from it


@pytest.mark.parametrize("launcher, stops", [(None, False), (os.getppid(), False), (os.getppid() + 1, True)])
def test_under_torchrun_a_rank_whose_parent_changed_stops_as_for_sigterm(monkeypatch, capsys, launcher, stops):
    """signals.TORCHRUN: torchrun's pid as the rank started (None: a plain run); another parent: it is gone."""
    monkeypatch.setattr(signals, "TORCHRUN", launcher, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with ExitStack() as on_exit:
        stop = StopRequest("log", on_exit)
    assert stop.agreed("cpu", ddp=False) == (signal.SIGTERM if stops else 0)
    gone = f"torchrun (pid {launcher}) is gone: stopping after this step with a checkpoint in log\n"
    assert capsys.readouterr().out == (gone if stops else "")


@pytest.mark.slow
def test_under_nohup_a_hangup_does_not_stop_the_run(data, tmp_path):
    out = tmp_path / "out"
    nohup = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # noqa: E731  what nohup does before exec
    args = tiny_args(data, out, "--max-steps", 300, "--eval-every", 0)
    proc, stdout, stderr = signal_on("step     2/", *args, signum=signal.SIGHUP, preexec_fn=nohup)
    assert proc.returncode == 0, stderr
    assert "caught" not in stdout
    assert sorted(read_log(out)[1]) == list(range(300))


@pytest.mark.parametrize("said", ["import torch", "model: ", "step     0/"])
def test_ctrl_c_during_start_up_is_one_line(data, tmp_path, said):
    """One Ctrl-C while torch loads, after the model is built or in step 0 (two, in-process through
    run_cli: test_ctrl_c_again_while_the_stop_checkpoint_is_written)."""
    flags = "--max-steps 100000 --warmup-steps 1 --eval-every 1 --val-tokens 512".split()
    proc, out, err = signal_on(said, *tiny_args(data, tmp_path / "out", *flags))
    assert proc.returncode == 130, err
    said = [line for line in err.strip().splitlines() if not line.startswith("warning: this run trains on")]
    assert "Traceback" not in err and len(said) <= 1, err


def test_a_second_ctrl_c_before_the_first_checkpoint_says_to_start_anew(data, tmp_path, monkeypatch):
    """Two Ctrl-Cs at step 3 with no checkpoint yet: the line says so, and its advice works (after a
    checkpoint: test_ctrl_c_again_while_the_stop_checkpoint_is_written)."""

    def ctrl_c_twice():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)

    at_step(monkeypatch, {3: ctrl_c_twice})
    with pytest.raises(KeyboardInterrupt) as e:
        train_gpt2.main(tiny_args(data, tmp_path / "out", "--ckpt-every", 0))
    monkeypatch.undo()
    assert str(e.value) == (  # read as run_cli reads it, once main has ended
        "interrupted before the run's first checkpoint: no checkpoint to continue from; the same command with "
        "a new --out-dir starts it again"
    )
    out = tmp_path / "new"  # what it says: the same command, a new --out-dir
    assert train_gpt2.main(tiny_args(data, out, "--ckpt-every", 0)) == 0
    assert train_gpt2.main(["--resume", "--out-dir", str(out), "--device", "cpu"]) == 0
    assert sorted(read_log(out)[1]) == list(range(6)) and len({h["run_id"] for h in headers(out)}) == 1


class CtrlCMidWrite:
    """A checkpoint's file that gets n Ctrl-Cs once torch.save has written some of it."""

    def __init__(self, f, n):
        self.f, self.n, self.calls = f, n, 0

    def write(self, data):
        self.calls += 1
        if self.calls == 5:  # mid-write: torch's zip writer wraps what a write raises in a RuntimeError
            for _ in range(self.n):
                signal.raise_signal(signal.SIGINT)
        return self.f.write(data)

    def __getattr__(self, name):  # flush, fileno, ... of the real file
        return getattr(self.f, name)


@pytest.mark.parametrize("more", [1, 2])
def test_ctrl_c_again_while_the_stop_checkpoint_is_written(data, tmp_path, monkeypatch, capsys, more):
    """Ctrl-C at step 3, then `more` while step 4's checkpoint is written: one more, a line says so and the
    write finishes; two, the run ends at once, its previous checkpoint named. Never torch's traceback."""
    out, stopped, real_save = tmp_path / "out", [], torch.save
    save = lambda obj, f, **kw: real_save(obj, CtrlCMidWrite(f, more if stopped else 0), **kw)  # noqa: E731
    monkeypatch.setattr(torch, "save", save)
    at_step(monkeypatch, {3: lambda: stopped.append(signal.raise_signal(signal.SIGINT))})
    args = tiny_args(data, out, "--ckpt-every", 2, "--max-steps", 100)
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: train_gpt2.main(args))
    monkeypatch.undo()
    said = capsys.readouterr()
    assert e.value.code == 130 and "Traceback" not in said.err, said.err
    assert not list(out.glob(".*.tmp"))  # no half checkpoint left behind
    if more == 1:
        [line] = [line for line in said.out.splitlines() if "being written" in line]
        assert line == (
            f"caught SIGINT: {out / 'ckpt_000004.pt'} is being written, then the run stops; another stop signal "
            f"ends the run now, without it ({out / 'ckpt_000002.pt'} stays the newest)"
        )
        assert load_checkpoint(str(out / "ckpt_000004.pt"))["step"] == 4
    else:
        assert said.err.strip().splitlines()[-1] == (
            f"interrupted: continue from its newest checkpoint, ckpt_000002.pt, with --resume --out-dir {out}"
        )
        assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_000002.pt"]
    # what the folder holds continues the run to its end
    assert train_gpt2.main(["--resume", "--out-dir", str(out), "--device", "cpu", "--max-steps", 6]) == 0
    assert sorted(read_log(out)[1]) == list(range(6))


@pytest.mark.parametrize("evaluation", ["val loss", "HellaSwag"])
def test_ctrl_c_during_a_long_eval_stops_it_at_the_next_batch_with_a_checkpoint(
    evaluation, tmp_path, assets, monkeypatch, capsys
):
    """Ctrl-C during an eval (minutes at 124M), at the run's 3rd stop poll (its 2nd batch, each 11 s apart on the
    run's clock), is honoured at that poll, with step 0's checkpoint and no half result; a long val eval says so."""
    data, out = random_shards(tmp_path / "data", train_lengths=(5000,), val_length=5000), tmp_path / "out"
    hellaswag = ("--hellaswag-every", 1, "--hellaswag-limit", 200)
    hellaswag += ("--hellaswag-data", assets.hellaswag)
    flags = ("--eval-every", 1, "--val-tokens", 4096) if evaluation == "val loss" else ("--eval-every", 0, *hellaswag)
    polls, real = [], StopRequest.__call__

    def poll(self):
        polls.append(signal.raise_signal(signal.SIGINT) if len(polls) == 2 else None)
        return real(self)

    monkeypatch.setattr(StopRequest, "__call__", poll)
    clock = itertools.count(step=11)
    monkeypatch.setattr(train_gpt2, "time", SimpleNamespace(time=lambda: next(clock), perf_counter=time.perf_counter))
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: train_gpt2.main(tiny_args(data, out, "--max-steps", 2, *flags)))
    monkeypatch.undo()
    assert e.value.code == 130 and len(polls) == 3  # no batch after the one the Ctrl-C came in, nor anything else
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert (out / "ckpt_000000.pt").exists() and not any("val_loss" in r or "hellaswag" in r for r in records)
    assert evaluation == "HellaSwag" or "val loss: batch 2/" in capsys.readouterr().err


def test_sigterm_while_a_run_samples_stops_it_within_a_token_with_a_checkpoint(data, tmp_path, monkeypatch):
    """SIGTERM at the 3rd token of step 2's samples: the run stops there, step 2's checkpoint, no half samples."""
    out, tokens = tmp_path / "out", []
    real = sampling.decode_step

    def decode_step(*args):
        tokens.append(1)
        if len(tokens) == 3:
            signal.raise_signal(signal.SIGTERM)
        return real(*args)

    monkeypatch.setattr(sampling, "decode_step", decode_step)
    args = tiny_args(data, out, "--sample-every", 2, "--max-new-tokens", 40, "--max-steps", 6, "--eval-every", 0)
    assert train_gpt2.main(args) == 128 + signal.SIGTERM
    # the start-up check draws 1 token (no decode step); step 2's samples stop at the signal
    assert len(tokens) == 3
    records, steps = read_log(out)
    assert sorted(steps) == [0, 1] and not [r for r in records if "samples" in r]
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_000002.pt"]
    assert train_gpt2.main([*args, "--resume"]) == 0  # and it continues from there
    assert sorted(read_log(out)[1]) == list(range(6))
    assert [r["step"] for r in read_log(out)[0] if "samples" in r] == [4, 6]

"""Faults thrown at whole runs of train_gpt2.py: SIGKILL at random moments then --resume, the console gone,
a DDP rank killed or frozen; each ends in an exact continuation or a prompt failure that leaves the run
whole. A fault within one support module is tested in that module's file (docs/reliability.md)."""

import json
import os
import random
import signal
import subprocess
import time

import psutil
import pytest

import train_gpt2
from helpers import cli, random_shards, read_log, same_weights, start_run, tiny_args, wait_for_step
from support.checkpoints import load_checkpoint, load_training_checkpoint
from support.run_folder import checkpoint_paths


def step_records(out):
    return sum('"train_loss"' in line for line in open(out / "log.jsonl")) if (out / "log.jsonl").exists() else 0


@pytest.mark.slow
def test_sigkill_at_random_moments_and_mid_checkpoint_then_resume_equals_uninterrupted(tmp_path):
    data = random_shards(tmp_path / "data", train_lengths=(200, 250))  # 2 epochs: the shuffle is resumed too
    steps_args = ("--max-steps", 12, "--ckpt-every", 2, "--keep-ckpts", 2, "--eval-every", 3)
    args = lambda out, *extra: tiny_args(data, out, *steps_args, *extra)  # noqa: E731
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # what a run printed before its kill is not lost
    ref = cli(*args(tmp_path / "ref"), process=True)
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "out"
    rng = random.Random(8)
    # when to kill each run: during start-up, while torch.save writes a checkpoint, a random few steps in
    plan = ["start-up", "checkpoint write", "steps", "checkpoint write", "steps"]
    hit, said = [], []
    for when in plan:
        expected = (checkpoint_paths(str(out)) or [None])[0]  # what --resume must pick: the newest complete one
        proc = start_run(*args(out), "--resume", env=env)
        try:
            deadline, records = time.time() + 120, step_records(out)
            if when == "start-up":  # after 0 to 4 of its start-up lines (the device, the model, ...)
                for _ in range(rng.randint(0, 4)):
                    proc.stdout.readline()
            elif when == "checkpoint write":  # poll for the temporary file torch.save is writing into
                stale = set(out.glob("*.pt.tmp"))  # an earlier kill's, which this run removes at start
                while proc.poll() is None and time.time() < deadline:
                    stale &= set(out.glob("*.pt.tmp"))
                    if set(out.glob("*.pt.tmp")) - stale:
                        break
                    time.sleep(0.001)
            else:
                n = rng.randint(1, 3)
                while proc.poll() is None and time.time() < deadline and step_records(out) < records + n:
                    time.sleep(0.002)
                time.sleep(rng.uniform(0, 0.1))
            proc.kill()
        finally:
            stdout, stderr = proc.communicate()
        said.append(stdout)
        assert proc.returncode == -signal.SIGKILL, f"{when}: the run ended before the kill\n{stderr}"
        if "resuming from" in stdout or expected is not None:
            assert f"resuming from {expected} " in stdout, (when, expected, stdout[-2000:])
        hit.append(
            when if when != "checkpoint write" or list(out.glob("*.pt.tmp")) else "just after a checkpoint write"
        )
    assert hit.count("checkpoint write") >= 1, hit  # at least one kill really cut a checkpoint in half
    final = cli(*args(out), "--resume", process=True)
    assert final.returncode == 0, final.stderr
    assert not list(out.glob("*.tmp")) and "removing the unfinished .ckpt_" in "".join(said) + final.stdout
    (ref_records, ref_steps), (records, steps) = read_log(tmp_path / "ref"), read_log(out)
    assert sorted(steps) == list(range(12))
    for s in range(12):  # bitwise: JSON floats round-trip exactly
        for key in ("train_loss", "grad_norm", "lr", "tokens", "epoch"):
            assert steps[s][key] == ref_steps[s][key], (s, key)
    vals = lambda recs: {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}  # noqa: E731
    assert vals(records) == vals(ref_records)
    a, b = load_checkpoint(str(tmp_path / "ref" / "ckpt_000012.pt")), load_checkpoint(str(out / "ckpt_000012.pt"))
    assert same_weights(a["model"], b["model"])
    print("kills:", hit)


@pytest.mark.slow
def test_training_outlives_its_closed_stdout(data, tmp_path):
    """`python train_gpt2.py ... | tee train.log`, and tee dies with the ssh session: the run goes on to its end."""
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 400, "--eval-every", 100, "--ckpt-every", 200)
    proc = start_run(*args)
    proc.stdout.readline()  # the run is printing
    proc.stdout.close()  # and its reader goes away
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    _, steps = read_log(out)
    assert sorted(steps) == list(range(400))
    assert (out / "ckpt_000400.pt").exists()  # named by the steps done


def hit_rank_1(tmp_path, sig, *extra):
    """torchrun 2 CPU ranks, rank 1 sent sig 2 steps in; -> (torchrun's exit code, seconds to it, its output)."""
    data = random_shards(tmp_path / "data")
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 100000, "--eval-every", 0, *extra)
    proc = start_run(*args, torchrun=True, stderr=subprocess.STDOUT)
    workers = []
    try:
        wait_for_step(proc, out, 2, timeout=120)
        workers = [
            p for p in psutil.Process(proc.pid).children(recursive=True) if "train_gpt2.py" in " ".join(p.cmdline())
        ]
        rank1 = [p for p in workers if p.environ().get("RANK") == "1"]
        assert len(workers) == 2 and len(rank1) == 1
        t0 = time.time()
        rank1[0].send_signal(sig)
        proc.wait(timeout=300)
        waited = time.time() - t0
        left_behind = [p.pid for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:  # a failed test must not leave a rank running either
        proc.kill()
        for p in workers:
            if p.is_running():
                p.kill()
        output = proc.communicate()[0]
    assert not left_behind, output[-2000:]
    return proc.returncode, waited, output


def assert_run_left_whole(out):
    """A log of whole JSON lines, steps 0, 1, 2, ... none missing, and a newest checkpoint that loads, of a step
    the log has done."""
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]  # a cut line fails
    steps = [r["step"] for r in records if "train_loss" in r]
    assert len(steps) >= 3 and steps == list(range(len(steps))), steps
    newest = sorted(out.glob("ckpt_*.pt"))[-1]
    ckpt = load_training_checkpoint(str(newest))
    assert ckpt["step"] >= 2 and ckpt["step"] % 2 == 0 and ckpt["step"] <= len(steps), (newest, len(steps))
    assert ckpt["world_size"] == 2 and set(ckpt["model"]) == set(train_gpt2.load_model(str(newest)).state_dict())


@pytest.mark.slow
def test_ddp_rank_killed_ends_torchrun_quickly(tmp_path):
    # the dead rank's sockets close: gloo fails the other rank's collective, torchrun stops the rest
    returncode, waited, output = hit_rank_1(tmp_path, signal.SIGKILL, "--ckpt-every", 2)
    assert returncode != 0 and waited < 150, output[-2000:]  # seconds; a hang: --ddp-timeout, 1800 s
    assert_run_left_whole(tmp_path / "out")


@pytest.mark.slow
def test_ddp_rank_frozen_times_out(tmp_path):
    # a frozen rank (a hung disk) looks alive to torchrun: the collective timeout ends the other's wait
    returncode, waited, output = hit_rank_1(tmp_path, signal.SIGSTOP, "--ddp-timeout", 5, "--ckpt-every", 2)
    assert returncode != 0 and waited < 200, output[-2000:]  # 5 + 30 s and a few; a hang: 1800 s
    assert "Timed out" in output
    assert_run_left_whole(tmp_path / "out")

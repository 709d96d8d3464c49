"""support/ddp.py, through real torchrun jobs of 2 CPU ranks (gloo): a --ddp-timeout c10d cannot
wait is one line; ranks that do not join within the timeout each say so in one line; a short
timeout survives rank 0's slow checkpoint writes and long samples, the other ranks waiting in the
fence; and a mistake every rank makes alike is said once a node, by its first process, while every
rank exits 1. All slow: each starts torchrun or its ranks. (Training under torchrun: test_train_ddp.py.)"""

import os
import subprocess
import sys
import time

import pytest

from helpers import ROOT, free_port, random_shards, ranks_without_agent, read_log, tiny_args, torchrun

# ----------------------------------------------------------------------------------------------
# Joining: within --ddp-timeout, or one line from each rank


@pytest.mark.slow
def test_a_ddp_timeout_c10d_cannot_wait_is_one_line_under_torchrun(tmp_path):
    """1e-9 s passed a `> 0` check and ended in c10d's C++ traceback (the join timed out after 0 ms)."""
    out = tmp_path / "out"
    r = torchrun(*tiny_args(random_shards(tmp_path / "data"), out, "--ddp-timeout", 1e-9))
    said = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error: ")]
    assert r.returncode != 0 and len(said) == 1, r.stderr[-3000:]
    assert "--ddp-timeout: must be a number of seconds from 1" in said[0]
    assert 'train_gpt2.py", line' not in r.stderr and "DistNetworkError" not in r.stderr  # no worker's traceback
    assert not out.exists()


@pytest.mark.slow
def test_ranks_that_do_not_join_within_the_timeout_say_so_in_one_line_each(tmp_path):
    """Rank 1 starts once rank 0 has ended, with --ddp-timeout 1: rank 0's join timed out, and rank 1
    finds no one to join; each says so in one line naming --ddp-timeout, exit 1 (as torchrun
    starts them: its environment variables, without its agent, which would end rank 1 early)."""
    args = tiny_args(random_shards(tmp_path / "data"), tmp_path / "out", "--ddp-timeout", 1)
    codes, outputs = ranks_without_agent(args, one_by_one=True)
    assert codes == [1, 1], outputs
    for rank, (_, stderr) in enumerate(outputs):
        said = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert said == [line for line in said if f"rank {rank} could not join the job's other ranks" in line], stderr
        assert len(said) == 1 and "pass a longer --ddp-timeout (e.g. 60)" in said[0], stderr
        assert "Traceback" not in stderr
    assert not (tmp_path / "out" / "log.jsonl").exists()


# ----------------------------------------------------------------------------------------------
# The fence: the other ranks wait while rank 0 works alone


# rank 0's disk takes 8 s per checkpoint: longer than the 3 s --ddp-timeout
SLOW_DISK = """
import os, sys, time
import train_gpt2
from support import checkpoints, cli
write = checkpoints.write_atomic
def slow(path, *args, **kwargs):
    if path.endswith(".pt") and os.environ["RANK"] == "0":
        time.sleep(8)
    return write(path, *args, **kwargs)
checkpoints.write_atomic = slow  # the name save_checkpoint calls
cli.run_cli(lambda: train_gpt2.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_short_ddp_timeout_survives_slow_checkpoints_and_long_samples(data, tmp_path):
    """Rank 0 writes checkpoints alone (8 s each here) and samples take seconds: with --ddp-timeout 3
    a healthy job finishes, because the other rank waits in the fence, and every rank samples."""
    out = tmp_path / "out"
    flags = "--max-steps 4 --ckpt-every 2 --eval-every 2 --sample-every 2 --num-samples 256 --max-new-tokens 48"
    flags += " --ddp-timeout 3"
    args = tiny_args(data, out, *flags.split())
    t0 = time.time()
    r = torchrun(*args, wrap=SLOW_DISK)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert time.time() - t0 > 16  # the slow writes happened: two checkpoints of 8 s
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_000002.pt", "ckpt_000004.pt"]
    assert [len(x["samples"]) for x in read_log(out)[0] if "samples" in x] == [256, 256]


# ----------------------------------------------------------------------------------------------
# A mistake is said once, and every rank exits the same way


@pytest.mark.parametrize("mistake", ["flag", "out-dir"])
@pytest.mark.slow
def test_torchrun_says_a_mistake_once_and_every_rank_exits_1(data, tmp_path, mistake):
    out = tmp_path / "out"
    extra = ["--seed", -1] if mistake == "flag" else []
    if mistake == "out-dir":  # found by rank 0 alone
        out.mkdir()
        (out / "log.jsonl").write_text("another run's\n")
    args = [*map(str, tiny_args(data, out, "--max-steps", 2, *extra))]
    r = torchrun(*args)
    said = (r.stdout + r.stderr).count("error: ")
    assert r.returncode != 0 and said == 1, r.stderr[-3000:]
    assert 'train_gpt2.py", line' not in r.stderr  # no worker's traceback (torchrun's own follows)
    # each rank's own exit code: torchrun stops the others once one has failed, so the two ranks
    # run here as torchrun would start them (its environment variables), without its agent
    codes, outputs = ranks_without_agent(args)
    assert codes == [1, 1], outputs
    assert [sum(o.count("error: ") for o in output) for output in outputs] == [1, 0], outputs


@pytest.mark.parametrize("mistake", ["data folder", "--seed"])
@pytest.mark.slow
def test_a_mistake_is_said_once_a_node(data, tmp_path, mistake):
    folder, extra = (tmp_path / "nope", []) if mistake == "data folder" else (data, ["--seed", -1])  # no such folder
    args = tiny_args(folder, tmp_path / "out", "--max-steps", 2, *extra)
    r = torchrun(*args)
    assert r.returncode != 0 and (r.stdout + r.stderr).count(f"error: {mistake}") == 1, r.stderr[-3000:]
    codes, outputs = ranks_without_agent(args)  # one node of two ranks: its first says it
    assert codes == [1, 1] and [sum(o.count("error: ") for o in out) for out in outputs] == [1, 0], outputs
    # two nodes of one rank each (LOCAL_RANK 0 on both): each node's console says why it stopped
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, "train_gpt2.py", *map(str, args)],
            cwd=ROOT,
            env={**env, "RANK": str(rank), "LOCAL_RANK": "0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=300) for proc in ranks]
    assert [proc.returncode for proc in ranks] == [1, 1]
    assert [sum(o.count(f"error: {mistake}") for o in out) for out in outputs] == [1, 1], outputs

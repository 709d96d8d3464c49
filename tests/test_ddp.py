"""support/ddp.py through torchrun jobs of 2 CPU ranks (gloo): joining within --ddp-timeout or one line
a rank, the fence that lets rank 0 work alone, a mistake said once a node (all slow); and runs of
torchrun's rank 0 one after another in one process."""

import time

import pytest

import train_gpt2
from helpers import free_port, random_shards, ranks_without_agent, read_log, tiny_args, torchrun


def test_runs_one_after_another_in_one_process_under_torchrun_need_no_reset(data, tmp_path, monkeypatch):
    """A world of 1 (gloo) as torchrun sets it, main() twice with nothing reset between: the second joins
    a process group of its own and fences in it, and trains as the first did."""
    for name, value in dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(name, str(value))
    for out in (tmp_path / "first", tmp_path / "second"):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        assert train_gpt2.main(tiny_args(data, out, "--ckpt-every", 3)) == 0
    assert read_log(tmp_path / "first")[1].keys() == set(range(6))
    assert [r["train_loss"] for r in read_log(tmp_path / "second")[1].values()] == [
        r["train_loss"] for r in read_log(tmp_path / "first")[1].values()
    ]


@pytest.mark.slow
def test_ranks_that_do_not_join_within_the_timeout_say_so_in_one_line_each(tmp_path):
    """Rank 1 starts once rank 0 has ended, --ddp-timeout 1: each says in one line it could not join, exit 1."""
    args = tiny_args(random_shards(tmp_path / "data"), tmp_path / "out", "--ddp-timeout", 1)
    codes, outputs = ranks_without_agent(args, one_by_one=True)
    assert codes == [1, 1], outputs
    for rank, (_, stderr) in enumerate(outputs):
        said = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert said == [line for line in said if f"rank {rank} could not join the job's other ranks" in line], stderr
        assert len(said) == 1 and "pass a longer --ddp-timeout (e.g. 60)" in said[0], stderr
        assert "Traceback" not in stderr
    assert not (tmp_path / "out" / "log.jsonl").exists()


# rank 0's disk takes 8 s per checkpoint: longer than the 3 s --ddp-timeout
SLOW_DISK = """
import os, sys, time
import train_gpt2
from support import cli, run_folder
write = run_folder.write_atomic
def slow(path, *args, **kwargs):
    if path.endswith(".pt") and os.environ["RANK"] == "0":
        time.sleep(8)
    return write(path, *args, **kwargs)
run_folder.write_atomic = slow  # the name save_checkpoint calls
cli.run_cli(lambda: train_gpt2.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_short_ddp_timeout_survives_slow_checkpoints_and_long_samples(data, tmp_path):
    """Checkpoints of 8 s (rank 0 alone) and samples of seconds: with --ddp-timeout 3 the job finishes."""
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


@pytest.mark.parametrize(
    "mistake, said",
    [
        ("out-dir", "log.jsonl is not this run's"),
        ("data folder", "error: data folder"),
        ("--seed", "error: argument --seed"),
    ],
)
@pytest.mark.slow
def test_a_mistake_is_said_once_a_node_and_every_rank_exits_1(data, tmp_path, mistake, said):
    """Under torchrun one error line, no worker's traceback; each rank as torchrun starts it, without its
    agent (which stops the others once one has failed), exits 1, and each node's first process says it."""
    folder, out, extra = (tmp_path / "nope" if mistake == "data folder" else data), tmp_path / "out", []
    if mistake == "--seed":
        extra = ["--seed", -1]
    if mistake == "out-dir":  # found by rank 0 alone
        out.mkdir()
        (out / "log.jsonl").write_text("another run's\n")
    args = tiny_args(folder, out, "--max-steps", 2, *extra)
    r = torchrun(*args)
    assert r.returncode != 0 and (r.stdout + r.stderr).count("error: ") == 1 and said in r.stderr, r.stderr[-3000:]
    assert 'train_gpt2.py", line' not in r.stderr  # no worker's traceback (torchrun's own follows)
    codes, outputs = ranks_without_agent(args)  # one node of two ranks: its first says it
    assert codes == [1, 1] and [sum(o.count(said) for o in output) for output in outputs] == [1, 0], outputs
    if mistake != "out-dir":  # two nodes of one rank each: each node's console says why it stopped
        codes, outputs = ranks_without_agent(args, one_per_node=True)
        assert codes == [1, 1] and [sum(o.count(said) for o in output) for output in outputs] == [1, 1], outputs

"""The README's multi-node commands as two one-rank torchruns over 127.0.0.1: one job, global rank 0 alone
writes, a signal to one node stops both with a checkpoint, --resume finishes as if never stopped."""

import json
import os
import signal
import subprocess
import time
import uuid
from types import SimpleNamespace

import psutil
import pytest
import torch

import train_gpt2
from helpers import ROOT, free_port, random_shards, read_log, same_weights, tiny_args, torchrun_command
from support.checkpoints import load_checkpoint

STEPS = ("--max-steps", 8, "--ckpt-every", 2, "--eval-every", 0)


class TwoNodes:
    """Two nodes launched, each a torchrun in a working folder of its own (its local disk), output in files."""

    def __init__(self, folder, rendezvous, args):
        self.folder, self.workers, self.ranks = folder, {}, {}
        port, rdzv_id = free_port(), f"gpt2-{uuid.uuid4().hex[:8]}"  # the job's id, the same on both nodes
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # what a stopped run printed is not lost
        self.nodes = []
        for node in (0, 1):
            (folder / f"node{node}").mkdir(parents=True)
            out, err = (open(folder / f"node{node}.{s}", "w") for s in ("out", "err"))
            # the README's command for one node of two: --node_rank and --master_addr, or the c10d rendezvous
            launch = [f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}"]
            if rendezvous == "c10d":
                launch = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv_id}"]
            self.nodes.append(
                subprocess.Popen(
                    torchrun_command(*args, nproc=1, script=ROOT / "train_gpt2.py", launch=["--nnodes=2", *launch]),
                    cwd=folder / f"node{node}",
                    env=env,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
            )
            out.close(), err.close()

    def find_workers(self):
        """{node: its training process}, and each one's RANK and LOCAL_RANK as torchrun set them."""
        for node, agent in enumerate(self.nodes):
            if node in self.workers:
                continue
            try:
                # a worker once exec'd: a child just forked still has torchrun's command line and environment
                found = [p for p in psutil.Process(agent.pid).children() if "torch.distributed.run" not in p.cmdline()]
                env = found[0].environ() if found else {}
                if "RANK" in env:
                    self.ranks[node] = {k: env.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
                    self.workers[node] = found[0]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return self.workers

    def wait(self, timeout=300):
        deadline = time.time() + timeout
        for node in self.nodes:
            while node.poll() is None:
                assert time.time() < deadline, f"a node still runs after {timeout} s:\n{self.output()}"
                self.find_workers()
                time.sleep(0.05)
        return [node.returncode for node in self.nodes]

    def kill(self):
        """Every process of both nodes, the workers too (torchrun starts them in sessions of their own)."""
        self.find_workers()
        for p in [*self.workers.values(), *(psutil.Process(n.pid) for n in self.nodes if n.poll() is None)]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        for n in self.nodes:
            n.wait(timeout=30)

    def stdout(self, node):
        return (self.folder / f"node{node}.out").read_text()

    def output(self):
        return "\n".join(
            f"--- node {n} {s}:\n" + (self.folder / f"node{n}.{s}").read_text()[-3000:]
            for n in (0, 1)
            for s in ("out", "err")
        )

    def rank0_node(self):
        """The node whose worker is global rank 0 (with c10d, the rendezvous decides which); each node's one
        worker is LOCAL_RANK 0 of a world of 2, as the README's commands make them."""
        nodes = [n for n, r in self.ranks.items() if r["RANK"] == "0"]
        assert len(nodes) == 1 and len(self.ranks) == 2, self.ranks
        assert all(r["LOCAL_RANK"] == "0" and r["WORLD_SIZE"] == "2" for r in self.ranks.values()), self.ranks
        return nodes[0]

    def files(self, node):
        return sorted(str(p.relative_to(self.folder / f"node{node}")) for p in (self.folder / f"node{node}").rglob("*"))


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory):
    """A run never stopped (--node_rank, a relative --out-dir on each node's disk); with c10d, a run into one
    shared --out-dir that a SIGTERM to one node stops after its first checkpoint; then it with --resume."""
    tmp = tmp_path_factory.mktemp("multinode")
    data = random_shards(tmp / "data")
    launches = []
    try:
        ref = TwoNodes(tmp / "ref", "static", tiny_args(data, "out", *STEPS))
        launches.append(ref)
        ref.returncodes = ref.wait()

        shared = tmp / "shared"
        stopped = TwoNodes(tmp / "stopped", "c10d", tiny_args(data, shared, *STEPS))
        launches.append(stopped)
        deadline = time.time() + 300
        while not (shared / "ckpt_000002.pt").exists() or len(stopped.find_workers()) < 2:
            assert time.time() < deadline and all(n.poll() is None for n in stopped.nodes), stopped.output()
            time.sleep(0.01)
        # a spot instance's notice reaches the node without rank 0: the checkpoint must come from the other
        other = 1 - stopped.rank0_node()
        os.kill(stopped.nodes[other].pid, signal.SIGTERM)  # torchrun passes it on to its worker
        stopped.signalled = other
        stopped.returncodes = stopped.wait(timeout=120)
        stopped.log = (shared / "log.jsonl").read_text()  # as the stopped run left it, before the resume appends

        resumed = TwoNodes(tmp / "resumed", "c10d", tiny_args(data, shared, *STEPS, "--resume"))
        launches.append(resumed)
        resumed.returncodes = resumed.wait()
        yield SimpleNamespace(ref=ref, stopped=stopped, resumed=resumed, shared=shared)
    finally:  # a failed test leaves no process behind
        for launch in launches:
            launch.kill()


@pytest.mark.slow
def test_two_nodes_train_as_one_job_and_only_global_rank_0_writes(two_node_runs):
    ref = two_node_runs.ref
    assert ref.returncodes == [0, 0], ref.output()
    writer = ref.rank0_node()
    assert writer == 0  # --node_rank=0's: one rank a node, global rank 0 on node 0
    # rank 0 wrote into its node's --out-dir; the other node's folder holds nothing, not even an --out-dir
    assert ref.files(1 - writer) == []
    assert ref.files(writer) == [
        "out",
        *(f"out/ckpt_00000{s}.pt" for s in (4, 6, 8)),
        "out/log.jsonl",
        *(f"out/meta_00000{s}.json" for s in (4, 6, 8)),
    ]
    assert "step     7/8" in ref.stdout(writer) and ref.stdout(1 - writer) == ""  # rank 0 alone prints
    records, steps = read_log(ref.folder / f"node{writer}" / "out")
    headers = [r for r in records if r.get("event") == "header"]
    assert len(headers) == 1 and headers[0]["config"]["world_size"] == 2 and headers[0]["device"]  # one writer
    assert [r["step"] for r in records if "train_loss" in r] == list(range(8))  # each step logged once
    ckpt = load_checkpoint(str(ref.folder / f"node{writer}" / "out" / "ckpt_000008.pt"))
    assert ckpt["world_size"] == 2


@pytest.mark.slow
def test_a_signal_to_one_node_stops_both_with_rank_0s_checkpoint(two_node_runs):
    stopped, shared = two_node_runs.stopped, two_node_runs.shared
    writer, signalled = stopped.rank0_node(), stopped.signalled
    assert signalled != writer
    # the signalled node said so; both stopped at one step, whose checkpoint rank 0 (the other node) wrote
    assert "caught SIGTERM: stopping after this step with a checkpoint" in stopped.stdout(signalled), stopped.output()
    steps = [json.loads(line)["step"] for line in stopped.log.splitlines() if '"train_loss"' in line]
    stop = len(steps)
    assert steps == list(range(stop)), stopped.log
    assert 3 <= stop < 8 and f"wrote {shared / f'ckpt_{stop:06d}.pt'}" in stopped.stdout(writer), stopped.output()
    assert stopped.returncodes == [1, 1], stopped.output()  # torchrun's code for a worker that did not end with 0
    assert stopped.files(0) == stopped.files(1) == []  # a shared --out-dir, given as an absolute path


@pytest.mark.slow
def test_the_same_command_with_resume_finishes_as_the_run_never_stopped(two_node_runs):
    ref, resumed, shared = two_node_runs.ref, two_node_runs.resumed, two_node_runs.shared
    assert resumed.returncodes == [0, 0], resumed.output()
    writer = resumed.rank0_node()
    assert resumed.files(0) == resumed.files(1) == [] and resumed.stdout(1 - writer) == ""
    records, steps = read_log(shared)
    headers = [r for r in records if r.get("event") == "header"]
    stop = sum('"train_loss"' in line for line in two_node_runs.stopped.log.splitlines())  # its checkpoint's step
    assert [h["resumed_from"] for h in headers] == [None, stop], headers
    assert f"resuming from {shared / f'ckpt_{stop:06d}.pt'} at step {stop}" in resumed.stdout(writer)
    after = records[records.index(headers[1]) :]
    assert [r["step"] for r in after if "train_loss" in r] == list(range(stop, 8))  # from the checkpoint on
    _, ref_steps = read_log(ref.folder / "node0" / "out")
    assert sorted(steps) == list(range(8))
    for s in range(8):  # bitwise: JSON floats round-trip exactly
        for key in ("train_loss", "grad_norm", "lr", "tokens", "epoch"):
            assert steps[s][key] == ref_steps[s][key], (s, key)
    a = load_checkpoint(str(ref.folder / "node0" / "out" / "ckpt_000008.pt"))["model"]
    assert same_weights(a, load_checkpoint(str(shared / "ckpt_000008.pt"))["model"])


@pytest.mark.parametrize(
    "rank, local_rank, world_size",
    [(1, 0, 2), (0, 0, 2), (3, 1, 4)],  # node 1 of two with one GPU each; node 0; node 1 of two with two GPUs
)
def test_a_rank_takes_the_gpu_of_its_local_rank_not_its_global_rank(
    monkeypatch, tmp_path, rank, local_rank, world_size
):
    """Node 1's only worker is rank 1 and must use cuda:0 (torch.cuda's answers faked, no group joined)."""
    env = {"RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": local_rank + 1}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    picked, joined = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.setattr(train_gpt2.dist, "init_process_group", lambda backend, timeout: joined.append(backend))
    monkeypatch.setattr(train_gpt2.dist, "new_group", lambda backend, timeout: "the fence's group")
    ddp, ddp_rank, ddp_local_rank, ddp_world_size, device = train_gpt2.setup_distributed("cuda", 60)
    assert ddp and (ddp_rank, ddp_local_rank, ddp_world_size) == (rank, local_rank, world_size)
    assert device == f"cuda:{local_rank}" and picked == [device] and joined == ["nccl"]

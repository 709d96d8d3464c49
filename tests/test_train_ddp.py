"""DDP: 2 CPU ranks (gloo) train as one process with twice the accumulation, and evaluate the same; a
signal to torchrun, or its kill -9, stops every rank with a checkpoint."""

import json
import signal

import pytest
import torch

from helpers import cli, hangup_default, random_shards, ranks_without_agent, read_log, signal_on, tiny_args
from support.checkpoints import load_checkpoint


def test_two_ranks_equal_one_process_with_twice_the_accumulation(tmp_path, assets):
    """2 ranks (without torchrun's agent: seconds sooner) and one process: the same losses, norms, evals and
    weights, to float tolerance."""
    # shards of 64k+1 tokens leave no tail for 2 ranks (64 tokens a micro-step) or one: the same tokens
    data = random_shards(tmp_path / "data", train_lengths=(321, 257), val_length=257)
    hellaswag = assets.hellaswag

    def args(out):
        flags = "--total-batch-size 128 --max-steps 5 --eval-every 5 --hellaswag-every 5 --hellaswag-limit 6"
        flags += " --sample-every 5 --num-samples 1 --max-new-tokens 4"
        return tiny_args(data, out, *flags.split(), "--hellaswag-data", hellaswag)

    codes, outputs = ranks_without_agent(args(tmp_path / "ddp"))
    assert codes == [0, 0], outputs
    single = cli(*args(tmp_path / "one"))
    assert single.returncode == 0, single.stderr

    ddp_records, ddp_steps = read_log(tmp_path / "ddp")
    one_records, one_steps = read_log(tmp_path / "one")
    ddp_header, one_header = ddp_records[0], one_records[0]
    assert ddp_header["config"]["world_size"] == 2 and ddp_header["config"]["grad_accum_steps"] == 2
    assert one_header["config"]["world_size"] == 1 and one_header["config"]["grad_accum_steps"] == 4
    assert sum(r.get("event") == "header" for r in ddp_records) == 1  # one process writes the log
    assert sorted(ddp_steps) == sorted(one_steps) == list(range(5))
    for s in range(5):
        assert ddp_steps[s]["train_loss"] == pytest.approx(one_steps[s]["train_loss"], rel=1e-5)
        assert ddp_steps[s]["grad_norm"] == pytest.approx(one_steps[s]["grad_norm"], rel=1e-4)
    for key in ("val_loss", "hellaswag"):  # evaluated on sharded data, summed over the ranks
        a = [(r["step"], r[key]) for r in ddp_records if key in r]
        b = [(r["step"], r[key]) for r in one_records if key in r]
        assert [s for s, _ in a] == [s for s, _ in b] == [0, 5]
        assert [v for _, v in a] == pytest.approx([v for _, v in b], rel=1e-5)
    assert [r["hellaswag_n"] for r in ddp_records if "hellaswag_n" in r] == [6, 6]
    assert [stdout.count("sample 0:") for stdout, _ in outputs] == [1, 0]  # rank 0 samples, once
    ddp, one = (load_checkpoint(str(tmp_path / run / "ckpt_000005.pt")) for run in ("ddp", "one"))
    assert ddp["world_size"] == 2 and ddp["model"].keys() == one["model"].keys()
    # atol: Adam turns gradients of float noise (the key bias's: softmax ignores it) into steps of lr's size
    assert all(torch.allclose(ddp["model"][k], one["model"][k], rtol=1e-4, atol=1e-5) for k in one["model"])
    json.dumps(ddp["train_config"])  # plain values only


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP, signal.SIGKILL])  # Ctrl-C; ssh dropped; kill -9
@pytest.mark.slow
def test_a_signal_to_torchrun_stops_every_rank_with_a_checkpoint(tmp_path, signum):
    """Ctrl-C reaches torchrun alone, which passes it on; after its kill -9 each rank sees its parent gone.
    Every rank stops at one step (and exits: the pipe ends only then) with a checkpoint --resume takes."""
    data = random_shards(tmp_path / "data", train_lengths=(2000,), val_length=257)
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 100000)
    proc, stdout, stderr = signal_on("step     3/", *args, signum=signum, torchrun=True, preexec_fn=hangup_default)
    said = f"caught {signum.name}: stopping after this step with a checkpoint"
    if signum == signal.SIGKILL:
        said = f"torchrun (pid {proc.pid}) is gone: stopping after this step with a checkpoint in {out}"
    assert said in stdout, stderr[-3000:]
    _, steps = read_log(out)
    last = max(steps)
    ckpt = load_checkpoint(str(out / f"ckpt_{last + 1:06d}.pt"))
    assert ckpt["step"] == last + 1 and ckpt["world_size"] == 2
    # what README says the user sees: the checkpoint written, then torchrun's own traceback and exit 1
    assert f"wrote {out / f'ckpt_{last + 1:06d}.pt'}" in stdout
    if signum != signal.SIGKILL:
        assert proc.returncode == 1 and f"SignalException: Process {proc.pid} got signal: {int(signum)}" in stderr
    resumed = cli(*tiny_args(data, out, "--max-steps", last + 3, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert max(read_log(out)[1]) == last + 2

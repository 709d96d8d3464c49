"""When a run cannot go on, it says what to do, and the advice works: running out of memory (for
real, under a memory limit), a divergence, numbers at the edge of what the code can do with them
(seeds, timeouts, temperatures), torchrun, read-only folders, and messages that must name the
right flag and tell the truth about what is on disk. Each message's advice is followed here."""

import math
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from test_notebook import clean_records, kernel_env, run_notebook, write_log  # noqa: F401  (kernel_env: a fixture)

import train_gpt2
from helpers import (
    ROOT,
    assert_one_line_error,
    random_shards,
    ranks_without_agent,
    read_log,
    strict_records,
    tiny_args,
    torchrun,
    user_error,
)
from support import common
from support.common import out_of_memory_line, run_cli
from support.out_of_memory import hellaswag_out_of_memory, oom_phase, training_out_of_memory

# Runs train_gpt2.py as `python train_gpt2.py ...` does, in a process whose address space is capped
# at what the imports map plus argv[1] MiB: an allocation past that fails as on a machine that is
# out of memory (RLIMIT_AS; the heavy imports come first, so that they are not what fails).
LIMITED = """
import resource, runpy, sys
import numpy, torch, fineweb, train_gpt2
headroom = int(sys.argv[1]) * 2**20
vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
sys.argv = ["train_gpt2.py", *sys.argv[2:]]
runpy.run_path("train_gpt2.py", run_name="__main__")
"""


def limited(headroom_mib, *args):
    return subprocess.run(
        [sys.executable, "-c", LIMITED, str(headroom_mib), *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def follow(message, args, flag):
    """args with the advice's `flag VALUE` (its last one: `e.g. flag VALUE`, `--resume flag VALUE`) and
    --resume when the advice says it."""
    value = re.findall(rf"{flag} (\d+)", message)[-1]
    i = args.index(flag) if flag in args else None
    args = args[:i] + args[i + 2 :] if i is not None else list(args)
    return args + [flag, value] + (["--resume"] if "--resume" in message and "--resume" not in args else [])


@pytest.fixture(scope="module")
def big_data(tmp_path_factory):
    return random_shards(tmp_path_factory.mktemp("big"), train_lengths=(20000,), val_length=5000)


# ----------------------------------------------------------------------------------------------
# Rule 1: out of memory is one line that says what ran out, during what, and the flag to lower


@pytest.mark.slow
def test_out_of_memory_in_the_first_step_names_B_and_lowering_it_trains(big_data, tmp_path):
    """A 64 x 64 micro-batch (800 MB of logits) under a 400 MiB cap: one line naming -B; each -B the
    advice names keeps the total batch, and following it ends in a run that trains."""
    out = tmp_path / "out"
    args = tiny_args(big_data, out, "-B", 64, "-T", 64, "--total-batch-size", 4096, "--max-steps", 2, "--eval-every", 0)
    r = limited(400, *args)
    line = assert_one_line_error(r, "out of host memory in the first training step", "-B 64", "lower -B (e.g. -B 32")
    assert "4,096 tokens" in line and "Traceback" not in r.stderr
    for _ in range(6):  # -B 32, 16, ... until it fits
        args = follow(line, args, "-B")
        r = limited(400, *args)
        if r.returncode == 0:
            break
        line = assert_one_line_error(r, "out of host memory")
    assert r.returncode == 0, r.stderr
    header = [x for x in strict_records(out) if x.get("event") == "header"][-1]
    B = header["config"]["batch_size"]
    assert B < 64 and header["config"]["grad_accum_steps"] == 4096 // (B * 64)  # the same total batch, accumulated
    assert sorted(read_log(out)[1]) == [0, 1]


@pytest.mark.slow
def test_out_of_memory_while_sampling_mid_run_keeps_the_checkpoint_and_resume_continues(big_data, tmp_path):
    """Samples of 1,000 tokens at step 2 need a KV cache the start-up check (one token) never
    allocates: out of memory there names --num-samples and the checkpoint that stands; --resume with
    the advice's --num-samples continues from it to the end. Many thin layers: a large KV cache per
    token (16 layers x 64 wide: 8 KiB per sample and token) under a cheap output layer; greedy, so no
    per-token noise is drawn. Under the 365 MiB cap 64 and 32 samples do not fit, 16 do."""
    out = tmp_path / "out"
    args = tiny_args(
        big_data,
        out,
        "--n-layer",
        16,
        "--n-head",
        4,
        "--n-embd",
        64,
        "--temperature",
        0,
        "--block-size",
        1024,
        "-B",
        1,
        "-T",
        16,
        "--total-batch-size",
        16,
        "--max-steps",
        4,
        "--warmup-steps",
        1,
        "--eval-every",
        0,
        "--sample-every",
        2,
        "--max-new-tokens",
        1000,
        "--num-samples",
        64,
        "--ckpt-every",
        1,
    )
    r = limited(365, *args)
    line = assert_one_line_error(r, "out of host memory while sampling at step 2", "--num-samples 64")
    assert f"{out / 'ckpt_000001.pt'} stands: continue from it with --resume --num-samples 32" in line
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_000001.pt"]
    for _ in range(6):
        args = follow(line, args, "--num-samples")
        r = limited(365, *args)
        if r.returncode == 0:
            break
        line = assert_one_line_error(r, "out of host memory while sampling at step 2", "--resume --num-samples")
    assert r.returncode == 0, r.stderr
    records, steps = read_log(out)
    assert sorted(steps) == [0, 1, 2, 3]
    assert [x["resumed_from"] for x in records if x.get("event") == "header"][-1] == 1
    samples = [x["samples"] for x in records if "samples" in x]
    assert samples and len(samples[-1]) == int(args[args.index("--num-samples") + 1]) < 64


def test_out_of_memory_in_the_start_up_sampling_check_leaves_nothing(data, tmp_path):
    out = tmp_path / "out"
    r = limited(400, *tiny_args(data, out, "--sample-every", 2, "--num-samples", 3000))
    assert_one_line_error(
        r, "out of host memory in the start-up sampling check", "lower --num-samples 3000 (e.g. 1500)"
    )
    assert not out.exists()


def test_out_of_memory_building_a_too_wide_model_names_the_model_flags(data, tmp_path):
    r = limited(400, *tiny_args(data, tmp_path / "out", "--n-embd", 2048, "--n-head", 1))  # 0.8 GB of weights
    assert_one_line_error(r, "out of host memory while building the model", "--n-layer or --n-embd")


def test_out_of_memory_in_the_val_loss_eval_gets_its_advice_not_the_training_steps(data, tmp_path, monkeypatch, capsys):
    """The model's forward, which the training step calls too, runs out of memory in the val-loss eval
    at step 2: the line is the val-loss eval's (the phase the recipe marked, whatever the functions
    the allocation failed in are called), with the checkpoint that stands; its advice trains on."""
    out = tmp_path / "out"
    args = tiny_args(data, out, "--eval-every", 2, "--ckpt-every", 1)
    real = train_gpt2.GPT.forward

    def forward(self, *a, **k):  # eval mode: the val loss; ckpt_000001.pt written: past step 1
        if not self.training and (out / "ckpt_000001.pt").exists():
            raise MemoryError()
        return real(self, *a, **k)

    monkeypatch.setattr(train_gpt2.GPT, "forward", forward)
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: train_gpt2.main(args), out_of_memory=training_out_of_memory)
    line = capsys.readouterr().err.strip()
    assert e.value.code == 1 and line == (
        "error: out of host memory in the val-loss eval at step 2 (it reads -B 2 rows at a time): lower -B (e.g. -B 1: "
        f"the total batch stays 64 tokens, accumulated over more micro-steps); {out / 'ckpt_000001.pt'} stands: "
        "continue from it with --resume -B 1"
    )
    monkeypatch.undo()
    assert train_gpt2.main(follow(line, args, "-B")) == 0
    assert sorted(read_log(out)[1]) == list(range(6))


def test_the_advice_is_the_marked_phases_not_the_function_names(tmp_path):
    """The innermost phase a script marked decides, and each script words its own: training's
    HellaSwag eval around hellaswag.py's scoring; a function named as the val-loss eval inside a
    training step; no advice outside every phase, and no mark on an error that is not memory."""
    args, _ = train_gpt2.parse_args(["--out-dir", str(tmp_path / "out")])
    run = SimpleNamespace(args=args, model=SimpleNamespace(config=train_gpt2.GPTConfig()), device="cpu")
    run.autocast_dtype = None

    def evaluate_val_loss(step=250, start_step=0):  # the val-loss eval's name and the loop's locals
        raise MemoryError()

    with pytest.raises(MemoryError) as raised:
        with oom_phase("HellaSwag eval", run=run, step=250), oom_phase("scoring HellaSwag", batch_tokens=65536):
            evaluate_val_loss()
    assert training_out_of_memory(raised.value) == (
        "in the HellaSwag eval at step 250: turn it off with --hellaswag-every 0 (hellaswag.py --batch-tokens scores "
        "a checkpoint in less); no checkpoint was written yet: --resume --hellaswag-every 0 starts the run again"
    )
    assert hellaswag_out_of_memory(raised.value) == (
        "while scoring HellaSwag: lower --batch-tokens (e.g. --batch-tokens 32768), or use a smaller --model"
    )
    with pytest.raises(MemoryError) as raised, oom_phase("training step", run=run, step=250, first=False):
        evaluate_val_loss()
    assert training_out_of_memory(raised.value).startswith("in training step 250 (-B 64 rows of -T 1024): lower -B")
    assert hellaswag_out_of_memory(raised.value) is None
    with pytest.raises(MemoryError) as raised:
        evaluate_val_loss()
    assert training_out_of_memory(raised.value) is None
    assert out_of_memory_line(raised.value, "host memory", training_out_of_memory) == "out of host memory (MemoryError)"
    with pytest.raises(ValueError) as raised, oom_phase("val loss", run=run, step=250):
        raise ValueError("not memory")
    assert not hasattr(raised.value, "oom_phases")


def test_out_of_memory_scoring_hellaswag_names_the_batch_tokens_it_used(tiny_config, enc, shared_data, monkeypatch):
    import hellaswag

    model = train_gpt2.GPT(tiny_config).eval()
    examples = hellaswag.load_examples(str(shared_data / "hellaswag" / "hellaswag_val.jsonl"), limit=4)

    def hidden_states(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(model, "hidden_states", hidden_states)
    with pytest.raises(MemoryError) as raised:
        hellaswag.evaluate(model, hellaswag.prepare(examples, enc), "cpu")  # --batch-tokens' CPU default, 4,096
    assert hellaswag_out_of_memory(raised.value) == (
        "while scoring HellaSwag: lower --batch-tokens (e.g. --batch-tokens 2048), or use a smaller --model"
    )


def test_gpu_out_of_memory_reads_as_gpu_memory_with_the_allocators_size():
    """The CUDA allocator's error (raised here by hand, as torch raises it) is GPU memory, its
    multi-line statistics cut to the size that did not fit; one outside every marked phase keeps
    the words."""
    e = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.2 GiB "
        "is free. Of the allocated memory 70 GiB is allocated by PyTorch\nmore lines"
    )
    assert common.memory_kind(e) == "GPU memory"
    assert out_of_memory_line(e, "GPU memory") == "out of GPU memory (CUDA out of memory. Tried to allocate 12.00 GiB)"
    assert common.memory_kind(ValueError("shapes differ")) is None
    wrapped = RuntimeError("compile failed")
    wrapped.__cause__ = MemoryError()
    assert common.memory_kind(wrapped) == "host memory"


# ----------------------------------------------------------------------------------------------
# Rule 2: after a divergence the advice works; a run never ends "done" on NaN


def test_a_nan_val_loss_reads_back_in_play_ipynb(tmp_path, kernel_env):  # noqa: F811
    records = clean_records()
    records.append({"step": 50, "val_loss": "NaN"})  # as RunLog writes a non-finite val loss
    log = write_log(tmp_path / "run", records)
    _, out = run_notebook(log, tmp_path)
    assert out["summary"]["best_val_loss"] == [40, 6.2]
    assert out["summary"]["last_val_loss"][0] == 50 and math.isnan(out["summary"]["last_val_loss"][1])


# ----------------------------------------------------------------------------------------------
# Rule 3: numbers checked for what the code can do with them


# rank 0's disk takes 8 s per checkpoint: longer than the 3 s --ddp-timeout
SLOW_DISK = """
import os, sys, time
import train_gpt2
from support import checkpoints, common
write = checkpoints.write_atomic
def slow(path, *args, **kwargs):
    if path.endswith(".pt") and os.environ["RANK"] == "0":
        time.sleep(8)
    return write(path, *args, **kwargs)
checkpoints.write_atomic = slow  # the name save_checkpoint calls
common.run_cli(lambda: train_gpt2.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_short_ddp_timeout_survives_slow_checkpoints_and_long_samples(data, tmp_path):
    """Rank 0 writes checkpoints alone (8 s each here) and samples take seconds: with --ddp-timeout 3
    a healthy job finishes, because the other rank waits in the fence, and every rank samples."""
    out = tmp_path / "out"
    args = tiny_args(
        data,
        out,
        "--max-steps",
        4,
        "--ckpt-every",
        2,
        "--eval-every",
        2,
        "--sample-every",
        2,
        "--num-samples",
        256,
        "--max-new-tokens",
        48,
        "--ddp-timeout",
        3,
    )
    t0 = time.time()
    r = torchrun(*args, wrap=SLOW_DISK)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert time.time() - t0 > 16  # the slow writes happened: two checkpoints of 8 s
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_000002.pt", "ckpt_000004.pt"]
    assert [len(x["samples"]) for x in read_log(out)[0] if "samples" in x] == [256, 256]


# ----------------------------------------------------------------------------------------------
# Rule 4: under torchrun a mistake is said once, and every rank exits the same way


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


def test_dry_run_runs_the_start_up_checks_and_writes_nothing(data, tmp_path, capsys):
    out = tmp_path / "new" / "out"
    args = tiny_args(data, out, "--sample-every", 2, "--eval-every", 2)
    assert train_gpt2.main(args + ["--dry-run"]) == 0
    assert "dry run: the flags, the data, --out-dir and the sampling check are fine" in capsys.readouterr().out
    assert not (tmp_path / "new").exists()
    assert "--prompt" in user_error(args + ["--dry-run", "--prompt", "word " * 100])  # the sampling check ran
    assert "does not exist" in user_error(tiny_args(tmp_path / "no_data", out, "--dry-run"))  # the data checks ran
    assert not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------------------------
# Rule 5: read-only is an answer, not a crash


def test_play_ipynb_on_a_read_only_run_folder_prints_its_summary(tmp_path, kernel_env, read_only):  # noqa: F811
    log = write_log(tmp_path / "run", clean_records())
    read_only(log.parent)
    nb, out = run_notebook(log, tmp_path)
    assert out["summary"]["last_step"] == 49 and out["summary"]["best_val_loss"] == [40, 6.2]
    said = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    for name in ("loss.png", "hellaswag.png", "throughput.png"):
        assert f"could not save {name} in {log.parent} (Read-only file system)" in said
    assert os.listdir(log.parent) == ["log.jsonl"]


# ----------------------------------------------------------------------------------------------
# Rule 6: every message names the flag of its program and tells the truth about the disk


def test_val_tokens_0_turns_the_val_loss_off(data, tmp_path):
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, out, "--val-tokens", 0, "--eval-every", 2, "--max-steps", 2)) == 0
    records = strict_records(out)
    assert not any("val_loss" in x for x in records) and sorted(read_log(out)[1]) == [0, 1]

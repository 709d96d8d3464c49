"""support/out_of_memory.py: out of memory is one line naming what ran out, in which marked phase, and the
flag to lower; under a real memory limit (RLIMIT_AS) the advice, followed, trains in the same folder."""

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hellaswag
import train_gpt2
from helpers import ROOT, GiB, assert_one_line_error, cli, random_shards, read_log, strict_records, tiny_args
from support.cli import out_of_memory_line, run_cli
from support.out_of_memory import (
    HELLASWAG_ADVICE,
    SAMPLE_ADVICE,
    TRAINING_ADVICE,
    forget_phases,
    hellaswag_out_of_memory,
    oom_phase,
    oom_run,
    sample_out_of_memory,
    training_out_of_memory,
)
from train_gpt2 import GPTConfig

# a script (argv[2]) in a process whose address space is capped at what its imports map plus argv[1] MiB;
# sample.py reads that cap as the machine's memory (support.gpu.device_memory)
LIMITED = """
import resource, runpy, sys
import numpy, torch, fineweb, sample, support.gpu, train_gpt2
headroom = int(sys.argv[1]) * 2**20
vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
if sys.argv[2] == "sample.py":
    support.gpu.device_memory = lambda device: (headroom, "the memory under the cap")
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def limited(headroom_mib, *args, script="train_gpt2.py"):
    return cli(LIMITED, headroom_mib, script, *args, script="-c")


def follow(message, args, flag):
    """args with the advice's last `flag VALUE`, --resume or a new --out-dir where the advice says it."""
    value = re.findall(rf"{flag} (\d+)", message)[-1]
    i = args.index(flag) if flag in args else None
    args = args[:i] + args[i + 2 :] if i is not None else list(args)
    if "in a new --out-dir" in message:  # a step trained, no checkpoint yet
        args[args.index("--out-dir") + 1] += "_new"
    return args + [flag, value] + (["--resume"] if "--resume" in message and "--resume" not in args else [])


@pytest.fixture(scope="module")
def big_data(tmp_path_factory):
    return random_shards(tmp_path_factory.mktemp("big"), train_lengths=(20000,), val_length=5000)


@pytest.mark.slow
def test_out_of_memory_in_the_first_step_names_B_and_lowering_it_trains(big_data, tmp_path):
    """B 64 x T 64 (800 MB of logits) under a 400 MiB cap: the advice, followed as it says, trains."""
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
    out = Path(args[args.index("--out-dir") + 1])  # the same folder, unless a step trained before it ran out
    header = [x for x in strict_records(out) if x.get("event") == "header"][-1]
    B = header["config"]["batch_size"]
    assert B < 64 and header["config"]["grad_accum_steps"] == 4096 // (B * 64)  # the same total batch, accumulated
    assert sorted(read_log(out)[1]) == [0, 1]


@pytest.mark.slow
def test_out_of_memory_while_sampling_mid_run_keeps_the_checkpoint_and_resume_continues(big_data, tmp_path):
    """1,000-token samples at step 2 need a KV cache the start-up check never allocates (16 thin layers: 8 KiB
    a sample and token; under 365 MiB 16 samples fit, 32 do not): the advice, --resume, runs to the end."""
    out = tmp_path / "out"
    flags = "--n-layer 16 --n-head 4 --n-embd 64 --temperature 0 --block-size 1024 -B 1 -T 16 --total-batch-size 16"
    flags += " --max-steps 4 --warmup-steps 1 --eval-every 0 --sample-every 2 --max-new-tokens 1000 --num-samples 64"
    args = tiny_args(big_data, out, *flags.split(), "--ckpt-every", 1)
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


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ("--sample-every", 2, "--num-samples", 3000),
            ("in the start-up sampling check", "--num-samples 3000 (e.g. 1500)"),
        ),
        (("--n-embd", 2048, "--n-head", 1), ("while building the model", "--n-layer or --n-embd")),  # 0.8 GB of weights
    ],
)
def test_out_of_memory_at_the_start_names_its_phase_and_flag_and_leaves_nothing(data, tmp_path, flags, words):
    out = tmp_path / "out"
    assert_one_line_error(limited(400, *tiny_args(data, out, *flags)), "out of host memory " + words[0], words[1])
    assert not out.exists()


def test_out_of_memory_in_sample_py_advises_a_num_samples_that_fits_and_it_samples(short_run):
    """--num-samples 100,000,000 under a 1 GiB cap: the advice is not half of it (which ran into the OOM
    killer) but a number the memory holds, and that many samples are drawn under the same cap."""
    args = [short_run[1] / "ckpt_000002.pt", "--prompt", "Hi", "--max-new-tokens", 2]
    r = limited(1024, *args, "--num-samples", 10**8, script="sample.py")
    line = assert_one_line_error(r, "out of host memory while sampling: lower --num-samples 100000000 (e.g. ")
    n = int(re.search(r"\(e\.g\. (\d+)\)", line)[1])
    assert 100 < n < 10**5, line  # a sample of the 2-layer model holds about 1 MB
    r = limited(1024, *args, "--num-samples", n, script="sample.py")
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.findall(r"^sample (\d+): ", r.stdout, re.M)[-1] == str(n - 1)


def test_out_of_memory_in_the_val_loss_eval_gets_its_advice_not_the_training_steps(data, tmp_path, monkeypatch, capsys):
    """The model's forward, which the training step calls too, fails in the val-loss eval: its own line."""
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


def recipe_run(out, config=None, device="cpu", autocast_dtype=None):
    """oom_run as train_gpt2.py records its run, for the recipe's -B 64 of -T 1024, 524,288 tokens a step."""
    oom_run(config or GPTConfig(), device, autocast_dtype, B=64, T=1024, total_batch_size=524288, out_dir=out)


def test_the_phase_marked_last_decides_and_each_script_words_its_own(tmp_path, tiny_config, enc, assets, monkeypatch):
    """No advice before the first mark (the allocator's words) nor for the run's shape alone; then the
    phase marked last among a script's own (a run's HellaSwag eval fails in hellaswag.py's scoring, which
    names the --batch-tokens it used: the CPU default, 4,096)."""
    out = str(tmp_path / "out")
    forget_phases()
    assert (
        out_of_memory_line(MemoryError(), "host memory", training_out_of_memory) == "out of host memory (MemoryError)"
    )
    recipe_run(out)
    assert training_out_of_memory() is None
    oom_phase("HellaSwag eval", step=250)
    model = train_gpt2.GPT(tiny_config).eval()
    examples = hellaswag.load_examples(str(assets.hellaswag), limit=4)

    def hidden_states(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(model, "hidden_states", hidden_states)
    with pytest.raises(MemoryError):
        hellaswag.evaluate(model, hellaswag.prepare(examples, enc), "cpu")  # --batch-tokens' CPU default, 4,096
    assert training_out_of_memory() == (
        "in the HellaSwag eval at step 250: turn it off with --hellaswag-every 0 (hellaswag.py --batch-tokens scores "
        "a checkpoint in less); no checkpoint was written yet: start the run again with --hellaswag-every 0 in a new "
        "--out-dir"
    )
    assert hellaswag_out_of_memory() == (
        "while scoring HellaSwag: lower --batch-tokens (e.g. --batch-tokens 2048), or use a smaller --model"
    )
    forget_phases()
    recipe_run(out)
    oom_phase("training step", step=250, first=False)
    assert training_out_of_memory().startswith("in training step 250 (-B 64 rows of -T 1024): lower -B")
    assert hellaswag_out_of_memory() is None and sample_out_of_memory() is None
    oom_phase("drawing samples", num_samples=4, max_new_tokens=32, fit=0)
    assert sample_out_of_memory() == "while sampling: lower --num-samples 4 (e.g. 2) or --max-new-tokens 32"
    forget_phases()


def marked_phases(path):
    """{phase name: line} of every oom_phase("name", ...) call in the file at path."""
    tree = ast.parse((ROOT / path).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "oom_phase"]
    return {call.args[0].value: call.lineno for call in calls}


def test_every_phase_a_script_marks_has_its_advice():
    """Each oom_phase mark in a script (and the support modules) has its advice entry, and each entry a mark."""
    training = {}
    for path in ["train_gpt2.py", *(f"support/{p.name}" for p in (ROOT / "support").glob("*.py"))]:
        training.update(marked_phases(path))
    training.pop(None, None)
    assert len(training) >= 10, training  # the ast walk found the marks
    assert sorted(training) == sorted(TRAINING_ADVICE), training
    assert sorted(marked_phases("hellaswag.py")) == sorted(HELLASWAG_ADVICE)
    assert sorted(marked_phases("sample.py")) == sorted(SAMPLE_ADVICE)


def first_step_error(tmp_path, config, autocast_dtype, device="cuda:0"):
    """The advice for a run of config out of GPU memory in its first step at the recipe's batch."""
    forget_phases()
    out = str(tmp_path / "out")
    recipe_run(out, config, device, autocast_dtype)
    oom_phase("training step", step=0, first=True)
    return training_out_of_memory()


def test_out_of_gpu_memory_names_the_B_the_memory_estimate_fits_where_it_holds(tmp_path, monkeypatch):
    """Under autocast (fp16 here; bf16 and the whole line through a run on a faked GPU: test_fake_gpu's
    test_out_of_memory_names_the_B_the_gpu_fits)."""
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(name="GPU", total_memory=int(23.65 * GiB))
    )
    recipe = GPTConfig(vocab_size=50304)
    assert "lower -B (e.g. -B 16, which this GPU's 23.6 GiB" in first_step_error(tmp_path, recipe, torch.float16)
    # where the estimate does not hold, -B halves: fp32, another model, a -B it says fits that ran out
    halved = "lower -B (e.g. -B 32: the total batch"
    assert halved in first_step_error(tmp_path, recipe, None)
    wider = GPTConfig(vocab_size=50304, n_layer=24, n_head=16, n_embd=1024)
    assert halved in first_step_error(tmp_path, wider, torch.bfloat16)
    assert halved in first_step_error(tmp_path, recipe, torch.bfloat16, "cpu")  # the estimate is a GPU's
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(name="GPU", total_memory=80 * GiB)
    )
    assert halved in first_step_error(tmp_path, recipe, torch.bfloat16)

"""The CUDA tier: what only a GPU can show. The 124M model compiled in bf16 learns; torchrun runs it
over NCCL; --resume is bitwise with --deterministic and close without it; HellaSwag and greedy
sampling in fp32 give the CPU's answers. Skipped, with the reason, on a machine without CUDA.

    python -m pytest -q tests/test_cuda.py        # ~3 min on one H100, most of it compiling
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import hellaswag
import train_gpt2
from helpers import ROOT, headers, read_log, torchrun_command
from support import checkpoints, gpu, precision, sampling, shards
from support.sampling import generate
from support.shards import write_shard
from train_gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

# GPT-2 124M as trained (12 layers, 768 wide, block 1024) at a small batch: B 4 x T 1024 x 2 micro-steps
SMALL_BATCH = ("-B", 4, "-T", 1024, "--total-batch-size", 8192)


def gpu_args(data_dir, out_dir, *extra):
    """train_gpt2.py's defaults (cuda, bf16, compile) at a small batch; later flags win."""
    flags = "--max-steps 8 --warmup-steps 4 --max-lr 1e-3 --eval-every 0 --hellaswag-every 0 --sample-every 0"
    return ["--data-dir", data_dir, "--out-dir", out_dir, *SMALL_BATCH, *flags.split(), "--ckpt-every", 0, *extra]


def run(*command, env=None, timeout=600):
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [str(c) for c in command]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def train(*args, env=None):
    r = run(sys.executable, "train_gpt2.py", *args, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory, assets, enc):
    """Tiny Shakespeare as shards: real text, so that a loss can fall. ~300k train tokens."""
    data = tmp_path_factory.mktemp("shakespeare_gpu")
    tokens = [enc.eot_token] + enc.encode_ordinary(assets.shakespeare.read_text())
    tokens = np.array(tokens, dtype=np.uint16)
    write_shard(str(data / "ts_val_000000.npy"), tokens[:32_768])
    write_shard(str(data / "ts_train_000001.npy"), tokens[32_768:])
    return data


@pytest.fixture(scope="module")
def run_124m(shakespeare, tmp_path_factory):
    """20 steps of the 124M model as a GPU run makes them: bf16 autocast, torch.compile, fused AdamW."""
    out = tmp_path_factory.mktemp("run_124m")
    train(*gpu_args(shakespeare, out, "--max-steps", 20, "--eval-every", 20, "--val-tokens", 16384))
    return out


def test_compiled_bf16_124m_loss_falls(run_124m):
    records, steps = read_log(run_124m)
    header = records[0]
    assert header["config"]["dtype"] == "bfloat16" and header["config"]["compile"] is True
    assert header["config"]["model_config"]["n_layer"] == 12 and header["config"]["model_config"]["n_embd"] == 768
    assert header["device"] == torch.cuda.get_device_name(0)
    assert sorted(steps) == list(range(20))
    losses = [steps[s]["train_loss"] for s in range(20)]
    assert 10.5 < losses[0] < 11.5  # ln(50304) = 10.83: a fresh model guesses uniformly
    assert max(losses[-3:]) < losses[0] - 3.0, losses  # Shakespeare's unigrams alone take it to ~7
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0] - 3.0
    # MFU for every step of a GPU in the peak-FLOPs table, none for one that is not
    known = gpu.peak_flops(header["device"]) is not None
    assert all(0 < steps[s]["mfu"] < 1 if known else steps[s]["mfu"] is None for s in range(1, 20))


def test_torchrun_one_rank_over_nccl(shakespeare, run_124m, tmp_path, assets):
    """DDP with one rank (NCCL, compile, bf16) trains as the plain run and evaluates too."""
    out = tmp_path / "ddp"
    flags = "--max-steps 20 --eval-every 20 --val-tokens 16384 --hellaswag-every 20 --hellaswag-limit 40"
    flags += " --sample-every 20 --num-samples 2 --max-new-tokens 8"
    args = gpu_args(shakespeare, out, *flags.split(), "--hellaswag-data", assets.hellaswag)
    r = run(*torchrun_command(*args, nproc=1), env={"NCCL_DEBUG": "VERSION"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "NCCL version" in r.stdout + r.stderr  # the process group really is NCCL's
    records, steps = read_log(out)
    _, plain = read_log(run_124m)
    assert records[0]["config"]["world_size"] == 1 and records[0]["config"]["compile"] is True
    assert sorted(steps) == list(range(20))
    # the same model, data and schedule; DDP splits the compiled graph at its gradient buckets,
    # so bf16 rounds a little differently: close, not bitwise
    for s in range(20):
        assert steps[s]["train_loss"] == pytest.approx(plain[s]["train_loss"], rel=1e-2), s
    assert [r["hellaswag_n"] for r in records if "hellaswag_n" in r] == [40, 40]
    assert [r["step"] for r in records if "samples" in r] == [20]
    assert "step    20 | sample 1:" in r.stdout


def _resume_pair(shakespeare, tmp_path, *flags):
    """A reference run of 8 steps, and a second process that resumes from its step-4 checkpoint."""
    args = lambda out: gpu_args(shakespeare, out, "--ckpt-every", 4, *flags)  # noqa: E731
    train(*args(tmp_path / "ref"))
    (tmp_path / "resumed").mkdir()
    shutil.copy(tmp_path / "ref" / "ckpt_000004.pt", tmp_path / "resumed")
    r = train(*args(tmp_path / "resumed"), "--resume")
    assert "resuming from" in r.stdout and "at step 4" in r.stdout
    ref, resumed = read_log(tmp_path / "ref")[1], read_log(tmp_path / "resumed")[1]
    assert sorted(resumed) == [4, 5, 6, 7]
    a, b = (checkpoints.load_checkpoint(str(tmp_path / d / "ckpt_000008.pt")) for d in ("ref", "resumed"))
    return ref, resumed, a, b


def test_resume_with_deterministic_is_bitwise(shakespeare, tmp_path):
    ref, resumed, a, b = _resume_pair(shakespeare, tmp_path, "--deterministic")
    for s in (4, 5, 6, 7):
        assert resumed[s]["train_loss"] == ref[s]["train_loss"], s
        assert resumed[s]["grad_norm"] == ref[s]["grad_norm"], s
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    moments = lambda c: [t for s in c["optimizer"]["state"].values() for t in (s["exp_avg"], s["exp_avg_sq"])]  # noqa: E731
    assert all(torch.equal(x, y) for x, y in zip(moments(a), moments(b), strict=True))


# Without --deterministic the backward's atomics reorder sums from run to run; over 4 steps of
# the 124M model that moved the loss in the 5th-6th digit on an H100. Stated tolerance:
RESUME_RTOL_LOSS, RESUME_RTOL_NORM = 1e-4, 1e-3


def test_resume_without_deterministic_is_close(shakespeare, tmp_path):
    ref, resumed, a, b = _resume_pair(shakespeare, tmp_path)
    for s in (4, 5, 6, 7):
        assert resumed[s]["train_loss"] == pytest.approx(ref[s]["train_loss"], rel=RESUME_RTOL_LOSS), s
        assert resumed[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=RESUME_RTOL_NORM), s
    differs = max((a["model"][k].float() - b["model"][k].float()).abs().max().item() for k in a["model"])
    assert differs < 1e-3  # AdamW moves a weight by at most ~lr = 1e-3 a step


# bf16 autocast against fp32 over the same 8 steps: bf16 rounds the matmuls' inputs to 8 mantissa
# bits and the loss (fp32 logits), gradients' accumulation and AdamW stay fp32. On a CPU the two
# differ by ~2e-4 in the loss and ~1e-3 relative in the gradient norm at every step of this config;
# the bounds allow ~50x that for the GPU's kernels (TF32 in the fp32 run, flash attention in bf16)
# and stay well below the ~0.25 the loss falls per step here.
BF16_LOSS_ATOL, BF16_NORM_RTOL = 0.01, 0.05


# a 4-layer, 256-wide model, eager, at 2 micro-steps of B 4 x T 256
SMALL_EAGER = tuple("--n-layer 4 --n-head 4 --n-embd 256 --block-size 256 -B 4 -T 256 --total-batch-size 2048".split())
SMALL_EAGER += ("--no-compile",)


@pytest.fixture(scope="module")
def fp32_steps(shakespeare, tmp_path_factory):
    """{step: its record} of SMALL_EAGER's 8 steps in fp32, the half precisions' reference."""
    out = tmp_path_factory.mktemp("fp32")
    train(*gpu_args(shakespeare, out, "--dtype", "float32", *SMALL_EAGER))
    steps = read_log(out)[1]
    assert sorted(steps) == list(range(8))
    assert steps[7]["train_loss"] < steps[0]["train_loss"] - 1  # the steps move the model: there is a path to follow
    return steps


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_autocast_steps_stay_close_to_fp32(shakespeare, fp32_steps, tmp_path, dtype):
    """A 4-layer, 256-wide model, eager, 8 steps in bf16 autocast (or fp16's, with its GradScaler) and the same 8
    in fp32: the logged loss and gradient norm agree within the bounds above at every step. fp16 keeps 10
    mantissa bits to bf16's 7, so bf16's bounds hold with room; every fp16 step trains (at the first scale,
    2**16, this model's scaled gradients fit fp16) and the scale is logged with it."""
    train(*gpu_args(shakespeare, tmp_path / dtype, "--dtype", dtype, *SMALL_EAGER))
    records, half = read_log(tmp_path / dtype)
    assert records[0]["config"]["dtype"] == dtype and records[0]["config"]["grad_accum_steps"] == 2
    assert sorted(half) == list(range(8))
    for s in range(8):
        assert half[s].get("loss_scale") == (2.0**16 if dtype == "float16" else None), half[s]
        assert half[s]["train_loss"] == pytest.approx(fp32_steps[s]["train_loss"], abs=BF16_LOSS_ATOL, rel=0), s
        assert half[s]["grad_norm"] == pytest.approx(fp32_steps[s]["grad_norm"], rel=BF16_NORM_RTOL, abs=0), s


def test_fp16_loss_scale_backs_off_on_the_gpu_then_trains(shakespeare, tmp_path, monkeypatch):
    """From a first scale of 2**40 the scaled gradients overflow fp16 on the GPU's kernels: the
    scaler skips those steps, halving the scale each time (logged as scaler skips, not a
    divergence), until the gradients fit; the steps after train with a finite loss. In-process: the
    first scale is set from here."""
    monkeypatch.setattr(precision, "INIT_SCALE", 2.0**40)
    out = tmp_path / "out"
    args = gpu_args(shakespeare, out, "--dtype", "float16", *SMALL_EAGER, "--max-steps", 40)
    before = torch.get_float32_matmul_precision()  # the run sets TF32 for the process: later tests get theirs back
    try:
        assert train_gpt2.main([str(a) for a in args]) == 0
    finally:
        torch.set_float32_matmul_precision(before)
    steps = read_log(out)[1]
    assert sorted(steps) == list(range(40)) and not any("skipped" in r for r in steps.values())  # no bad step
    first = min(s for s in steps if "train_loss" in steps[s])  # the first step whose gradients fit
    assert first >= 4 and all("scaler_skipped" in steps[s] for s in range(first))
    assert [steps[s]["loss_scale"] for s in range(first + 1)] == [2.0 ** (40 - s) for s in range(first + 1)]
    assert all(np.isfinite(r["train_loss"]) for r in steps.values() if "train_loss" in r)


@pytest.fixture(scope="module")
def eval_model():
    """A random 4-layer, 256-wide GPT (seeded): the CPU and the GPU get the same weights."""
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=256, vocab_size=50304, n_layer=4, n_head=4, n_embd=256)).eval()


@pytest.fixture
def fp32_exact():
    """fp32 on the GPU without TF32 (11-bit mantissa matmuls): the CPU's arithmetic, up to the order of sums."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _hellaswag_scores(model, enc, examples, device):
    """(4 summed ending losses, 4 token counts) per example, on the CPU."""
    sum_loss, n_tokens = hellaswag.ending_losses(model, hellaswag.prepare(examples, enc), device)
    return sum_loss.cpu(), n_tokens.cpu()


def test_hellaswag_cuda_fp32_predicts_as_the_cpu(eval_model, enc, assets, fp32_exact):
    examples = hellaswag.load_examples(str(assets.hellaswag), limit=200)
    cpu_loss, cpu_n = _hellaswag_scores(eval_model, enc, examples, "cpu")
    gpu_loss, gpu_n = _hellaswag_scores(eval_model.to("cuda"), enc, examples, "cuda")
    eval_model.to("cpu")
    assert torch.equal(cpu_n, gpu_n)
    assert torch.allclose(gpu_loss, cpu_loss, rtol=1e-5, atol=1e-4)
    # the predictions: where two endings score within 1e-3 of each other, the order of the GPU's
    # sums may legitimately pick the other one; everywhere else the pick must be the CPU's
    undecided = 0
    for scores_cpu, scores_gpu in ((cpu_loss, gpu_loss), (cpu_loss / cpu_n, gpu_loss / gpu_n)):
        top2 = scores_cpu.topk(2, dim=1, largest=False).values
        decided = (top2[:, 1] - top2[:, 0]) > 1e-3
        undecided += int((~decided).sum())
        assert torch.equal(scores_cpu.argmin(1)[decided], scores_gpu.argmin(1)[decided])
    assert undecided <= 10  # near-ties are rare: the comparison covers nearly every example
    # and the counts training logs, through the whole evaluate path on the GPU, against the CPU's
    # scores counted here by hand
    gpu_counts = hellaswag.evaluate(eval_model.to("cuda"), hellaswag.prepare(examples, enc), "cuda")
    eval_model.to("cpu")
    labels = torch.tensor([ex["label"] for ex in examples])
    cpu_correct = int((cpu_loss.argmin(1) == labels).sum())
    cpu_correct_norm = int(((cpu_loss / cpu_n).argmin(1) == labels).sum())
    assert gpu_counts["n"] == 200
    assert abs(gpu_counts["correct"] - cpu_correct) <= undecided
    assert abs(gpu_counts["correct_norm"] - cpu_correct_norm) <= undecided


def test_greedy_samples_cuda_fp32_equal_the_cpu(eval_model, enc, fp32_exact):
    """Eager and compiled (generate(compile=True)) decoding on the GPU, against the CPU's."""
    prompt = torch.tensor([enc.encode("Hello, I'm a language model,")] * 2)
    n_prompt, n_new = prompt.size(1), 32
    with torch.no_grad():
        cpu = generate(eval_model, prompt, n_new, temperature=0)
        gpu = generate(eval_model.to("cuda"), prompt.to("cuda"), n_new, temperature=0).cpu()
        # the compiled decode step, captured as a CUDA graph
        compiled = generate(eval_model, prompt.to("cuda"), n_new, temperature=0, compile=True).cpu()
        eval_model.to("cpu")
        # the CPU's margin between its best and second-best token at each step: only a near-tie may flip
        logits, _ = eval_model(cpu[:1, :-1])
    assert torch.equal(cpu[0], cpu[1]) and torch.equal(gpu[0], gpu[1])  # greedy: both rows the same
    top2 = logits[0, n_prompt - 1 :, : shards.GPT2_VOCAB].topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    first_tie = next((i for i, g in enumerate(gaps) if g < 1e-3), n_new)
    assert torch.equal(gpu[:, : n_prompt + first_tie], cpu[:, : n_prompt + first_tie])
    assert torch.equal(compiled[:, : n_prompt + first_tie], cpu[:, : n_prompt + first_tie])
    assert first_tie >= 24, gaps  # the whole sample, or all but a last few tokens after a near-tie
    # and the text path training prints, on the GPU
    # (2 rows: the shapes, and so the kernels, of the eager GPU decode above)
    text = sampling.sample_text(eval_model.to("cuda"), enc, "Hello, I'm a language model,", 2, n_new, temperature=0)
    eval_model.to("cpu")
    assert text == [enc.decode(gpu[0].tolist())] * 2


def test_bench_tiny_on_cuda(tmp_path, assets):
    out = tmp_path / "bench.json"
    hellaswag = ("--hellaswag-data", assets.hellaswag)
    only = ("--only", "ceiling,loader,train,hellaswag,sample")  # fineweb tokenizes on the CPU: test_bench's
    r = run(sys.executable, ROOT / "bench.py", "--tiny", "--device", "cuda", "--out", out, *hellaswag, *only)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["device"] == torch.cuda.get_device_name(0)
    assert sorted(report["sections"]) == ["ceiling", "hellaswag", "loader", "sample", "train"]
    assert not [name for name, s in report["sections"].items() if "skipped" in s]
    names = " | ".join(row["name"] for row in report["rows"])
    for wanted in ("matmul ceiling", "loader", "ours vs transformers", "bf16 vs fp32", "hellaswag", "KV cache"):
        assert wanted in names
    train = report["sections"]["train"]["tiny"]
    for variant in ("ours fp32 eager", "ours bf16 eager", "hf fp32 eager", "hf bf16 eager"):
        assert 0 < train["mfu"][variant]["median"] < 1  # against the GPU's datasheet peak
    loader = report["sections"]["loader"]
    per_shard = (200_000 - 1) // (loader["B"] * loader["T"])
    assert loader["batches"] == 2 * per_shard + 2 and loader["switches"] == 2


def test_out_of_gpu_memory_is_one_line_and_lowering_B_as_advised_trains(shakespeare, tmp_path):
    """A micro-batch whose fp32 logits alone take twice the GPU's memory: one `error:` line naming GPU
    memory, the first step and -B; following the advice's -B (the same total batch, accumulated)
    until the run fits ends in a run that trains."""
    total = torch.cuda.get_device_properties(0).total_memory
    B = 2 ** int(np.ceil(np.log2(2 * total / (1024 * 50304 * 4))))
    out = tmp_path / "out"
    args = gpu_args(shakespeare, out, "-B", B, "--total-batch-size", B * 1024, "--max-steps", 1, "--no-compile")
    for _ in range(12):
        r = run(sys.executable, "train_gpt2.py", *args)
        if r.returncode == 0:
            break
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
        assert lines[0].startswith("error: out of GPU memory in the first training step"), lines[0]
        smaller = int(lines[0].rsplit("-B ", 1)[1].split()[0].rstrip(":);"))
        assert smaller < args[args.index("-B") + 1]
        args[args.index("-B") + 1] = smaller
        if "--resume" in lines[0] and "--resume" not in args:
            args.append("--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    header = headers(out)[-1]
    assert header["config"]["total_batch_size"] == B * 1024 and header["config"]["batch_size"] < B


def test_out_of_gpu_memory_in_the_start_up_sampling_check_names_num_samples(shakespeare, tmp_path):
    total = torch.cuda.get_device_properties(0).total_memory
    n = int(2 * total / (50304 * 4)) + 1  # the noise and logits of one token alone take twice the GPU
    r = run(
        sys.executable,
        "train_gpt2.py",
        *gpu_args(shakespeare, tmp_path / "out", "--sample-every", 4, "--num-samples", n, "--no-compile"),
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: out of GPU memory in the start-up sampling check: lower --num-samples")

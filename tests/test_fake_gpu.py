"""The scripts with `--device cuda` on a faked GPU (fake_gpu.py): at compute capability 9.0, 8.0 and 7.5
they compute what the CPU computes in that dtype; last, every CUDA-only place must have run on the fake."""

import ast
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tokenize

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import bench
import hellaswag
import sample
import train_gpt2
from benchmarks import gpu_check
from fake_gpu import GPUS, LINES_RUN, ROOT, SCANNED, faked
from helpers import free_port, read_log, refused_before_step_0, tiny_args, write_shard
from support.cli import UserError, run_cli
from support.out_of_memory import training_out_of_memory

# the tiny run every test here shares: val loss at 2 and 4, HellaSwag, a sample and a checkpoint at 4
EVALS = ("--max-steps", 4, "--ckpt-every", 2, "--eval-every", 2, "--hellaswag-every", 4, "--hellaswag-limit", 4)
EVALS += ("--sample-every", 4, "--num-samples", 1, "--max-new-tokens", 4)
RESULTS = ("step", "train_loss", "grad_norm", "loss_scale", "val_loss", "hellaswag", "samples")


def results(out):
    """What a run computed, record by record (the header, times and speeds left out)."""
    return [{k: r[k] for k in RESULTS if k in r} for r in read_log(out)[0] if "event" not in r]


def args_for(data, out, assets, *flags):
    return tiny_args(data, out, *EVALS, "--hellaswag-data", assets.hellaswag, *flags)


@pytest.fixture(scope="module")
def runs(data, assets, tmp_path_factory):
    """run(gpu or "cpu", *flags) -> (its folder, the FakeGPU or None): the tiny run, each made once."""
    made = {}

    def run(where, *flags):
        if (where, flags) not in made:
            out = tmp_path_factory.mktemp(where)
            device = ("--device", "cpu") if where == "cpu" else ("--device", "cuda", "--no-compile")
            with contextlib.nullcontext() if where == "cpu" else faked(where) as fake:
                assert train_gpt2.main(args_for(data, out, assets, *device, *flags)) == 0
            made[where, flags] = out, fake
        return made[where, flags]

    return run


@pytest.mark.parametrize("gpu, dtype", [("H100", "bfloat16"), ("A100 80GB", "bfloat16"), ("T4", "float16")])
def test_dtype_auto_picks_by_compute_capability_and_trains_as_the_cpu_does_in_it(runs, gpu, dtype):
    out, fake = runs(gpu)
    header = read_log(out)[0][0]
    major, minor = GPUS[gpu]["capability"]
    assert header["device"] == GPUS[gpu]["name"] and header["config"]["dtype"] == dtype
    assert header["config"]["dtype_reason"].startswith(f"auto: compute capability {major}.{minor}")
    # every loss, norm, fp16 loss scale, eval and sample is the CPU's in that dtype
    assert results(out) == results(runs("cpu", "--dtype", dtype)[0])
    steps = [r for r in read_log(out)[0] if "train_loss" in r]
    assert [r.get("loss_scale") for r in steps] == [65536.0 if dtype == "float16" else None] * 4
    assert all((r["mfu"] is not None) == (gpu != "T4") for r in steps)  # a T4 has no peak in the table
    # what it asked of the GPU: TF32 for fp32 matmuls, pinned batches, a wait before each step's clock
    assert fake.asked_for("set_float32_matmul_precision") == [("high",)]
    assert fake.asked_for("pin_memory") and fake.asked_for("synchronize") == [(0,)] * 4


def test_resume_on_a_gpu_goes_on_as_the_run_did(runs, fake_gpu, tmp_path):
    out, _ = runs("H100")
    fake_gpu("H100")
    args = ["--resume", out / "ckpt_000002.pt", "--out-dir", tmp_path / "resumed", "--device", "cuda", "--no-compile"]
    assert train_gpt2.main([str(a) for a in args]) == 0
    after_2 = [r for r in results(out) if r["step"] > 2 or (r["step"] == 2 and "train_loss" in r)]
    assert results(tmp_path / "resumed") == after_2  # step 2's evals are in its checkpoint already


def test_deterministic_on_a_gpu_sets_cudnn_cublas_and_attention(fake_gpu, data, tmp_path):
    fake = fake_gpu("H100")
    args = tiny_args(data, tmp_path / "out", "--device", "cuda", "--no-compile", "--deterministic", "--max-steps", 1)
    assert train_gpt2.main(args) == 0
    assert fake.switches() == {
        "matmul_precision": "high",
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "cudnn_sdp": False,
        "deterministic_algorithms": True,
        "inductor_deterministic": True,
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }
    assert fake.asked_for("enable_cudnn_sdp") == [(False,)]


def test_ddp_on_a_gpu_takes_its_local_rank_joins_over_nccl_and_trains_as_one_process(
    runs, fake_gpu, data, assets, tmp_path, monkeypatch
):
    """torchrun's environment for a world of 1 in this process (two ranks: test_bench_sections_on_a_gpu)."""
    env = dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    fake = fake_gpu("H100")
    assert train_gpt2.main(args_for(data, tmp_path / "ddp", assets, "--device", "cuda", "--no-compile")) == 0
    assert fake.asked_for("set_device") == [("cuda:0",)] and fake.asked_for("init_process_group") == [("nccl",)]
    assert fake.asked_for("DistributedDataParallel") == [([0],)]
    assert results(tmp_path / "ddp") == results(runs("H100")[0])


def test_hellaswag_script_on_a_gpu_scores_as_the_cpu_in_its_dtype(runs, fake_gpu, assets, capsys):
    argv = ["-m", str(runs("H100")[0]), "--limit", "8", "--data", str(assets.hellaswag)]
    capsys.readouterr()  # the run's own lines, when this test is the first to ask for it
    hellaswag.main([*argv, "-d", "cpu", "--dtype", "bfloat16"])
    on_cpu = capsys.readouterr().out
    fake_gpu("H100")
    hellaswag.main([*argv, "-d", "cuda"])  # --dtype auto: bf16 at 9.0
    assert capsys.readouterr().out == on_cpu and "8 examples, bfloat16" in on_cpu


def test_sample_py_on_a_gpu_prints_the_cpus_samples(runs, fake_gpu, capsys):
    argv = [str(runs("H100")[0]), "--num-samples", "2", "--max-new-tokens", "8"]
    capsys.readouterr()
    assert sample.main([*argv, "--device", "cpu"]) == 0
    on_cpu = capsys.readouterr().out
    fake_gpu("H100")
    assert sample.main([*argv, "--device", "cuda"]) == 0
    assert capsys.readouterr().out == on_cpu and on_cpu.count("sample ") == 2


def test_a_model_too_big_for_a_16_gb_gpu_is_refused_before_it_is_built(fake_gpu, data, tmp_path):
    fake_gpu("A4000")
    big = ("--n-layer", 48, "--n-head", 25, "--n-embd", 1600, "--block-size", 1024)  # 1.56B parameters: 23 GiB
    args = tiny_args(data, tmp_path / "out", "--device", "cuda", "--no-compile", *big)
    words = "more than the 16 GiB of the GPU's memory (NVIDIA RTX A4000): lower --n-layer or --n-embd"
    refused_before_step_0(args, tmp_path / "out", words)


@pytest.mark.parametrize("gpu, fits", [("RTX 3090", 16), ("A100", 32)])
def test_out_of_memory_names_the_B_the_gpu_fits(fake_gpu, tmp_path, capsys, gpu, fits):
    """The recipe's model at B 64 x T 1024 runs out in its first step: the -B for 90% of the GPU's memory."""
    (tmp_path / "data").mkdir()
    write_shard(tmp_path / "data" / "ids_train_000001.npy", np.arange(70_000) % 256)
    recipe = ("--n-layer", 12, "--n-head", 12, "--n-embd", 768, "--block-size", 1024)
    flags = "-B 64 -T 1024 --total-batch-size 65536 --max-steps 1"
    args = tiny_args(tmp_path / "data", tmp_path / "out", *flags.split(), *recipe, "--device", "cuda", "--no-compile")
    fake = fake_gpu(gpu)
    fake.out_of_memory(lambda func, args, kwargs: func is F.embedding)  # the forward's first op
    with pytest.raises(SystemExit) as e:  # run_cli as train_gpt2.py calls it, with its out-of-memory hook
        run_cli(lambda: train_gpt2.main([*args, "--eval-every", 0]), out_of_memory=training_out_of_memory)
    assert e.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: out of GPU memory in the first training step (-B 64 rows of -T 1024): lower -B (e.g. -B {fits}, "
        f"which this GPU's {GPUS[gpu]['memory'] / 2**30:.1f} GiB should fit, see docs/gpus.md: the total batch stays "
        f"65,536 tokens, accumulated over more micro-steps); no checkpoint was written yet: start the run again with "
        f"-B {fits} in a new --out-dir"
    ]


def test_bench_on_a_gpu_missing_from_the_peak_table_asks_for_peak_flops(fake_gpu, tmp_path):
    fake_gpu("A4000")
    with pytest.raises(UserError, match=r"no peak FLOP/s known for NVIDIA RTX A4000: pass --peak-flops"):
        bench.main(["--tiny", "--device", "cuda", "--only", "ceiling", "--out", str(tmp_path / "b.json")])


def test_the_fake_fails_where_a_gpu_would(fake_gpu):
    fake_gpu("T4")
    assert torch.cuda.is_available() and torch.cuda.device_count() == 1
    props = torch.cuda.get_device_properties("cuda")
    assert (props.name, props.major, props.minor, props.total_memory) == ("Tesla T4", 7, 5, GPUS["T4"]["memory"])
    assert torch.ones(2, device="cuda:0").device.type == "cpu"  # where the fake keeps it
    for wrong in (
        lambda: props.total_mem,  # AttributeError
        lambda: torch.cuda.get_device_properties(devce=0),  # TypeError
        lambda: torch.cuda.get_device_name("cuda:1"),  # one GPU: CUDA's invalid device ordinal
        lambda: torch.zeros(2, device="cuda:1"),
        lambda: torch.cuda.get_device_capability("cpu"),
        lambda: torch.set_float32_matmul_precision("hihg"),  # torch itself only warns
    ):
        with pytest.raises((AttributeError, TypeError, RuntimeError, ValueError)):
            wrong()


def test_nothing_of_the_fake_is_left_after_it():
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.deterministic, dict(os.environ)
    with faked("H100"):
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.deterministic = True
        assert torch.cuda.is_available() and os.environ["FAKE_GPU"] == "H100,1"
    assert not torch.cuda.is_available()
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.deterministic, dict(os.environ)) == before
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")  # "Torch not compiled with CUDA enabled"


@pytest.mark.slow
def test_bench_sections_on_a_gpu(fake_gpu, assets, tmp_path):
    """Each --tiny section on two faked GPUs (the DDP rung: torchrun); the train section's first forward runs
    out of GPU memory: it halves fp32's B."""
    fake = fake_gpu("H100", count=2)
    training = lambda func, args, kwargs: func is F.scaled_dot_product_attention and torch.is_grad_enabled()  # noqa: E731
    fake.out_of_memory(training, times=1)
    out = tmp_path / "bench.json"
    argv = ["--tiny", "--device", "cuda", "--out", str(out), "--only", "train,ceiling,sample,ladder,hellaswag"]
    report = bench.main([*argv, "--hellaswag-data", str(assets.hellaswag)])
    assert report["machine"]["device"] == GPUS["H100"]["name"] and not any("skipped" in s for s in report["sections"])
    assert report["sections"]["train"]["tiny"]["config"]["B"] == {"fp32": 1, "bf16": 2}
    ladder = {row["rung"]: row for row in report["sections"]["ladder"]["rungs"]}
    assert ladder["DDP"]["measured"] and ladder["DDP"]["ddp"]["processes"] == 2
    assert all(np.isfinite(ladder["DDP"]["ddp"]["losses"])) and report["sections"]["ladder"]["losses_agree"]
    assert "kv_cache_compiled" in report["sections"]["sample"]["tok_per_sec"]  # the CUDA-graph decode step, compiled
    assert {"reset_peak_memory_stats", "max_memory_allocated", "empty_cache"} <= {name for name, _ in fake.asked}


@pytest.mark.slow
def test_gpu_check_items_on_a_gpu(fake_gpu, tmp_path, monkeypatch):
    """bench.py --gpu-check --tiny --device cuda: every item runs (the CUDA tier's pytest without the fake)."""
    real = gpu_check.cuda_tier

    def cuda_tier(tmp, timeout):
        with pytest.MonkeyPatch.context() as m:
            m.delenv("FAKE_GPU")
            return real(tmp, timeout)

    monkeypatch.setattr(gpu_check, "cuda_tier", cuda_tier)
    fake_gpu("H100")
    bench.main(["--gpu-check", "--tiny", "--device", "cuda", "--out", str(tmp_path / "gpu.json")])
    report = json.loads((tmp_path / "gpu.json").read_text())
    items = ["cuda_tier", "recipe", "ladder_7_to_10", "ladder_1_to_6", "ladder_11_12"]
    assert [(i["name"], i["status"]) for i in report["items"]] == [(name, "done") for name in items]
    recipe = report["items"][1]["result"]
    assert recipe["recipe"]["device"] == GPUS["H100"]["name"] and recipe["float16"]["loss_scales"]
    assert recipe["recipe"]["peak_memory_gib"] == 0.0  # PEAK_WRAPPER read the fake's (zero) statistics


# --- every CUDA-only place runs under the fake ---------------------------------------------------------

CUDA_ONLY = re.compile(
    r"torch\.cuda\b|torch\.backends\.(cuda|cudnn)\b|\.cuda\(|pin_memory|nccl|startswith\([\"']cuda"
    r"|(==|!=)\s*[\"']cuda[\"']|[\"']cuda[\"']\s+(not )?in\b|autocast\([\"']cuda|device=[\"']cuda"
)

# What the fake cannot run (file, function or None, a regex its line matches): PEAK_WRAPPER, code a process
# runs as python -c (test_gpu_check_items_on_a_gpu asserts its peak); rung 7+, the 124M model, minutes a step
CANNOT = (
    ("benchmarks/gpu_check.py", None, r"torch\.cuda\.(is_initialized|max_memory_allocated)"),
    ("benchmarks/ladder.py", "rung_7_plus", r"torch\.cuda\.empty_cache"),
)


def code_lines(path):
    """{line number: (its function or None, its code)} of a Python file, comments and docstrings left out."""
    source = path.read_text()
    lines, docstrings, functions = source.splitlines(), set(), {}
    for node in ast.walk(ast.parse(source)):  # outer nodes first: a nested function's lines are its own
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node) is not None:
            docstrings.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
        if isinstance(node, ast.FunctionDef):
            functions.update(dict.fromkeys(range(node.lineno, node.end_lineno + 1), node.name))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines[token.start[0] - 1] = lines[token.start[0] - 1][: token.start[1]]
    return {i: (functions.get(i), line.strip()) for i, line in enumerate(lines, 1) if i not in docstrings}


def cuda_only_places():
    """[(path from ROOT, line number, code)] of every line of SCANNED that matches CUDA_ONLY, CANNOT's left out."""
    paths = sorted(p for pattern in SCANNED for p in ROOT.glob(pattern))
    places = [(str(p.relative_to(ROOT)), i, fn, code) for p in paths for i, (fn, code) in code_lines(p).items()]
    cannot = lambda f, fn, code: any(f == g and h in (None, fn) and re.search(r, code) for g, h, r in CANNOT)  # noqa: E731
    return [(f, i, code) for f, i, fn, code in places if CUDA_ONLY.search(code) and not cannot(f, fn, code)]


RAN = []  # the tests of this file that ran in this process (a pytest-xdist worker runs some of them)


@pytest.fixture(autouse=True)
def ran_here(request):
    yield
    RAN.append(request.node.nodeid)


@pytest.mark.slow
def test_every_cuda_only_place_runs_under_the_fake(request, tmp_path):
    """Last in this file: the lines its tests ran in this process, and those a pytest run of the others reports."""
    ran = list(RAN)
    lines = {(path, line) for path, line in LINES_RUN}
    left_out = ["--deselect", request.node.nodeid] + [a for nodeid in ran for a in ("--deselect", nodeid)]
    report = tmp_path / "lines"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fake_gpu.py", *left_out]
    child = subprocess.run(
        command, cwd=ROOT, env={**os.environ, "FAKE_GPU_LINES": str(report)}, capture_output=True, text=True
    )
    if report.exists():
        lines |= {(p, int(n)) for p, n in (line.rsplit(":", 1) for line in report.read_text().splitlines())}
    places = cuda_only_places()
    run = [(f, i) for f, i, _ in places if (str(ROOT / f), i) in lines]
    not_run = [f"{f}:{i}: {code}" for f, i, code in places if (f, i) not in run]
    assert not not_run, (
        "no test ran these CUDA-only lines on the fake GPU:\n" + "\n".join(not_run) + child.stdout[-3000:]
    )
    assert len(run) >= 60, f"{len(run)} of {len(places)} CUDA-only places ran on the fake GPU"

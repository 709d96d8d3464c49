"""
Every speed claim of this project, measured side by side in one run on one machine.

Shared machines drift: absolute times move, ratios taken back to back hold. So each benchmark
runs its contenders interleaved (A B A B ...), drops the warm-up rounds, and reports medians with
min-max; a ratio is the ratio of the medians, with the min-max of the per-round (paired) ratios.
On a CPU, from the train section on, glibc's malloc keeps freed memory, as training and
hellaswag.py run there (support.device.keep_freed_memory); the sections before it (sample among them,
as sample.py runs) have glibc's default.

  ceiling    fp32 and bf16 GFLOP/s of a large square torch.mm: what this device can do with the
             kernels torch uses (on a CPU also fp32 through oneDNN, for reference: torch.mm and
             nn.Linear call MKL for fp32, which on AMD CPUs reaches about half of oneDNN's speed)
  train      one training step (forward, backward, clip, AdamW step) of train_gpt2.GPT with
             GPT.configure_optimizers, against transformers' GPT2LMHeadModel (sdpa attention, plain
             torch AdamW) with the same config, batch, precision and data (train_gpt2's loader feeds
             both the same micro-batches); on a CPU first that setting itself: glibc's malloc
             keeping freed memory (support.device.keep_freed_memory) against its default.
             Configs small (6 layers, 384 wide, T 256, B 8) and gpt2 (124M, T 1024, B 1 on CPU;
             on a GPU the recipe's 64 where memory allows, else 32, 16, ... per precision); fp32
             and bf16 autocast; eager and torch.compile (compile time: cold, from an empty
             inductor cache). MFU: against the matmul ceiling measured in the same rounds on a
             CPU, against the datasheet peak (support.gpu.PEAK_FLOPS, --peak-flops) on a GPU
  ladder     build-nanogpt's speed-up ladder, one change per rung (fp32, TF32, bf16 autocast,
             torch.compile, flash attention, vocab padded to 50,304, fused AdamW with parameter
             groups), then this project's rungs 8-12 (chunked LM-head loss, a larger micro-batch;
             on CUDA only: cuDNN attention, max-autotune, CUDA graphs): train_gpt2's training step
             from the same weights on the same batches, the rungs interleaved, their losses checked
             to agree; on CUDA the 124M model at B 16, T 1024 (and the recipe's B 64), elsewhere
             the small config; the DDP rung runs train_gpt2.py under torchrun when 2 or more GPUs
             are visible. ladder.png goes beside the JSON
  loader     DataLoaderLite.next_batch through 100M-token shards (written to a temporary folder):
             microseconds per batch, at the shard switches, and the memory it adds; the data
             identity check every start makes (100 sparse 100M-token shards; real shards read cold)
             and a start's whole data check on them: token ids from fineweb.py's manifest against
             reading every shard
  fineweb    fineweb.py's tokenizer pool against tiktoken's encode_ordinary_batch, same documents
             and the same number of workers
  hellaswag  hellaswag.evaluate (what training calls) and the whole `python hellaswag.py` process
             against a plain in-process loop of one (context + ending) row per forward, on the first
             N examples with a random 6-layer, 384-wide model in fp32 (the same counts asserted);
             on CUDA also the full set with a random 124M model in bf16 (in-loop and process)
  sample     support.sampling.generate with the KV cache against recomputing the whole prefix,
             256 new tokens; on CUDA also the compiled (CUDA-graph) decode step

Usage:
    python bench.py                  # everything: ~17 min on 2 idle CPU cores; table on stdout, JSON to bench.json
    python bench.py --quick          # small models, eager only, fewer rounds: 3 min on 2 cores at load 2
    python bench.py --only train --configs gpt2 --out gpt2.json     # one section, one config
    python bench.py --only ladder    # the speed-up ladder: table, bench.json and ladder.png (~4 min on 2 CPU cores)
    python bench.py --device cuda    # on a GPU (the recipe's B 64 at the gpt2 config where memory allows)
    python bench.py --tiny           # seconds: every section on toy sizes (the smoke test runs this)
    python bench.py --gpu-check --budget-s 480 --out docs/gpu/h100.json   # a GPU spell: see docs/gpus.md
FineWeb documents and HellaSwag data come from --docs / --hellaswag-data, else from shared/data
beside the repository when it is there.

What a run writes and what it runs is settled before anything is measured. --out names a new file,
or one an earlier bench.py wrote, in a folder this process can write; ladder.png goes beside it;
nothing else is written outside a temporary folder. The default run measures every section this
machine has the data for, and ends with a line for each one it skipped and why (exit 0). A section
named with --only that cannot run (no data), a --docs or --hellaswag-data that names no data, an
--out that cannot be written, and a run that compiles where torch.compile does not work (pass
--no-compile) are each one `error:` line before anything is measured (exit 1). Parts of a section
this machine cannot run (ladder rungs that need CUDA or 2 GPUs, wandb logging without wandb) are
noted in the table and the JSON, not errors.
"""

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, not a traceback from inside an import
    signal.signal(signal.SIGINT, lambda signum, frame: (print("interrupted", file=sys.stderr), os._exit(130)))

import argparse
import gc
import json
import math
import platform
import re
import subprocess
import tempfile
import time
from importlib import metadata

import torch

from benchmarks.ceiling import bench_ceiling
from benchmarks.gpu_check import DEFAULT_BUDGET_S, GpuCheck, run_gpu_check, write_report
from benchmarks.hellaswag_eval import bench_hellaswag, find_hellaswag_data
from benchmarks.ladder import bench_ladder
from benchmarks.loader import bench_loader
from benchmarks.report import missed, table
from benchmarks.sample import bench_sample
from benchmarks.settings import ROOT, TRAIN_CONFIGS, find_shared_data, settings
from benchmarks.timing import log
from benchmarks.tokenizer import bench_fineweb, find_documents
from benchmarks.train import bench_train
from support.cli import ArgumentParser, UserError, run_cli
from support.device import keep_freed_memory, pick_device
from support.files import check_folder, write_atomic
from support.gpu import peak_flops

# sample comes before train: from train on, glibc's malloc keeps freed memory (see the docstring)
SECTIONS = ("ceiling", "loader", "fineweb", "sample", "train", "ladder", "hellaswag")


def machine(device, device_type):
    cpu = platform.processor() or platform.machine()
    try:
        info = {k.strip(): v for k, v in (line.split(":", 1) for line in open("/proc/cpuinfo") if ":" in line)}
        cpu = f"{info['model name'].strip()} (family {info['cpu family'].strip()}, model {info['model'].strip()})"
    except (OSError, KeyError):
        pass
    return {
        "device": torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu",
        "cpu": cpu,
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": metadata.version("transformers"),  # from its metadata: importing it takes half a second
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def parse_args(argv=None):
    p = ArgumentParser(prog="bench.py", description=__doc__)
    p.add_argument(
        "--quick",
        action="store_true",
        help="small models, eager only, fewer rounds (3.0 min on 2 CPU cores at load 2.1; far longer where other "
        "processes keep the cores busy: small ops wait for them)",
    )
    p.add_argument("--tiny", action="store_true", help="toy sizes everywhere: a smoke run of seconds")
    p.add_argument("--only", default=None, help=f"comma-separated sections to run: {','.join(SECTIONS)}")
    p.add_argument(
        "--configs", default=None, help=f"training configs to run, comma-separated: {','.join(TRAIN_CONFIGS)}"
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time torch.compile (default: on in the full run)",
    )
    p.add_argument("--device", default=None, help="cuda, cuda:N, mps or cpu (default: the best available)")
    p.add_argument(
        "--peak-flops", type=float, default=None, help="the GPU's peak FLOP/s for MFU (default: train_gpt2's table)"
    )
    p.add_argument(
        "--docs", default=None, help="documents for the fineweb benchmark (.parquet/.jsonl/.txt files or a glob)"
    )
    p.add_argument("--text-field", default="text", help="their text column")
    p.add_argument(
        "--hellaswag-data", default=None, help="a HellaSwag jsonl (default: shared/data, else hellaswag.py's cache)"
    )
    p.add_argument("--out", default="bench.json", help="the JSON results (default bench.json)")
    p.add_argument(
        "--gpu-check",
        action="store_true",
        help="the GPU path in one short spell instead of the sections: the CUDA tier, the recipe, the ladder "
        "(benchmarks/gpu_check.py); its JSON rewritten after each item",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="--gpu-check: seconds it may take; an item whose estimate does not fit is skipped "
        f"(default {DEFAULT_BUDGET_S:g})",
    )
    args = p.parse_args(argv)
    if args.budget_s is not None and not args.gpu_check:
        raise UserError("--budget-s is the time of --gpu-check: pass --gpu-check too, or leave --budget-s out")
    if args.budget_s is not None and not (args.budget_s > 0 and math.isfinite(args.budget_s)):
        raise UserError(f"--budget-s {args.budget_s:g}: pass a number of seconds above 0, e.g. --budget-s 480")
    if args.gpu_check:
        for flag, given in (("--only", args.only), ("--configs", args.configs), ("--quick", args.quick or None)):
            if given is not None:
                raise UserError(f"--gpu-check runs its own items: leave {flag} out (or run without --gpu-check)")
        args.budget_s = args.budget_s or DEFAULT_BUDGET_S
    args.named = args.only is not None  # sections asked for by name: each must run
    args.only = named_list("--only", args.only, SECTIONS, "section", "run them all") or list(SECTIONS)
    args.configs = named_list("--configs", args.configs, tuple(TRAIN_CONFIGS), "config", "use the run size's own")
    if args.tiny and args.quick:
        raise UserError("--tiny and --quick are two sizes of run: pass one")
    return args


def named_list(flag, value, choices, what, default):
    """The names a comma-separated flag gives (spaces around them ignored), each one of choices; None
    when the flag is left out. An empty name (--only '', a stray comma) is refused, not read as no
    choice at all: --only '' would otherwise run every section, the opposite of what it says."""
    if value is None:
        return None
    names = [name.strip() for name in value.split(",")]
    if "" in names:
        raise UserError(
            f"{flag} {value!r} names an empty {what}: pass names separated by commas from {','.join(choices)} "
            f"(e.g. {flag} {','.join(choices[:2])}), or leave {flag} out to {default}"
        )
    for name in names:
        if name not in choices:
            raise UserError(f"{flag} {name}: unknown {what}, choose from {', '.join(choices)}")
    return names


def is_bench_report(path):
    """Whether path is a file an earlier bench.py wrote: JSON whose first key is its command."""
    try:
        with open(path, "rb") as f:
            head = f.read(200)
    except OSError:
        return False
    return re.match(rb'\{\s*"command":\s*"python bench\.py', head) is not None


def check_out(out, ladder):
    """Where the results will go, checked before anything is measured (a run can take an hour of a
    rented GPU): a file in a folder this process can write, replacing only what an earlier
    bench.py wrote, and with the ladder a ladder.png beside it that can be. -> ladder.png's path."""
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise UserError(f"--out {out} is a folder: name the JSON file, e.g. --out {os.path.join(out, 'bench.json')}")
    if not os.path.basename(out):  # '' or a path that ends in a separator
        raise UserError(f"--out {out!r} names no file: name the JSON file, e.g. --out bench.json")
    if not os.path.isdir(folder):
        check_folder(folder, f"--out {out}:")  # a file where the folder goes
        raise UserError(f"--out {out}: folder {folder} does not exist")
    if os.path.lexists(out) and not (os.path.isfile(out) and is_bench_report(out)):
        raise UserError(f"--out {out}: a file bench.py did not write is there: pass another --out")
    png = os.path.join(folder, "ladder.png")
    if ladder and os.path.lexists(png) and not os.path.isfile(png):
        raise UserError(f"--out {out}: the ladder draws {png}, and something else is there: pass another --out")
    try:
        fd, probe = tempfile.mkstemp(prefix=".bench_", suffix=".tmp", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UserError(
            f"--out {out}: cannot write in {folder} ({e.strerror}): pass an --out in a writable folder"
        ) from None
    return png


def plan(args, shared):
    """The data of the sections that read some, found before anything is measured. -> ({section: its
    data}, {section: why it cannot run here}). A section named with --only that cannot run is a
    UserError; the default run skips it and says so at the end."""
    find = {
        "fineweb": lambda: find_documents(args.docs, args.text_field, shared),
        "hellaswag": lambda: find_hellaswag_data(args.hellaswag_data, shared),
    }
    data, skipped = {}, {}
    for section in args.only:
        if section in find:
            data[section], why = find[section]()
            if why:
                skipped[section] = why
    if skipped and args.named:
        raise UserError("; ".join(f"--only {section}: {why}" for section, why in skipped.items()))
    return data, skipped


def compile_problem_apart(device, tmp):
    """support.device.compile_problem(device) (why torch.compile does not work on it, or None),
    asked in a process of its own with its inductor cache in tmp: this process's first compile
    (the train section times it) stays a first one."""
    code = "import sys; from support.device import compile_problem; print(compile_problem(sys.argv[1]) or '')"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "compile_probe")}
    r = subprocess.run([sys.executable, "-c", code, str(device)], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:  # the check itself failed: its last line says how
        return (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
    return (r.stdout.strip().splitlines() or [None])[-1]


def skipped_parts(report):
    """{what: why} for every section, and every part of one, that the run skipped."""
    out = {}
    for section, result in report["sections"].items():
        if "skipped" in result:
            out[section] = result["skipped"]
        for part, r in result.items():
            if isinstance(r, dict) and "skipped" in r:
                out[f"{section} ({part.replace('_', ' ')})"] = r["skipped"]
    return out


def commit():
    """The checkout's commit (with "+changes" where tracked files differ from it), or None without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(  # tracked files only: the JSON this run writes may lie in the checkout
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def gpu_check(args, argv, s, device, device_type, started):
    """--gpu-check: the items of benchmarks/gpu_check.py within --budget-s, the JSON (and ladder.png
    beside it) rewritten after each, so that a spell cut short keeps what it measured. --budget-s
    counts from started, main's start: the compile check before the items is in it."""
    if device_type != "cuda" and not args.tiny:
        raise UserError(
            f"--gpu-check on {device_type} runs a GPU's sizes (the 124M model at B 64): pass --tiny for toy sizes"
        )
    png = check_out(args.out, ladder=True)
    report = {
        "command": " ".join(["python", "bench.py", *(sys.argv[1:] if argv is None else argv)]),
        "mode": "gpu-check" + (" tiny" if args.tiny else ""),
        "machine": machine(device, device_type),
        "commit": commit(),
    }

    with tempfile.TemporaryDirectory(prefix="bench_gpu_check_") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor_cache")  # first compiles, timed
        if True in s["compile"]:
            why = compile_problem_apart(device, tmp)
            if why:
                raise UserError(f"torch.compile does not work on this {device_type} ({why}): pass --no-compile")
        check = GpuCheck(s, device, device_type, args.tiny, tmp, png, args.peak_flops)
        run_gpu_check(check, report, args.budget_s, lambda r: write_report(args.out, r), started)
    for item in report["items"]:
        why = item.get("why") or item.get("error") or ""
        summary = item.get("result", {}).get("summary")  # the CUDA tier's tests: {outcome: count}
        counts = ", ".join(f"{n} {outcome}" for outcome, n in summary.items()) if summary else ""
        print(f"{item['name']}: {item['status']}" + (f" ({why or counts})" if why or counts else ""))
    if "ladder" in report:
        print(f"\n{report['ladder']['table']}")
        if report["ladder"]["headline"]:
            print(f"\n{report['ladder']['headline']['text']}")
    print(f"\nwrote {args.out}")
    if any(item["status"] == "failed" for item in report["items"]):
        return 1
    return report


def main(argv=None):
    started = time.monotonic()
    args = parse_args(argv)
    shared = find_shared_data()
    s = settings(args)
    device, device_type = pick_device(args.device)
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # as train_gpt2 does: TF32 for fp32 matmuls
    peak = args.peak_flops or (peak_flops(torch.cuda.get_device_name(device)) if device_type == "cuda" else None)
    if device_type == "cuda" and peak is None:
        raise UserError(f"no peak FLOP/s known for {torch.cuda.get_device_name(device)}: pass --peak-flops")
    if args.gpu_check:
        return gpu_check(args, argv, s, device, device_type, started)
    png = check_out(args.out, "ladder" in args.only)
    data, skipped = plan(args, shared)

    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    report = {
        "command": " ".join(["python", "bench.py", *(sys.argv[1:] if argv is None else argv)]),
        "mode": mode,
        "machine": machine(device, device_type),
        "settings": s,
        "sections": {},
        "rows": [],
    }
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        # an empty inductor cache: the compile times are those of a first compile, not of a cache hit
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor_cache")
        if True in s["compile"] and {"train", "ladder"} & set(args.only):
            why = compile_problem_apart(device, tmp)
            if why:
                raise UserError(f"torch.compile does not work on this {device_type} ({why}): pass --no-compile")
        load, cores = report["machine"]["load_average_at_start"], report["machine"]["cpu_cores"]
        if load and load[0] > cores:  # torch's threads then wait for cores: small ops slow down the most
            log(f"note: load average {load[0]:.1f} on {cores} cores: other processes share them; the run takes longer")
        for section in SECTIONS:
            if section not in args.only:
                continue
            log(f"{section} ...")
            t0 = time.time()
            if section in skipped:
                result, rows = {"skipped": skipped[section]}, []
            elif section == "ceiling":
                result, rows = bench_ceiling(s, device, device_type)
            elif section == "loader":
                result, rows = bench_loader(s, device_type, tmp)
            elif section == "fineweb":
                result, rows = bench_fineweb(s, data["fineweb"], args.text_field)
            elif section == "train":
                result, rows = bench_train(s, device, device_type, peak, tmp)
            elif section == "ladder":
                device_name = report["machine"]["device" if device_type == "cuda" else "cpu"]
                result, rows = bench_ladder(s, device, device_type, device_name, tmp, png)
            elif section == "hellaswag":
                if device_type == "cpu":  # as hellaswag.py and training evaluate there (also with --only)
                    keep_freed_memory()
                result, rows = bench_hellaswag(s, data["hellaswag"], device, device_type, tmp)
            else:
                result, rows = bench_sample(s, device, device_type)
            result["seconds"] = time.time() - t0
            if "skipped" in result:
                log(f"  skipped {section}: {result['skipped']}")
            report["sections"][section] = result
            report["rows"] += rows
            gc.collect()
    report["seconds"] = time.time() - t_start
    report["machine"]["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    report["table"] = table(report["rows"])
    write_atomic(args.out, lambda f: f.write((json.dumps(report, indent=1) + "\n").encode()))
    m = report["machine"]
    load = (
        ", load average {:.1f} at the start".format(m["load_average_at_start"][0]) if m["load_average_at_start"] else ""
    )
    print(
        f"`{report['command']}` ({mode}) on {m['device']}, {m['cpu']}, {m['cpu_cores']} cores, "
        f"{m['torch_threads']} torch threads, torch {m['torch']}, transformers {m['transformers']}: "
        f"{report['seconds'] / 60:.1f} min{load}"
    )
    if report["rows"]:
        print()
        print(report["table"])
        if missed(report["rows"]):
            print("\nA **no** is a target this machine did not meet; what each one means here:")
            print("\n".join(missed(report["rows"])))
    if "ladder" in report["sections"]:
        ladder = report["sections"]["ladder"]
        print(f"\nspeed-up ladder on {ladder['device']}, {ladder['config_text']}:\n")
        print(ladder["table"])
        print(f"\n{ladder['headline']['text']}")
        if ladder["png"]:
            print(f"wrote {os.path.relpath(ladder['png'])}")
    for what, why in skipped_parts(report).items():
        print(f"\n{what}: skipped ({why})")
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    run_cli(main)

"""bench.py --gpu-check: the GPU path checked in one short spell, item by item within a time
budget, its JSON (and ladder.png) rewritten after every item so that a spell cut short keeps what
it measured.

The items, in order: the CUDA tier (tests/test_cuda.py under pytest, each test's outcome); the
recipe (train_gpt2.py itself at its defaults for a few steps, then with --dtype float16); the
ladder's rungs 7, 7+, 8, 9 and 10 (the headline); rungs 1-6; rungs 11-12 (max-autotune). An item
starts only if its estimate fits the time left of --budget-s; one that does not is listed as
skipped, with why. Every token it trains on is random (a shard it writes to a temporary folder):
the numbers are speeds and loss checks, not learning."""

import gc
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from benchmarks.ladder import (
    LADDER_REFERENCE,
    ladder_png,
    ladder_result,
    ladder_setup,
    measure_rungs,
    rung_7_plus,
    rung_rows,
)
from benchmarks.settings import ROOT
from benchmarks.timing import log, stats
from support.files import write_atomic
from support.shards import shard_path, write_shard

DEFAULT_BUDGET_S = 480.0  # a 15-minute spell less the machine's start (2-4 min) and a margin
DATA_NOTE = "random token ids (uniform over GPT-2's 50,257), written by this run: speed and loss checks only"

# What an item takes, guessed before this run has timed anything: on CUDA for the 124M model, on
# the conservative side (a default torch.compile of its step: about 30 s on an H100), and for --tiny
GUESS = {
    "cuda": dict(cuda_tier_s=240.0, start_s=30.0, compile_s=60.0, recipe_step_s=2.5, step_scale=1.0),
    "tiny": dict(cuda_tier_s=60.0, start_s=10.0, compile_s=30.0, recipe_step_s=0.5, step_scale=0.005),
}
AUTOTUNE_FACTOR = 7  # a max-autotune compile over a default one (207 s against about 30 s on an H100)
LADDER_ROUNDS_CUDA = (2, 5)  # warm-up (the first one compiles) and measured rounds of each ladder item

# The ladder's items: (name, what, its rungs, whether rung 7+ (the recipe's B 64) runs with them,
# compiles per compiled rung in the estimate)
LADDER_ITEMS = (
    (
        "ladder_7_to_10",
        "the ladder's rungs 7, 7+ (B 64), 8, 9 and 10, loss-checked against rung 7",
        (7, 8, 9, 10),
        True,
        1,
    ),
    ("ladder_1_to_6", "the ladder's rungs 1-6", (1, 2, 3, 4, 5, 6), False, 1),
    ("ladder_11_12", "the ladder's rungs 11-12 (max-autotune)", (11, 12), False, AUTOTUNE_FACTOR),
)


@dataclass
class Item:
    name: str
    what: str
    estimate: Callable[[], tuple]  # -> (seconds, how the estimate was made)
    run: Callable[[], dict]  # -> its result; {"failed": True, ...} where it ran and something failed
    not_here: Callable[[], str] = lambda: None  # why it cannot run on this device, or None


def run_items(items, report, budget_s, write, clock=time.monotonic, started=None):
    """Run items in order, each only if its estimate fits what is left of budget_s (counted from
    started, a clock() reading; None: now); after every item
    (run, skipped, failed or not for this device) its entry goes into report["items"], its name
    leaves report["to_do"], and write(report) saves it. A failing item is recorded with its error
    and the next one runs. -> report."""
    t0 = clock() if started is None else started
    report["budget_s"] = budget_s
    report["items"], report["to_do"] = [], [item.name for item in items]
    write(report)
    for item in items:
        left = budget_s - (clock() - t0)
        entry = {"name": item.name, "what": item.what}
        why = item.not_here()
        if why:
            entry.update(status="not run on this device", why=why)
            log(f"{item.name}: not run on this device ({why})")
            estimate = None
        else:
            estimate, how = item.estimate()
            entry.update(estimate_s=estimate, estimate_from=how, left_s=left)
        if estimate is None:
            pass
        elif estimate > left:
            entry.update(
                status="skipped",
                why=f"its estimate, {estimate:.0f} s ({how}), is more than the {max(left, 0):.0f} s left "
                f"of --budget-s {budget_s:g}",
            )
            log(f"{item.name}: skipped ({entry['why']})")
        else:
            log(f"{item.name}: {item.what} (estimate {estimate:.0f} s, {left:.0f} s left) ...")
            t = clock()
            try:
                entry["result"] = item.run()
                entry["status"] = "failed" if entry["result"].get("failed") else "done"
            except Exception as e:  # recorded, and the spell goes on to the next item
                entry.update(
                    status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:]
                )
            entry["seconds"] = clock() - t
            log(f"{item.name}: {entry['status']} in {entry['seconds']:.0f} s")
        report["items"].append(entry)
        report["to_do"].remove(item.name)
        report["seconds"] = clock() - t0
        write(report)
    return report


def write_report(path, report):
    """The report as JSON at path, atomically: a reader, or a machine taken back mid-write, sees the
    whole previous report or the whole new one."""
    write_atomic(path, lambda f: f.write((json.dumps(report, indent=1) + "\n").encode()))


# Each child runs under this watcher, which reads a pipe whose other end only bench.py holds: when
# bench.py ends in any way, kill -9 included, the pipe closes and the watcher ends the child and all
# it started (their session; where os.killpg is missing, as on Windows, the child alone).
WATCHER = """\
import os, signal, subprocess, sys, threading
child = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
def end_with_bench():
    while os.read(0, 1):  # b"": the pipe's other end is closed
        pass
    if hasattr(os, "killpg"):
        os.killpg(0, signal.SIGKILL)
    child.kill()
    os._exit(1)
threading.Thread(target=end_with_bench, daemon=True).start()
code = child.wait()
sys.exit(code if code >= 0 else 128 - code)  # a child killed by signal N: 128 + N, as a shell says it
"""


def run_killable(cmd, timeout, env=None):
    """(returncode or None when it ran past timeout, stdout, stderr) of cmd in a session of its own,
    under WATCHER, so that a timeout, Ctrl-C here or this process killed ends its children too
    (pytest's and train_gpt2.py's own)."""
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", WATCHER, *[str(c) for c in cmd]],
            cwd=ROOT,
            env=env,
            stdin=read_end,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    finally:
        os.close(read_end)

    def kill():
        os.close(write_end)  # the watcher ends the child, on every platform
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()

    try:
        out, err = proc.communicate(timeout=timeout)
        os.close(write_end)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill()
        out, err = proc.communicate()
        return None, out, err
    except BaseException:  # Ctrl-C reaches this process only (the child has a session of its own)
        kill()
        raise


# ----------------------------------------------------------------------------------------------
# item 1: the CUDA tier

VERBOSE_LINE = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", re.M)


def junit_tests(path):
    """{test: {"outcome", "seconds", "message"}} from pytest's --junitxml file."""
    tests = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name')}"
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (child.get("message") or "")[:500]
                if tag != "skipped":
                    message += "\n" + (child.text or "")[-2000:]
                break
        tests[name] = {"outcome": outcome, "seconds": float(case.get("time", 0)), "message": message}
    return tests


def cuda_tier(tmp, timeout):
    """tests/test_cuda.py under pytest in a process of its own: each test's outcome and seconds."""
    xml = os.path.join(tmp, "cuda_tier.xml")
    cmd = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    # its compiles in a cache of their own: the ones this run times after it stay first compiles
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "cuda_tier_inductor")
    rc, out, err = run_killable(cmd, timeout, env)
    result = {"command": " ".join(cmd[1:4]), "returncode": rc}
    if rc is not None and os.path.exists(xml):
        result["tests"] = junit_tests(xml)
    else:  # cut off at the budget, or pytest stopped before its report: the outcomes it printed so far
        if rc is None:
            result["timed_out_after_s"] = timeout
        result["tests"] = {name: {"outcome": o.lower(), "seconds": None} for name, o in VERBOSE_LINE.findall(out)}
    outcomes = [t["outcome"] for t in result["tests"].values()]
    result["summary"] = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    result["failed"] = rc not in (0, 5) or any(o in ("failed", "error") for o in outcomes)  # 5: none collected
    if result["failed"]:
        result["output_tail"] = (out + err)[-3000:]
    return result


# ----------------------------------------------------------------------------------------------
# item 2: the recipe, train_gpt2.py itself

# train_gpt2.py run as itself (as __main__), with the peak GPU memory its process allocated written
# to a file at exit: its log.jsonl has no such field
PEAK_WRAPPER = """\
import atexit, json, runpy, sys
import torch
out = sys.argv.pop(1)
def peak():
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with open(out, "w") as f:
        json.dump({"peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None}, f)
atexit.register(peak)
sys.argv[0] = "train_gpt2.py"
runpy.run_path("train_gpt2.py", run_name="__main__")
"""

TINY_MODEL = ["--n-layer", 2, "--n-head", 2, "--n-embd", 64, "--block-size", 32, "-B", 2, "-T", 32]


def recipe_shard(tmp, tokens):
    """A folder with a val and a train shard of random token ids, for train_gpt2.py."""
    data_dir = os.path.join(tmp, "recipe_data")
    os.makedirs(data_dir, exist_ok=True)
    ids = np.random.default_rng(2).integers(0, 50257, tokens + 100_000, dtype=np.uint16)
    write_shard(shard_path(data_dir, "gpucheck", 0), ids[:100_000])
    write_shard(shard_path(data_dir, "gpucheck", 1), ids[100_000:])
    return data_dir


def train_run(data_dir, out_dir, steps, device, tiny, compile_on, dtype, timeout, peak_flops=None):
    """train_gpt2.py for `steps` steps (the recipe's model and batch, or toy ones with tiny), read
    back from its log.jsonl: tok/s and MFU (median of the steps after the first quarter, and at
    least 2, which compile and warm up), step 0's time, the compile time it holds (step 0 over a
    later step), losses, loss scales, peak GPU memory."""
    peak_file = os.path.join(os.path.dirname(out_dir), os.path.basename(out_dir) + "_peak.json")
    args = ["--data-dir", data_dir, "--out-dir", out_dir, "--device", device, "--max-steps", steps]
    args += ["--eval-every", 0, "--hellaswag-every", 0, "--sample-every", 0, "--ckpt-every", 0, "--keep-ckpts", 1]
    args += ["--compile" if compile_on else "--no-compile", "--dtype", dtype]
    if peak_flops:
        args += ["--peak-flops", peak_flops]
    if tiny:
        args += [*TINY_MODEL, "--total-batch-size", 128, "--warmup-steps", 1]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    rc, out, err = run_killable([sys.executable, "-c", PEAK_WRAPPER, peak_file, *args], timeout, env)
    result = {"command": "python train_gpt2.py " + " ".join(map(str, args)), "returncode": rc}
    if rc != 0:
        result.update(failed=True, output_tail=(out + err)[-3000:])
        if rc is None:
            result["timed_out_after_s"] = timeout
        return result
    records = [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl"))]
    header = next(r for r in records if r.get("event") == "header")
    steps_run = [r for r in records if "train_loss" in r]
    skip = max(2, len(steps_run) // 4)
    dt = [r["dt_ms"] for r in steps_run]
    losses = [r["train_loss"] for r in steps_run]
    losses = [float(x) if isinstance(x, str) else x for x in losses]  # "NaN" / "Infinity" as log.jsonl spells them
    mfu = [r["mfu"] for r in steps_run[skip:] if r["mfu"] is not None]
    with open(peak_file) as f:
        peak = json.load(f)["peak_memory_bytes"]
    result.update(
        device=header["device"],
        dtype=header["config"]["dtype"],
        compile=header["config"]["compile"],
        B=header["config"]["batch_size"],
        T=header["config"]["seq_len"],
        total_batch_size=header["config"]["total_batch_size"],
        grad_accum_steps=header["config"]["grad_accum_steps"],
        steps=len(steps_run),
        steps_dropped=skip,
        tok_per_sec=stats([r["tok_per_sec"] for r in steps_run[skip:]]) if len(steps_run) > skip else None,
        mfu=stats(mfu) if mfu else None,
        step0_ms=dt[0] if dt else None,
        compile_s=(dt[0] - statistics.median(dt[skip:])) / 1e3 if compile_on and len(dt) > skip else None,
        losses=losses,
        losses_finite=bool(losses) and all(math.isfinite(x) for x in losses),
        loss_scales=[r["loss_scale"] for r in steps_run if "loss_scale" in r] or None,
        peak_memory_gib=peak / 2**30 if peak is not None else None,
    )
    result["failed"] = not result["losses_finite"] or len(steps_run) != steps
    return result


# ----------------------------------------------------------------------------------------------
# the check: its items, their estimates, the report after each


class GpuCheck:
    """One --gpu-check run: the items, what they share (the time of the first compile timed, the
    ladder's setup and measured rungs), and the report each item adds to."""

    def __init__(self, s, device, device_type, tiny, tmp, png, peak_flops=None):
        self.peak_flops = peak_flops
        self.s, self.device, self.device_type, self.tiny, self.tmp, self.png = s, device, device_type, tiny, tmp, png
        self.compile_on = True in s["compile"]
        self.guess = GUESS["tiny" if tiny else "cuda"]
        self.compile_s, self.compile_from = None, None  # the first compile this run timed
        self.step_scale = None  # rung 7's step here over the A100 reference's, once measured
        self.setup, self.measured, self.rung_7_plus = None, {}, None
        warmup, rounds = s["ladder_rounds"] if tiny else LADDER_ROUNDS_CUDA
        self.rounds = (warmup, rounds)

    # --- estimates ---
    def compile_estimate(self):
        if not self.compile_on:
            return 0.0, "compile off"
        if self.compile_s is not None:
            return self.compile_s, f"{self.compile_s:.0f} s a compile, timed in {self.compile_from}"
        return self.guess["compile_s"], f"{self.guess['compile_s']:.0f} s a compile, a default until one is timed"

    def timed_compile(self, seconds, where):
        if self.compile_on and self.compile_s is None and seconds is not None:
            self.compile_s, self.compile_from = max(seconds, 0.0), where

    def estimate_cuda_tier(self):
        return self.guess["cuda_tier_s"], "a fixed guess: tests/test_cuda.py takes about 3 min on one H100"

    def recipe_steps(self):
        return (6, 3) if self.tiny else (20, 5)

    def estimate_recipe(self):
        c, how = self.compile_estimate()
        steps = sum(self.recipe_steps())
        est = 2 * (self.guess["start_s"] + c) + steps * self.guess["recipe_step_s"]
        return est, f"2 starts of {self.guess['start_s']:.0f} s, {steps} steps, {how}"

    def estimate_ladder(self, rungs, compiles_each=1, plus=False):
        c, how = self.compile_estimate()
        accum = self.setup["accum"] if self.setup else (2 if self.tiny else 8)
        scale = self.step_scale or self.guess["step_scale"]
        n = sum(self.rounds)
        step_s = sum(LADDER_REFERENCE.get(r, (None, 90.0))[1] / 1e3 * accum * scale for r in rungs)
        compiles = sum(r >= 4 for r in rungs) * compiles_each
        if plus:  # rung 7 at B 16 and at B 64, one micro-batch each: 5 B 16 steps a round
            step_s += 5 * 0.09 * scale
            compiles += 2
        est = (0 if self.setup else self.guess["start_s"]) + n * step_s + compiles * c
        scaled = "rung 7's step here" if self.step_scale else "the A100 reference's steps"
        return est, f"{compiles} compiles x {c:.0f} s ({how}), {n} rounds from {scaled}"

    # --- items ---
    def run_cuda_tier(self):
        if self.device_type != "cuda":  # pytest's own outcome: every test skipped, with its reason
            log("  the CUDA tier on a machine without CUDA: pytest reports its tests as skipped")
        return cuda_tier(self.tmp, timeout=self.time_left())

    def run_recipe(self):
        steps, fp16_steps = self.recipe_steps()
        data_dir = recipe_shard(self.tmp, 2_000_000 if not self.tiny else 50_000)
        dtype = "bfloat16" if self.tiny or self.device_type != "cuda" else "auto"  # auto: bf16 on sm80+
        result = {"data": DATA_NOTE}
        result["recipe"] = train_run(
            data_dir, os.path.join(self.tmp, "recipe"), steps, str(self.device), self.tiny, self.compile_on, dtype,
            self.time_left(), self.peak_flops,
        )  # fmt: skip
        self.timed_compile(result["recipe"].get("compile_s"), "the recipe's step 0")
        result["float16"] = train_run(
            data_dir, os.path.join(self.tmp, "recipe_fp16"), fp16_steps, str(self.device), self.tiny,
            self.compile_on, "float16", self.time_left(), self.peak_flops,
        )  # fmt: skip
        result["failed"] = bool(result["recipe"].get("failed") or result["float16"].get("failed"))
        return result

    def run_ladder(self, rungs, plus=False):
        if self.setup is None:
            self.setup = ladder_setup(self.s, self.device, self.device_type, self.tmp)
        warmup, rounds = self.rounds
        measured = measure_rungs(self.setup, rungs, self.device, self.device_type, warmup, rounds)
        self.measured.update(measured)
        for r, m in measured.items():
            if "compile" in m["changes"]:
                self.timed_compile(m["first_s"] - statistics.median(m["seconds"]), f"ladder rung {r}")
        if 7 in measured:
            self.step_scale = statistics.median(measured[7]["seconds"]) / (
                LADDER_REFERENCE[7][1] / 1e3 * self.setup["accum"]
            )
        if plus:
            self.rung_7_plus = rung_7_plus(self.setup, self.device, self.device_type, warmup, rounds)
            self.rung_7_plus["loss_check"] = (
                "none: it trains on other batches than rung 7 (B 64 rows a step, rung 7 B x its micro-batches)"
            )
        torch._dynamo.reset()  # this item's graphs and their GPU memory go before the next item's rungs
        gc.collect()
        if self.device_type == "cuda":
            torch.cuda.empty_cache()
        rows = {row["rung"]: row for row in rung_rows(self.setup, self.measured)}
        result = {"rungs": [rows[r] for r in rungs]}
        if plus:
            result["rungs"].insert(1, self.rung_7_plus)
        result["losses_agree"] = all(r.get("losses_agree", True) for r in result["rungs"])
        result["failed"] = not result["losses_agree"]
        return result

    def items(self):
        ladder = []
        for name, what, rungs, plus, compiles_each in LADDER_ITEMS:
            ladder.append(
                Item(
                    name,
                    what,
                    lambda rungs=rungs, plus=plus, k=compiles_each: self.estimate_ladder(rungs, k, plus),
                    lambda rungs=rungs, plus=plus: self.run_ladder(rungs, plus),
                )
            )
        if self.device_type != "cuda":  # rungs 11-12 compile for a GPU's kernels
            ladder[-1].not_here = lambda: "CUDA only (max-autotune tunes the GPU's GEMM and Triton kernels)"
        return [
            Item("cuda_tier", "the CUDA tier: tests/test_cuda.py", self.estimate_cuda_tier, self.run_cuda_tier),
            Item(
                "recipe",
                "train_gpt2.py at the recipe's defaults, then --dtype float16",
                self.estimate_recipe,
                self.run_recipe,
            ),
            *ladder,
        ]

    # --- the report ---
    def ladder_report(self, report):
        """The ladder so far, as the ladder section writes it (rows, table, headline), and its picture."""
        if self.setup is None or not self.measured:
            return None
        done = {e["name"]: e for e in report["items"]}
        not_run = {}
        for name, _, rungs, *_ in LADDER_ITEMS:
            e = done.get(name)
            why = "not reached" if e is None else f"{e['status']}: {e.get('why') or e.get('error', '')}"
            not_run.update({r: f"{name} {why}" for r in rungs})
        rows = rung_rows(self.setup, self.measured, not_run)
        plus = self.rung_7_plus or {
            "rung": "7+",
            "change": "the recipe's B 64",
            "reference_tok_per_sec": None,
            "reference_ms": None,
            "measured": False,
            "note": "not run",
        }
        rung1 = next(r for r in rows if r["rung"] == 1)
        if plus["measured"] and rung1["measured"]:
            plus["vs_rung1"] = plus["tok_per_sec"]["median"] / rung1["tok_per_sec"]["median"]
        rows.insert(next(i for i, r in enumerate(rows) if r["rung"] == 7) + 1, plus)
        result = ladder_result(self.setup, rows, report["machine"]["device"], self.device_type, sum(self.rounds))
        try:
            ladder_png(result, self.png)
            result["png"] = self.png
        except ImportError as e:
            result["png"] = None
            log(f"  ladder: no picture ({e}): pip install matplotlib")
        return result

    def time_left(self):
        return max(1.0, self.deadline - time.monotonic())


def run_gpu_check(check, report, budget_s, write, started=None):
    """Run check's items within budget_s from started (a time.monotonic() reading; None: now),
    writing the report (with the ladder so far) after each."""
    started = time.monotonic() if started is None else started
    check.deadline = started + budget_s

    def write_with_ladder(r):
        ladder = check.ladder_report(r)
        if ladder is not None:
            r["ladder"] = ladder
        write(r)

    return run_items(check.items(), report, budget_s, write_with_ladder, started=started)

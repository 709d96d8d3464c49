"""
Every speed claim of this project, measured side by side in one run on one machine.

Shared machines drift: absolute times move, ratios taken back to back hold. So each benchmark
runs its contenders interleaved (A B A B ...), drops the warm-up rounds, and reports medians with
min-max; a ratio is the ratio of the medians, with the min-max of the per-round (paired) ratios.
On a CPU, from the train section on, glibc's malloc keeps freed memory, as training and
hellaswag.py run there (support.machine.keep_freed_memory); the sections before it (sample among them,
as `--sample-from` runs) have glibc's default.

  ceiling    fp32 and bf16 GFLOP/s of a large square torch.mm: what this device can do with the
             kernels torch uses (on a CPU also fp32 through oneDNN, for reference: torch.mm and
             nn.Linear call MKL for fp32, which on AMD CPUs reaches about half of oneDNN's speed)
  train      one training step (forward, backward, clip, AdamW step) of train_gpt2.GPT with
             GPT.configure_optimizers, against transformers' GPT2LMHeadModel (sdpa attention, plain
             torch AdamW) with the same config, batch, precision and data (train_gpt2's loader feeds
             both the same micro-batches); on a CPU first that setting itself: glibc's malloc
             keeping freed memory (support.machine.keep_freed_memory) against its default.
             Configs small (6 layers, 384 wide, T 256, B 8) and gpt2 (124M, T 1024, B 1 on CPU;
             on a GPU the recipe's 64 where memory allows, else 32, 16, ... per precision); fp32
             and bf16 autocast; eager and torch.compile (compile time: cold, from an empty
             inductor cache). MFU: against the matmul ceiling measured in the same rounds on a
             CPU, against the datasheet peak (support.machine.PEAK_FLOPS, --peak-flops) on a GPU
  ladder     build-nanogpt's speed-up ladder, one change per rung (fp32, TF32, bf16 autocast,
             torch.compile, flash attention, vocab padded to 50,304, fused AdamW with parameter
             groups): train_gpt2's training step from the same weights on the same batches, the
             rungs interleaved, their losses checked to agree; on CUDA the 124M model at B 16,
             T 1024 (and the recipe's B 64), elsewhere the small config; rung 8 runs train_gpt2.py
             under torchrun when 2 or more GPUs are visible. ladder.png goes beside the JSON
  loader     DataLoaderLite.next_batch through 100M-token shards (written to a temporary folder):
             microseconds per batch, at the shard switches, and the memory it adds; the data
             identity check every start makes (100 sparse 100M-token shards; real shards read cold)
  fineweb    fineweb.py's tokenizer pool against tiktoken's encode_ordinary_batch, same documents
             and the same number of workers
  hellaswag  hellaswag.evaluate (what training calls) and the whole `python hellaswag.py` process
             against a plain in-process loop of one (context + ending) row per forward, on the first
             N examples with a random 6-layer, 384-wide model in fp32 (the same counts asserted);
             on CUDA also the full set with a random 124M model in bf16 (in-loop and process)
  sample     GPT.generate with the KV cache against recomputing the whole prefix, 256 new tokens;
             on CUDA also the compiled (CUDA-graph) decode step

Usage:
    python bench.py                  # everything: ~17 min on 2 idle CPU cores; table on stdout, JSON to bench.json
    python bench.py --quick          # small models, eager only, fewer rounds: < 5 min on 2 CPU cores
    python bench.py --only train --configs gpt2 --out gpt2.json     # one section, one config
    python bench.py --only ladder    # the speed-up ladder: table, bench.json and ladder.png (~4 min on 2 CPU cores)
    python bench.py --device cuda    # on a GPU (the recipe's B 64 at the gpt2 config where memory allows)
    python bench.py --tiny           # seconds: every section on toy sizes (the smoke test runs this)
FineWeb documents and HellaSwag data come from --docs / --hellaswag-data, else from shared/data
beside the repository when it is there; a section without data is skipped with a note.
"""

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, not a traceback from inside an import
    signal.signal(signal.SIGINT, lambda signum, frame: (print("interrupted", file=sys.stderr), os._exit(130)))

import argparse
import gc
import json
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import train_gpt2
from fineweb import get_tokenizer
from support import checks, sampling
from support.common import UserError, run_cli, write_atomic
from support.machine import keep_freed_memory, peak_flops
from support.run_log import RunLog
from train_gpt2 import GPT, GPTConfig, flops_per_token, pick_device

# sample comes before train: from train on, glibc's malloc keeps freed memory (see the docstring)
SECTIONS = ("ceiling", "loader", "fineweb", "sample", "train", "ladder", "hellaswag")

# the model configs of the training benchmark; B is per device type where it differs
TRAIN_CONFIGS = {
    "small": dict(n_layer=6, n_head=6, n_embd=384, T=256, B=8),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, T=1024, B=1, B_cuda=64),  # B 64: the recipe's
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, T=32, B=2),
}
VOCAB = 50304  # the padded vocabulary training uses, for both implementations

# The original build-nanogpt training step, measured on these 2-core CPU machines (AMD Zen 5,
# torch 2.13, fp32, 124M, B 1, T 1024): its code is not run here, so it is quoted.
ORIGINAL_TOK_PER_SEC = 164.0
ORIGINAL_MFU = 0.79  # of the 177 GFLOP/s fp32 matmul ceiling measured alongside it

# the targets, as ratios ours / baseline (MFU: a fraction of the ceiling)
TARGETS = {
    "vs_transformers": 1.15,
    "vs_original": 1.0,
    "mfu_gpt2_fp32": 0.85,
    "bf16_vs_fp32": 1.7,  # on a CPU
    "compile_vs_eager": 1.0,
    "loader_switch_ms": 1.0,  # below
    "loader_rss_mb": 50.0,  # below
    "data_identity_s": 0.25,  # below: the data check of every start, 100 shards of 100M tokens
    "fineweb_vs_tiktoken": 0.8,
    "hellaswag_process": 4.0,  # the whole hellaswag.py process vs an in-process one-row-per-forward loop
    "hellaswag_full_s": 3.0,  # CUDA: the full set inside training, 124M bf16, below
    "hellaswag_process_full_s": 8.0,  # CUDA: hellaswag.py on the full set, 124M bf16, wall, below
    "samples_in_training_s": 0.5,  # CUDA: 4 x 32 tokens at a --sample-every step, 124M bf16
    "decode_tok_s_cuda": 2000.0,  # CUDA: batch-1 decode of the 124M model
    "kv_cache": 5.0,
}


# How much each size of run does. *_rounds: (warm-up rounds, measured rounds), or measured
# rounds alone where the warm-up is a short call of its own.
RUNS = {
    "full": dict(
        configs=["small", "gpt2"],
        compile=[False, True],
        train_rounds=dict(tiny=(2, 6), small=(2, 6), gpt2=(1, 4)),
        # keep_freed_memory: the README's tiny run and the small config
        heap=[dict(n_layer=4, n_head=4, n_embd=64, T=64, B=16), dict(n_layer=6, n_head=6, n_embd=384, T=256, B=8)],
        heap_rounds=(1, 5),
        mm_n=4096,
        mm_rounds=(1, 5),
        shards=3,
        shard_tokens=100_000_000,
        docs=None,
        docs_repeat=2,
        tok_rounds=(1, 3),  # all the documents, twice: ~3M tokens
        eval_model="gpt2",
        hs_model="small",  # 6 layers, 384 wide
        hs_examples=300,  # the first 300 of the file on a CPU
        hs_examples_cuda=2000,
        hs_full_gpt2=True,  # CUDA only: the full set with a 124M model, bf16
        hs_rounds=3,
        new_tokens=256,
        sample_rounds=2,
        sample_rounds_cuda=5,
        wandb_rounds=(500, 5),  # step records a round, rounds
        # the speed-up ladder: gpt2 at B 16 on CUDA, the small config elsewhere (a few minutes on 2 cores)
        ladder_config="gpt2",
        ladder_rounds=(1, 5),
        ladder_rounds_cuda=(3, 9),
    ),
    "quick": dict(
        configs=["small"],
        compile=[False],
        train_rounds=dict(tiny=(1, 3), small=(1, 3), gpt2=(1, 2)),
        heap=[dict(n_layer=4, n_head=4, n_embd=64, T=64, B=16)],
        heap_rounds=(1, 3),
        mm_n=4096,
        mm_rounds=(1, 3),
        shards=2,
        shard_tokens=100_000_000,
        docs=None,
        docs_repeat=1,
        tok_rounds=(1, 3),
        eval_model="small",
        hs_model="small",
        hs_examples=100,
        hs_examples_cuda=1000,
        hs_rounds=2,
        new_tokens=256,
        sample_rounds=2,
        sample_rounds_cuda=5,
        wandb_rounds=(200, 3),  # step records a round, rounds
        ladder_config="small",
        ladder_rounds=(1, 3),
        ladder_rounds_cuda=(2, 5),
    ),
    "tiny": dict(
        configs=["tiny"],
        compile=[False],
        train_rounds=dict(tiny=(1, 2), small=(0, 1), gpt2=(0, 1)),
        heap=[dict(n_layer=2, n_head=2, n_embd=64, T=32, B=2)],
        heap_rounds=(0, 1),
        mm_n=256,
        mm_rounds=(1, 3),
        shards=2,
        shard_tokens=200_000,
        docs=20,
        docs_repeat=1,
        tok_rounds=(0, 2),
        eval_model="tiny",
        hs_model="tiny",
        hs_examples=8,
        hs_rounds=2,
        new_tokens=16,
        sample_rounds=2,
        sample_rounds_cuda=3,
        wandb_rounds=(20, 2),  # step records a round, rounds
        ladder_config="tiny",
        ladder_rounds=(1, 3),
        ladder_rounds_cuda=(1, 3),
    ),
}


def settings(args):
    s = dict(RUNS["tiny" if args.tiny else "quick" if args.quick else "full"])
    if args.configs:
        s["configs"] = args.configs
    if args.compile is not None:
        s["compile"] = [False, True] if args.compile else [False]
    return s


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Timing and statistics


def timed(fn, device_type):
    """Seconds one call of fn takes; on a GPU the queued work is waited for on both sides."""
    sync = {"cuda": torch.cuda.synchronize, "mps": lambda: torch.mps.synchronize()}.get(device_type, lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def interleave(contenders, warmup, rounds, device_type, label):
    """Call every contender once per round, in the same order each round (A B A B ...), so that
    a slow spell of the machine hits them all alike. Returns ({name: seconds per measured
    round}, {name: seconds of its very first call}); the first `warmup` rounds are dropped."""
    times = {name: [] for name in contenders}
    first = {}
    for r in range(warmup + rounds):
        this_round = {}
        for name, fn in contenders.items():
            this_round[name] = timed(fn, device_type)
            first.setdefault(name, this_round[name])
            if r >= warmup:
                times[name].append(this_round[name])
        done = "warm-up" if r < warmup else "measured"
        log(
            f"  {label}: round {r + 1}/{warmup + rounds} ({done}): "
            + ", ".join(f"{n} {t:.3f}s" for n, t in this_round.items())
        )
    return times, first


def stats(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def rates(work, seconds):
    """Throughput per round: work (tokens, examples, ...) over each round's seconds."""
    return [work / s for s in seconds]


# ----------------------------------------------------------------------------------------------
# The report: every comparison is one row of the table and one entry of the JSON


def fmt(x, unit):
    if unit == "%":
        return f"{100 * x:.1f}%"
    if abs(x) >= 100:
        return f"{x:,.0f} {unit}"
    return f"{x:.3g} {unit}"


def fmt_stats(s, unit):
    return f"{fmt(s['median'], unit)} [{fmt(s['min'], unit).split()[0]}–{fmt(s['max'], unit).split()[0]}]"


def comparison(name, ours, baseline, unit, target=None, higher_is_better=True, judge="median", note=""):
    """One row: ours and baseline are lists of per-round values (the same rounds, in order,
    when paired) or, for a quoted reference, a single number; baseline None: ours alone
    against the target, judged by its median or its mean."""
    ours_s = stats(ours)
    row = {
        "name": name,
        "unit": unit,
        "ours": ours_s,
        "note": note,
        "target": target,
        "higher_is_better": higher_is_better,
    }
    if baseline is None:  # an absolute number against a target
        row.update(baseline=None, ratio=None)
        value = ours_s["median"] if judge == "median" else statistics.fmean(ours)
        if judge == "mean":
            row["ours"]["mean"] = value
    else:
        base_s = (
            stats(baseline)
            if isinstance(baseline, list)
            else {"median": baseline, "min": baseline, "max": baseline, "n": 0}
        )
        row["baseline"] = base_s
        row["ratio"] = ours_s["median"] / base_s["median"]
        if isinstance(baseline, list) and len(baseline) == len(ours):
            row["paired_ratio"] = stats([a / b for a, b in zip(ours, baseline)])
        value = row["ratio"]
    row["met"] = None if target is None else (value >= target if higher_is_better else value < target)
    return row


def table(rows):
    lines = [
        "| benchmark | ours | baseline | ratio [paired min–max] | target | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        unit = r["unit"]
        ours = fmt_stats(r["ours"], unit)
        if r["baseline"] is None:
            base, ratio = "", ""
        else:
            base = (
                fmt_stats(r["baseline"], unit)
                if r["baseline"]["n"]
                else f"{fmt(r['baseline']['median'], unit)} (quoted)"
            )
            ratio = f"{r['ratio']:.2f}x"
            if "paired_ratio" in r:
                ratio += f" [{r['paired_ratio']['min']:.2f}–{r['paired_ratio']['max']:.2f}]"
        if r["target"] is None:
            target = ""
        elif r["baseline"] is None:
            target = ("≥ " if r["higher_is_better"] else "< ") + fmt(r["target"], unit)
            if "mean" in r["ours"]:
                target = "mean " + target
        else:
            target = f"≥ {r['target']:g}x"
        met = {None: "", True: "yes", False: "**no**"}[r["met"]]
        name = r["name"] + (f" ({r['note']})" if r["note"] else "")
        lines.append(f"| {name} | {ours} | {base} | {ratio} | {target} | {met} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Matmul ceiling


def matmul_fn(n, dtype, device):
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return lambda: torch.mm(a, b)


def onednn_fp32_fn(n):
    """The same fp32 product through oneDNN's matmul, which torch.mm and nn.Linear do not use for
    fp32 on x86 (they call MKL, whose sgemm on AMD CPUs runs at about AVX2 speed), or None where
    torch lacks the op."""
    linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if linear is None:
        return None
    a, b = torch.randn(n, n), torch.randn(n, n)
    return lambda: linear(a, b, None, "none", [], "")  # a @ b.T: the same 2 n^3 FLOPs


def bench_ceiling(s, device, device_type):
    n = s["mm_n"]
    contenders = {"fp32": matmul_fn(n, torch.float32, device), "bf16": matmul_fn(n, torch.bfloat16, device)}
    if device_type == "cpu" and onednn_fp32_fn(8) is not None:
        contenders["fp32 oneDNN"] = onednn_fp32_fn(n)
    times, _ = interleave(contenders, *s["mm_rounds"], device_type, f"ceiling {n}x{n} matmul")
    gflops = {k: rates(2 * n**3 / 1e9, v) for k, v in times.items()}
    result = {"n": n, "gflops": {k: stats(v) for k, v in gflops.items()}}
    rows = [
        comparison(
            f"matmul ceiling fp32 ({n}x{n} torch.mm{', TF32 as training sets it' if device_type == 'cuda' else ''})",
            gflops["fp32"],
            None,
            "GFLOP/s",
        ),
        comparison(f"matmul ceiling bf16 ({n}x{n} torch.mm)", gflops["bf16"], None, "GFLOP/s"),
    ]
    if "fp32 oneDNN" in gflops:
        rows.append(
            comparison(
                f"matmul fp32 through oneDNN ({n}x{n})",
                gflops["fp32 oneDNN"],
                gflops["fp32"],
                "GFLOP/s",
                note="for reference: nn.Linear and torch.mm call MKL for fp32",
            )
        )
    return result, rows


# ----------------------------------------------------------------------------------------------
# Training step


class HFCausalLM(nn.Module):
    """transformers' GPT2LMHeadModel behind our model's call, (idx, targets) -> (logits, loss),
    so that the same training step drives both. It computes its loss the way its users
    do, labels=input_ids (it shifts them itself): the same batch and the same next tokens as
    ours, less the last position of each row, whose target only ours is given."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, idx, targets):
        out = self.hf(input_ids=idx, labels=idx, use_cache=False)  # no KV cache to build in training
        return out.logits, out.loss


def make_hf_model(config):
    from transformers import GPT2Config, GPT2LMHeadModel

    hc = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.block_size,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,  # ours has no dropout either
        attn_implementation="sdpa",
    )
    hf = GPT2LMHeadModel(hc)
    assert hf.config._attn_implementation == "sdpa"
    return hf


def train_step_fn(model, optimizer, loader, autocast_dtype):
    """train_gpt2's step: zero grads, forward + backward (one micro-batch), clip to 1.0, AdamW;
    the step returns its loss (a tensor: reading it waits for the device)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    device_type = torch.device(loader.device).type

    def step():
        optimizer.zero_grad(set_to_none=True)
        x, y = loader.next_batch()
        with train_gpt2.autocast(device_type, autocast_dtype):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return loss.detach()

    return step


def fits_in_memory(models, B, T, autocast_dtype, device):
    """Whether one eager forward + backward at micro-batch B runs on this GPU for every model."""
    ok = True
    for model in models:
        x = torch.randint(0, 50257, (B, T), device=device)
        try:
            with train_gpt2.autocast("cuda", autocast_dtype):
                _, loss = model(x, x)
            loss.backward()
        except torch.cuda.OutOfMemoryError:
            ok = False
        model.zero_grad(set_to_none=True)
        del x
        gc.collect()
        torch.cuda.empty_cache()
        if not ok:
            return False
    return True


def bench_train_config(name, s, device, device_type, peak, data_dir):
    from train_gpt2 import DataLoaderLite

    c = TRAIN_CONFIGS[name]
    T = c["T"]
    config = GPTConfig(block_size=T, vocab_size=VOCAB, n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"])
    torch.manual_seed(1337)
    ours = GPT(config).to(device)
    ours_opt = ours.configure_optimizers(0.1, 6e-4, device_type, verbose=False)
    hf = HFCausalLM(make_hf_model(config)).to(device).train()
    # transformers' users pass all the parameters to torch's AdamW, which runs its per-tensor loop on a CPU
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # B per precision: on a GPU the recipe's micro-batch (B 64 at the gpt2 config) where both
    # implementations fit in memory at that precision, else half of it, and so on
    B = {}
    for precision, autocast_dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        B[precision] = c.get(f"B_{device_type}", c["B"])
        if device_type == "cuda":
            while B[precision] > 1 and not fits_in_memory((ours, hf), B[precision], T, autocast_dtype, device):
                log(f"  train {name} {precision}: B {B[precision]} does not fit in GPU memory, trying half")
                B[precision] //= 2
    # the same batches for both: two loaders over the same shard, in the same order
    loaders = {
        (impl, precision): DataLoaderLite(data_dir, "train", B[precision], T, shuffle=False, device=device)
        for impl in ("ours", "hf")
        for precision in B
    }

    contenders = {}
    for compiled in s["compile"]:
        for precision, autocast_dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            mode = "compiled" if compiled else "eager"
            for impl, model, opt in (("ours", ours, ours_opt), ("hf", hf, hf_opt)):
                # the compiled module shares the eager one's parameters, so one optimizer serves both
                m = torch.compile(model) if compiled else model
                step = train_step_fn(m, opt, loaders[impl, precision], autocast_dtype)
                contenders[f"{impl} {precision} {mode}"] = step
    if device_type != "cuda":  # the CPU's own ceiling, measured in the same rounds
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            contenders[f"mm {precision}"] = matmul_fn(s["mm_n"], dtype, device)

    warmup, rounds = s["train_rounds"][name]
    B_text = f"B{B['fp32']}" if B["fp32"] == B["bf16"] else f"B{B['fp32']} fp32, B{B['bf16']} bf16,"
    times, first = interleave(contenders, warmup, rounds, device_type, f"train {name} {B_text} T{T}")
    fpt = flops_per_token(config, T)
    tok = {k: rates(B[k.split()[1]] * T, v) for k, v in times.items() if not k.startswith("mm ")}
    mfu = {}
    for k, r in tok.items():
        precision = k.split()[1]
        if device_type == "cuda":
            mfu[k] = [fpt * x / peak for x in r]
        else:  # each round against the same round's ceiling at this precision
            ceiling = rates(2 * s["mm_n"] ** 3, times[f"mm {precision}"])
            mfu[k] = [fpt * x / cl for x, cl in zip(r, ceiling)]
    result = {
        "config": {
            **c,
            "B": B["fp32"] if B["fp32"] == B["bf16"] else B,
            "vocab_size": VOCAB,
            "n_params": sum(p.numel() for p in ours.parameters()),
        },
        "flops_per_token": fpt,
        "step_s": {k: stats(v) for k, v in times.items()},
        "tok_per_sec": {k: stats(v) for k, v in tok.items()},
        "mfu": {k: stats(v) for k, v in mfu.items()},
        "first_call_s": first,
    }
    if device_type != "cuda":
        result["ceiling_gflops"] = {
            p: stats(rates(2 * s["mm_n"] ** 3 / 1e9, times[f"mm {p}"])) for p in ("fp32", "bf16")
        }

    compile_s = {k: first[k] - stats(times[k])["median"] for k in tok if k.endswith("compiled")}
    if compile_s:
        result["compile_s"] = compile_s  # the first step's time over a later step's: compiling

    def median_mfu(k):
        return fmt(stats(mfu[k])["median"], "%")

    rows = []
    for k in tok:
        if k.startswith("ours"):
            hf_k = k.replace("ours", "hf")
            note = f"B {B[k.split()[1]]}, MFU ours {median_mfu(k)}, transformers {median_mfu(hf_k)}"
            rows.append(
                comparison(
                    f"train {name} {k[5:]}: ours vs transformers",
                    tok[k],
                    tok[hf_k],
                    "tok/s",
                    TARGETS["vs_transformers"],
                    note=note,
                )
            )
    for mode in ("eager", "compiled"):
        if f"ours fp32 {mode}" not in tok:
            continue
        fp32, bf16 = tok[f"ours fp32 {mode}"], tok[f"ours bf16 {mode}"]
        target = TARGETS["bf16_vs_fp32"] if device_type == "cpu" else None  # the target is the CPU's
        rows.append(comparison(f"train {name} {mode}: bf16 vs fp32 (ours)", bf16, fp32, "tok/s", target))
        if name == "gpt2" and device_type == "cpu":  # the quoted reference's own config and precision
            mfu32 = mfu[f"ours fp32 {mode}"]
            rows += [
                comparison(
                    f"train gpt2 fp32 {mode}: ours vs build-nanogpt",
                    fp32,
                    ORIGINAL_TOK_PER_SEC,
                    "tok/s",
                    TARGETS["vs_original"],
                    note="its quoted 164 tok/s",
                ),
                comparison(
                    f"train gpt2 fp32 {mode}: MFU ours vs build-nanogpt",
                    mfu32,
                    ORIGINAL_MFU,
                    "%",
                    TARGETS["vs_original"],
                    note="its quoted 79% of the fp32 ceiling",
                ),
                comparison(
                    f"train gpt2 fp32 {mode}: MFU (of the fp32 torch.mm ceiling)",
                    mfu32,
                    None,
                    "%",
                    TARGETS["mfu_gpt2_fp32"],
                ),
            ]
    for precision in ("fp32", "bf16"):
        k = f"ours {precision} compiled"
        if k in tok:
            note = f"compile {compile_s[k]:.0f} s, transformers {compile_s[k.replace('ours', 'hf')]:.0f} s"
            rows.append(
                comparison(
                    f"train {name} {precision}: compiled vs eager (ours)",
                    tok[k],
                    tok[f"ours {precision} eager"],
                    "tok/s",
                    TARGETS["compile_vs_eager"],
                    note=note,
                )
            )
    del contenders, ours, ours_opt, hf, hf_opt
    torch._dynamo.reset()
    gc.collect()
    return result, rows


def heap_probe(config, data_dir, keep, steps):
    """In a fresh interpreter (glibc's default malloc unless keep): the seconds of `steps` training
    steps of config (fp32, eager) after one warm-up step, printed as JSON."""
    from train_gpt2 import DataLoaderLite

    if keep:
        keep_freed_memory()
    c = config
    torch.manual_seed(1337)
    model = GPT(
        GPTConfig(block_size=c["T"], vocab_size=VOCAB, n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"])
    )
    opt = model.configure_optimizers(0.1, 6e-4, "cpu", verbose=False)
    step = train_step_fn(model, opt, DataLoaderLite(data_dir, "train", c["B"], c["T"], shuffle=False), None)
    step()
    print(json.dumps([timed(step, "cpu") for _ in range(steps)]))


def bench_keep_freed_memory(s, data_dir):
    """keep_freed_memory, which a CPU training run turns on: training steps (fp32, eager)
    with glibc keeping freed memory in the heap against glibc's default (big blocks mapped and
    unmapped, the heap trimmed), for the README's tiny run and the small config. glibc's default
    cannot be restored in a process once changed, so each round runs each setting in a fresh
    interpreter (heap_probe); a round's time is the median of its steps."""
    results, rows = [], []
    for c in s["heap"]:
        shape = f"{c['n_layer']} layers, {c['n_embd']} wide, B {c['B']}, T {c['T']}"
        times = {"kept": [], "glibc default": []}
        warmup, rounds = s["heap_rounds"]
        for r in range(warmup + rounds):
            this_round = {}
            for name in times:
                code = f"import bench; bench.heap_probe({c!r}, {data_dir!r}, {name == 'kept'}, 3)"
                out = subprocess.run(
                    [sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True, check=True
                ).stdout
                this_round[name] = statistics.median(json.loads(out.splitlines()[-1]))
                if r >= warmup:
                    times[name].append(this_round[name])
            log(
                f"  keep_freed_memory {shape}: round {r + 1}/{warmup + rounds}: "
                + ", ".join(f"{n} {t:.3f}s" for n, t in this_round.items())
            )
        tok = {k: rates(c["B"] * c["T"], v) for k, v in times.items()}
        results.append({"config": c, "tok_per_sec": {k: stats(v) for k, v in tok.items()}})
        rows.append(
            comparison(
                f"train on a CPU: freed memory kept (keep_freed_memory) vs glibc's default ({shape}, fp32 eager)",
                tok["kept"],
                tok["glibc default"],
                "tok/s",
                note="each in a fresh process",
            )
        )
    return results, rows


def bench_train(s, device, device_type, peak, tmp):
    # a shard of random token ids; every config reads it through train_gpt2's loader
    import fineweb

    data_dir = os.path.join(tmp, "train_data")
    os.makedirs(data_dir, exist_ok=True)
    tokens = np.random.default_rng(0).integers(0, 50257, 2_000_000, dtype=np.uint16)
    fineweb.write_shard(fineweb.shard_path(data_dir, "bench", 1), tokens)
    results, rows = {}, []
    # on a CPU, from here on (and for hellaswag after it), as training and hellaswag.py run there
    if device_type == "cpu" and keep_freed_memory():
        results["keep_freed_memory"], rows = bench_keep_freed_memory(s, data_dir)
    for name in s["configs"]:
        results[name], r = bench_train_config(name, s, device, device_type, peak, data_dir)
        rows += r
    results["wandb_logging"], r = bench_wandb_logging(s, tmp, results[s["configs"][-1]])
    return results, rows + r


def bench_wandb_logging(s, tmp, train_result):
    """The cost of --wandb-project per step record, with wandb offline (no network: what is
    measured is wandb's own work): RunLog with its wandb mirror against RunLog alone (log.jsonl),
    the console line left out of both. 'on the step': what the training loop waits for; 'drained':
    also until wandb's thread has logged the records, the most it costs where nothing overlaps.
    Against the fastest of our steps of the last train config."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        return {"skipped": "wandb is not installed (pip install wandb)"}, []
    env = dict(WANDB_MODE="offline", WANDB_DIR=os.path.join(tmp, "wandb"), WANDB_SILENT="true")
    env.update(WANDB_DISABLE_GIT="true", WANDB_ERROR_REPORTING="false")
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    n, rounds = s["wandb_rounds"]
    try:
        logs = {}
        for name, project in (("wandb", "bench"), ("plain", None)):
            out = os.path.join(tmp, f"wandb_bench_{name}")
            os.makedirs(out)
            logs[name] = run_log = RunLog(out, True, n * (rounds + 1))
            run_log.print = lambda record: None
            run_log.header(f"bench-{name}-{os.getpid()}", "bench", None, {}, {"wandb_project": project, "out_dir": out})
        mirror, step = logs["wandb"].wandb, iter(range(10**9))

        def records():
            for _ in range(n):
                i = next(step)
                yield {
                    "step": i,
                    "train_loss": 3.0 + 1 / (i + 1),
                    "lr": 6e-4,
                    "grad_norm": 0.3,
                    "dt_ms": 100.0,
                    "tok_per_sec": 5e6,
                    "mfu": 0.4,
                    "tokens": i * 524288,
                    "epoch": 0,
                }

        times = {"plain": [], "on_step": [], "drained": []}
        for r in range(rounds + 1):  # the first round warms up
            t0 = time.perf_counter()
            for record in records():
                logs["plain"](record)
            t1 = time.perf_counter()
            if not mirror.flush():
                raise UserError(f"wandb failed in the benchmark: {mirror.error}")
            t2 = time.perf_counter()
            for record in records():
                logs["wandb"](record)
            t3 = time.perf_counter()
            mirror.flush()
            t4 = time.perf_counter()
            if r > 0:
                times["plain"].append((t1 - t0) / n)
                times["on_step"].append((t3 - t2) / n)
                times["drained"].append((t4 - t2) / n)
            done = ", ".join(f"{k} {v[-1] * 1e3:.3f} ms" for k, v in times.items() if v) or "warm-up"
            log(f"  wandb logging: round {r + 1}/{rounds + 1}: {done}")
        RunLog.finish_wandb()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    step_s = min(v["median"] for k, v in train_result["step_s"].items() if k.startswith("ours"))
    ms, share = {k: [t * 1e3 for t in v] for k, v in times.items()}, [t / step_s for t in times["drained"]]
    result = {"records_per_round": n, "ms": {k: stats(v) for k, v in ms.items()}, "step_s": step_s}
    result["share_of_step"] = stats(share)
    note = f"wandb offline, {n} step records a round; the step: {step_s * 1e3:.1f} ms"
    rows = [
        comparison(
            "wandb logging per step record, on the step: with wandb vs log.jsonl alone",
            ms["on_step"],
            ms["plain"],
            "ms",
            higher_is_better=False,
            note=note,
        ),
        comparison(
            "wandb logging per step record, drained: with wandb vs log.jsonl alone",
            ms["drained"],
            ms["plain"],
            "ms",
            higher_is_better=False,
            note=note,
        ),
        comparison(
            "wandb logging per step record, drained, as a share of a step",
            share,
            None,
            "%",
            higher_is_better=False,
            note=note,
        ),
    ]
    return result, rows


# ----------------------------------------------------------------------------------------------
# The speed-up ladder: the reference's speed-ups, one at a time

# The reference run (build-nanogpt on one A100, 124M, B 16, T 1024): (tok/s, ms per step) at each
# rung; rung 8 is its whole job on 8 GPUs.
LADDER_REFERENCE = {
    1: (16_300, 1000.0),
    2: (49_000, 333.0),
    3: (54_700, 300.0),
    4: (126_000, 129.5),
    5: (170_000, 97.0),
    6: (176_000, 93.0),
    7: (182_000, 90.0),
    8: (1_500_000, None),
}

# (rung, what it changes, the change's name): each rung keeps every change before it
LADDER_RUNGS = (
    (1, "fp32 baseline", None),
    (2, "TF32 matmuls", "tf32"),
    (3, "bf16 autocast", "bf16"),
    (4, "torch.compile", "compile"),
    (5, "flash attention (SDPA)", "sdpa"),
    (6, "vocab 50,257 padded to 50,304", "padded_vocab"),
    (7, "fused AdamW, GPT-3 parameter groups", "fused_adamw"),
)

# How far a rung's loss may lie from rung 1's (fp32), at the same step from the same weights and
# batches, by the lowest precision its matmuls run in (absolute, on losses near ln(50257) = 10.8).
# fp32: the same arithmetic in another order (SDPA, compile's fusions), ~10 ulp of the loss.
# bf16 keeps 8 bits of mantissa, TF32 11: a matmul's relative error of ~2**-9 resp. 2**-12,
# which the loss, a mean over B*T tokens, averages down.
LADDER_LOSS_TOL = {"fp32": 1e-4, "tf32": 5e-3, "bf16": 5e-3}
# and a padded vocabulary's: its 47 new rows start at zero, 47 logits of 0 more in the softmax,
# log(1 + 47 / 50257) = 9.4e-4 more loss while the others are near 0 (at init)
LADDER_PAD_ALLOWANCE = 2e-3

LADDER_LR = 6e-4  # the recipe's max_lr, held constant: the loss check's few steps move the weights a little


class MaskedSoftmaxAttention(nn.Module):
    """The attention of rungs 1-4, written out as the reference had it before flash attention:
    every head's (T, T) scores materialised, the future filled with -inf, softmax, then the
    weighted sum of the values. It takes over a block's CausalSelfAttention with that module's
    c_attn and c_proj (the same Parameters), for training's call: causal, no KV cache."""

    def __init__(self, attn, block_size):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head, self.n_embd = attn.c_attn, attn.c_proj, attn.n_head, attn.n_embd
        causal = torch.ones(block_size, block_size, dtype=torch.bool, device=attn.c_attn.weight.device).tril()
        self.register_buffer("causal", causal.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x, cache=None, layer=0, mask=None):
        if cache is not None or mask is not None:
            raise ValueError("MaskedSoftmaxAttention computes training's causal attention only")
        B, T, C = x.size()
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * hs**-0.5  # (B, nh, T, T)
        att = att.masked_fill(~self.causal[:, :, :T, :T], float("-inf"))
        y = F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def ladder_config(name, device_type):
    """(config name, n_layer/n_head/n_embd/T/B): the 124M model at the reference's B 16 on CUDA;
    elsewhere the smaller TRAIN_CONFIGS entry the run names (the gpt2 one takes too long there)."""
    if name == "gpt2" and device_type != "cuda":
        name = "small"
    c = dict(TRAIN_CONFIGS[name])
    if name == "gpt2":
        c["B"] = 16  # the reference's micro-batch; the recipe's 64 is a rung of its own
    return name, {k: c[k] for k in ("n_layer", "n_head", "n_embd", "T", "B")}


def ladder_base_state(c):
    """The weights every rung starts from: a fresh GPT with the 50,257-token vocabulary."""
    torch.manual_seed(1337)
    return GPT(ladder_gpt_config(c, 50257)).state_dict()


def ladder_gpt_config(c, vocab_size):
    return GPTConfig(
        block_size=c["T"], vocab_size=vocab_size, n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"]
    )


def ladder_model(changes, base_state, c, device):
    """A rung's model: base_state's weights (the padded vocabulary's extra rows zero), with the
    masked-softmax attention unless the rung has flash attention."""
    vocab = 50304 if "padded_vocab" in changes else 50257
    state = {k: v.clone() for k, v in base_state.items()}
    wte = base_state["lm_head.weight"]
    if vocab > wte.size(0):  # zero rows: logits of 0 for ids the data never holds
        padded = torch.cat([wte, wte.new_zeros(vocab - wte.size(0), wte.size(1))])
        state["lm_head.weight"] = state["transformer.wte.weight"] = padded
    model = GPT.from_state_dict(ladder_gpt_config(c, vocab), state, "the ladder's base weights").to(device)
    if "sdpa" not in changes:
        for block in model.transformer.h:
            block.attn = MaskedSoftmaxAttention(block.attn, c["T"])
    return model


def ladder_step(changes, base_state, c, B, data_dir, device, device_type):
    """(step function, the list its losses go to) for a rung: train_gpt2's training step
    (train_step_fn) on this rung's model, optimizer, precision and compile setting, reading the
    same batches as every other rung. Each call sets the rung's fp32 matmul precision first, so
    that rungs interleaved in one process each run at their own."""
    from train_gpt2 import DataLoaderLite

    model = ladder_model(changes, base_state, c, device)
    if "fused_adamw" in changes:
        optimizer = model.configure_optimizers(0.1, LADDER_LR, device_type, verbose=False)
    else:  # torch's AdamW as its users call it: every parameter decayed, one group, torch's default kernel
        optimizer = torch.optim.AdamW(model.parameters(), lr=LADDER_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # static shapes, as in training: a rung with other shapes (vocab, B) gets its own graph, not a dynamic one
    run = torch.compile(model, dynamic=False) if "compile" in changes else model
    loader = DataLoaderLite(data_dir, "train", B, c["T"], shuffle=False, device=device)
    step = train_step_fn(run, optimizer, loader, torch.bfloat16 if "bf16" in changes else None)
    precision = "high" if "tf32" in changes else "highest"
    losses = []

    def run_step():
        torch.set_float32_matmul_precision(precision)
        losses.append(step().item())  # training reads each step's loss too

    return run_step, losses


def tf32_has_effect(base_state, c, data_dir, device):
    """Whether allowing TF32 changes the fp32 model's logits on this device (bitwise): where it
    does not (CPUs without TF32 matmuls, GPUs before Ampere), the same kernels run either way."""
    from train_gpt2 import DataLoaderLite

    model = ladder_model(set(), base_state, c, device)
    x, _ = DataLoaderLite(data_dir, "train", 1, c["T"], shuffle=False, device=device).next_batch()
    before = torch.get_float32_matmul_precision()
    logits = []
    try:
        for precision in ("highest", "high"):
            torch.set_float32_matmul_precision(precision)
            with torch.no_grad():
                logits.append(model(x)[0])
    finally:
        torch.set_float32_matmul_precision(before)
    return not torch.equal(*logits)


def compile_unavailable(s):
    """Why this run has no compile rung, or None."""
    if True not in s["compile"]:
        return "compile is off in this run (--compile runs it)"
    try:
        torch.compile(lambda t: t * 2 + 1, dynamic=False)(torch.ones(4))
    except Exception as e:  # no C++ compiler, a Python torch.compile does not support, ...
        return f"torch.compile is unavailable here ({str(e).strip().splitlines()[0][:120]})"
    finally:
        torch._dynamo.reset()
    return None


def loss_check(losses, changes):
    """{rung: (max |loss - rung 1's loss| over the steps, tolerance, agrees)}, each rung's losses
    against rung 1's (fp32) step by step; the tolerance is that of the rung's lowest precision (bf16,
    else TF32, else fp32), plus the padded vocabulary's allowance where it has one."""
    out = {}
    for rung, values in losses.items():
        if len(values) != len(losses[1]):
            raise ValueError(f"rung {rung} ran {len(values)} steps, rung 1 {len(losses[1])}")
        diff = max(abs(a - b) for a, b in zip(values, losses[1]))
        tol = LADDER_LOSS_TOL[ladder_precision(changes[rung])]
        tol += LADDER_PAD_ALLOWANCE if "padded_vocab" in changes[rung] else 0.0
        out[rung] = (diff, tol, diff <= tol)
    return out


def ladder_precision(changes):
    return "bf16" if "bf16" in changes else "tf32" if "tf32" in changes else "fp32"


def ladder_ddp(n_proc, c, B, steps, data_dir, out_dir, device_type):
    """Rung 8: train_gpt2.py itself under torchrun, one process per GPU, with rung 7's settings
    (bf16, compile, flash attention, padded vocabulary, fused AdamW) at B per GPU and no gradient
    accumulation. -> {tok/s of the whole job and per process (median over the steps after the
    first quarter, and at least 2, which compile and warm up), compile s}. On a CPU (gloo, fp32,
    eager) it runs the same command, for the tests."""
    T = c["T"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n_proc}",
        str(Path(__file__).resolve().parent / "train_gpt2.py"),
        "--data-dir",
        data_dir,
        "--out-dir",
        out_dir,
        "--n-layer",
        c["n_layer"],
        "--n-head",
        c["n_head"],
        "--n-embd",
        c["n_embd"],
        "--block-size",
        T,
        "--vocab-size",
        50304,
        "-B",
        B,
        "-T",
        T,
        "--total-batch-size",
        B * T * n_proc,
        "--max-steps",
        steps,
        "--warmup-steps",
        1,
        "--max-lr",
        LADDER_LR,
        "--no-shuffle",
        "--eval-every",
        0,
        "--hellaswag-every",
        0,
        "--sample-every",
        0,
        "--ckpt-every",
        0,
        "--keep-ckpts",
        1,
    ]
    if device_type == "cuda":
        cmd += ["--dtype", "bfloat16", "--compile"]
    else:
        cmd += ["--device", "cpu", "--dtype", "float32", "--no-compile"]
    r = subprocess.run([str(a) for a in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"rung 8 (torchrun train_gpt2.py) failed: {r.stderr.strip()[-800:]}")
    records = [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl"))]
    steps_run = [rec for rec in records if "train_loss" in rec]
    skip = max(2, len(steps_run) // 4)
    tok = [rec["tok_per_sec"] for rec in steps_run[skip:]]
    dt = [rec["dt_ms"] for rec in steps_run]
    return {
        "processes": n_proc,
        "B_per_process": B,
        "steps": len(steps_run),
        "steps_dropped": skip,
        "tok_per_sec": stats(tok),
        "tok_per_sec_per_process": stats([t / n_proc for t in tok]),
        "step_ms": stats(dt[skip:]),
        "first_step_ms": dt[0],
        "losses": [rec["train_loss"] for rec in steps_run],
    }


def ladder_png(result, path):
    """ladder.png: tok/s per rung, ours beside the reference's A100 (log scale), and each one's
    speed-up over its rung 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rungs"]
    labels = [str(r["rung"]) for r in rows]
    ours = [r["tok_per_sec"]["median"] if r["measured"] else 0 for r in rows]
    ref = [r["reference_tok_per_sec"] or 0 for r in rows]
    ours1 = rows[0]["tok_per_sec"]["median"]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, scale, title in ((axes[0], False, "tok/s"), (axes[1], True, "speed-up over rung 1")):
        mine = [v / ours1 if scale else v for v in ours]
        theirs = [v / ref[0] if scale else v for v in ref]
        ax.bar(x - 0.2, mine, 0.4, label=f"ours: {result['device']}")
        ax.bar(x + 0.2, theirs, 0.4, label="reference: A100")
        for i, r in enumerate(rows):
            if not r["measured"]:
                where = ax.get_xaxis_transform()  # x in data, y a fraction of the axes
                ax.text(x[i] - 0.2, 0.02, "n/a", ha="center", va="bottom", fontsize=8, rotation=90, transform=where)
        ax.set_yscale("log")
        ax.set_xticks(x, labels)
        ax.set_xlabel("rung")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"speed-up ladder: {result['config_text']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ladder_table(result):
    lines = [
        "| rung | what changes | tok/s [min–max] | ms per step | vs previous [paired min–max] | vs rung 1 "
        "| A100 reference | loss vs rung 1 (tolerance) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rungs"]:
        ref_tok, ref_ms = r["reference_tok_per_sec"], r["reference_ms"]
        ref = "" if ref_tok is None else f"{ref_tok / 1000:,.1f}K tok/s" + (f", {ref_ms:,g} ms" if ref_ms else "")
        if ref_tok and ref_tok >= 1e6:
            ref = f"{ref_tok / 1e6:g}M tok/s"
        # compile: the first step over a later one; a cache hit leaves ~0, and noise can make that negative
        change = r["change"] + (f" (compile {max(0, r['compile_s']):.0f} s)" if r.get("compile_s") is not None else "")
        if not r["measured"]:
            lines.append(f"| {r['rung']} | {change} | not measured: {r['note']} |  |  |  | {ref} |  |")
            continue
        prev = ""
        if r.get("vs_previous") is not None:
            prev = f"{r['vs_previous']:.2f}x"
            if r.get("vs_previous_paired"):
                prev += f" [{r['vs_previous_paired']['min']:.2f}–{r['vs_previous_paired']['max']:.2f}]"
            if r.get("previous") != r["rung"] - 1 and isinstance(r["rung"], int):
                prev += f" (over rung {r['previous']})"
        loss = ""
        if r.get("loss_max_abs_diff") is not None:
            ok = "" if r["losses_agree"] else " **differs**"
            loss = f"{r['loss_max_abs_diff']:.2g} (≤ {r['loss_tol']:g}){ok}"
        note = f"; {r['note']}" if r.get("note") else ""
        ms = r["step_ms"]["median"]
        lines.append(
            f"| {r['rung']} | {change}{note} | {fmt_stats(r['tok_per_sec'], 'tok/s')} | {ms:,.1f} ms | {prev} "
            f"| {r['vs_rung1']:.2f}x | {ref} | {loss} |"
        )
    return "\n".join(lines)


def bench_ladder(s, args, device, device_type, tmp):
    import fineweb

    if device_type == "cpu":  # as a CPU training run does
        keep_freed_memory()
    name, c = ladder_config(s["ladder_config"], device_type)
    T, B = c["T"], c["B"]
    data_dir = os.path.join(tmp, "ladder_data")
    os.makedirs(data_dir, exist_ok=True)
    tokens = np.random.default_rng(1).integers(0, 50257, 2_000_000, dtype=np.uint16)
    fineweb.write_shard(fineweb.shard_path(data_dir, "bench", 1), tokens)
    base_state = ladder_base_state(c)
    if device_type == "cuda":  # rung 1 (fp32, the (T, T) scores) needs the most memory: halve B until it fits
        probe = ladder_model(set(), base_state, c, device)
        while B > 1 and not fits_in_memory([probe], B, T, None, device):
            log(f"  ladder: B {B} does not fit in GPU memory at rung 1, trying half")
            B //= 2
        c["B"] = B
        del probe
        torch.cuda.empty_cache()
    config_text = f"{name} config: {c['n_layer']} layers, {c['n_head']} heads, {c['n_embd']} wide, B {B}, T {T}"
    log(f"  ladder on {device}: {config_text}")
    before = torch.get_float32_matmul_precision()
    torch._dynamo.reset()

    skipped = {}
    if not tf32_has_effect(base_state, c, data_dir, device):
        skipped[2] = "no effect on this device (fp32 logits bitwise the same with TF32 allowed)"
    if device_type == "cuda" and not torch.cuda.is_bf16_supported():
        skipped[3] = "no bf16 on this device"
    why = compile_unavailable(s)
    if why:
        skipped[4] = why

    contenders, losses, changes, previous, last = {}, {}, {}, {}, None
    for rung, _, _ in LADDER_RUNGS:
        if rung in skipped:
            continue
        changes[rung] = change_set(rung, skipped)
        step, losses[rung] = ladder_step(changes[rung], base_state, c, B, data_dir, device, device_type)
        contenders[f"rung {rung}"] = step
        previous[rung], last = last, rung
    warmup, rounds = s["ladder_rounds" if device_type == "cpu" else "ladder_rounds_cuda"]
    try:
        times, first = interleave(contenders, warmup, rounds, device_type, f"ladder {name} B{B} T{T}")
    finally:
        torch.set_float32_matmul_precision(before)
    checks = loss_check(losses, changes)
    tok = {k: rates(B * T, times[f"rung {k}"]) for k in losses}

    rungs = []
    for rung, what, change in LADDER_RUNGS:
        ref_tok, ref_ms = LADDER_REFERENCE[rung]
        row = {"rung": rung, "change": what, "reference_tok_per_sec": ref_tok, "reference_ms": ref_ms}
        if rung in skipped:
            rungs.append({**row, "measured": False, "note": skipped[rung]})
            continue
        secs = times[f"rung {rung}"]
        diff, tol, agree = checks[rung]
        row.update(measured=True, note="", tok_per_sec=stats(tok[rung]), step_ms=stats([1e3 * t for t in secs]))
        row.update(vs_rung1=stats(tok[rung])["median"] / stats(tok[1])["median"], previous=previous[rung])
        if previous[rung] is not None:
            p = previous[rung]
            row["vs_previous"] = stats(tok[rung])["median"] / stats(tok[p])["median"]
            row["vs_previous_paired"] = stats([a / b for a, b in zip(tok[rung], tok[p])])
        if "compile" in changes[rung]:  # the first step's time over a later one's
            row["compile_s"] = first[f"rung {rung}"] - statistics.median(secs)
        row.update(losses=losses[rung], loss_precision=ladder_precision(changes[rung]), loss_max_abs_diff=diff)
        row.update(loss_tol=tol, losses_agree=agree)
        rungs.append(row)
    del contenders
    gc.collect()

    # the recipe's B 64 (CUDA): rung 7 at B 64 against rung 7 at B 16, interleaved on their own
    if device_type == "cuda" and name == "gpt2":
        row = {"rung": "7+", "change": "the recipe's B 64", "reference_tok_per_sec": None, "reference_ms": None}
        torch.cuda.empty_cache()
        ch = change_set(7, skipped)
        probe = ladder_model(ch, base_state, c, device)
        fits = fits_in_memory([probe], 64, T, torch.bfloat16 if "bf16" in ch else None, device)
        del probe
        torch.cuda.empty_cache()
        if fits:
            b16, _ = ladder_step(ch, base_state, c, B, data_dir, device, device_type)
            b64, _ = ladder_step(ch, base_state, c, 64, data_dir, device, device_type)
            t2, first2 = interleave({"B16": b16, "B64": b64}, warmup, rounds, device_type, "ladder rung 7, B 16 and 64")
            tok16, tok64 = rates(B * T, t2["B16"]), rates(64 * T, t2["B64"])
            row.update(
                measured=True,
                note="against rung 7 at B 16 in rounds of their own",
                tok_per_sec=stats(tok64),
                step_ms=stats([1e3 * t for t in t2["B64"]]),
                previous=7,
                vs_previous=stats(tok64)["median"] / stats(tok16)["median"],
                vs_previous_paired=stats([a / b for a, b in zip(tok64, tok16)]),
                vs_rung1=stats(tok64)["median"] / rungs[0]["tok_per_sec"]["median"],
            )
            if "compile" in ch:
                row["compile_s"] = first2["B64"] - statistics.median(t2["B64"])
            del b16, b64
            torch.cuda.empty_cache()
        else:
            row.update(measured=False, note="B 64 does not fit in this GPU's memory")
        rungs.append(row)
    else:
        rungs.append(
            {
                "rung": "7+",
                "change": "the recipe's B 64",
                "reference_tok_per_sec": None,
                "reference_ms": None,
                "measured": False,
                "note": "CUDA and the gpt2 config only",
            }
        )
    torch._dynamo.reset()
    torch.set_float32_matmul_precision(before)

    # rung 8: every GPU of this machine, through torchrun (this process's cached blocks handed back first)
    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()
    row = {"rung": 8, "change": "DDP over every visible GPU", "reference_tok_per_sec": 1_500_000, "reference_ms": None}
    n_gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    if n_gpus > 1:
        r8 = ladder_ddp(n_gpus, c, B, 40, data_dir, os.path.join(tmp, "ladder_ddp"), device_type)
        rung7_tok = next(r for r in rungs if r["rung"] == 7)["tok_per_sec"]["median"]
        row.update(
            measured=True,
            change=f"DDP over {n_gpus} GPUs (train_gpt2.py under torchrun)",
            ddp=r8,
            tok_per_sec=r8["tok_per_sec"],
            step_ms=r8["step_ms"],
            previous=7,
            vs_previous=r8["tok_per_sec"]["median"] / rung7_tok,
            vs_rung1=r8["tok_per_sec"]["median"] / rungs[0]["tok_per_sec"]["median"],
            note=f"whole job; per GPU {fmt_stats(r8['tok_per_sec_per_process'], 'tok/s')}; a run of its own",
            compile_s=(r8["first_step_ms"] - r8["step_ms"]["median"]) / 1e3,
        )
    else:
        visible = f"{n_gpus or 'no'} GPU{'' if n_gpus == 1 else 's'} visible"
        row.update(measured=False, note=f"{visible}; it needs 2 or more")
    rungs.append(row)

    result = {
        "config_name": name,
        "config": {**c, "vocab_size": "50257 (rungs 1-5), 50304 (6-7)"},
        "config_text": config_text,
        "device": machine(device, device_type)["device" if device_type == "cuda" else "cpu"],
        "steps_per_rung": warmup + rounds,
        "lr": LADDER_LR,
        "loss_tolerance": {**LADDER_LOSS_TOL, "padded_vocab_allowance": LADDER_PAD_ALLOWANCE},
        "losses_agree": all(r.get("losses_agree", True) for r in rungs),
        "rungs": rungs,
    }
    if not result["losses_agree"]:
        log("  ladder: WARNING: a rung's loss differs from rung 1's beyond its precision's tolerance (see the table)")
    result["table"] = ladder_table(result)
    png = os.path.join(os.path.dirname(os.path.abspath(args.out)), "ladder.png")
    try:
        ladder_png(result, png)
        result["png"] = png
    except ImportError as e:
        result["png"] = None
        log(f"  ladder: no picture ({e}): pip install matplotlib")
    return result, []


def change_set(rung, skipped):
    """The changes a rung runs with: its own and every earlier one's, less the skipped rungs'."""
    return {ch for r, _, ch in LADDER_RUNGS if ch and r <= rung and r not in skipped}


# ----------------------------------------------------------------------------------------------
# Data loader across shard boundaries


def rss_mib():
    """(anonymous, file-backed) resident MiB of this process. Anonymous memory is what the process
    allocated; the file-backed pages of a memory-mapped shard are the kernel's page cache, shared
    and dropped under memory pressure, and leave with the mapping."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["RssAnon"].split()[0]) / 1024, int(fields["RssFile"].split()[0]) / 1024
    except (OSError, KeyError):  # not Linux
        import psutil

        return psutil.Process().memory_info().rss / 2**20, 0.0


def bench_loader(s, device_type, tmp):
    import fineweb
    from train_gpt2 import DataLoaderLite

    c = TRAIN_CONFIGS["gpt2"]
    B, T = c.get(f"B_{device_type}", c["B"]), c["T"]
    data_dir = os.path.join(tmp, "loader_data")
    os.makedirs(data_dir)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for i in range(1, s["shards"] + 1):
        fineweb.write_shard(
            fineweb.shard_path(data_dir, "bench", i), rng.integers(0, 50257, s["shard_tokens"], dtype=np.uint16)
        )
    log(f"  loader: wrote {s['shards']} shards of {s['shard_tokens']:,} tokens in {time.perf_counter() - t0:.1f}s")
    gc.collect()
    anon0, file0 = rss_mib()
    loader = DataLoaderLite(data_dir, "train", B, T, shuffle=False)  # on the CPU: the loader's own cost
    calls = loader.batches_per_epoch + 2  # through every shard and on into the next epoch
    times, switch_times = np.empty(calls), []
    anon_peak, file_peak = anon0, file0
    for i in range(calls):
        where = (loader.epoch, loader.shard)
        t0 = time.perf_counter()
        loader.next_batch()
        times[i] = time.perf_counter() - t0
        if (loader.epoch, loader.shard) != where:
            switch_times.append(times[i])
        if (loader.epoch, loader.shard) != where or i % 4096 == 0 or i == calls - 1:
            anon, file = rss_mib()
            anon_peak, file_peak = max(anon_peak, anon), max(file_peak, file)
    anon1, file1 = rss_mib()
    del loader
    result = {
        "B": B,
        "T": T,
        "shards": s["shards"],
        "shard_tokens": s["shard_tokens"],
        "batches": calls,
        "switches": len(switch_times),
        "us_per_batch_mean": 1e6 * times.mean(),
        "us_per_batch": stats((1e6 * times).tolist()),
        "us_at_switch": stats([1e6 * t for t in switch_times]),
        "rss_anon_growth_mib": anon_peak - anon0,
        "rss_anon_end_growth_mib": anon1 - anon0,
        "rss_file_peak_growth_mib": file_peak - file0,
    }
    note = f"B {B} T {T}, {len(switch_times)} switches between {s['shards']} shards of {s['shard_tokens']:,} tokens"
    ms, switch_ms = (times * 1e3).tolist(), [t * 1e3 for t in switch_times]
    below_1ms = dict(target=TARGETS["loader_switch_ms"], higher_is_better=False, judge="mean")
    rows = [
        comparison("loader: ms per next_batch, all batches", ms, None, "ms", note=note, **below_1ms),
        comparison("loader: ms per next_batch at a shard switch", switch_ms, None, "ms", **below_1ms),
        comparison(
            "loader: RSS added (anonymous, peak)",
            [anon_peak - anon0],
            None,
            "MiB",
            TARGETS["loader_rss_mb"],
            higher_is_better=False,
            note=f"and up to {file_peak - file0:,.0f} MiB of page cache: the mapped shard",
        ),
    ]
    result["data_identity"], more = bench_data_identity(data_dir, tmp)
    return result, rows + more


def bench_data_identity(data_dir, tmp, n_shards=100, shard_tokens=100_000_000, rounds=5):
    """checks.data_identity, the check of the data every start and --resume makes: on a
    folder of 100 shards of 100M tokens (20 GB, as FineWeb-Edu 10B's: sparse files, a real .npy
    header and then holes, so they take no disk and read from the page cache), and per shard on
    the loader's real shards with their pages dropped from the page cache first (posix_fadvise
    DONTNEED): a read from the disk, as on a machine's first start."""
    import fineweb

    folder = os.path.join(tmp, "identity_data")
    os.makedirs(folder)
    for i in range(n_shards):
        path = fineweb.shard_path(folder, "bench", i)
        np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(shard_tokens,))
    checks.data_identity(folder)  # warm-up: the first start after writing them
    times = [timed(lambda: checks.data_identity(folder), "cpu") for _ in range(rounds)]
    cold = []
    for path in checks.find_shards(data_dir, "train") if hasattr(os, "posix_fadvise") else []:  # not macOS
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        cold.append(timed(lambda: checks.shard_fingerprint(path), "cpu"))
    shutil.rmtree(folder)
    cold_ms = [1e3 * t for t in cold]
    result = {"shards": n_shards, "shard_tokens": shard_tokens, "seconds": stats(times), "cold_ms_per_shard": cold_ms}
    cold_note = (
        f"; {statistics.median(cold_ms):.2f} ms a shard read cold from disk ({len(cold)} real shards)" if cold else ""
    )
    rows = [
        comparison(
            f"data identity check: {n_shards} shards of {shard_tokens:,} tokens",
            times,
            None,
            "s",
            TARGETS["data_identity_s"],
            higher_is_better=False,
            note=f"sparse shards, page cache{cold_note}",
        )
    ]
    return result, rows


# ----------------------------------------------------------------------------------------------
# fineweb.py tokenization


def find_shared_data():
    """shared/data beside the repository (or above it), where the offline test data lives."""
    for base in Path(__file__).resolve().parents:
        if (base / "shared" / "data").is_dir():
            return base / "shared" / "data"
    return None


def bench_fineweb(s, args):
    import fineweb

    pattern = args.docs
    if pattern is None:
        shared = find_shared_data()
        if shared is None or not list((shared / "fineweb_sample").glob("*.parquet")):
            return {"skipped": "no documents: pass --docs 'files/*.parquet'"}, []
        pattern = str(shared / "fineweb_sample" / "*.parquet")
    docs = list(fineweb.local_documents(fineweb.expand_inputs([pattern]), args.text_field))[: s["docs"]]
    workers = fineweb.default_workers()
    # the same work per worker at any core count (a 10B-token run is all steady state): on 16 cores
    # the 2-core amount is a tenth of a second, which measures little beyond starting the pool
    docs = docs * (s["docs_repeat"] * max(1, workers // 2))
    enc = get_tokenizer()
    n_tokens = sum(len(ids) for ids in enc.encode_ordinary_batch(docs, num_threads=workers))
    chars = sum(len(d) for d in docs)
    log(f"  fineweb: {len(docs)} documents, {chars:,} characters, {n_tokens:,} tokens, {workers} workers")

    def ours():  # the CLI's own path: its pool of tokenizer threads, EOT-prefixed uint16 tokens
        out = fineweb.tokenize_docs(docs, workers)
        assert len(out) == n_tokens + len(docs)  # the same work: every token, plus one EOT per document

    def theirs():
        enc.encode_ordinary_batch(docs, num_threads=workers)

    times, _ = interleave({"fineweb": ours, "tiktoken": theirs}, *s["tok_rounds"], "cpu", "fineweb tokenize")
    start = [timed(lambda: fineweb.tokenize_docs([""] * workers, workers), "cpu") for _ in range(3)]  # the pool alone
    tok = {k: rates(n_tokens, v) for k, v in times.items()}
    result = {
        "documents": len(docs),
        "characters": chars,
        "tokens": n_tokens,
        "workers": workers,
        "tok_per_sec": {k: stats(v) for k, v in tok.items()},
        "pool_start_s": stats(start),
    }
    rows = [
        comparison(
            "fineweb.py tokenize vs tiktoken encode_ordinary_batch",
            tok["fineweb"],
            tok["tiktoken"],
            "tok/s",
            TARGETS["fineweb_vs_tiktoken"],
            note=f"{workers} threads each, {n_tokens:,} tokens; "
            f"pool start {statistics.median(start) * 1e3:.1f} ms included",
        )
    ]
    return result, rows


# ----------------------------------------------------------------------------------------------
# HellaSwag and sampling: one eval-mode model


def eval_model(name, device, vocab_size=50257):
    c = TRAIN_CONFIGS[name]
    block_size = 1024 if name != "tiny" else 256
    config = GPTConfig(
        block_size=block_size, vocab_size=vocab_size, n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"]
    )
    torch.manual_seed(0)
    return GPT(config).to(device).eval()  # random weights: the speed does not depend on them


def plain_hellaswag_preds(model, prepared, device):
    """The plain way, for reference: one (context + ending) row per forward pass, logits and
    log-softmax everywhere, the ending's tokens summed. -> (acc predictions, acc_norm predictions)."""
    preds, preds_norm = [], []
    with torch.no_grad():
        for ctx, ends in zip(prepared.ctx, prepared.endings):
            sums = []
            for end in ends:
                row = torch.tensor([ctx + end], device=device)
                logits, _ = model(row[:, :-1])
                logp = F.log_softmax(logits[0].float(), dim=-1)[len(ctx) - 1 :]  # the ending's predictions
                sums.append(-logp.gather(1, row[0, len(ctx) :, None]).sum().item())
            preds.append(min(range(4), key=sums.__getitem__))
            preds_norm.append(min(range(4), key=lambda j: sums[j] / len(ends[j])))
    return preds, preds_norm


def counts_of(prepared, preds, preds_norm):
    return {
        "n": len(preds),
        "correct": sum(p == y for p, y in zip(preds, prepared.labels)),
        "correct_norm": sum(p == y for p, y in zip(preds_norm, prepared.labels)),
    }


def run_hellaswag_cli(ckpt, path, n, device, dtype):
    """The whole `python hellaswag.py` process (start-up, data, tokenizing, model load, eval):
    -> (seconds, {n, correct, correct_norm} parsed from its output)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve().parent / "hellaswag.py"),
        "-m",
        ckpt,
        "--data",
        path,
        "--limit",
        str(n),
        "-d",
        str(device),
        "--dtype",
        dtype,
    ]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"hellaswag.py failed: {r.stderr.strip()[-500:]}")
    counts = {}
    for key, name in (("acc ", "correct"), ("acc_norm ", "correct_norm")):
        line = next(line for line in r.stdout.splitlines() if line.startswith(key))
        counts[name], counts["n"] = map(int, line.split("(")[1].rstrip(")").split("/"))
    return seconds, counts


def save_checkpoint(model, tmp):
    path = os.path.join(tmp, f"hellaswag_model_{model.config.n_layer}.pt")
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config)}, path)
    return path


def bench_hellaswag(s, args, device, device_type, tmp):
    try:
        import hellaswag
    except ImportError as e:
        return {"skipped": f"cannot import hellaswag.py ({e})"}, []
    path = args.hellaswag_data
    if path is None:
        shared = find_shared_data()
        candidate = shared / "hellaswag" / "hellaswag_val.jsonl" if shared else None
        path = str(candidate) if candidate and candidate.is_file() else None
    if path is None:  # hellaswag.py's cache, if an earlier run downloaded it (never a download here)
        candidate = Path(hellaswag.DEFAULT_CACHE_DIR) / hellaswag.CACHE_NAME
        path = str(candidate) if candidate.is_file() else None
    if path is None:
        return {"skipped": "no HellaSwag data: pass --hellaswag-data path/to/hellaswag_val.jsonl"}, []
    try:
        examples = hellaswag.load_examples(path)
    except hellaswag.HellaSwagDataError as e:
        return {"skipped": str(e)}, []
    enc = get_tokenizer()
    n = s["hs_examples"] if device_type == "cpu" else s.get("hs_examples_cuda", s["hs_examples"])
    # the first n examples of the file: what `hellaswag.py --limit n` evaluates
    t0 = time.perf_counter()
    prepared = hellaswag.prepare(examples[:n], enc)
    prepare_s = time.perf_counter() - t0
    model = eval_model(s["hs_model"], device, vocab_size=VOCAB)  # the padded vocabulary training uses
    ckpt = save_checkpoint(model, tmp)
    hellaswag.evaluate(model, hellaswag.prepare(examples[:4], enc), device)  # warm-up
    state = {}

    def in_loop():  # what training calls (the batches are built at the first call and kept)
        state["in_loop"] = hellaswag.evaluate(model, prepared, device)

    def plain():
        state["plain"] = counts_of(prepared, *plain_hellaswag_preds(model, prepared, device))

    def process():  # fp32 too: the same predictions are asserted
        seconds, state["process"] = run_hellaswag_cli(ckpt, path, n, device, "float32")
        state["process_s"] = state.get("process_s", []) + [seconds]

    times, first = interleave(
        {"in_loop": in_loop, "plain": plain, "process": process},
        0,
        s["hs_rounds"],
        device_type,
        f"hellaswag {n} examples",
    )
    ours = {k: state["in_loop"][k] for k in ("n", "correct", "correct_norm")}
    # on CUDA (TF32 matmuls, other kernels) a near-tie between two endings may fall the other way:
    # allow a few such flips there, and none on the CPU
    flips = max(
        abs(ours[k] - other[k]) for other in (state["plain"], state["process"]) for k in ("correct", "correct_norm")
    )
    if flips > (0 if device_type == "cpu" else max(2, n // 500)):
        raise RuntimeError(
            f"hellaswag: different answers: in-loop {ours}, plain {state['plain']}, process {state['process']}"
        )
    ex = {k: rates(n, v) for k, v in times.items()}
    note = f"{s['hs_model']} model, first {n:,} examples, fp32, same predictions"
    result = {
        "model": s["hs_model"],
        "examples_per_round": n,
        "examples_per_sec": {k: stats(v) for k, v in ex.items()},
        "first_in_loop_s": first["in_loop"],
        "prepare_s": prepare_s,
        "counts": ours,
        "same_counts": True,
    }
    rows = [
        comparison(
            "hellaswag in-loop evaluate vs plain one-row-per-forward loop",
            ex["in_loop"],
            ex["plain"],
            "ex/s",
            note=note,
        ),
        comparison(
            "hellaswag.py whole process vs plain one-row-per-forward loop in-process",
            ex["process"],
            ex["plain"],
            "ex/s",
            TARGETS["hellaswag_process"],
            note=f"{note}; start-up included",
        ),
    ]
    del model
    # the one-time host work of a full-set eval, with no model: tokenizing the set (prepare) and
    # building the batches for a 1024-token window and copying them to the device (the first
    # evaluate() call does this; _batches is that step alone)
    host = {"prepare": [], "batches": []}
    batch_tokens = 65536 if device_type == "cuda" else 4096  # evaluate()'s defaults
    for _ in range(2):
        t0 = time.perf_counter()
        full = hellaswag.prepare(examples, enc)
        host["prepare"].append(time.perf_counter() - t0)
        host["batches"].append(
            timed(lambda p=full: hellaswag._batches(p, range(len(p)), 1024, True, batch_tokens, device), device_type)
        )
    result["full_set_host_s"] = {k: stats(v) for k, v in host.items()}
    rows.append(
        comparison(
            f"hellaswag one-time host work, full {len(examples):,} examples: prepare + build the batches",
            [a + b for a, b in zip(host["prepare"], host["batches"])],
            None,
            "s",
            higher_is_better=False,
            note=f"prepare {stats(host['prepare'])['median']:.2f} s, "
            f"batches {stats(host['batches'])['median']:.2f} s; window 1024",
        )
    )
    if device_type == "cuda" and s.get("hs_full_gpt2"):
        # the CUDA targets: the full set with a 124M model in bf16, in training and as a process
        prepared = hellaswag.prepare(examples, enc)  # fresh: its first evaluate() builds the batches
        model = eval_model("gpt2", device, vocab_size=VOCAB)
        ckpt = save_checkpoint(model, tmp)
        evaluate = lambda: hellaswag.evaluate(model, prepared, device, autocast_dtype=torch.bfloat16)  # noqa: E731
        first_s = timed(evaluate, device_type)  # builds and uploads the batches
        in_loop = [timed(evaluate, device_type) for _ in range(3)]
        process = [run_hellaswag_cli(ckpt, path, len(examples), device, "bfloat16")[0] for _ in range(2)]
        result["full_gpt2_bf16"] = {
            "in_loop_s": stats(in_loop),
            "first_in_loop_s": first_s,
            "process_s": stats(process),
        }
        rows += [
            comparison(
                "hellaswag in training: full 10,042, gpt2 124M, bf16",
                in_loop,
                None,
                "s",
                TARGETS["hellaswag_full_s"],
                higher_is_better=False,
                note=f"first call {first_s:.1f} s builds the batches",
            ),
            comparison(
                "hellaswag.py -m <124M> full set, bf16, whole process",
                process,
                None,
                "s",
                TARGETS["hellaswag_process_full_s"],
                higher_is_better=False,
            ),
        ]
        del model
    return result, rows


def bench_sample(s, device, device_type):
    enc = get_tokenizer()
    model = eval_model(s["eval_model"], device)
    prompt = torch.tensor([enc.encode("Hello, I'm a language model,")], dtype=torch.long, device=device)
    new = min(s["new_tokens"], model.config.block_size - prompt.size(1))

    def generate(use_cache, n_tokens, compile=False):
        def run():  # the same seed every call: the same tokens drawn, the same work
            g = torch.Generator(device=device).manual_seed(42)
            model.generate(prompt, n_tokens, generator=g, use_cache=use_cache, compile=compile)

        return run

    for use_cache in (True, False):  # warm-up: a few tokens are enough, recomputing 256 is long
        generate(use_cache, 8)()
    contenders = {"kv_cache": generate(True, new), "recompute": generate(False, new)}
    compile_s = None
    if device_type == "cuda":  # the compiled, CUDA-graph decode step; its first call compiles
        compile_s = timed(generate(True, new, compile=True), device_type)
        contenders = {"kv_cache_compiled": generate(True, new, compile=True), **contenders}
    # what a run does at each --sample-every with the defaults: 4 samples of 32 tokens from the
    # eager KV cache under the run's autocast (bf16 on CUDA); timed as one call, seconds
    autocast_dtype = torch.bfloat16 if device_type == "cuda" else None

    def in_training():
        with train_gpt2.autocast(device_type, autocast_dtype):
            sampling.sample_text(model, enc, "Hello, I'm a language model,", num_samples=4, max_new_tokens=32)

    first_in_training_s = timed(in_training, device_type)  # picks kernels, as a run's first sample step does
    contenders["in_training"] = in_training
    rounds = s["sample_rounds"] if device_type == "cpu" else s["sample_rounds_cuda"]  # cheap there: more repeats
    times, _ = interleave(contenders, 0, rounds, device_type, f"sample {new} tokens")
    in_training_s = times.pop("in_training")
    tok = {k: rates(new, v) for k, v in times.items()}
    result = {
        "model": s["eval_model"],
        "new_tokens": new,
        "prompt_tokens": prompt.size(1),
        "batch": 1,
        "tok_per_sec": {k: stats(v) for k, v in tok.items()},
        "compile_s": compile_s,
        "in_training_s": stats(in_training_s),
        "first_in_training_s": first_in_training_s,
    }
    note = f"{s['eval_model']} model, batch 1"
    rows = [
        comparison(
            f"sample {new} new tokens: KV cache vs recompute",
            tok["kv_cache"],
            tok["recompute"],
            "tok/s",
            TARGETS["kv_cache"] if device_type == "cpu" else None,
            note=note,
        )
    ]  # the target is the CPU's
    rows.append(
        comparison(
            "samples in training: 4 x 32 tokens, eager KV cache" + (", bf16" if autocast_dtype else ""),
            in_training_s,
            None,
            "s",
            TARGETS["samples_in_training_s"] if device_type == "cuda" else None,
            higher_is_better=False,
            note=f"{note.replace('batch 1', 'batch 4')}; the first call {first_in_training_s:.2f} s",
        )
    )
    if "kv_cache_compiled" in tok:
        rows += [
            comparison(
                f"sample {new} new tokens: compiled decode step (CUDA graphs) vs eager KV cache",
                tok["kv_cache_compiled"],
                tok["kv_cache"],
                "tok/s",
                note=f"{note}, compile {compile_s:.0f} s",
            ),
            comparison(
                f"sample {new} new tokens: compiled decode step, batch 1",
                tok["kv_cache_compiled"],
                None,
                "tok/s",
                TARGETS["decode_tok_s_cuda"],
                note=note,
            ),
        ]
    return result, rows


# ----------------------------------------------------------------------------------------------
# Command line


def machine(device, device_type):
    cpu = platform.processor() or platform.machine()
    try:
        info = {k.strip(): v for k, v in (line.split(":", 1) for line in open("/proc/cpuinfo") if ":" in line)}
        cpu = f"{info['model name'].strip()} (family {info['cpu family'].strip()}, model {info['model'].strip()})"
    except (OSError, KeyError):
        pass
    import transformers

    return {
        "device": torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu",
        "cpu": cpu,
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="small models, eager only, fewer rounds (< 5 min on 2 CPU cores)"
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
    args = p.parse_args(argv)
    args.only = args.only.split(",") if args.only else list(SECTIONS)
    args.configs = args.configs.split(",") if args.configs else None
    for name in args.only:
        if name not in SECTIONS:
            raise UserError(f"--only {name}: unknown section, choose from {', '.join(SECTIONS)}")
    for name in args.configs or []:
        if name not in TRAIN_CONFIGS:
            raise UserError(f"--configs {name}: unknown config, choose from {', '.join(TRAIN_CONFIGS)}")
    if args.tiny and args.quick:
        raise UserError("--tiny and --quick are two sizes of run: pass one")
    return args


def main(argv=None):
    args = parse_args(argv)
    shared = find_shared_data()
    if shared is not None and (shared / "tiktoken_cache").is_dir():
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(shared / "tiktoken_cache"))  # offline machines
    s = settings(args)
    device, device_type = pick_device(args.device)
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # as train_gpt2 does: TF32 for fp32 matmuls
    peak = args.peak_flops or (peak_flops(torch.cuda.get_device_name(device)) if device_type == "cuda" else None)
    if device_type == "cuda" and peak is None:
        raise UserError(f"no peak FLOP/s known for {torch.cuda.get_device_name(device)}: pass --peak-flops")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise UserError(f"--out {args.out}: folder {out_dir} does not exist")

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
        for section in SECTIONS:
            if section not in args.only:
                continue
            log(f"{section} ...")
            t0 = time.time()
            if section == "ceiling":
                result, rows = bench_ceiling(s, device, device_type)
            elif section == "loader":
                result, rows = bench_loader(s, device_type, tmp)
            elif section == "fineweb":
                result, rows = bench_fineweb(s, args)
            elif section == "train":
                result, rows = bench_train(s, device, device_type, peak, tmp)
            elif section == "ladder":
                result, rows = bench_ladder(s, args, device, device_type, tmp)
            elif section == "hellaswag":
                if device_type == "cpu":  # as hellaswag.py and training evaluate there (also with --only)
                    keep_freed_memory()
                result, rows = bench_hellaswag(s, args, device, device_type, tmp)
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
    if "ladder" in report["sections"]:
        ladder = report["sections"]["ladder"]
        print(f"\nspeed-up ladder on {ladder['device']}, {ladder['config_text']}:\n")
        print(ladder["table"])
        if ladder["png"]:
            print(f"wrote {os.path.relpath(ladder['png'])}")
    for section, result in report["sections"].items():
        if "skipped" in result:
            print(f"\n{section}: skipped ({result['skipped']})")
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    run_cli(main)

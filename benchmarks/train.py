"""The training step against transformers', glibc's kept freed memory, and the cost of wandb logging."""

import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

import numpy as np
import torch
from torch import nn

import train_gpt2
from benchmarks.ceiling import matmul_fn
from benchmarks.report import comparison, fmt
from benchmarks.settings import ORIGINAL_MFU, ORIGINAL_TOK_PER_SEC, ROOT, TRAIN_CONFIGS, VOCAB
from benchmarks.timing import interleave, log, rates, stats, timed
from support.cli import UserError
from support.device import keep_freed_memory
from support.run_log import RunLog
from support.shards import shard_path, write_shard
from train_gpt2 import GPT, DataLoaderLite, GPTConfig, flops_per_token


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
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415  2 s to import: only the hf contender needs it

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


def train_step_fn(model, optimizer, loader, autocast_dtype, grad_accum_steps=1):
    """train_gpt2's step: zero grads, forward + backward of grad_accum_steps micro-batches (each
    loss divided by their number), clip to 1.0, AdamW; the step returns its loss, the mean over the
    micro-batches (a tensor: reading it waits for the device). In fp16, with the loss scaled and the
    gradients unscaled before the clip by a GradScaler, as train_gpt2 does."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    device_type = torch.device(loader.device).type
    scaler = torch.amp.GradScaler(device_type, enabled=autocast_dtype == torch.float16)  # else a no-op

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_accum = 0.0
        for _ in range(grad_accum_steps):
            x, y = loader.next_batch()
            with train_gpt2.autocast(device_type, autocast_dtype):
                loss = model(x, y)[1]  # as the recipe: the logits not kept
            loss = loss / grad_accum_steps
            loss_accum = loss_accum + loss.detach()  # before the next micro-batch: CUDA graphs reuse the output
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(optimizer)  # skipped when the fp16 gradients overflowed
        scaler.update()
        return loss_accum

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
            mfu[k] = [fpt * x / cl for x, cl in zip(r, ceiling, strict=True)]
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
                    "vs_transformers",
                    note=note,
                )
            )
    for mode in ("eager", "compiled"):
        if f"ours fp32 {mode}" not in tok:
            continue
        fp32, bf16 = tok[f"ours fp32 {mode}"], tok[f"ours bf16 {mode}"]
        target = "bf16_vs_fp32" if device_type == "cpu" else None  # the target is the CPU's
        rows.append(comparison(f"train {name} {mode}: bf16 vs fp32 (ours)", bf16, fp32, "tok/s", target))
        if name == "gpt2" and device_type == "cpu":  # the quoted reference's own config and precision
            mfu32 = mfu[f"ours fp32 {mode}"]
            rows += [
                comparison(
                    f"train gpt2 fp32 {mode}: ours vs build-nanogpt",
                    fp32,
                    ORIGINAL_TOK_PER_SEC,
                    "tok/s",
                    "vs_original",
                    note="its quoted 164 tok/s",
                ),
                comparison(
                    f"train gpt2 fp32 {mode}: MFU ours vs build-nanogpt",
                    mfu32,
                    ORIGINAL_MFU,
                    "%",
                    "vs_original",
                    note="its quoted 79% of the fp32 ceiling",
                ),
                comparison(
                    f"train gpt2 fp32 {mode}: MFU (of the fp32 torch.mm ceiling)", mfu32, None, "%", "mfu_gpt2_fp32"
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
                    "compile_vs_eager",
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
                code = f"from benchmarks.train import heap_probe; heap_probe({c!r}, {data_dir!r}, {name == 'kept'}, 3)"
                out = subprocess.run(
                    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
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
    data_dir = os.path.join(tmp, "train_data")
    os.makedirs(data_dir, exist_ok=True)
    tokens = np.random.default_rng(0).integers(0, 50257, 2_000_000, dtype=np.uint16)
    write_shard(shard_path(data_dir, "bench", 1), tokens)
    results, rows = {}, []
    # on a CPU, from here on (and for hellaswag after it), as training and hellaswag.py run there
    if device_type == "cpu" and keep_freed_memory():
        results["keep_freed_memory"], rows = bench_keep_freed_memory(s, data_dir)
    for name in s["configs"]:
        results[name], r = bench_train_config(name, s, device, device_type, peak, data_dir)
        rows += r
    results["wandb_logging"], r = bench_wandb_logging(s, tmp, results[s["configs"][-1]])
    return results, rows + r


def drained(mirror, timeout=60):
    """Wait until the records the wandb mirror has queued so far are logged (its thread sets an Event it
    meets in the queue); False if wandb failed or timeout passed."""
    done, deadline = threading.Event(), time.monotonic() + timeout
    mirror.records.put(done)
    while not done.wait(0.01):
        if mirror.error is not None or time.monotonic() > deadline:
            return False
    return True


def bench_wandb_logging(s, tmp, train_result):
    """The cost of --wandb-project per step record, with wandb offline (no network: what is
    measured is wandb's own work): RunLog with its wandb mirror against RunLog alone (log.jsonl),
    the console line left out of both. 'on the step': what the training loop waits for; 'drained':
    also until wandb's thread has logged the records, the most it costs where nothing overlaps.
    Against the fastest of our steps of the last train config."""
    try:
        import wandb  # noqa: F401, PLC0415  optional: without it this part is skipped
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
            logs[name] = run_log = RunLog(out, True, n * (rounds + 1), {})
            run_log.print = lambda record: None
            run_log.mirror(project, None, f"bench-{name}-{os.getpid()}", ExitStack())  # finished below
            run_log.header(f"bench-{name}-{os.getpid()}", "bench", None, {}, {"out_dir": out})
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
            if not drained(mirror):
                raise UserError(f"wandb failed in the benchmark: {mirror.error}")
            t2 = time.perf_counter()
            for record in records():
                logs["wandb"](record)
            t3 = time.perf_counter()
            drained(mirror)
            t4 = time.perf_counter()
            if r > 0:
                times["plain"].append((t1 - t0) / n)
                times["on_step"].append((t3 - t2) / n)
                times["drained"].append((t4 - t2) / n)
            done = ", ".join(f"{k} {v[-1] * 1e3:.3f} ms" for k, v in times.items() if v) or "warm-up"
            log(f"  wandb logging: round {r + 1}/{rounds + 1}: {done}")
        logs["wandb"].finish_wandb()
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

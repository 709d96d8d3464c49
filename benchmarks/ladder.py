"""build-nanogpt's speed-up ladder and this project's rungs past it, one change per rung, the losses checked."""

import gc
import json
import os
import statistics
import subprocess
import sys
from contextlib import nullcontext

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.chunked_loss import chunked_cross_entropy
from benchmarks.report import fmt_stats
from benchmarks.settings import ROOT, TRAIN_CONFIGS
from benchmarks.timing import interleave, log, rates, stats
from benchmarks.train import fits_in_memory, train_step_fn
from support.device import compile_problem, keep_freed_memory
from support.files import write_atomic
from support.precision import pick_dtype
from support.shards import shard_path, write_shard
from train_gpt2 import GPT, DataLoaderLite, GPTConfig

# The reference run (build-nanogpt on one A100, 124M, B 16, T 1024): (tok/s, ms per step) at each
# rung; its rung 8, "DDP" here, is its whole job on 8 GPUs.
LADDER_REFERENCE = {
    1: (16_300, 1000.0),
    2: (49_000, 333.0),
    3: (54_700, 300.0),
    4: (126_000, 129.5),
    5: (170_000, 97.0),
    6: (176_000, 93.0),
    7: (182_000, 90.0),
    "DDP": (1_500_000, None),
}

# (rung, what it changes, the change's name, what it needs): each rung keeps every change before
# it. 1-7 are the reference's; from 8 this project's, past its end point (rung 7 is build-nanogpt's
# configuration). needs: "cuda" (why a CPU cannot run it) for a rung that runs on CUDA only,
# "compile" for a setting of torch.compile's (nothing to run without compile)
LADDER_RUNGS = (
    (1, "fp32 baseline", None, {}),
    (2, "TF32 matmuls", "tf32", {}),
    (3, "bf16 autocast", "bf16", {}),
    (4, "torch.compile", "compile", {}),
    (5, "flash attention (SDPA)", "sdpa", {}),
    (6, "vocab 50,257 padded to 50,304", "padded_vocab", {}),
    (7, "fused AdamW, GPT-3 parameter groups", "fused_adamw", {}),
    (8, "LM head + cross-entropy fused in chunks of rows (no full logits)", "chunked_loss", {}),
    (9, "larger micro-batch, same total batch", "bigger_B", {}),
    (10, "cuDNN attention (SDPA backend)", "cudnn_attention", {"cuda": "cuDNN's attention backend"}),
    (
        11,
        'compile mode "max-autotune-no-cudagraphs"',
        "autotune",
        {"cuda": "autotunes the GPU's GEMM and Triton kernels", "compile": True},
    ),
    (12, 'CUDA graphs (compile mode "max-autotune")', "cuda_graphs", {"cuda": "CUDA graphs", "compile": True}),
)
LADDER_CHUNK_ROWS = 4096  # rung 8: rows of logits at a time; 4,096 x 50,304 in fp32 is 0.8 GB
LADDER_MAX_B_FACTOR = 8  # rung 9 on CUDA: the micro-batch grows by up to 8x (B 16 -> 128) where it fits

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


class ChunkedLossGPT(nn.Module):
    """Rung 8's model: the GPT's hidden states, then the LM head and the loss fused in chunks of
    rows (benchmarks.chunked_loss.chunked_cross_entropy), with the GPT's own tied lm_head weight.
    Training's call only: it returns (None, loss), no logits."""

    def __init__(self, gpt, chunk_rows=LADDER_CHUNK_ROWS):
        super().__init__()
        self.gpt, self.chunk_rows = gpt, chunk_rows

    def forward(self, idx, targets):
        x = self.gpt.hidden_states(idx)  # (B, T, n_embd)
        w = self.gpt.lm_head.weight
        return None, chunked_cross_entropy(x.view(-1, x.size(-1)), w, targets.reshape(-1), self.chunk_rows)

    def configure_optimizers(self, *args, **kwargs):
        return self.gpt.configure_optimizers(*args, **kwargs)


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
    masked-softmax attention unless the rung has flash attention, the chunked loss from rung 8."""
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
    return ChunkedLossGPT(model) if "chunked_loss" in changes else model


def ladder_half(device_type):
    """Rung 3's 16-bit autocast dtype: bf16, or fp16 with a GradScaler on a GPU without native bf16
    (compute capability below 8.0: T4, V100), where bf16 is emulated; as --dtype auto picks."""
    return torch.float16 if device_type == "cuda" and pick_dtype("auto", "cuda")[0] == "float16" else torch.bfloat16


def compile_mode(changes):
    """torch.compile's mode for a rung: max-autotune (CUDA graphs and autotuned kernels) from rung
    12, its no-cudagraphs variant at rung 11, the default before."""
    if "cuda_graphs" in changes:
        return "max-autotune"
    return "max-autotune-no-cudagraphs" if "autotune" in changes else None


def attention_backend(changes):
    """The SDPA backends a rung's steps may use: cuDNN's only from rung 10, any (torch's pick) before."""
    if "cudnn_attention" not in changes:
        return nullcontext()
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


def cudnn_attention_unavailable(device):
    """Why cuDNN's SDPA backend cannot run here, or None: asked of torch with a small causal bf16 call."""
    if torch.device(device).type != "cuda":
        return "CUDA only (cuDNN's attention)"
    try:
        q = torch.randn(1, 2, 64, 64, device=device, dtype=torch.bfloat16)
        with attention_backend({"cudnn_attention"}):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except Exception as e:  # no cuDNN 9, a GPU before sm80, a torch without the backend
        return f"cuDNN attention is unavailable here ({str(e).strip().splitlines()[0][:120]})"
    return None


def ladder_step(changes, base_state, c, B, data_dir, device, device_type, grad_accum_steps=1):
    """(step function, the list its losses go to) for a rung: train_gpt2's training step
    (train_step_fn, grad_accum_steps micro-batches of B) on this rung's model, optimizer, precision,
    attention backend and compile setting, reading the same batches as every other rung. Each call
    sets the rung's fp32 matmul precision first, so that rungs interleaved in one process each run
    at their own. On CUDA the step function's peak_bytes holds the most GPU memory a step held."""
    model = ladder_model(changes, base_state, c, device)
    if "fused_adamw" in changes:
        optimizer = model.configure_optimizers(0.1, LADDER_LR, device_type, verbose=False)
    else:  # torch's AdamW as its users call it: every parameter decayed, one group, torch's default kernel
        optimizer = torch.optim.AdamW(model.parameters(), lr=LADDER_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # static shapes, as in training: a rung with other shapes (vocab, B) gets its own graph, not a dynamic one
    run = torch.compile(model, dynamic=False, mode=compile_mode(changes)) if "compile" in changes else model
    loader = DataLoaderLite(data_dir, "train", B, c["T"], shuffle=False, device=device)
    half = ladder_half(device_type) if "bf16" in changes else None
    step = train_step_fn(run, optimizer, loader, half, grad_accum_steps)
    precision = "high" if "tf32" in changes else "highest"
    losses = []

    def run_step():
        torch.set_float32_matmul_precision(precision)
        if device_type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with attention_backend(changes):
            losses.append(step().item())  # training reads each step's loss too
        if device_type == "cuda":
            run_step.peak_bytes = max(run_step.peak_bytes, torch.cuda.max_memory_allocated(device))

    run_step.peak_bytes = None if device_type != "cuda" else 0
    return run_step, losses


def tf32_has_effect(base_state, c, data_dir, device):
    """Whether allowing TF32 changes the fp32 model's logits on this device (bitwise): where it
    does not (CPUs without TF32 matmuls, GPUs before Ampere), the same kernels run either way."""
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


def compile_unavailable(s, device):
    """Why this run has no compile rung, or None: the training script's own check on device."""
    if True not in s["compile"]:
        return "compile is off in this run (--compile runs it)"
    why = compile_problem(str(device))
    torch._dynamo.reset()  # the probe's graph is not the rungs'
    return f"torch.compile is unavailable here ({why[:120]})" if why else None


def loss_check(losses, changes, against=1):
    """{rung: (max |loss - the other rung's loss| over the steps, tolerance, agrees)}, each rung's
    losses against rung `against`'s (rung 1: fp32) step by step; the tolerance is that of the lower
    precision of the two (bf16, else TF32, else fp32), plus the padded vocabulary's allowance where
    one of them has it and the other not."""
    out = {}
    ref = losses[against]
    for rung, values in losses.items():
        if len(values) != len(ref):
            raise ValueError(f"rung {rung} ran {len(values)} steps, rung {against} {len(ref)}")
        diff = max(abs(a - b) for a, b in zip(values, ref, strict=True))
        tol = LADDER_LOSS_TOL[ladder_precision(changes[rung] | changes[against])]
        tol += (
            LADDER_PAD_ALLOWANCE if ("padded_vocab" in changes[rung]) != ("padded_vocab" in changes[against]) else 0.0
        )
        out[rung] = (diff, tol, diff <= tol)
    return out


def ladder_precision(changes, half=torch.bfloat16):
    """The lowest precision a rung's matmuls run in; rung 3's fp16 (ladder_half) is held to bf16's
    tolerance, which its 3 more mantissa bits meet with room."""
    if "bf16" in changes:
        return "fp16" if half == torch.float16 else "bf16"
    return "tf32" if "tf32" in changes else "fp32"


def ladder_ddp(n_proc, c, B, steps, data_dir, out_dir, device_type):
    """The DDP rung (the reference's rung 8): train_gpt2.py under torchrun, one process per GPU, rung 7's settings
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
        str(ROOT / "train_gpt2.py"),
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
    if device_type == "cuda":  # bf16, or fp16 on a GPU without native bf16 (ladder_half)
        cmd += ["--dtype", "float16" if ladder_half(device_type) == torch.float16 else "bfloat16", "--compile"]
    else:
        cmd += ["--device", "cpu", "--dtype", "float32", "--no-compile"]
    r = subprocess.run([str(a) for a in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"the DDP rung (torchrun train_gpt2.py) failed: {r.stderr.strip()[-800:]}")
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
    import matplotlib  # noqa: PLC0415  only ladder.png needs it, and a missing one costs only the picture

    matplotlib.use("Agg")  # no display: chosen before pyplot loads
    import matplotlib.pyplot as plt  # noqa: PLC0415  as above, after the backend is chosen

    rows = result["rungs"]
    labels = [str(r["rung"]) for r in rows]
    ours = [r["tok_per_sec"]["median"] if r["measured"] else 0 for r in rows]
    ref = [r["reference_tok_per_sec"] or 0 for r in rows]
    first = next(r for r in rows if r["measured"])  # rung 1 in the ladder section
    ours1 = first["tok_per_sec"]["median"]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, scale, title in ((axes[0], False, "tok/s"), (axes[1], True, f"speed-up over rung {first['rung']}")):
        mine = [v / ours1 if scale else v for v in ours]
        theirs = [v / (first["reference_tok_per_sec"] or ref[0]) if scale else v for v in ref]
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
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


def ladder_table(result):
    lines = [
        "| rung | what changes | tok/s [min–max] | ms per step | vs previous [paired min–max] | vs rung 1 "
        "| A100 reference | loss vs rung 1 (tolerance) | loss vs rung 7 (tolerance) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rungs"]:
        ref_tok, ref_ms = r["reference_tok_per_sec"], r["reference_ms"]
        ref = "" if ref_tok is None else f"{ref_tok / 1000:,.1f}K tok/s" + (f", {ref_ms:,g} ms" if ref_ms else "")
        if ref_tok and ref_tok >= 1e6:
            ref = f"{ref_tok / 1e6:g}M tok/s"
        # compile: the first step over a later one; a cache hit leaves ~0, and noise can make that negative
        change = r["change"] + (f" (compile {max(0, r['compile_s']):.0f} s)" if r.get("compile_s") is not None else "")
        if not r["measured"]:
            lines.append(f"| {r['rung']} | {change} | not measured: {r['note']} |  |  |  | {ref} |  |  |")
            continue
        prev = ""
        if r.get("vs_previous") is not None:
            prev = f"{r['vs_previous']:.2f}x"
            if r.get("vs_previous_paired"):
                prev += f" [{r['vs_previous_paired']['min']:.2f}–{r['vs_previous_paired']['max']:.2f}]"
            if isinstance(r["rung"], int) and r.get("previous") != r["rung"] - 1:
                prev += f" (over rung {r['previous']})"
        loss = ""
        if r.get("loss_max_abs_diff") is not None:
            ok = "" if r["loss_max_abs_diff"] <= r["loss_tol"] else " **differs**"
            loss = f"{r['loss_max_abs_diff']:.2g} (≤ {r['loss_tol']:g}){ok}"
        loss7 = ""
        if r.get("loss_vs_rung7_max_abs_diff") is not None:
            ok = "" if r["loss_vs_rung7_max_abs_diff"] <= r["loss_vs_rung7_tol"] else " **differs**"
            loss7 = f"{r['loss_vs_rung7_max_abs_diff']:.2g} (≤ {r['loss_vs_rung7_tol']:g}){ok}"
        note = f"; {r['note']}" if r.get("note") else ""
        ms = r["step_ms"]["median"]
        vs1 = "" if r.get("vs_rung1") is None else f"{r['vs_rung1']:.2f}x"
        lines.append(
            f"| {r['rung']} | {change}{note} | {fmt_stats(r['tok_per_sec'], 'tok/s')} | {ms:,.1f} ms | {prev} "
            f"| {vs1} | {ref} | {loss} | {loss7} |"
        )
    return "\n".join(lines)


def ladder_setup(s, device, device_type, tmp):
    """What every rung of a run shares, settled once before any rung runs: the config and its B
    (halved on CUDA until rung 1 fits), rung 9's micro-batch factor, a shard of random token ids
    in tmp, the base weights, rung 3's half dtype, and {rung: why it does not run here}."""
    if device_type == "cpu":  # as a CPU training run does
        keep_freed_memory()
    name, c = ladder_config(s["ladder_config"], device_type)
    T, B = c["T"], c["B"]
    data_dir = os.path.join(tmp, "ladder_data")
    os.makedirs(data_dir, exist_ok=True)
    tokens = np.random.default_rng(1).integers(0, 50257, 2_000_000, dtype=np.uint16)
    write_shard(shard_path(data_dir, "bench", 1), tokens)
    base_state = ladder_base_state(c)
    if device_type == "cuda":  # rung 1 (fp32, the (T, T) scores) needs the most memory: halve B until it fits
        probe = ladder_model(set(), base_state, c, device)
        while B > 1 and not fits_in_memory([probe], B, T, None, device):
            log(f"  ladder: B {B} does not fit in GPU memory at rung 1, trying half")
            B //= 2
        c["B"] = B
        del probe
        torch.cuda.empty_cache()
    accum = ladder_accum(base_state, c, B, device, device_type)  # rung 9's micro-batch is B * accum
    config_text = (
        f"{name} config: {c['n_layer']} layers, {c['n_head']} heads, {c['n_embd']} wide, B {B}, T {T}, "
        f"{accum} micro-batches a step (rung 9: one of B {B * accum})"
    )
    log(f"  ladder on {device}: {config_text}")
    torch._dynamo.reset()

    half = ladder_half(device_type)  # rung 3 runs fp16 on a GPU without native bf16, and says so
    return dict(
        name=name, c=c, B=B, T=T, accum=accum, data_dir=data_dir, base_state=base_state, half=half,
        skipped=skipped_rungs(s, base_state, c, data_dir, device, device_type), config_text=config_text,
    )  # fmt: skip


def skipped_rungs(s, base_state, c, data_dir, device, device_type):
    """{rung: why it does not run here}: what a rung needs (LADDER_RUNGS) that this run lacks, or a
    change that has no effect or is unavailable on this device."""
    skipped = {}
    compile_rung = next(rung for rung, _, change, _ in LADDER_RUNGS if change == "compile")
    for rung, _, change, needs in LADDER_RUNGS:
        if "cuda" in needs and device_type != "cuda":
            skipped[rung] = f"CUDA only ({needs['cuda']})"
        elif "compile" in needs and compile_rung in skipped:
            no_compile = f"rung {compile_rung}: {skipped[compile_rung]}"
            skipped[rung] = f"a compile setting, and this run has no compile ({no_compile})"
        elif change == "tf32" and not tf32_has_effect(base_state, c, data_dir, device):
            skipped[rung] = "no effect on this device (fp32 logits bitwise the same with TF32 allowed)"
        elif change == "compile" and (why := compile_unavailable(s, device)):
            skipped[rung] = why
        elif change == "cudnn_attention" and (why := cudnn_attention_unavailable(device)):
            skipped[rung] = why
    return skipped


def measure_rungs(setup, rungs, device, device_type, warmup, rounds):
    """The chosen rungs (less the skipped ones) interleaved in rounds of their own, from the same
    weights on the same batches. -> {rung: {"seconds": per measured round, "first_s", "losses",
    "changes", "peak_bytes", "group": the rungs measured alongside}}."""
    c, B, accum, skipped = setup["c"], setup["B"], setup["accum"], setup["skipped"]
    contenders, losses, changes = {}, {}, {}
    for rung in rungs:
        if rung in skipped:
            continue
        changes[rung] = change_set(rung, skipped)
        micro, n = (B * accum, 1) if "bigger_B" in changes[rung] else (B, accum)
        step, losses[rung] = ladder_step(
            changes[rung], setup["base_state"], c, micro, setup["data_dir"], device, device_type, n
        )
        contenders[f"rung {rung}"] = step
    before = torch.get_float32_matmul_precision()
    try:
        times, first = interleave(contenders, warmup, rounds, device_type, f"ladder {setup['name']} B{B} T{c['T']}")
    finally:
        torch.set_float32_matmul_precision(before)
    group = tuple(losses)
    out = {
        rung: dict(
            seconds=times[f"rung {rung}"],
            first_s=first[f"rung {rung}"],
            losses=losses[rung],
            changes=changes[rung],
            peak_bytes=contenders[f"rung {rung}"].peak_bytes,
            group=group,
        )
        for rung in losses
    }
    del contenders
    gc.collect()
    return out


def rung_rows(setup, measured, not_run=None):
    """A row for every rung of LADDER_RUNGS: a measured one's tok/s, ms per step, its ratio over the
    rung before it in its own rounds (paired), over rung 1, its compile time and its losses checked
    against rung 1's and (from rung 8) rung 7's where those were measured; an unmeasured one's why
    (setup's skipped, else not_run's, else "not run")."""
    B, T, accum, half, skipped = setup["B"], setup["T"], setup["accum"], setup["half"], setup["skipped"]
    not_run = not_run or {}
    losses = {k: m["losses"] for k, m in measured.items()}
    changes = {k: m["changes"] for k, m in measured.items()}
    checks = loss_check(losses, changes) if 1 in losses else {}
    checks7 = loss_check(losses, changes, against=7) if 7 in losses else {}
    tok = {k: rates(accum * B * T, m["seconds"]) for k, m in measured.items()}
    rows = []
    for rung, what, change, _ in LADDER_RUNGS:
        ref_tok, ref_ms = LADDER_REFERENCE.get(rung, (None, None))  # none past the reference's rung 7
        if change == "bf16" and half == torch.float16:
            what = "fp16 autocast + GradScaler (this GPU has no native bf16)"
        row = {"rung": rung, "change": what, "reference_tok_per_sec": ref_tok, "reference_ms": ref_ms}
        if rung not in measured:
            rows.append({**row, "measured": False, "note": skipped.get(rung) or not_run.get(rung, "not run")})
            continue
        m = measured[rung]
        earlier = [k for k in m["group"] if k < rung]
        previous = earlier[-1] if earlier else None
        row.update(measured=True, note="", tok_per_sec=stats(tok[rung]), step_ms=stats([1e3 * t for t in m["seconds"]]))
        row.update(vs_rung1=stats(tok[rung])["median"] / stats(tok[1])["median"] if 1 in tok else None)
        row["previous"] = previous
        if previous is not None:
            row["vs_previous"] = stats(tok[rung])["median"] / stats(tok[previous])["median"]
            row["vs_previous_paired"] = stats([a / b for a, b in zip(tok[rung], tok[previous], strict=True)])
        if "compile" in m["changes"]:  # the first step's time over a later one's
            row["compile_s"] = m["first_s"] - statistics.median(m["seconds"])
        row.update(losses=m["losses"], loss_precision=ladder_precision(m["changes"], half))
        diff, tol, agree = checks.get(rung, (None, None, True))
        row.update(loss_max_abs_diff=diff, loss_tol=tol, losses_agree=agree)
        row.update(
            B=B * accum if "bigger_B" in m["changes"] else B,
            grad_accum_steps=1 if "bigger_B" in m["changes"] else accum,
        )
        if m["peak_bytes"] is not None:
            row["peak_memory_gib"] = m["peak_bytes"] / 2**30
        if rung > 7 and rung in checks7:  # this project's rungs: against build-nanogpt's end point too
            diff7, tol7, agree7 = checks7[rung]
            row.update(loss_vs_rung7_max_abs_diff=diff7, loss_vs_rung7_tol=tol7, losses_agree=agree and agree7)
        rows.append(row)
    return rows


def rung_7_plus(setup, device, device_type, warmup, rounds, rung1_tok=None):
    """The recipe's B 64 (CUDA, the gpt2 config): rung 7 at B 64 against rung 7 at B 16, interleaved
    in rounds of their own. -> its row (not measured, with why, elsewhere or where B 64 does not fit)."""
    row = {"rung": "7+", "change": "the recipe's B 64", "reference_tok_per_sec": None, "reference_ms": None}
    if not (device_type == "cuda" and setup["name"] == "gpt2"):
        return {**row, "measured": False, "note": "CUDA and the gpt2 config only"}
    c, B, T, skipped, base_state = setup["c"], setup["B"], setup["T"], setup["skipped"], setup["base_state"]
    torch.cuda.empty_cache()
    ch = change_set(7, skipped)
    probe = ladder_model(ch, base_state, c, device)
    fits = fits_in_memory([probe], 64, T, setup["half"] if "bf16" in ch else None, device)
    del probe
    torch.cuda.empty_cache()
    if not fits:
        return {**row, "measured": False, "note": "B 64 does not fit in this GPU's memory"}
    b16, _ = ladder_step(ch, base_state, c, B, setup["data_dir"], device, device_type)
    b64, _ = ladder_step(ch, base_state, c, 64, setup["data_dir"], device, device_type)
    before = torch.get_float32_matmul_precision()
    try:
        t2, first2 = interleave({"B16": b16, "B64": b64}, warmup, rounds, device_type, "ladder rung 7, B 16 and 64")
    finally:
        torch.set_float32_matmul_precision(before)
    tok16, tok64 = rates(B * T, t2["B16"]), rates(64 * T, t2["B64"])
    row.update(
        measured=True,
        note="against rung 7 at B 16 in rounds of their own",
        tok_per_sec=stats(tok64),
        step_ms=stats([1e3 * t for t in t2["B64"]]),
        previous=7,
        vs_previous=stats(tok64)["median"] / stats(tok16)["median"],
        vs_previous_paired=stats([a / b for a, b in zip(tok64, tok16, strict=True)]),
        vs_rung1=stats(tok64)["median"] / rung1_tok if rung1_tok else None,
    )
    if "compile" in ch:
        row["compile_s"] = first2["B64"] - statistics.median(t2["B64"])
    if b64.peak_bytes is not None:
        row["peak_memory_gib"] = b64.peak_bytes / 2**30
    del b16, b64
    torch.cuda.empty_cache()
    return row


def bench_ladder(s, device, device_type, device_name, tmp, png):
    setup = ladder_setup(s, device, device_type, tmp)
    c, B = setup["c"], setup["B"]
    before = torch.get_float32_matmul_precision()
    warmup, rounds = s["ladder_rounds" if device_type == "cpu" else "ladder_rounds_cuda"]
    measured = measure_rungs(setup, [rung for rung, *_ in LADDER_RUNGS], device, device_type, warmup, rounds)
    rungs = rung_rows(setup, measured)
    del measured
    gc.collect()

    # the recipe's B 64 (CUDA): rung 7 at B 64 against rung 7 at B 16, interleaved on their own (row after rung 7's)
    after7 = next(i for i, r in enumerate(rungs) if r["rung"] == 7) + 1
    rungs.insert(after7, rung_7_plus(setup, device, device_type, warmup, rounds, rungs[0]["tok_per_sec"]["median"]))
    torch._dynamo.reset()
    torch.set_float32_matmul_precision(before)

    # DDP (the reference's rung 8): every GPU here, through torchrun (this process's cached blocks handed back first)
    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()
    row = {
        "rung": "DDP",
        "change": "DDP over every visible GPU",
        "reference_tok_per_sec": 1_500_000,
        "reference_ms": None,
    }
    n_gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    if n_gpus > 1:
        r8 = ladder_ddp(n_gpus, c, B, 40, setup["data_dir"], os.path.join(tmp, "ladder_ddp"), device_type)
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

    result = ladder_result(setup, rungs, device_name, device_type, warmup + rounds)
    if not result["losses_agree"]:
        log("  ladder: WARNING: a rung's loss differs from rung 1's or 7's beyond its tolerance (see the table)")
    try:
        ladder_png(result, png)
        result["png"] = png
    except ImportError as e:
        result["png"] = None
        log(f"  ladder: no picture ({e}): pip install matplotlib")
    return result, []


def ladder_result(setup, rungs, device_name, device_type, steps_per_rung):
    """The ladder's JSON: its config, the rows, whether every loss agrees, the headline and the table."""
    result = {
        "config_name": setup["name"],
        "config": {**setup["c"], "vocab_size": "50257 (rungs 1-5), 50304 (from 6)", "grad_accum_steps": setup["accum"]},
        "config_text": setup["config_text"],
        "device": device_name,
        "steps_per_rung": steps_per_rung,
        "lr": LADDER_LR,
        "loss_tolerance": {**LADDER_LOSS_TOL, "padded_vocab_allowance": LADDER_PAD_ALLOWANCE},
        "losses_agree": all(r.get("losses_agree", True) for r in rungs),
        "rungs": rungs,
    }
    result["headline"] = ladder_headline(rungs, device_type)
    result["table"] = ladder_table(result)
    return result


def ladder_accum(base_state, c, B, device, device_type):
    """How many micro-batches of B each rung's step takes, rung 9 taking them as one: 2 on a CPU;
    on CUDA the largest power of 2 up to LADDER_MAX_B_FACTOR at which rung 9's model (the chunked
    loss, bf16) fits one micro-batch of B times it, where the full logits no longer take memory."""
    if device_type != "cuda":
        return 2
    probe = ladder_model(change_set(9, {}), base_state, c, device)
    accum = LADDER_MAX_B_FACTOR
    while accum > 2 and not fits_in_memory([probe], B * accum, c["T"], ladder_half(device_type), device):
        log(f"  ladder: rung 9's B {B * accum} does not fit in GPU memory, trying half")
        accum //= 2
    del probe
    torch.cuda.empty_cache()
    return accum


def ladder_headline(rungs, device_type):
    """The final measured rung over rung 7 (build-nanogpt's configuration), ratio of median tok/s;
    None while rung 7 is not measured."""
    measured = [r for r in rungs if r["measured"] and isinstance(r["rung"], int)]
    final, seven = measured[-1] if measured else None, next(r for r in rungs if r["rung"] == 7)
    if not seven["measured"]:
        return None
    ratio = final["tok_per_sec"]["median"] / seven["tok_per_sec"]["median"]
    where = "" if device_type == "cuda" else f" ({device_type.upper()}: not a GPU measurement)"
    return {
        "final_rung": final["rung"],
        "over_rung7": ratio,
        "device_type": device_type,
        "text": f"final rung {final['rung']} over rung 7 (build-nanogpt's configuration): {ratio:.2f}x{where}",
    }


def change_set(rung, skipped):
    """The changes a rung runs with: its own and every earlier one's, less the skipped rungs'."""
    return {ch for r, _, ch, _ in LADDER_RUNGS if ch and r <= rung and r not in skipped}

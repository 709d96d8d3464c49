"""Sampling: support.sampling.generate with the KV cache against recomputing the prefix, and in-training samples."""

import torch

import train_gpt2
from benchmarks.report import comparison
from benchmarks.settings import TRAIN_CONFIGS
from benchmarks.timing import interleave, rates, stats, timed
from support.device import compile_problem
from support.precision import AUTOCAST_DTYPES, pick_dtype
from support.sampling import draw_noise, generate, next_token, sample_text
from support.shards import get_tokenizer
from train_gpt2 import GPT, GPTConfig


def eval_model(name, device, vocab_size=50257):
    c = TRAIN_CONFIGS[name]
    block_size = 1024 if name != "tiny" else 256
    config = GPTConfig(
        block_size=block_size, vocab_size=vocab_size, n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"]
    )
    torch.manual_seed(0)
    return GPT(config).to(device).eval()  # random weights: the speed does not depend on them


@torch.no_grad()
def recompute(model, idx, n, generator):
    """The plain way, for reference: the whole prefix recomputed for every token, drawn as generate draws."""
    for _ in range(n):
        logits, _ = model(idx)
        noise = draw_noise(len(idx), 1.0, generator, idx.device)
        idx = torch.cat([idx, next_token(logits[:, -1], 1.0, 50, noise)[:, None]], dim=1)
    return idx


def bench_sample(s, device, device_type):
    enc = get_tokenizer()
    model = eval_model(s["eval_model"], device)
    prompt = torch.tensor([enc.encode("Hello, I'm a language model,")], dtype=torch.long, device=device)
    new = min(s["new_tokens"], model.config.block_size - prompt.size(1))

    def sampler(use_cache, n_tokens, compile=False):
        def run():  # the same seed every call: the same tokens drawn, the same work
            g = torch.Generator(device=device).manual_seed(42)
            if use_cache:
                generate(model, prompt, n_tokens, generator=g, compile=compile)
            else:
                recompute(model, prompt, n_tokens, g)

        return run

    for use_cache in (True, False):  # warm-up: a few tokens are enough, recomputing 256 is long
        sampler(use_cache, 8)()
    contenders = {"kv_cache": sampler(True, new), "recompute": sampler(False, new)}
    compile_s, compile_skipped = None, None
    if device_type == "cuda":  # the compiled, CUDA-graph decode step; its first call compiles
        compile_skipped = compile_problem(str(device))  # Windows has no Triton by default
        if compile_skipped is None:
            compile_s = timed(sampler(True, new, compile=True), device_type)
            contenders = {"kv_cache_compiled": sampler(True, new, compile=True), **contenders}
    # what a run does at each --sample-every with the defaults: 4 samples of 32 tokens from the
    # eager KV cache under the run's autocast (--dtype auto's: bf16, fp16 below compute capability 8.0);
    # timed as one call, seconds
    autocast_dtype = AUTOCAST_DTYPES[pick_dtype("auto", device_type)[0]]

    def in_training():
        with train_gpt2.autocast(device_type, autocast_dtype):
            sample_text(model, enc, "Hello, I'm a language model,", num_samples=4, max_new_tokens=32)

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
    if compile_skipped:  # said among the run's skips
        result["kv_cache_compiled"] = {"skipped": f"torch.compile does not work here ({compile_skipped})"}
    note = f"{s['eval_model']} model, batch 1"
    rows = [
        comparison(
            f"sample {new} new tokens: KV cache vs recompute",
            tok["kv_cache"],
            tok["recompute"],
            "tok/s",
            "kv_cache" if device_type == "cpu" else None,
            note=note,
        )
    ]  # the target is the CPU's
    rows.append(
        comparison(
            "samples in training: 4 x 32 tokens, eager KV cache" + (", bf16" if autocast_dtype else ""),
            in_training_s,
            None,
            "s",
            "samples_in_training_s" if device_type == "cuda" else None,
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
                "decode_tok_s_cuda",
                note=note,
            ),
        ]
    return result, rows

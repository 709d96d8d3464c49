"""HellaSwag: the in-training evaluate and the hellaswag.py process against a plain loop."""

import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch.nn import functional as F

import hellaswag
from benchmarks.report import comparison
from benchmarks.sample import eval_model
from benchmarks.settings import ROOT, VOCAB
from benchmarks.timing import interleave, rates, stats, timed
from support.cli import UserError
from support.shards import get_tokenizer


def plain_hellaswag_preds(model, examples, enc, device):
    """The plain way, for reference: one (context + ending) row per forward pass, logits and
    log-softmax everywhere, the ending's tokens summed. -> (acc predictions, acc_norm predictions)."""
    preds, preds_norm = [], []
    with torch.no_grad():
        for ctx, ends in (hellaswag.render_example(ex, enc) for ex in examples):
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
        "correct": sum(p == y for p, y in zip(preds, prepared.labels, strict=True)),
        "correct_norm": sum(p == y for p, y in zip(preds_norm, prepared.labels, strict=True)),
    }


def run_hellaswag_cli(ckpt, path, n, device, dtype):
    """The whole `python hellaswag.py` process (start-up, data, tokenizing, model load, eval):
    -> (seconds, {n, correct, correct_norm} parsed from its output)."""
    cmd = [
        sys.executable,
        str(ROOT / "hellaswag.py"),
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


def find_hellaswag_data(path, shared):
    """The HellaSwag jsonl the section reads: --hellaswag-data's, else the one in shared/data, else
    hellaswag.py's cache if an earlier run downloaded it (never a download here). -> (path, None),
    or (None, why the section cannot run here). A --hellaswag-data that is no HellaSwag file is a
    mistake: UserError."""
    given = path is not None
    if path is None:
        candidate = shared / "hellaswag" / "hellaswag_val.jsonl" if shared else None
        path = str(candidate) if candidate and candidate.is_file() else None
    if path is None:
        candidate = Path(hellaswag.DEFAULT_CACHE_DIR) / hellaswag.CACHE_NAME
        path = str(candidate) if candidate.is_file() else None
    if path is None:
        return None, "no HellaSwag data: pass --hellaswag-data path/to/hellaswag_val.jsonl"
    try:
        hellaswag.load_examples(path)
    except UserError as e:
        if given:
            raise UserError(f"--hellaswag-data {e}") from None
        return None, str(e)
    return path, None


def bench_hellaswag(s, path, device, device_type, tmp):
    examples = hellaswag.load_examples(path)
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
        state["plain"] = counts_of(prepared, *plain_hellaswag_preds(model, examples[:n], enc, device))

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
            "hellaswag_process",
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
            timed(lambda p=full: hellaswag._batches(p, range(len(p)), 1024, batch_tokens, device), device_type)
        )
    result["full_set_host_s"] = {k: stats(v) for k, v in host.items()}
    rows.append(
        comparison(
            f"hellaswag one-time host work, full {len(examples):,} examples: prepare + build the batches",
            [a + b for a, b in zip(host["prepare"], host["batches"], strict=True)],
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
                "hellaswag_full_s",
                higher_is_better=False,
                note=f"first call {first_s:.1f} s builds the batches",
            ),
            comparison(
                "hellaswag.py -m <124M> full set, bf16, whole process",
                process,
                None,
                "s",
                "hellaswag_process_full_s",
                higher_is_better=False,
            ),
        ]
        del model
    return result, rows

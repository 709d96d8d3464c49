"""
HellaSwag (validation, 10,042 examples) for GPT-2 style models, completion style.

Each example is a context and 4 endings. Every ending is scored by the model's loss on the
ending's tokens given the context: context tokens = enc.encode(ctx), ending tokens =
enc.encode(" " + ending). acc picks the ending with the lowest summed loss, acc_norm the one
with the lowest mean loss per ending token. OpenAI GPT-2 124M scores acc 0.2859, acc_norm 0.2955
this way (the EleutherAI harness scores it differently: 0.2892 / 0.3114).

Many examples go through the model in one forward pass (4 rows per example, right-padded; the
padding comes after every real token, so causal attention keeps it out of the real positions).
evaluate(..., batch_size=1) is the original one-example-per-forward approach.

Rows longer than the model's window: the model reads a row's tokens up to the second to last
(the last is only predicted), so a row of block_size + 1 tokens fits. A longer row keeps its
last block_size + 1 tokens: the context is cut from the left. An ending longer than the window
also loses its first tokens, which are then not scored. (GPT-2's 1024 positions hold every
validation row: the longest is 166 tokens.)

Data: --data a local jsonl, else the cache (~/.cache/gpt2-repro/hellaswag/hellaswag_val.jsonl),
else a download: the Hugging Face Hub dataset Rowan/hellaswag (through `datasets`), then the
original GitHub file if it still answers. The download is checked (HTTP status, every row, the
10,042 count) and cached atomically in the original jsonl format. A cache that does not parse
or is short is refused, never trusted.

Usage:
    python hellaswag.py -m gpt2                    # OpenAI GPT-2 124M (gpt2-medium, ... too)
    python hellaswag.py -m log/ckpt_019073.pt      # one of our checkpoints, or a transformers dir
    python hellaswag.py -m gpt2 --limit 500 -d cuda --batch-size 64 --dtype bfloat16
    python hellaswag.py -m gpt2 --data path/to/hellaswag_val.jsonl
"""

import argparse
import json
import os
import sys
import urllib.request

import torch
from torch.nn import functional as F

from fineweb import UserError, first_line, run_cli, write_atomic

NUM_VAL = 10042
HUB_DATASET = "Rowan/hellaswag"  # split "validation": the same rows, with label as a string
DATA_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "gpt2-repro", "hellaswag")
CACHE_NAME = "hellaswag_val.jsonl"
SPLIT_TYPES = ("indomain", "zeroshot")  # activity labels seen / not seen in HellaSwag's train split

# the original file's key order; its WikiHow rows put ctx second (kept so the cache we write is
# byte-for-byte the original file)
KEYS = ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "split", "split_type", "label", "endings", "source_id")
WIKIHOW_KEYS = ("ind", "ctx", *(k for k in KEYS if k not in ("ind", "ctx")))


class HellaSwagDataError(UserError):
    """The data is missing, malformed or a bad cache: one line that names the file and the fix."""


# ----------------------------------------------------------------------------------------------
# Data


def parse_rows(lines, source):
    """jsonl lines -> list of examples; the first bad line raises an error that names it."""
    examples = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as e:
            raise HellaSwagDataError(f"{source}, line {lineno}: not JSON ({e.msg})") from None
        problem = None
        if not isinstance(ex, dict):
            problem = "not a JSON object"
        elif not isinstance(ex.get("ctx"), str):
            problem = "no ctx string"
        elif not (isinstance(ex.get("endings"), list) and len(ex["endings"]) == 4):
            problem = "endings is not a list of 4"
        elif not all(isinstance(e, str) for e in ex["endings"]):
            problem = "an ending is not a string"
        elif type(ex.get("label")) is not int or not 0 <= ex["label"] <= 3:
            problem = f"label {ex.get('label')!r} is not an int from 0 to 3"
        elif not isinstance(ex.get("split_type"), str):
            problem = "no split_type string"
        if problem:
            raise HellaSwagDataError(f"{source}, line {lineno}: {problem}")
        examples.append(ex)
    return examples


def _read_jsonl(path):
    try:
        with open(path, encoding="utf-8") as f:
            return parse_rows(f, path)
    except UnicodeDecodeError as e:
        raise HellaSwagDataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _fetch_from_hub():
    """The validation split from the Hugging Face Hub, as jsonl text in the original format."""
    import datasets  # only when downloading: training never needs it

    ds = datasets.load_dataset(HUB_DATASET, split="validation")
    lines = []
    for i, row in enumerate(ds):
        row = dict(row)
        try:
            row["label"] = int(row["label"])  # a string on the Hub
        except (KeyError, TypeError, ValueError):
            raise HellaSwagDataError(f"{HUB_DATASET} row {i}: label {row.get('label')!r} is not a number") from None
        keys = WIKIHOW_KEYS if str(row.get("source_id", "")).startswith("wikihow") else KEYS
        missing = [k for k in keys if k not in row]
        if missing:
            raise HellaSwagDataError(f"{HUB_DATASET} row {i}: no field {missing[0]!r}")
        lines.append(json.dumps({k: row[k] for k in keys}) + "\n")
    return "".join(lines)


def _fetch_from_url():
    """The original GitHub file. An error page must not become the data: check the status."""
    with urllib.request.urlopen(DATA_URL, timeout=60) as resp:
        if resp.status != 200:
            raise HellaSwagDataError(f"HTTP status {resp.status}")
        return resp.read().decode("utf-8")


def download(cache_path):
    """Fetch the validation split (Hub, then the original URL), check it, write cache_path atomically."""
    print(f"downloading the HellaSwag validation split to {cache_path}", file=sys.stderr)
    errors = []
    for where, fetch in ((HUB_DATASET, _fetch_from_hub), (DATA_URL, _fetch_from_url)):
        try:
            text = fetch()
            n = len(parse_rows(text.splitlines(), where))
            if n != NUM_VAL:
                raise HellaSwagDataError(f"{n} rows, expected {NUM_VAL}")
            break
        except Exception as e:  # offline, 404, a moved dataset: all mean "try the next source"
            errors.append(f"{where}: {first_line(e)}")
    else:
        raise HellaSwagDataError(
            f"cannot download HellaSwag ({'; '.join(errors)}); pass --data path/to/hellaswag_val.jsonl"
        )
    os.makedirs(os.path.dirname(cache_path) or ".", exist_ok=True)
    write_atomic(cache_path, lambda f: f.write(text.encode("utf-8")))  # a cut download never leaves a partial cache


def load_examples(path=None, cache_dir=None, limit=None):
    """The HellaSwag validation examples as parsed jsonl rows (label an int).

    path: a local jsonl in the original format (any number of rows). Without it, the cache in
    cache_dir (default ~/.cache/gpt2-repro/hellaswag) is read, downloading it first if absent;
    the cache must hold exactly 10,042 valid rows. limit keeps the first limit examples."""
    if path is not None:
        if not os.path.isfile(path):
            raise HellaSwagDataError(f"{path} does not exist: pass the path of a HellaSwag jsonl file")
        examples = _read_jsonl(path)
        if not examples:
            raise HellaSwagDataError(f"{path} holds no examples: pass a HellaSwag jsonl file")
    else:
        cache_path = os.path.join(cache_dir or DEFAULT_CACHE_DIR, CACHE_NAME)
        if not os.path.exists(cache_path):
            download(cache_path)
        fix = f"delete {cache_path} to download it again"
        try:
            examples = _read_jsonl(cache_path)
        except HellaSwagDataError as e:
            raise HellaSwagDataError(f"bad cache: {e}; {fix}") from None
        if len(examples) != NUM_VAL:
            raise HellaSwagDataError(f"bad cache: {cache_path} has {len(examples)} rows, expected {NUM_VAL}; {fix}")
    return examples if limit is None else examples[:limit]


# ----------------------------------------------------------------------------------------------
# Scoring


def render_example(example, enc):
    """-> (context tokens, [tokens of each of the 4 endings]); an ending follows a space."""
    ctx_tokens = enc.encode(example["ctx"])
    ending_tokens = [enc.encode(" " + ending) for ending in example["endings"]]
    return ctx_tokens, ending_tokens


def _block_size(model):
    # our GPT has config.block_size, transformers' GPT-2 config.n_positions; DDP wraps the
    # model in .module and torch.compile in ._orig_mod, so look through those for the config
    while not hasattr(model, "config"):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None:
            raise ValueError(f"cannot find the block size of {type(model).__name__}: it has no config")
        model = inner
    return getattr(model.config, "block_size", None) or model.config.n_positions


def _row(ctx_tokens, end_tokens, block_size):
    """Model input, targets and a mask of the targets that are ending tokens, for one ending."""
    tokens = ctx_tokens + end_tokens
    is_end = [False] * len(ctx_tokens) + [True] * len(end_tokens)
    # the last token is only a target, so block_size + 1 tokens fit in the window; cut the left
    tokens, is_end = tokens[-(block_size + 1) :], is_end[-(block_size + 1) :]
    return tokens[:-1], tokens[1:], is_end[1:]


@torch.no_grad()
def ending_losses(model, enc, examples, device, batch_size=16, autocast_dtype=None, progress=False):
    """Summed loss and number of scored tokens of every ending: two (len(examples), 4) tensors
    on the CPU, in the order of examples. batch_size examples (4 rows each) per forward pass.
    The model is used as it is (our GPT has no dropout; a transformers model must be in eval())."""
    block_size = _block_size(model)
    device_type = torch.device(device).type
    rows = []  # 4 per example: (input, targets, mask)
    for ex in examples:
        ctx_tokens, ending_tokens = render_example(ex, enc)
        rows.extend(_row(ctx_tokens, end, block_size) for end in ending_tokens)
    n = len(examples)
    sum_loss = torch.zeros(n, 4)
    n_tokens = torch.zeros(n, 4, dtype=torch.long)
    # longest examples first: similar lengths share a batch (little padding), and an
    # out-of-memory shows up in the first batch, not the last
    order = sorted(range(n), key=lambda i: -max(len(rows[4 * i + j][0]) for j in range(4)))
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="hellaswag", unit="batch")
    for batch in batches:
        batch_rows = [rows[4 * i + j] for i in batch for j in range(4)]
        T = max(len(r[0]) for r in batch_rows)
        idx = torch.full((len(batch_rows), T), enc.eot_token, dtype=torch.long)  # padding: any real id
        targets = torch.zeros_like(idx)
        mask = torch.zeros_like(idx, dtype=torch.bool)
        for r, (x, y, m) in enumerate(batch_rows):
            idx[r, : len(x)] = torch.tensor(x)
            targets[r, : len(y)] = torch.tensor(y)
            mask[r, : len(m)] = torch.tensor(m)
        idx, targets, mask = idx.to(device), targets.to(device), mask.to(device)
        with torch.autocast(device_type=device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = model(idx)
        logits = out.logits if hasattr(out, "logits") else out[0]  # transformers output or our tuple
        # the loss only at positions that predict an ending token: context and padding cost nothing
        losses = F.cross_entropy(logits[mask].float(), targets[mask], reduction="none")
        row_of = torch.arange(len(batch_rows), device=device).unsqueeze(1).expand_as(mask)[mask]
        row_loss = torch.zeros(len(batch_rows), device=device).index_add_(0, row_of, losses)
        sum_loss[batch] = row_loss.view(-1, 4).cpu()
        n_tokens[batch] = mask.sum(1).view(-1, 4).cpu()
    return sum_loss, n_tokens


def evaluate(model, enc, examples, device, rank=0, world_size=1, batch_size=16, autocast_dtype=None, progress=False):
    """Score this rank's share of examples (every world_size-th, from rank): a dict of counts
    that the ranks sum: n, correct (acc), correct_norm (acc_norm), and the same three per
    split_type as n_<type>, correct_<type>, correct_norm_<type>. The keys depend only on
    examples, so every rank returns the same keys. batch_size=1 is one example per forward."""
    split_types = sorted(set(SPLIT_TYPES) | {ex["split_type"] for ex in examples})
    share = examples[rank::world_size]
    counts = {f"{k}{t}": 0 for t in ("", *(f"_{s}" for s in split_types)) for k in ("n", "correct", "correct_norm")}
    if share:
        sum_loss, n_tokens = ending_losses(model, enc, share, device, batch_size, autocast_dtype, progress)
        pred = sum_loss.argmin(1).tolist()
        pred_norm = (sum_loss / n_tokens).argmin(1).tolist()
        for ex, p, pn in zip(share, pred, pred_norm):
            for t in ("", f"_{ex['split_type']}"):
                counts[f"n{t}"] += 1
                counts[f"correct{t}"] += int(p == ex["label"])
                counts[f"correct_norm{t}"] += int(pn == ex["label"])
    return counts


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="gpt2", help="gpt2*, a transformers dir or our checkpoint (default gpt2)")
    p.add_argument("-d", "--device", default=None, help="cuda, cuda:N, mps or cpu (default: the best available)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N examples")
    p.add_argument("--batch-size", type=int, default=16, help="examples per forward pass (4 rows each)")
    p.add_argument("--data", default=None, help="a local HellaSwag jsonl instead of the cache / download")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="where the downloaded jsonl is kept")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="autocast dtype")
    args = p.parse_args(argv)

    from train_gpt2 import get_tokenizer, load_model, pick_device  # train_gpt2 imports us: not at the top

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: give a positive number of examples")
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: give a positive number of examples")
    examples = load_examples(args.data, args.cache_dir, args.limit)  # bad data fails before the model loads
    device, _ = pick_device(args.device)
    enc = get_tokenizer()
    model = load_model(args.model, device).eval()
    autocast_dtype = None if args.dtype == "float32" else getattr(torch, args.dtype)
    counts = evaluate(
        model, enc, examples, device, batch_size=args.batch_size, autocast_dtype=autocast_dtype, progress=True
    )
    n = counts["n"]
    print(f"HellaSwag {args.model}: {n} examples")
    print(f"acc      {counts['correct'] / n:.4f}  ({counts['correct']}/{n})")
    print(f"acc_norm {counts['correct_norm'] / n:.4f}  ({counts['correct_norm']}/{n})")
    for t in sorted(k[2:] for k in counts if k.startswith("n_")):
        n_t = counts[f"n_{t}"]
        if n_t:
            acc, acc_norm = counts[f"correct_{t}"] / n_t, counts[f"correct_norm_{t}"] / n_t
            print(f"  {t:<9} n={n_t:<5} acc {acc:.4f}  acc_norm {acc_norm:.4f}")


if __name__ == "__main__":
    run_cli(main)

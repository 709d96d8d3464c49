"""
HellaSwag (validation, 10,042 examples) for GPT-2 style models, completion style.

Each example is a context and 4 endings. Every ending is scored by the model's loss on the
ending's tokens given the context: context tokens = enc.encode(ctx), ending tokens =
enc.encode(" " + ending). acc picks the ending with the lowest summed loss, acc_norm the one
with the lowest mean loss per ending token. OpenAI GPT-2 124M scores acc 0.2859, acc_norm 0.2955
this way (the EleutherAI harness scores it differently: 0.2892 / 0.3114).

In a program: prepared = prepare(examples, enc) once (tokenizes), then evaluate(model, prepared,
device, rank, world_size, ...) as often as needed; how a batch is scored: "Scoring" below.

Models: a training run scores its own GPT (train_gpt2.py imports this file; this file imports no
script). The command line loads every -m as transformers' GPT2LMHeadModel with SDPA attention
(load_model), which scores a packed row with the same losses as our GPT's up to float rounding.

A row longer than the model's window keeps its last block_size + 1 tokens (_row_batches); GPT-2's
1024 positions hold every validation row (the longest is 166 tokens).

Data: --data a local jsonl, else the cache, else a download from the Hugging Face Hub's Rowan/hellaswag,
checked against the original file and cached in its form (load_examples).

Usage:
    python hellaswag.py -m gpt2                    # OpenAI GPT-2 124M (gpt2-medium, ... too)
    python hellaswag.py -m log/ckpt_019073.pt      # one of our checkpoints, a run's folder (its newest
                                                   # checkpoint) or a transformers dir
    python hellaswag.py -m gpt2 --limit 500 -d cuda --dtype float32   # fp32 instead of bf16 on CUDA
    python hellaswag.py -m gpt2 --data path/to/hellaswag_val.jsonl
"""

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, not a traceback from inside an import
    signal.signal(signal.SIGINT, lambda signum, frame: (print("interrupted", file=sys.stderr), os._exit(130)))

import hashlib
import itertools
import json
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from support.cli import ArgumentParser, Number, UserError, add_flags, first_line, flag, run_cli
from support.ddp import fence
from support.device import keep_freed_memory, pick_device
from support.files import check_folder, jsonl_rows, write_atomic
from support.hf_interop import hf_gpt2, load_hf_model
from support.model_files import find_model
from support.offline import hub_offline
from support.out_of_memory import hellaswag_out_of_memory, oom_phase
from support.precision import AUTOCAST_DTYPES, pick_dtype
from support.shards import get_tokenizer

HUB_DATASET = "Rowan/hellaswag"  # HellaSwag's own copy on the Hugging Face Hub (label a string there)
# the original file's fields, in its order (WikiHow rows put ctx second), so that the cache is the original jsonl
FIELDS = ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "split", "split_type", "label", "endings", "source_id")
# the original hellaswag_val.jsonl's row count and digests(): a copy that differs is refused, never cached
ORIGINAL_ROWS = 10042
ORIGINAL_DIGESTS = (
    "df40a5928da24b1f bbc545cc7dc70a42 a83eed1f11dc59bf f4dbabdbdc965073 90571e07ef69e9cc 09e2d87d091d5844 "
    "a5d2a0b058ac5998 2f1c3e46cea3b4b7 ccced27d9d3a7fad b03d3d3275976611 0ebaddc42a6564eb d4068ce62a408c8f "
    "561c9314196ca00b fa14e9cd453f44fd a024c0241f6148f4"
).split()
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "gpt2-repro", "hellaswag")
CACHE_NAME = "hellaswag_val.jsonl"


# ----------------------------------------------------------------------------------------------
# Data


def parse_rows(lines, source):
    """jsonl lines -> list of examples; the first line whose endings or label would be scored wrong
    raises an error that names it (a missing or non-string text fails in prepare, naming it too)."""
    examples = []
    for lineno, ex in jsonl_rows(lines, source):
        if not (isinstance(ex, dict) and isinstance(ex.get("endings"), list) and len(ex["endings"]) == 4):
            raise UserError(f"{source} line {lineno}: not a HellaSwag example (a list of 4 endings)")
        if type(ex.get("label")) is not int or not 0 <= ex["label"] <= 3:
            raise UserError(f"{source} line {lineno}: label {ex.get('label')!r} is not an int from 0 to 3")
        examples.append(ex)
    return examples


def _read_jsonl(path):
    try:
        with open(path, encoding="utf-8") as f:
            return parse_rows(f, path)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:  # not there, a folder, no read permission, an I/O error
        raise UserError(f"{path} cannot be read: {e.strerror or first_line(e)}") from None


def digests(examples):
    """sha256 (16 hex digits) of the ctx, endings, label and split_type of the first 1, 2,
    4, ... rows and of all of them: two copies that differ first differ between two of these."""
    h, out = hashlib.sha256(), []
    for i, ex in enumerate(examples, 1):
        h.update(json.dumps([ex["ctx"], ex["endings"], ex["label"], ex["split_type"]]).encode() + b"\n")
        if i & (i - 1) == 0 or i == len(examples):
            out.append(h.hexdigest()[:16])
    return out


def original_row(r):
    """A Hub row as a line of the original file: label an int, the fields in its order."""
    keys = FIELDS if r["source_id"].startswith("activitynet") else ("ind", "ctx", *FIELDS[1:4], *FIELDS[5:])
    return json.dumps({k: int(r[k]) if k == "label" else r[k] for k in keys}) + "\n"


def download(cache_path):
    """Fetch the validation split from the Hub, turn it into the original jsonl (label an int, the
    original's fields and rows in order), check it against the original, and write cache_path atomically."""
    fix = "pass --data path/to/hellaswag_val.jsonl"
    hub, reason = hub_offline(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))  # at once: the Hub client retries for ~30 s
    if reason:
        raise UserError(f"cannot download HellaSwag from {hub} ({reason}); {fix}")
    print(f"downloading the HellaSwag validation split ({HUB_DATASET}) to {cache_path}", file=sys.stderr)
    import datasets  # noqa: PLC0415  only a download needs datasets (half a second to import)

    try:
        lines = [original_row(r) for r in datasets.load_dataset(HUB_DATASET, split="validation")]
        examples = parse_rows(lines, HUB_DATASET)
    except Exception as e:  # not found, no network, a changed schema: the library's message says which
        raise UserError(f"cannot download HellaSwag ({HUB_DATASET}: {first_line(e)}); {fix}") from None
    n, got, how = ORIGINAL_ROWS, digests(examples), None
    if len(examples) != n:
        how = f"has {len(examples):,} rows, not the original's {n:,}"
    elif got != ORIGINAL_DIGESTS:  # the first 2**(k-1) rows match, the first 2**k do not
        k = next(i for i, (a, b) in enumerate(zip(got, ORIGINAL_DIGESTS, strict=True)) if a != b)
        first, last = 2**k // 2 + 1, min(2**k, n)
        rows = f"at row {first:,}" if first == last else f"between rows {first:,} and {last:,}"
        how = f"differs from the original first {rows}"
    if how:
        raise UserError(f"{HUB_DATASET}'s validation split {how} (not cached); {fix}")
    os.makedirs(os.path.dirname(cache_path) or ".", exist_ok=True)
    # a cut download never leaves a partial cache; a link at its name is refused (no flag to name: any caller's)
    write_atomic(cache_path, lambda f: f.write("".join(lines).encode("utf-8")))


def load_examples(path=None, cache_dir=None, limit=None):
    """The HellaSwag validation examples as parsed jsonl rows (label an int).

    path: a local jsonl in the original format (any number of rows). Without it, the cache in
    cache_dir (default ~/.cache/gpt2-repro/hellaswag) is read, downloaded from the Hub first if absent.
    limit keeps the first limit examples."""
    if path is not None:
        examples = _read_jsonl(path)
        if not examples:
            raise UserError(f"{path} holds no examples: pass a HellaSwag jsonl file")
    else:
        cache_path = os.path.join(cache_dir or DEFAULT_CACHE_DIR, CACHE_NAME)
        if not os.path.exists(cache_path):
            check_folder(os.path.dirname(cache_path), "--cache-dir")  # before the download, not after it
            download(cache_path)
        examples = _read_jsonl(cache_path)
    return examples if limit is None else examples[:limit]


# ----------------------------------------------------------------------------------------------
# Scoring
#
# Only the work the score needs. An ending's score is the log-probability of its tokens after the
# context, so:
# - an example is one packed row: its context, then its 4 endings (each but its last token, which
#   is only predicted). An attention mask lets each ending see the context and its own earlier
#   tokens, and each ending's positions start where the context ends, so every ending is scored
#   exactly as if it followed the context alone: 1.74M positions for the 10,042 examples instead
#   of 3.29M when each ending re-reads its context, in one forward pass per batch. (Continuing
#   the 4 endings from the context's KV cache does the same arithmetic, but copies the cache 4
#   times, and pads more.)
# - the LM head and log-softmax run only at the 1.27M positions that predict an ending token (the
#   50,304-wide head is a third of a 124M model's FLOPs per position, most of a small model's);
# - a batch holds rows of similar length; the batches are built once per (window, device, share
#   of the examples), by array operations (no Python step per token), copied to the device once
#   and kept there, and the scores stay there until the end: no host sync per batch.
# Examples whose longest (context + ending) does not fit the window are scored one row per ending,
# still with the head only at the scored positions.


def render_example(example, enc):
    """-> (context tokens, [tokens of each of the 4 endings]); an ending follows a space."""
    ctx_tokens = enc.encode(example["ctx"])
    ending_tokens = [enc.encode(" " + ending) for ending in example["endings"]]
    return ctx_tokens, ending_tokens


class Prepared:
    """The examples tokenized once (see prepare): one flat array, example 0's context, its 4 endings,
    example 1's context, ..., with each piece's start and length, from which the batches are cut by
    array operations: a Python step per batch rather than per token (the full set has 2.4M tokens
    and 1.27M scored positions)."""

    def __init__(self, pieces, labels):
        self.labels = np.array(labels, dtype=np.int64)
        self.batches = None  # (key, _batches' answer) of the last set built: a training run asks for one
        lengths = np.array([len(piece) for piece in pieces], dtype=np.int64).reshape(-1, 5)
        self.ctx_len, self.end_len = lengths[:, 0], lengths[:, 1:]
        starts = np.cumsum(lengths).reshape(-1, 5) - lengths
        self.ctx_start, self.end_start = starts[:, 0], starts[:, 1:]
        self.tokens = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64, count=int(lengths.sum()))

    def __len__(self):
        return len(self.labels)


def prepare(examples, enc):
    """Tokenize every example once, for every later evaluate(). An example that cannot be rendered
    (a missing field, text the tokenizer refuses) is a UserError that names it."""
    pieces, labels = [], []
    for i, ex in enumerate(examples):
        try:
            ctx, endings = render_example(ex, enc)
            label = ex["label"]
        except Exception as e:  # KeyError, TypeError, "<|endoftext|>" in the text (ValueError), ...
            name = f"example {i}" + (f" (ind {ex['ind']})" if isinstance(ex, dict) and "ind" in ex else "")
            raise UserError(f"HellaSwag {name} cannot be tokenized: {first_line(e)}") from None
        pieces += [ctx, *endings]
        labels.append(label)
    return Prepared(pieces, labels)


def _trunk(model):
    """-> (hidden(idx, pos=None, mask=None): the final LayerNorm's output, the LM head). model: our
    GPT or transformers' GPT2LMHeadModel itself (SDPA attention, as load_model asks for), not
    wrapped by DDP or torch.compile."""
    if hasattr(model, "hidden_states"):  # our GPT
        return model.hidden_states, model.lm_head

    # transformers' GPT2LMHeadModel: .transformer ends with ln_f, .lm_head is the head; its SDPA
    # attention takes position_ids and a 4D boolean mask (True: attend) as ours does
    def hidden(idx, pos=None, mask=None):
        out = model.transformer(input_ids=idx, position_ids=pos, attention_mask=mask, use_cache=False)
        return out.last_hidden_state

    return hidden, model.lm_head


# The batches are cut from Prepared.tokens with index arrays. A batch's rows are laid out along
# columns 0 .. width-1 of a (rows, width) grid; the cells past a row's end are padding (token 0, a
# real id that is never scored). A cell's flat position r * width + t is what picks the scored
# positions out of h.flatten(0, 1). Packed rows place their cells by (row, column) index arrays;
# rows of one ending use a boolean mask of the grid's shape, with two numpy facts: grid[mask] lists
# the cells row by row, left to right, and np.flatnonzero(mask) gives their flat positions.


def _chunks(widths, budget):
    """(start, stop) of consecutive runs of items whose count x the width of their last item (items
    are sorted so that the last one is the widest) is within budget; at least one item a run."""
    start = 0
    while start < len(widths):
        stop = start + 1
        while stop < len(widths) and (stop + 1 - start) * widths[stop] <= budget:
            stop += 1
        yield start, stop
        start = stop


def _packed_batches(p, exs, slot, batch_tokens):
    """Examples (an index array) packed one to a row: the context, then each ending but its last
    token, back to back, rows of similar length together. pos: each token's position in its own
    (context + ending) sequence; seg: 0 for the context, 1 + j for ending j, 5 for padding (the
    attention mask is built from it: see ending_losses). Scored: the context's last position once
    per ending (each ending's first token), then every ending position (its next token).
    slot[i]: where example i's first ending's score goes."""
    lens = np.concatenate([p.ctx_len[:, None], p.end_len - 1], axis=1)  # (n, 5): each segment's cells in a row
    src = np.concatenate([p.ctx_start[:, None], p.end_start], axis=1)  # (n, 5): where each segment is in p.tokens
    exs = exs[np.argsort(lens[exs].sum(1), kind="stable")]  # by row length: little padding
    row_len = lens[exs].sum(1)
    batches = []
    for start, stop in _chunks(row_len.tolist(), batch_tokens):
        b = exs[start:stop]
        n = lens[b].ravel()  # segment lengths, row by row
        cell_seg = np.repeat(np.arange(n.size), n)  # every real cell's segment, 5 r + s, row by row
        offset = np.arange(n.sum()) - (np.cumsum(n) - n)[cell_seg]  # the cell's place in its segment
        row, seg = np.divmod(cell_seg, 5)
        row_first = np.cumsum(row_len[start:stop]) - row_len[start:stop]  # each row's first cell
        col = np.arange(n.sum()) - row_first[row]  # the cell's place in its row
        at = src[b].ravel()[cell_seg] + offset  # the cell's token in p.tokens
        ctx_len = p.ctx_len[b]
        shape = (len(b), row_len[stop - 1])
        idx, pos, segs = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64), np.full(shape, 5)
        idx[row, col], segs[row, col] = p.tokens[at], seg
        pos[row, col] = np.where(seg == 0, offset, ctx_len[row] + offset)
        ends = seg > 0
        last = np.arange(len(b)) * shape[1] + ctx_len - 1  # each context's last cell, flat
        batches.append(
            {
                "idx": idx,
                "pos": pos,
                "seg": segs,
                "gather": np.concatenate([np.repeat(last, 4), (row * shape[1] + col)[ends]]),
                "targets": np.concatenate([p.tokens[p.end_start[b]].ravel(), p.tokens[at[ends] + 1]]),
                "slots": np.concatenate(
                    [(slot[b][:, None] + np.arange(4)).ravel(), slot[b][row[ends]] + seg[ends] - 1]
                ),
            }
        )
    return batches


def _row_batches(p, exs, slot, block_size, batch_tokens):
    """(context + ending) rows sorted by length; scored: each row's last n_scored positions. The
    last token is only a target, so block_size + 1 tokens fit the window; a longer row loses its
    first tokens (cut), so an ending longer than the window is scored on its last tokens only."""
    i, j = np.repeat(exs, 4), np.tile(np.arange(4), len(exs))  # row 4 k + j: ending j of exs[k]
    ctx_len, end_len = p.ctx_len[i], p.end_len[i, j]
    kept = np.minimum(ctx_len + end_len, block_size + 1)
    cut, n_in, n_scored = ctx_len + end_len - kept, kept - 1, np.minimum(end_len, kept - 1)
    order = np.argsort(n_in, kind="stable")
    widths = n_in[order].tolist()
    batches = []
    for start, stop in _chunks(widths, batch_tokens):
        rows = order[start:stop]
        r = rows[:, None]  # a column: these rows, broadcast along the columns below
        cols = np.arange(widths[stop - 1])
        seq = cut[r] + cols  # the cell's position in context + ending
        real = cols < n_in[r]
        scored = real & (cols >= n_in[r] - n_scored[r])
        in_end = p.end_start[i[r], j[r]] + seq - ctx_len[r]  # where the cell is in p.tokens if in the ending
        at = np.where(seq < ctx_len[r], p.ctx_start[i[r]] + seq, in_end)
        idx = np.zeros(real.shape, dtype=np.int64)
        idx[real] = p.tokens[at[real]]
        batches.append(
            {
                "idx": idx,
                "gather": np.flatnonzero(scored),
                "targets": p.tokens[in_end[scored] + 1],  # a scored cell predicts the next token: an ending's
                "slots": np.repeat(slot[i[rows]] + j[rows], n_scored[rows]),
            }
        )
    return batches


def _batches(p, share, block_size, batch_tokens, device):
    """This share's batches on the device and the number of scored tokens of each of its endings
    (len(share), 4), built once; slot 4 k + j is ending j of share[k]."""
    key = (block_size, batch_tokens, str(device), tuple(share))
    if p.batches is None or p.batches[0] != key:
        share = np.asarray(share, dtype=np.int64)
        slot = np.zeros(len(p), dtype=np.int64)
        slot[share] = 4 * np.arange(len(share))
        ctx_len, end_len = p.ctx_len[share], p.end_len[share]
        row_len = ctx_len[:, None] + end_len
        # a packed row needs a context to continue from, and every (context + ending) in the window
        fits = (ctx_len > 0) & (row_len.max(1) <= block_size + 1)
        batches = _packed_batches(p, share[fits], slot, batch_tokens)
        batches += _row_batches(p, share[~fits], slot, block_size, batch_tokens)
        n_tokens = np.minimum(end_len, np.minimum(row_len, block_size + 1) - 1)  # a cut row scores fewer
        on_device = [{k: torch.from_numpy(a).to(device) for k, a in b.items()} for b in batches]
        p.batches = key, (on_device, torch.from_numpy(n_tokens))
    return p.batches[1]


# Rows of logits (chunk x vocab, fp32) computed at a time. On a CPU, 128 rows are 26 MB of logits,
# under glibc's largest mmap threshold (32 MB), so malloc hands the same memory back chunk after
# chunk; much larger chunks come fresh from the kernel every chunk, zeroed and page-faulted in
# (docs/performance.md has the measurement). On a GPU there is no such cost, and 16,384 rows
# (3.3 GB of fp32 logits) keep the head's matmuls large.
HEAD_CHUNK = {"cuda": 16384, "cpu": 128}


@torch.no_grad()
def ending_losses(
    model, prepared, device, share=None, autocast_dtype=None, should_stop=None, progress=False, batch_tokens=None
):
    """Summed loss and number of scored tokens of every ending of the examples share (indices
    into prepared, default all): two (len(share), 4) tensors on the CPU, or None if should_stop()
    became true (it is asked between batches). batch_tokens: the most positions in one forward
    pass (default 65,536 on CUDA, 4,096 elsewhere). The model is used as it is (our GPT has no
    dropout; a transformers model must be in eval())."""
    share = list(range(len(prepared))) if share is None else list(share)
    device_type = torch.device(device).type
    batch_tokens = batch_tokens or (65536 if device_type == "cuda" else 4096)
    config = model.config
    block_size = getattr(config, "block_size", None) or config.n_positions
    hidden, lm_head = _trunk(model)
    oom_phase("scoring HellaSwag", batch_tokens=batch_tokens)  # its advice: a smaller --batch-tokens
    batches, n_tokens = _batches(prepared, share, block_size, batch_tokens, device)
    sum_loss = torch.zeros(4 * len(share), device=device)
    head_chunk = HEAD_CHUNK.get(device_type, 2048)
    t0 = t_print = time.time()
    for n_done, b in enumerate(batches):
        if should_stop is not None and should_stop():
            return None
        # not cuDNN attention (an H100's default): it builds a plan for every new shape, and each
        # batch has its own: seconds of a first eval
        with (
            torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None),
            sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
        ):
            if "seg" in b:  # packed: a token sees the context and its own ending, causally
                seg, W = b["seg"], b["seg"].size(1)
                mask = (seg[:, None, :] == seg[:, :, None]) | (seg[:, None, :] == 0)  # (B, W, W): query, key
                mask &= torch.ones(W, W, dtype=torch.bool, device=seg.device).tril()
                h = hidden(b["idx"], pos=b["pos"], mask=mask[:, None])
            else:
                h = hidden(b["idx"])
            h = h.flatten(0, 1)[b["gather"]]
            for s in range(0, h.size(0), head_chunk):
                logits = lm_head(h[s : s + head_chunk])
                loss = F.cross_entropy(logits.float(), b["targets"][s : s + head_chunk], reduction="none")
                sum_loss.index_add_(0, b["slots"][s : s + head_chunk], loss)
        if progress and time.time() - t_print > 10:
            t_print = time.time()
            print(f"hellaswag: batch {n_done + 1}/{len(batches)}, {t_print - t0:.0f} s", file=sys.stderr, flush=True)
    return sum_loss.view(-1, 4).cpu(), n_tokens


def evaluate(model, prepared, device, rank=0, world_size=1, **scoring):
    """Score this rank's share of the prepared examples (every world_size-th, from rank): a dict
    of counts that the ranks sum: n, correct (acc) and correct_norm (acc_norm). None if
    should_stop() became true. scoring: ending_losses's autocast_dtype, should_stop, progress
    and batch_tokens."""
    share = list(range(rank, len(prepared), world_size))
    counts = {"n": len(share), "correct": 0, "correct_norm": 0}
    if share:
        result = ending_losses(model, prepared, device, share, **scoring)
        if result is None:
            return None
        sum_loss, n_tokens = result
        labels = torch.from_numpy(prepared.labels[share])
        counts["correct"] = int((sum_loss.argmin(1) == labels).sum())
        counts["correct_norm"] = int(((sum_loss / n_tokens).argmin(1) == labels).sum())
    return counts


# ----------------------------------------------------------------------------------------------
# Inside a training run: every rank loads the examples once, and the counts are summed over ranks


def load_for_run(path, limit, enc, master_process, ddp):
    """(the examples tokenized once for every eval of a training run, None), or (None, why not) after
    one warning when the data cannot be had: a run never dies for want of its side evaluation."""

    def load():
        try:
            return prepare(load_examples(path, limit=limit), enc), None
        except Exception as e:  # no network, a bad cache, a datasets error: all mean "no data"
            return None, first_line(e).replace("pass --data ", "pass --hellaswag-data ")  # training's flag

    # rank 0 first: it may download and cache the data, which the others then just read
    prepared, problem = load() if master_process else (None, None)
    if ddp:
        fence(ddp)  # the others wait for rank 0's download here, for longer than --ddp-timeout
        if not master_process:
            prepared, problem = load()
        # every rank must agree, or the ones with data would wait forever for the others
        ok = torch.tensor(int(problem is None), device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item() and problem is None:
            problem = "another rank could not load the HellaSwag data"
    if problem is not None and master_process:
        print(f"warning: HellaSwag evaluation is off for this run: {problem}", file=sys.stderr)
    return (prepared if problem is None else None), problem


def evaluate_all_ranks(model, prepared, device, autocast_dtype, rank, world_size, should_stop):
    """acc_norm, acc and n summed over every rank (each scores its share), or None when a rank was
    interrupted. The model is used in the mode it is in (our GPT has no dropout)."""
    scoring = dict(autocast_dtype=autocast_dtype, should_stop=should_stop, progress=rank == 0)  # rank 0 says how far
    counts = evaluate(model, prepared, device, rank, world_size, **scoring)
    c = counts or {"n": 0, "correct": 0, "correct_norm": 0}
    totals = torch.tensor([c["n"], c["correct"], c["correct_norm"], counts is None], device=device)
    if world_size > 1:
        dist.all_reduce(totals)
    n, correct, correct_norm, interrupted = totals.tolist()
    return None if interrupted else {"hellaswag": correct_norm / n, "hellaswag_acc": correct / n, "hellaswag_n": n}


# ----------------------------------------------------------------------------------------------
# Command line


def load_model(spec, device):
    """The model -m names, as transformers' GPT2LMHeadModel in eval mode on device: OpenAI GPT-2 or
    a transformers folder loaded by transformers; our checkpoint (or a run's folder: its newest)
    built from its state dict, its vocabulary as it is, so that it scores as our GPT in training
    does. This file never imports train_gpt2.py (train_gpt2.py imports it)."""
    kind, path, ckpt = find_model(spec)
    if kind == "transformers":
        return load_hf_model(path).to(device).eval()
    return hf_gpt2(ckpt["model_config"], ckpt["model"], f"checkpoint {path}", attn_implementation="sdpa").to(device)


@dataclass
class EvalFlags:
    """hellaswag.py's flags."""

    model: str = flag("gpt2", "gpt2*, a transformers dir, our checkpoint or a run's folder (its newest)", short="-m")
    device: str | None = flag(None, "cuda, cuda:N, mps or cpu (None: the best available)", short="-d")
    limit: int | None = flag(None, "evaluate only the first N examples (None: all)", Number.POSITIVE)
    batch_tokens: int | None = flag(None, "tokens per forward pass (None: 65536 on CUDA, else 4096)", Number.POSITIVE)
    data: str | None = flag(None, "a local HellaSwag jsonl instead of the cache / download")
    cache_dir: str = flag(DEFAULT_CACHE_DIR, "where the downloaded jsonl is kept")
    dtype: str = flag("auto", "autocast dtype (auto: as training picks)", choices=("auto", *AUTOCAST_DTYPES))


def main(argv=None):
    p = ArgumentParser(prog="hellaswag.py", description=__doc__)
    add_flags(p, EvalFlags)
    args = EvalFlags(**vars(p.parse_args(argv)))  # the flags given over the defaults
    examples = load_examples(args.data, args.cache_dir, args.limit)  # bad data fails before the model loads
    device, device_type = pick_device(args.device)
    if device_type == "cpu":
        keep_freed_memory()  # as a CPU training run evaluates, so that the two take the same time
    prepared = prepare(examples, get_tokenizer())
    model = load_model(args.model, device)
    dtype, _ = pick_dtype(args.dtype, device_type)  # what training picks on this machine
    scoring = dict(autocast_dtype=AUTOCAST_DTYPES[dtype], progress=True, batch_tokens=args.batch_tokens)
    counts = evaluate(model, prepared, device, **scoring)
    n = counts["n"]
    print(f"HellaSwag {args.model}: {n} examples, {dtype}")
    print(f"acc      {counts['correct'] / n:.4f}  ({counts['correct']}/{n})")
    print(f"acc_norm {counts['correct_norm'] / n:.4f}  ({counts['correct_norm']}/{n})")


if __name__ == "__main__":
    run_cli(main, out_of_memory=hellaswag_out_of_memory)

"""
FineWeb-Edu (or your own text) -> GPT-2 token shards for train_gpt2.py.

Documents are streamed (nothing is downloaded up front), tokenized with tiktoken's gpt2 encoding
by a pool of threads (tiktoken releases the GIL), each prefixed by <|endoftext|> (50256), and
written as shards of --shard-size uint16 tokens: {prefix}_val_000000.npy first, then
{prefix}_train_000001.npy, ...
A manifest beside the shards ({prefix}_manifest.json) records what each finished shard consumed,
so rerunning the same command after a crash or a kill continues after the last finished shard.

Usage:
    python fineweb.py                                     # FineWeb-Edu sample-10BT -> edu_fineweb10B/
    python fineweb.py --name sample-100BT --out-dir edu_fineweb100B
    python fineweb.py --dataset HuggingFaceFW/fineweb --name sample-10BT --prefix fineweb --out-dir fineweb10B
    python fineweb.py --input 'corpus/*.parquet' --out-dir my_shards       # local files, offline
    python fineweb.py --input input.txt --shard-size 1000000 --format bin  # llm.c / modded-nanogpt .bin
    python fineweb.py --max-tokens 10000000                                # a quick 10M-token run
"""

import argparse
import collections
import concurrent.futures
import functools
import json
import os
import queue
import re
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass

if __name__ == "__main__":  # Ctrl-C while numpy loads: one line, not a traceback from inside an import
    signal.signal(signal.SIGINT, lambda signum, frame: (print("interrupted", file=sys.stderr), os._exit(130)))

import numpy as np
from tqdm import tqdm

from support.cli import ArgumentParser, Number, UserError, add_flags, flag, flag_type, run_cli
from support.documents import check_inputs, default_workers, expand_inputs, hub_documents, local_documents
from support.files import check_folder, disk_error, lock_folder, unlock_folder, write_atomic
from support.shards import EOT, SHARD_NAME, get_tokenizer, shard_path, write_shard

BATCH_CHARS = 1 << 16  # characters per task of a worker thread: ~15K tokens, a few ms of work


# ----------------------------------------------------------------------------------------------
# Tokenization in a pool of threads
#
# tiktoken encodes in Rust with the GIL released, so threads of one process scale like processes
# (tiktoken's own encode_ordinary_batch is a thread pool too) without their costs: no pool start
# (a process per worker, each loading the tokenizer: the part that made 16 workers slow on small
# inputs), no copy of every text and result through pipes, one tokenizer in memory, and Ctrl-C
# lands in the one process, which stops at once (worker processes died holding the pool's queue
# lock and hung the run). What a worker does while holding the GIL is kept small: tokens come back
# as a numpy buffer, not as a Python list of ints, so 16 threads do not queue for the GIL.


def encode_ordinary(enc, text):
    """tiktoken's enc.encode_ordinary(text) as a uint32 array, the same tokens without the list."""
    try:
        return enc.encode_to_numpy(text, disallowed_special=())  # no special tokens: "<|endoftext|>" is text
    except UnicodeEncodeError:  # lone surrogates (a JSON "\ud800"): repaired as encode_ordinary does
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return enc.encode_to_numpy(text, disallowed_special=())


def _tokenize_batch(enc, texts):
    """The <|endoftext|>-prefixed tokens of texts, concatenated (uint16), and each document's length."""
    docs = [encode_ordinary(enc, text) for text in texts]
    eot = np.array([EOT], dtype=np.uint32)
    # exact: every id of GPT-2's encoding fits in 16 bits
    tokens = np.concatenate([part for ids in docs for part in (eot, ids)]).astype(np.uint16)
    return tokens, np.array([len(ids) + 1 for ids in docs], dtype=np.int64)


def _batched(documents, batch_chars):
    batch, chars = [], 0
    for text in documents:
        batch.append(text)
        chars += len(text)
        if chars >= batch_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize_batches(documents, workers=None, batch_chars=BATCH_CHARS):
    """Yield (tokens, doc_lengths) for successive batches of documents, in input order.

    tokens is uint16, every document prefixed by EOT. At most 4 * workers batches are in flight,
    so memory does not grow with the dataset (Pool.imap would read the whole input ahead)."""
    workers = workers or default_workers()
    enc = get_tokenizer()  # GPT-2's: every id fits the shards' uint16
    tasks = queue.SimpleQueue()

    def work():
        while (task := tasks.get()) is not None:
            texts, result = task
            try:
                result.set_result(_tokenize_batch(enc, texts))
            except BaseException as e:
                result.set_exception(e)

    # daemon threads: on Ctrl-C the process exits without waiting for a batch in progress (a single
    # large .txt is one document, and one encode call, of minutes)
    threads = [threading.Thread(target=work, name=f"fineweb-tokenizer-{i}", daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    pending = collections.deque()
    try:
        for batch in _batched(documents, batch_chars):
            pending.append(concurrent.futures.Future())
            tasks.put((batch, pending[-1]))
            if len(pending) >= 4 * workers:  # small batches, several per worker: none waits for the slowest
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # the end, an early stop (the generator closed), an error or Ctrl-C: stop every thread once it
        # has done the batches queued (at most 4 * workers, a few ms each; Ctrl-C's exit does not wait)
        for _ in threads:
            tasks.put(None)


# ----------------------------------------------------------------------------------------------
# Shards and the manifest


def load_manifest(path, config):
    """The shards a previous run of this configuration finished, or a fresh manifest."""
    if not os.path.exists(path):
        return {"config": config, "shards": [], "complete": False}
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        old = dict(manifest["config"])
    except (ValueError, KeyError, TypeError) as e:  # edited by hand, or another program's
        raise UserError(
            f"cannot read {path} as fineweb.py's manifest ({type(e).__name__}): use another --out-dir"
        ) from None
    if old != config:
        k = next(k for k in sorted(set(old) | set(config)) if old.get(k) != config.get(k))  # the first that differs
        shown = "the input (files or sizes)" if k == "source" else f"{k} {old.get(k)!r} there, {config.get(k)!r} now"
        raise UserError(
            f"{path} was written by a different configuration ({shown}): use another --out-dir, "
            f"or delete that folder's shards and manifest to start over"
        )
    return manifest


def save_manifest(path, manifest):
    """The manifest written whole, atomically: a kill leaves the old one or the new one."""
    write_atomic(path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def check_no_foreign_shards(out_dir, config, had_manifest):
    """Training reads every *_train_* / *_val_* file of the folder: refuse to mix ours (this
    configuration's names, where its manifest is) with others' (a run of another --prefix, shards
    whose manifest was deleted, the user's files), and never delete them."""
    ours = re.compile(rf"{re.escape(config['prefix'])}_(val|train)_\d+\.{config['format']}")
    foreign = [
        n for n in sorted(os.listdir(out_dir)) if SHARD_NAME.fullmatch(n) and not (had_manifest and ours.fullmatch(n))
    ]
    if foreign:
        raise UserError(
            f"{out_dir} holds {len(foreign)} shard file(s) this run's manifest does not list ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}), which train_gpt2.py would read with the new ones: "
            f"use another --out-dir, or move those files away"
        )


FOLDER_LOCK = ".fineweb.lock"  # in --out-dir while a run writes there; its text names that run's process


# ----------------------------------------------------------------------------------------------
# The run


def build_shards(open_documents, config, out_dir, workers=None, limit=float("inf"), command=None):
    """Tokenize documents into shards in out_dir, up to `limit` tokens, resuming from its manifest.

    open_documents(skip) returns the documents after the first `skip`. config (a JSON-able dict
    with at least shard_size, prefix and format) must match the manifest's to resume. command: this
    run's, which the manifest keeps for training to name while the folder is unfinished.
    Returns a summary dict."""
    try:
        lock = lock_folder(out_dir, FOLDER_LOCK, "fineweb.py")  # made if need be; a second run would interleave
    except OSError as e:
        raise disk_error(e, f"to --out-dir {out_dir}", "run the same command again") from None
    try:  # stopped before anything was written, unlock_folder removes the folder it made
        manifest_path = os.path.join(out_dir, f"{config['prefix']}_manifest.json")
        had_manifest = os.path.exists(manifest_path)
        manifest = load_manifest(manifest_path, config)
        manifest["command"] = command  # rerun, it finishes what this run leaves unfinished, and stops where it asked
        shards = manifest["shards"]
        check_no_foreign_shards(out_dir, config, had_manifest)

        pos0 = sum(s["tokens"] for s in shards)  # tokens written so far
        nothing_to_do, t0 = manifest["complete"] or pos0 >= limit, time.time()
        if not nothing_to_do:
            if shards and shards[-1]["tokens"] < config["shard_size"]:
                pos0 -= shards.pop()["tokens"]  # a partial last shard (an earlier --max-tokens stop) is redone
            manifest.pop("limit", None)  # unfinished until this run reaches the end or its own limit
            if had_manifest:
                save_manifest(manifest_path, manifest)  # the list as this run starts from it
            if shards:
                print(f"resuming after {shards[-1]['file']}: {pos0:,} tokens in {len(shards)} shards", file=sys.stderr)
            _write_shards(out_dir, config, manifest, manifest_path, open_documents, workers, limit)
        elif not (manifest["complete"] or manifest.get("limit") is not None):
            manifest["limit"] = int(limit)  # finished as asked (a manifest that did not say so yet)
            save_manifest(manifest_path, manifest)
    finally:
        unlock_folder(lock)
    tokens = sum(s["tokens"] for s in shards)
    return dict(
        nothing_to_do=nothing_to_do,
        complete=manifest["complete"],
        new_tokens=tokens - pos0,
        seconds=time.time() - t0,
        documents=sum(s["documents"] for s in shards),
        tokens=tokens,
        files=[s["file"] for s in shards],
    )


def _write_shards(out_dir, config, manifest, manifest_path, open_documents, workers, limit):
    """The documents after the manifest's, tokenized by `workers` threads, into shards after its, up to
    token limit or the end of the input (the last shard partial, the manifest marked complete). A shard
    is listed after its rename (the manifest rewritten whole, atomically), so the manifest never names
    a file that is not there."""
    shards, fmt = manifest["shards"], config["format"]
    buf, fill = np.empty(config["shard_size"], dtype=np.uint16), 0  # the shard being filled
    pos = sum(s["tokens"] for s in shards)
    # documents whose every token is in a finished shard: the first of the shard being filled, and of the batch
    shard_first_doc = batch_first_doc = sum(s["documents"] for s in shards)
    skip_tokens = shards[-1]["carry"] if shards else 0  # tokens of the next document already written
    # opened before the bar: a dataset that cannot be opened is just an error
    stream = tokenize_batches(open_documents(batch_first_doc), workers)

    def finish_shard(end_doc, carry):
        """buf[:fill] written as the next shard and listed. end_doc: the index of the first document that
        does not end in it; carry: that document's tokens in it."""
        nonlocal fill, shard_first_doc
        if not shards:  # the manifest before the first shard: every shard file is named by one
            save_manifest(manifest_path, manifest)
        path = shard_path(out_dir, config["prefix"], len(shards), fmt)
        write_shard(path, buf[:fill], fmt)
        # documents: those that end in this shard; carry: the next one's tokens in it (it is split across shards)
        shards.append(dict(file=os.path.basename(path), tokens=fill, documents=end_doc - shard_first_doc, carry=carry))
        save_manifest(manifest_path, manifest)
        fill, shard_first_doc = 0, end_doc

    bar = tqdm(total=None if limit == float("inf") else limit, initial=pos, unit="tok", unit_scale=True, desc=out_dir)
    try:
        for tokens, lengths in stream:
            ends = np.cumsum(lengths)  # end of each document in this batch's tokens
            i, skip_tokens = skip_tokens, 0
            while i < len(tokens) and pos < limit:
                n = min(len(buf) - fill, len(tokens) - i, limit - pos)
                buf[fill : fill + n] = tokens[i : i + n]
                fill, i, pos = fill + n, i + n, pos + n
                if fill == len(buf) or pos == limit:
                    done = int(np.searchsorted(ends, i, side="right"))  # documents of this batch fully written
                    finish_shard(batch_first_doc + done, i - (int(ends[done - 1]) if done else 0))
            batch_first_doc += len(lengths)
            bar.update(pos - bar.n)
            bar.set_postfix(docs=batch_first_doc, shards=len(shards), refresh=False)
            if pos >= limit:
                manifest["limit"] = int(limit)  # stopped where --max-tokens / --max-shards asked: training may use it
                break
        else:  # the input is exhausted: write the last, partial shard
            if not shards and pos == batch_first_doc:  # a first run that read nothing but empty texts' EOTs
                raise UserError("no text in the input (no documents, or only empty ones): no shard written")
            if fill:
                finish_shard(batch_first_doc, 0)
            manifest["complete"] = True
        save_manifest(manifest_path, manifest)
    except OSError as e:  # a full disk, a folder gone read-only: the manifest still names only whole shards
        raise disk_error(e, f"to {out_dir}", "rerun the same command: it resumes after the shards kept") from None
    finally:
        stream.close()  # stops the worker pool, also on an early stop or an error
        bar.close()


# ----------------------------------------------------------------------------------------------
# Command line


# the shard is built in memory (2 bytes a token) before it is written, and llm.c's .bin header counts
# its tokens in an int32
SHARD_SIZE = flag_type(int, lambda n: n < 2**31, "below 2**31 (2,147,483,648), 4 GiB in memory")
WORKERS = flag_type(int, lambda n: 1 <= n <= 256, "from 1 to 256 (threads beyond the cores only add overhead)")
# the smallest shard: one GPT-2 context (block_size 1,024) and the token after it, the longest sequence
# train_gpt2.py cuts from a shard (a batch never spans two)
MIN_SHARD_SIZE = 1025


@dataclass
class Flags:
    """fineweb.py's flags: the input (default: FineWeb-Edu sample-10BT streamed from the Hugging Face Hub),
    then the output."""

    dataset: str = flag("HuggingFaceFW/fineweb-edu", "Hub dataset")
    name: str = flag("sample-10BT", "its subset, e.g. sample-100BT; '' for none")
    split: str = flag("train", "the dataset's split to read")
    input: list | None = flag(
        None,
        "local .txt (one document each), .jsonl or .parquet files or globs, instead of the Hub",
        nargs="+",
        metavar="FILE",
    )
    text_field: str = flag("text", "the jsonl field / parquet / dataset column holding the text")
    out_dir: str = flag("edu_fineweb10B", "shard folder, relative to the working dir")
    prefix: str = flag("edufineweb", "shard name prefix")
    shard_size: int = flag(100_000_000, f"tokens per shard, at least {MIN_SHARD_SIZE}", SHARD_SIZE)
    format: str = flag("npy", "npy (np.save) or bin (llm.c header + uint16)", choices=("npy", "bin"))
    max_tokens: int | None = flag(None, "stop after this many tokens (the last shard may be partial)", Number.POSITIVE)
    max_shards: int | None = flag(None, "stop after this many shards", Number.POSITIVE)
    workers: int | None = flag(None, "tokenizer threads (None: the CPU cores)", WORKERS)


def parse_args(argv=None):
    """The flags (the defaults, the ones given over them), checked against each other before any work
    (each number's own range is its type's)."""
    p = ArgumentParser(prog="fineweb.py", description=__doc__)
    defaults = add_flags(p, Flags)
    given = vars(p.parse_args(argv))
    hub = [f"--{k}" for k in ("dataset", "name", "split") if k in given]
    args = argparse.Namespace(**{**defaults, **given})
    if args.input and hub:
        raise UserError(f"{hub[0]} chooses a Hub dataset, but --input reads local files instead: pass one of them")
    check_folder(args.out_dir, "--out-dir")
    prefix = args.prefix
    if not prefix or prefix.startswith(".") or "/" in prefix or os.sep in prefix or "\0" in prefix:
        raise UserError(
            f"--prefix {prefix!r}: a shard name prefix is a plain name (not empty, no '/', no leading '.'), "
            f"e.g. edufineweb; the folder is --out-dir"
        )
    if args.shard_size < MIN_SHARD_SIZE:
        raise UserError(
            f"--shard-size {args.shard_size:,} is too small: a shard must hold one GPT-2 context of 1,024 tokens and "
            f"its next-token target ({MIN_SHARD_SIZE:,}), for train_gpt2.py cuts each sequence from one shard; pass "
            f"at least {MIN_SHARD_SIZE}, e.g. --shard-size 100000 for a small text like README's Shakespeare (the "
            f"default, 100,000,000, suits FineWeb)"
        )
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.input:
        paths = expand_inputs(args.input)
        check_inputs(paths, args.text_field)
        paths = list(dict.fromkeys(map(os.path.realpath, paths)))  # a file named twice (a glob and its path) once
        # each file's size goes in the manifest: resuming over input that grew would skip the wrong documents
        source = {"input": [{"path": path, "bytes": os.path.getsize(path)} for path in paths]}
        open_documents = functools.partial(local_documents, paths, args.text_field)  # given the documents to skip
    else:
        name = args.name or None
        source = {"dataset": args.dataset, "name": name, "split": args.split}
        # called only if there is work to do: a finished folder needs no network
        open_documents = functools.partial(hub_documents, args.dataset, name, args.split, args.text_field)
    config = dict(
        source=source,
        text_field=args.text_field,
        encoding="gpt2",
        shard_size=args.shard_size,
        prefix=args.prefix,
        format=args.format,
    )
    command = f"cd {shlex.quote(os.getcwd())} && " + shlex.join(["python", os.path.relpath(__file__), *argv])
    # --max-shards is a token limit too: max_shards full shards
    limit = min(args.max_tokens or float("inf"), args.max_shards * args.shard_size if args.max_shards else float("inf"))
    s = build_shards(open_documents, config, args.out_dir, args.workers, limit, command)
    state = "nothing to do" if s["nothing_to_do"] else "done" if s["complete"] else "stopped early"
    rate = s["new_tokens"] / max(s["seconds"], 1e-9)
    print(
        f"{state}: {s['tokens']:,} tokens from {s['documents']:,} documents in {len(s['files'])} shards in "
        f"{args.out_dir}; this run wrote {s['new_tokens']:,} tokens in {s['seconds']:.1f}s ({rate:,.0f} tokens/s)"
    )
    if len(s["files"]) == 1:  # shard 0 is val: train_gpt2.py would find no train shard
        smaller = max(MIN_SHARD_SIZE, s["tokens"] // 10)  # about a tenth of the input, the rest in train shards
        if not s["complete"]:  # stopped by --max-shards 1 or --max-tokens within shard 0
            instead = " and no --max-tokens" if args.max_tokens else ""
            fix = f"run it again with --max-shards 2{instead} (it adds a train shard)"
        elif smaller < s["tokens"]:
            fix = f"write smaller shards into another --out-dir, e.g. --shard-size {smaller}"
        else:
            fix = f"add input: even the smallest --shard-size, {MIN_SHARD_SIZE}, puts all of it in the val shard"
        print(
            f"note: there is no train shard: all {s['tokens']:,} tokens are in the val shard {s['files'][0]}; "
            f"for training, {fix}",
            file=sys.stderr,
        )
    return s


if __name__ == "__main__":
    run_cli(main, interrupted="interrupted: rerun the same command to resume after the last finished shard")

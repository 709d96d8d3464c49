"""fineweb.py's tokenizer pool against tiktoken's encode_ordinary_batch."""

import statistics

import numpy as np

import fineweb
from benchmarks.report import comparison
from benchmarks.timing import interleave, log, rates, stats, timed
from support.cli import UserError
from support.documents import default_workers, expand_inputs, local_documents
from support.shards import get_tokenizer


def find_documents(pattern, text_field, shared):
    """The files of documents the section tokenizes: --docs's, else the FineWeb sample in shared/data.
    -> (paths, None), or (None, why the section cannot run here) when --docs is not given and there
    is no sample. A --docs that names no files of documents is a mistake: UserError."""
    if pattern is None:
        if shared is None or not list((shared / "fineweb_sample").glob("*.parquet")):
            return None, "no documents: pass --docs 'files/*.parquet'"
        pattern = str(shared / "fineweb_sample" / "*.parquet")
    try:
        paths = expand_inputs([pattern])
        if next(local_documents(paths, text_field), None) is None:
            raise UserError(f"--docs {pattern}: its files hold no documents")
    except UserError as e:  # fineweb.py's messages name its own flag for the files
        raise UserError(str(e).replace("--input", "--docs")) from None
    return paths, None


def bench_fineweb(s, paths, text_field):
    docs = list(local_documents(paths, text_field))[: s["docs"]]
    workers = default_workers()
    # the same work per worker at any core count (a 10B-token run is all steady state): on 16 cores
    # the 2-core amount is a tenth of a second, which measures little beyond starting the pool
    docs = docs * (s["docs_repeat"] * max(1, workers // 2))
    enc = get_tokenizer()
    n_tokens = sum(len(ids) for ids in enc.encode_ordinary_batch(docs, num_threads=workers))
    chars = sum(len(d) for d in docs)
    log(f"  fineweb: {len(docs)} documents, {chars:,} characters, {n_tokens:,} tokens, {workers} workers")

    def ours():  # the CLI's own path: its pool of tokenizer threads, EOT-prefixed uint16 tokens
        out = np.concatenate([t for t, _ in fineweb.tokenize_batches(docs, workers)])
        assert len(out) == n_tokens + len(docs)  # the same work: every token, plus one EOT per document

    def theirs():
        enc.encode_ordinary_batch(docs, num_threads=workers)

    times, _ = interleave({"fineweb": ours, "tiktoken": theirs}, *s["tok_rounds"], "cpu", "fineweb tokenize")
    start = [
        timed(lambda: list(fineweb.tokenize_batches([""] * workers, workers)), "cpu") for _ in range(3)
    ]  # the pool alone
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
            "fineweb_vs_tiktoken",
            note=f"{workers} threads each, {n_tokens:,} tokens; "
            f"pool start {statistics.median(start) * 1e3:.1f} ms included",
        )
    ]
    return result, rows

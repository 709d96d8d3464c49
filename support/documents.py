"""Where fineweb.py's documents come from: local .txt, .jsonl and .parquet files (their names
expanded, their encoding checked before any work) or a Hugging Face dataset streamed from the Hub,
each as an iterator of strings; and the threads that read and tokenize them by default
(default_workers); torch-free, as fineweb.py is."""

import codecs
import glob
import os
import shlex

from support.cli import UserError, first_line
from support.files import jsonl_rows
from support.offline import hub_offline

INPUT_TYPES = (".txt", ".jsonl", ".parquet")


def expand_inputs(patterns):
    """Files named on the command line, globs expanded (sorted), in the order given."""
    paths = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            raise UserError(f"--input {pattern} is a directory: pass its files, e.g. '{pattern}/*.parquet'")
        matches = [m for m in sorted(glob.glob(pattern, recursive=True)) if not os.path.isdir(m)]  # a path: itself
        if not matches:
            raise UserError(f"--input {pattern!r} matches no file")
        paths += matches
    for path in paths:
        if not path.endswith(INPUT_TYPES):
            raise UserError(f"--input {path}: unknown file type, use {', '.join(INPUT_TYPES)}")
    return paths


TEXT_PROBE = 1 << 16  # bytes of a .txt / .jsonl file whose encoding is checked before any work


def check_encoding(path, head):
    """Refuse text that is not UTF-8, seen in its first bytes `head`: tiktoken would take UTF-16 (what
    Windows PowerShell's `>` writes) as text full of NULs, and a binary file as text."""
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # UTF-32's (LE) starts as UTF-16's
        name = "UTF-32" if head.startswith(codecs.BOM_UTF32_LE) else "UTF-16"
        root, ext = os.path.splitext(path)
        command = f"iconv -f {name} -t UTF-8 {shlex.quote(path)} > {shlex.quote(root + '.utf8' + ext)}"
        raise UserError(f"{path} is {name} text (its byte-order mark says so), not UTF-8: convert it (e.g. {command})")
    if b"\0" in head:
        raise UserError(f"{path} holds NUL bytes: not UTF-8 text (UTF-16 without a byte-order mark? binary?)")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start} is not UTF-8): convert it to UTF-8") from None


def default_workers():
    """The cores this process may run on (its affinity where the OS has one): the default thread count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _text(value, where):
    if not isinstance(value, str):
        raise UserError(f"{where}: the text is {type(value).__name__}, not a string")
    return value


def read_documents(path, text_field):
    """The documents of one file: a .txt is one document; .jsonl and .parquet have one per row."""
    try:
        # utf-8-sig: a UTF-8 byte-order mark is not a character of the first document
        if path.endswith(".txt"):
            with open(path, encoding="utf-8-sig", newline="") as f:  # newline="": the text exactly as stored
                yield f.read()
        elif path.endswith(".jsonl"):
            with open(path, encoding="utf-8-sig") as f:
                for lineno, row in jsonl_rows(f, path):
                    if not isinstance(row, dict) or text_field not in row:
                        raise UserError(
                            f"{path} line {lineno} has no {text_field!r} field: choose one with --text-field"
                        )
                    yield _text(row[text_field], f"{path} line {lineno}")
        else:
            yield from _parquet_documents(path, text_field)
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def _parquet_documents(path, text_field):
    import pyarrow as pa  # noqa: PLC0415  pyarrow only for parquet input: .txt and .jsonl runs never load it
    import pyarrow.parquet as pq  # noqa: PLC0415  as above

    try:
        pf = pq.ParquetFile(path)
        columns = pf.schema_arrow.names
        if text_field not in columns:
            raise UserError(
                f"{path} has no {text_field!r} column (it has {', '.join(columns)}): choose one with --text-field"
            )
        row = 0
        for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                row += 1
                yield _text(text, f"{path} row {row}")
    except pa.ArrowException as e:
        raise UserError(f"{path} is not a readable parquet file ({first_line(e)})") from None


def _parquet_rows(path):
    """The number of rows of a parquet file, from its metadata (no text is read)."""
    import pyarrow.parquet as pq  # noqa: PLC0415  pyarrow only for parquet input: .txt and .jsonl runs never load it

    return pq.ParquetFile(path).metadata.num_rows


def check_inputs(paths, text_field):
    """Fail before any work on an unreadable file or a missing text column, not hours into the run."""
    for path in paths:
        if path.endswith((".txt", ".jsonl")):
            try:
                with open(path, "rb") as f:
                    check_encoding(path, f.read(TEXT_PROBE))
            except OSError as e:
                raise UserError(f"cannot read {path}: {e.strerror or e}") from None
        if not path.endswith(".txt"):
            next(read_documents(path, text_field), None)  # opens the file and checks the first row


def local_documents(paths, text_field, skip=0):
    """All documents of the files in order, after the first `skip` (a resumed run)."""
    for path in paths:
        # a whole file whose row count is known without reading its text is skipped for free
        if skip and path.endswith((".txt", ".parquet")):
            rows = 1 if path.endswith(".txt") else _parquet_rows(path)
            if skip >= rows:
                skip -= rows
                continue
        for text in read_documents(path, text_field):
            if skip:
                skip -= 1
                continue
            yield text


def hub_documents(dataset, name, split, text_field, skip=0):
    """Documents streamed from the Hugging Face Hub: tokenizing starts at once, nothing but the
    shards is kept on disk. Opens the dataset now, so a bad name fails before any work."""
    if not os.path.exists(dataset):  # a dataset's local folder needs no Hub
        # offline, the Hub client retries for half a minute and then says nothing about offline use: say it at once
        hub, reason = hub_offline(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        if reason:
            raise UserError(
                f"cannot stream {dataset} from {hub} ({reason}): pass local files with --input instead, "
                f"e.g. --input 'corpus/*.parquet' (.txt, .jsonl or .parquet)"
            )
    import datasets  # noqa: PLC0415  only streaming from the Hub needs datasets (half a second to import)

    try:
        ds = datasets.load_dataset(dataset, name=name, split=split, streaming=True)
    except Exception as e:  # not found, no network, bad config name: the library's message says which
        raise UserError(f"cannot open {dataset} (name {name}, split {split}): {first_line(e)}") from None
    if ds.column_names is not None:
        if text_field not in ds.column_names:
            raise UserError(
                f"{dataset} has no {text_field!r} column (it has {', '.join(ds.column_names)}): "
                f"choose one with --text-field"
            )
        ds = ds.select_columns([text_field])  # the other columns are then never decoded
    ds = ds.skip(skip)

    def documents():
        row = skip
        batches = ds.iter(batch_size=1000)
        while True:
            try:
                batch = next(batches, None)
            except Exception as e:  # a dropped connection hours in: what finished is kept, so say how to go on
                raise UserError(
                    f"reading {dataset} failed ({first_line(e)}): rerun the same command to resume"
                ) from None
            if batch is None:
                return
            if text_field not in batch:
                raise UserError(f"{dataset} rows have no {text_field!r} field: choose one with --text-field")
            for text in batch[text_field]:
                row += 1
                yield _text(text, f"{dataset} row {row}")

    return documents()

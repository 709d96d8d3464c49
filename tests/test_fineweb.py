"""fineweb.py: the shards are exactly tiktoken's EOT-prefixed encoding of the input, in order;
.bin headers are llm.c's; a killed run resumes byte-identically; bad input is a one-line error; a
full disk keeps the finished shards."""

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fineweb
from helpers import assert_one_line_error, cli, fail_nth_write, snapshot, start_run, started_until, user_error
from support import documents, files, offline
from support.shards import EOT

SHARD = 10_000  # small shards: the 174,082-token FineWeb sample gives 17 full ones and a partial one


def read_shards(out_dir, fmt="npy"):
    """{file name: tokens} of the shards in out_dir; .bin parsed by hand from llm.c's layout."""
    shards = {}
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if name.endswith(".npy") and fmt == "npy":
            shards[name] = np.load(path)
        elif name.endswith(".bin") and fmt == "bin":
            raw = open(path, "rb").read()
            header = np.frombuffer(raw[:1024], dtype="<i4")
            assert header[0] == 20240520 and header[1] == 1 and (header[3:] == 0).all()
            assert len(raw) == 1024 + 2 * header[2]
            shards[name] = np.frombuffer(raw[1024:], dtype="<u2")
    return shards


def ordered(shards):
    """Shard arrays in index order, checking the names: val first, then train, numbered from 0."""
    names = sorted(shards, key=lambda n: int(n.rsplit("_", 1)[1].split(".")[0]))
    for i, name in enumerate(names):
        assert name.startswith(f"edufineweb_{'val' if i == 0 else 'train'}_{i:06d}."), names
    return [shards[n] for n in names]


def file_bytes(out_dir):
    """Each file's bytes; the manifest's but for its command, which names that run's own flags and folder."""
    files = {name: open(os.path.join(out_dir, name), "rb").read() for name in sorted(os.listdir(out_dir))}
    return {n: json.dumps({**json.loads(b), "command": None}) if n.endswith(".json") else b for n, b in files.items()}


def parquet_texts(path):
    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


@pytest.fixture(scope="session")
def parquet_tokens(assets, enc):
    """The reference: texts read with pyarrow directly, encoded by tiktoken's own batch API."""
    ids = enc.encode_ordinary_batch(parquet_texts(assets.fineweb), num_threads=2)
    return np.array([t for doc in ids for t in [EOT, *doc]], dtype=np.uint16)


@pytest.fixture(scope="session")
def parquet_copies(tmp_path_factory, assets, enc):
    """The parquet sample as 40 files of distinct bytes (copy k ends in " (copy k)"), and tiktoken's tokens."""
    folder, texts = tmp_path_factory.mktemp("copies"), parquet_texts(assets.fineweb)
    copies = [[t + f" (copy {k})" for t in texts] for k in range(40)]
    files = [str(folder / f"copy{k}.parquet") for k in range(40)]
    for path, copy in zip(files, copies, strict=True):
        pq.write_table(pa.table({"text": copy}), path)
    ids = enc.encode_ordinary_batch([t for copy in copies for t in copy], num_threads=2)
    return files, np.array([t for doc in ids for t in [EOT, *doc]], dtype=np.uint16)


def wait_for_shards(proc, manifest, n, timeout):
    """Until the manifest at path lists more than n shards, proc ends, or timeout seconds pass."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if len(json.loads(manifest.read_text())["shards"]) > n:
                return
        except (OSError, ValueError, TypeError):
            pass
        time.sleep(0.002)


@pytest.fixture(scope="session")
def parquet_run(tmp_path_factory, assets):
    """One uninterrupted run over the parquet sample, shared by the tests that compare against it."""
    out, docs = tmp_path_factory.mktemp("parquet_run") / "shards", str(assets.fineweb.with_name("fineweb_*.parquet"))
    fineweb.main(["--input", docs, "--out-dir", str(out), "--shard-size", str(SHARD), "--workers", "2"])
    return out


def test_parquet_sample_is_tiktoken_encoding_in_order(parquet_run, parquet_tokens):
    assert len(parquet_tokens) == 174_082
    shards = ordered(read_shards(parquet_run))
    assert [len(s) for s in shards] == [SHARD] * 17 + [4_082]  # the last, partial shard is written
    assert all(s.dtype == np.uint16 for s in shards)
    np.testing.assert_array_equal(np.concatenate(shards), parquet_tokens)
    manifest = json.loads((parquet_run / "edufineweb_manifest.json").read_text())
    assert manifest["complete"] and sum(s["documents"] for s in manifest["shards"]) == 100


def test_tinyshakespeare_is_one_document_in_llmc_bin(tmp_path, assets, enc):
    # in .npy: test_fineweb_disk_full_mid_run_keeps_finished_shards_and_resumes
    text, fmt, size = assets.shakespeare, "bin", 150_000
    expected = np.array([EOT] + enc.encode_ordinary(text.read_text()), dtype=np.uint16)
    assert len(expected) == 300_736 + 1
    fineweb.main(["--input", str(text), "--out-dir", str(tmp_path), "--shard-size", str(size), "--format", fmt])
    shards = read_shards(tmp_path, fmt)  # .bin: checks magic, version, count, zero padding and file size
    assert len(shards) == len(os.listdir(tmp_path)) - 1  # every file but the manifest is a shard of that format
    assert [len(s) for s in ordered(shards)] == [size] * (300_737 // size) + [300_737 % size]
    np.testing.assert_array_equal(np.concatenate(ordered(shards)), expected)


def test_txt_and_jsonl_globs_in_order_with_text_field(tmp_path, enc):
    src = tmp_path / "src"
    src.mkdir()
    (src / "b.txt").write_bytes("second file\r\nkeeps its CRLF\n".encode())
    (src / "a.txt").write_text("first file, sorted before b")
    rows = [
        {"content": "caf\u00e9 \u2603 <|endoftext|> is plain text here", "id": 1},
        {"content": "", "id": 2},
        {"content": "x " * 2500, "id": 3},
    ]
    (src / "c.jsonl").write_text(json.dumps(rows[0]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[1:]) + "\n")
    docs = ["first file, sorted before b", "second file\r\nkeeps its CRLF\n"] + [r["content"] for r in rows]
    expected = np.array([t for d in docs for t in [EOT, *enc.encode_ordinary(d)]], dtype=np.uint16)

    out = tmp_path / "out"
    os.symlink(src / "a.txt", tmp_path / "link.txt")
    # each file read once, however often it is named: its glob and its path, another spelling, a link
    named_again = [str(src / "c.jsonl"), f"{src}/./a.txt", str(tmp_path / "link.txt")]
    # shards of the smallest size, 1,025 tokens: documents split across shards, the long one across several
    inputs = ["--input", str(src / "*.txt"), str(src / "c.jsonl"), *named_again, "--text-field", "content"]
    fineweb.main([*inputs, "--out-dir", str(out), "--shard-size", "1025"])
    shards = ordered(read_shards(out))
    assert len(shards) == 3 and all(len(s) == 1025 for s in shards[:-1]) and 0 < len(shards[-1]) <= 1025
    np.testing.assert_array_equal(np.concatenate(shards), expected)
    manifest = json.loads((out / "edufineweb_manifest.json").read_text())
    assert sum(s["documents"] for s in manifest["shards"]) == len(docs)


@pytest.mark.slow  # 7M tokens written, killed and finished: ~13 s
def test_resume_after_sigkill_is_byte_identical(tmp_path, monkeypatch, parquet_copies):
    # the sample 40 times over (7M tokens, 140 shards) and one worker: the kill lands mid-run
    files, tokens = parquet_copies
    args = ["--input", *files, "--out-dir", "out", "--shard-size", "50000"]
    options = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True}
    proc = start_run(*args, "--workers", "1", script="fineweb.py", cwd=tmp_path, **options)
    manifest_path = tmp_path / "out" / "edufineweb_manifest.json"
    try:
        wait_for_shards(proc, manifest_path, 2, timeout=120)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its pool workers, nothing else
        proc.wait()
    killed = json.loads(manifest_path.read_text())
    assert not killed["complete"] and 3 <= len(killed["shards"]) < 140, "the kill did not land mid-run"

    monkeypatch.chdir(tmp_path)  # the same command, relative --out-dir included
    fineweb.main([*args, "--workers", "2"])
    fresh = tmp_path / "fresh"
    fineweb.main(["--input", *files, "--out-dir", str(fresh), "--shard-size", "50000", "--workers", "2"])
    # every file, manifest included, and no leftover temporary files
    assert file_bytes(tmp_path / "out") == file_bytes(fresh)
    np.testing.assert_array_equal(np.concatenate(ordered(read_shards(fresh))), tokens)


def test_max_tokens_stops_exactly_then_resumes(tmp_path, assets, parquet_run, parquet_tokens):
    args = ["--input", str(assets.fineweb), "--out-dir", str(tmp_path), "--shard-size", str(SHARD), "--workers", "2"]
    fineweb.main([*args, "--max-tokens", "25001"])  # stops inside a document
    shards = ordered(read_shards(tmp_path))
    assert [len(s) for s in shards] == [SHARD, SHARD, 5_001]
    np.testing.assert_array_equal(np.concatenate(shards), parquet_tokens[:25_001])

    before = {p: os.stat(tmp_path / p).st_mtime_ns for p in os.listdir(tmp_path)}
    assert fineweb.main([*args, "--max-tokens", "25001"])["nothing_to_do"]
    assert {p: os.stat(tmp_path / p).st_mtime_ns for p in os.listdir(tmp_path)} == before

    fineweb.main(args)  # without the limit: the partial shard is redone and the rest follows
    assert file_bytes(tmp_path) == file_bytes(parquet_run)


def test_hub_path_streams_through_datasets(tmp_path, monkeypatch, assets, parquet_run):
    datasets = pytest.importorskip("datasets")

    real_load_dataset = datasets.load_dataset
    calls = []

    def local_hub(path, name=None, split=None, streaming=False):
        # the Hub stands in as local parquet, still a streamed datasets.IterableDataset
        calls.append((path, name, split, streaming))
        return real_load_dataset("parquet", data_files=[str(assets.fineweb)], split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", local_hub)
    monkeypatch.setattr(documents, "hub_offline", lambda variables: ("hub", None))  # online (offline: below)
    args = ["--out-dir", str(tmp_path), "--shard-size", str(SHARD), "--workers", "2"]
    fineweb.main([*args, "--max-tokens", "33333"])  # and resume through the stream's skip
    summary = fineweb.main(args)
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)] * 2
    assert summary["complete"] and summary["tokens"] == 174_082
    shards = lambda d: {n: b for n, b in file_bytes(d).items() if n.endswith(".npy")}  # noqa: E731
    assert shards(tmp_path) == shards(parquet_run)


def test_the_pool_gives_tiktokens_tokens_in_order(enc, assets):
    text = assets.shakespeare.read_text()
    docs = [text[i : i + 5000 + 37 * i % 9000] for i in range(0, len(text), 9000)] + ["", "\u00e9\n", "a \ud800 b"]
    expected = [t for d in docs for t in [EOT, *enc.encode_ordinary(d)]]  # a lone surrogate repaired as tiktoken does
    tokens = np.concatenate([t for t, _ in fineweb.tokenize_batches(docs, workers=2)])  # several batches of BATCH_CHARS
    assert tokens.dtype == np.uint16 and tokens.tolist() == expected


def test_pool_reads_only_a_bounded_amount_ahead(enc):
    # memory must not grow with the dataset: the input is read at most 4 * workers batches ahead
    pulled = 0

    def documents():
        nonlocal pulled
        for _ in range(10_000):
            pulled += 1
            yield "word " * 100

    stream = fineweb.tokenize_batches(documents(), workers=2, batch_chars=5_000)  # 10 documents a batch
    tokens, lengths = next(stream)
    stream.close()
    n = len(enc.encode_ordinary("word " * 100)) + 1
    assert lengths.tolist() == [n] * 10 and len(tokens) == 10 * n
    assert pulled <= (4 * 2 + 1) * 10  # 4 * workers batches in flight, and the one being read


def test_manifest_from_other_config_is_refused(tmp_path):
    (tmp_path / "doc.txt").write_text("hello world, " * 20)
    args = ["--input", str(tmp_path / "doc.txt"), "--out-dir", str(tmp_path / "out"), "--workers", "1"]
    fineweb.main([*args, "--shard-size", "1025"])
    before = file_bytes(tmp_path / "out")
    assert "configuration (shard_size 1025 there, 2000 now)" in user_error([*args, "--shard-size", 2000], fineweb.main)
    with (tmp_path / "doc.txt").open("a") as f:
        f.write("one more line")  # the input grew: skipping by document count would be wrong
    assert "configuration (the input (files or sizes))" in user_error([*args, "--shard-size", 1025], fineweb.main)
    assert file_bytes(tmp_path / "out") == before  # refused without touching anything
    (tmp_path / "out" / "edufineweb_manifest.json").write_text("{not json")  # edited by hand
    msg = user_error([*args, "--shard-size", 1025], fineweb.main)
    assert re.match(r"cannot read .*edufineweb_manifest.json as fineweb.py's manifest \(", msg)


def unreachable(*args, **kwargs):
    raise OSError(101, "Network is unreachable")


@pytest.mark.parametrize(
    "env, connect, message",
    [
        ({"HF_HUB_OFFLINE": "1"}, None, "HF_HUB_OFFLINE is set"),
        ({"HF_DATASETS_OFFLINE": "true"}, None, "HF_DATASETS_OFFLINE is set"),
        ({}, unreachable, r"from https://huggingface.co \(\[Errno 101\] Network is unreachable\)"),
    ],
    ids=["hub-offline", "datasets-offline", "no-network"],
)
def test_offline_hub_mode_says_at_once_what_to_pass(tmp_path, monkeypatch, env, connect, message):
    # rule 8: the library would retry for ~27 s and then say nothing about offline use
    datasets = pytest.importorskip("datasets")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the Hub was asked"))
    tried = []
    monkeypatch.setattr(offline.socket, "create_connection", lambda *a, **k: tried.append(a) or connect(*a, **k))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("the user's")
    before = snapshot(tmp_path)
    msg = user_error(["--out-dir", tmp_path / "out", "--max-tokens", 1000], fineweb.main)
    assert re.search(message, msg) and "--input" in msg  # says what to pass instead
    assert bool(tried) == (connect is not None)  # the flag alone decides, without a connection attempt
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------------------------
# The reliability rules for fineweb.py: every flag checked before any work, the out-dir belongs to
# one run, Ctrl-C is prompt and clean. A refusal is one `error:` line, exit 1, and leaves
# the folder exactly as it was.


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--shard-size", "10000000000000"], r"--shard-size: must be below 2\*\*31 \(2,147,483,648\), 4 GiB in memory"),
        (["--shard-size", "1e8"], r"argument --shard-size: invalid int value: '1e8'"),
        (["--max-tokens", "-5"], r"--max-tokens: must be at least 1, not -5"),
        (["--workers", "100000"], r"--workers: must be from 1 to 256 \(threads beyond the cores only add overhead\)"),
        (["--prefix", ""], r"--prefix '': a shard name prefix is a plain name"),
        (["--prefix", "../elsewhere"], r"--prefix '../elsewhere'"),
        (["--prefix", ".hidden"], r"--prefix '.hidden'"),
        (["--dataset", "HuggingFaceFW/fineweb"], r"--dataset chooses a Hub dataset, but --input reads local files"),
        (["--split", "validation"], r"--split chooses a Hub dataset"),
        (["--sharding", "7"], r"unrecognized arguments: --sharding 7"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_every_flag_is_checked_before_any_work(tmp_path, flags, message):
    (tmp_path / "doc.txt").write_text("hello world")
    before = snapshot(tmp_path)
    msg = user_error(["--input", tmp_path / "doc.txt", "--out-dir", tmp_path / "out", *flags], fineweb.main)
    assert re.search(message, msg)
    assert snapshot(tmp_path) == before  # not even the out-dir was made


def test_a_shard_too_small_for_one_sequence_is_refused_and_the_size_it_names_works(tmp_path, assets):
    text = assets.shakespeare
    r = cli("--input", str(text), "--out-dir", "out", "--shard-size", "1", script="fineweb.py", cwd=tmp_path)
    assert_one_line_error(r, match=r"^error: --shard-size 1 is too small: .*pass at least 1025")
    line = r.stderr.splitlines()[-1]
    assert os.listdir(tmp_path) == []  # not a file a token: nothing written
    fix = re.search(r"e\.g\. (--shard-size \d+) for a small text like README's Shakespeare", line).group(1).split()
    r = cli("--input", str(text), "--out-dir", "out", *fix, "--workers", "1", script="fineweb.py", cwd=tmp_path)
    assert r.returncode == 0 and "no train shard" not in r.stderr, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*_train_*.npy"))[-1] == "edufineweb_train_000003.npy"


@pytest.mark.parametrize(
    "text, fix",
    [
        (None, "write smaller shards into another --out-dir, e.g. --shard-size 30073"),  # in one 100M-token shard
        ("x" + " x" * 998, "add input: even the smallest --shard-size, 1025, puts all of it in the val shard"),
    ],
    ids=["tiny-shakespeare", "1000-tokens"],
)
def test_input_within_one_shard_says_there_is_no_train_shard(tmp_path, assets, text, fix):
    (tmp_path / "doc.txt").write_text(assets.shakespeare.read_text() if text is None else text)
    for said in ("done: ", "nothing to do: "):  # and again on a rerun
        r = cli("--input", "doc.txt", "--out-dir", "out", "--workers", "1", script="fineweb.py", cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.startswith(said), r.stderr
        assert "note: there is no train shard" in r.stderr and r.stderr.strip().endswith(f"for training, {fix}")
    assert sorted(os.listdir(tmp_path / "out")) == ["edufineweb_manifest.json", "edufineweb_val_000000.npy"]


@pytest.mark.parametrize(
    "files",
    [
        {"docs.jsonl": b""},
        {"docs.jsonl": b"\n\n  \n"},
        {"none.parquet": None},  # a parquet table of no rows
        {"a.txt": b"", "b.jsonl": b'{"text": ""}\n'},
    ],
    ids=["empty-file", "blank-lines", "empty-parquet", "empty-texts"],
)
@pytest.mark.parametrize("out_dir", ["new", "the user's empty folder"])
def test_empty_input_says_no_text(tmp_path, files, out_dir):
    for name, content in files.items():
        if content is None:
            pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), tmp_path / name)
        else:
            (tmp_path / name).write_bytes(content)
    if out_dir != "new":
        (tmp_path / "out").mkdir()
    before = snapshot(tmp_path)
    r = cli("--input", *files, "--out-dir", "out", "--workers", "1", script="fineweb.py", cwd=tmp_path)
    assert_one_line_error(r, match=r"no text in the input \(no documents, or only empty ones\): no shard written")
    assert "done" not in r.stdout
    assert snapshot(tmp_path) == before  # no manifest; a folder made for nothing removed, the user's kept


@pytest.mark.parametrize(
    "plant, message",
    [
        # the manifest deleted (as an old refusal suggested), then the run again
        (
            lambda out: os.remove(out / "edufineweb_manifest.json"),
            r"holds 3 shard file\(s\) .*edufineweb_train_000001.npy",
        ),
        # another prefix's shards: training reads every *_train_* file of the folder
        (lambda out: (out / "other_train_000001.npy").write_bytes(b"x"), r"holds 1 shard .*other_train_000001.npy"),
        # our prefix in the other format
        (lambda out: (out / "edufineweb_train_000001.bin").write_bytes(b"x"), r"edufineweb_train_000001.bin"),
    ],
    ids=["manifest-deleted", "other-prefix", "other-format"],
)
def test_foreign_shards_in_out_dir_are_refused_never_deleted(tmp_path, assets, plant, message):
    args = ["--input", str(assets.shakespeare), "--out-dir", str(tmp_path / "out"), "--shard-size", "100000"]
    fineweb.main([*args, "--max-tokens", "250000"])  # tiny shakespeare's first 3 shards, to be continued
    plant(tmp_path / "out")
    before = snapshot(tmp_path)
    r = cli(*args, script="fineweb.py", cwd=tmp_path)
    assert_one_line_error(r, match=message + r".*train_gpt2.py would read")
    assert snapshot(tmp_path) == before


@pytest.fixture(scope="module")
def sample_x2(tmp_path_factory, parquet_copies):
    """The parquet sample 20 times over (3.5M tokens) in 50K-token shards: the run Ctrl-C interrupts."""
    args = ["--input", *parquet_copies[0][:20], "--shard-size", "50000", "--workers", "1"]
    fresh = tmp_path_factory.mktemp("sample_x2") / "fresh"
    fineweb.main([*args, "--out-dir", str(fresh)])
    return args, file_bytes(fresh)


@pytest.mark.parametrize("when", ["start-up", "first-shard", "mid-run"])
def test_ctrl_c_is_prompt_and_clean_then_resumes(tmp_path, sample_x2, when):
    # rule 7: SIGINT ends the run where it is (no shard after the one in flight) with one line and no
    # traceback, leaves no .tmp file, keeps the finished shards; the same command then continues to
    # the same bytes
    args, fresh = sample_x2
    manifest = tmp_path / "out" / "edufineweb_manifest.json"
    listed = lambda: json.loads(manifest.read_text())["shards"] if manifest.exists() else []  # noqa: E731
    args, options = [*args, "--out-dir", "out"], dict(script="fineweb.py", cwd=tmp_path, start_new_session=True)
    proc = started_until("import numpy", *args, **options) if when == "start-up" else start_run(*args, **options)
    try:
        if when != "start-up":
            wait_for_shards(proc, manifest, {"first-shard": 0, "mid-run": 8}[when], timeout=120)
        assert proc.poll() is None, "the run ended before the interrupt"
        shards = len(listed())
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole process group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert len(listed()) <= shards + 1, "it went on after the interrupt"  # one may finish as it is sent
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("interrupted"), err
    if (tmp_path / "out").exists():
        names = os.listdir(tmp_path / "out")
        assert not [n for n in names if n.endswith(".tmp")], names
        assert all(file_bytes(tmp_path / "out")[s["file"]] == fresh[s["file"]] for s in listed())  # kept, whole
    r = cli(*args, script="fineweb.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert file_bytes(tmp_path / "out") == fresh


# ----------------------------------------------------------------------------------------------
# Input that is not UTF-8


UTF16_TEXT = "Hello, world: caf\u00e9 \u2603\n" * 50


@pytest.mark.parametrize("encoding, suffix", [("UTF-16", ".txt"), ("UTF-32", ".jsonl")])
def test_text_that_is_not_utf8_is_refused_naming_the_file_and_the_conversion_works(tmp_path, enc, encoding, suffix):
    content = UTF16_TEXT if suffix == ".txt" else json.dumps({"text": UTF16_TEXT}) + "\n"
    path = tmp_path / f"doc{suffix}"
    path.write_bytes(content.encode(encoding))
    message = rf"is {encoding} text \(its byte-order mark says so\)"
    r = cli("--input", path.name, "--out-dir", "out", "--workers", "1", script="fineweb.py", cwd=tmp_path)
    assert_one_line_error(r, match=rf"^error: doc{re.escape(suffix)} ")
    assert re.search(message, r.stderr) and not (tmp_path / "out").exists()  # before any work
    command = re.search(r"e\.g\. (iconv [^)]*)\)", r.stderr).group(1)  # the conversion it names works
    assert subprocess.run(command, shell=True, cwd=tmp_path).returncode == 0
    converted = tmp_path / f"doc.utf8{suffix}"
    args = ["--input", converted.name, "--out-dir", "out", "--shard-size", 1025, "--workers", 1]
    r = cli(*args, script="fineweb.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    expected = np.array([EOT, *enc.encode_ordinary(UTF16_TEXT)], dtype=np.uint16)
    np.testing.assert_array_equal(np.concatenate(ordered(read_shards(tmp_path / "out"))), expected)


# ----------------------------------------------------------------------------------------------
# A full disk mid-run


def test_fineweb_disk_full_mid_run_keeps_finished_shards_and_resumes(tmp_path, monkeypatch, assets, enc):
    text_path = assets.shakespeare
    expected = np.array([EOT] + enc.encode_ordinary(text_path.read_text()), dtype=np.uint16)  # tiktoken directly
    out = tmp_path / "out"
    args = ["--input", str(text_path), "--out-dir", str(out), "--shard-size", "100000", "--workers", "1"]
    opened = fail_nth_write(monkeypatch, files, ".npy.tmp", 3)  # the third shard hits a full disk
    msg = user_error(args, fineweb.main)
    assert len(opened) == 3 and "No space left on device" in msg and "rerun the same command" in msg
    # the two finished shards and their manifest are untouched; the half-written one is gone
    listed = [s["file"] for s in json.loads((out / "edufineweb_manifest.json").read_text())["shards"]]
    assert listed == ["edufineweb_val_000000.npy", "edufineweb_train_000001.npy"]
    assert sorted(os.listdir(out)) == sorted([*listed, "edufineweb_manifest.json"])
    np.testing.assert_array_equal(np.load(out / "edufineweb_train_000001.npy"), expected[100_000:200_000])

    monkeypatch.undo()  # space freed: the same command continues after the finished shards
    summary = fineweb.main(args)
    assert summary["complete"] and summary["new_tokens"] == len(expected) - 200_000
    shards = [np.load(out / f) for f in summary["files"]]
    np.testing.assert_array_equal(np.concatenate(shards), expected)


@pytest.mark.online
def test_online_fineweb_edu_on_the_hub_is_the_text_fineweb_py_makes_shards_of(tmp_path, enc):
    """fineweb.py's default source: its rows hold documents in `text`, and a run's first shard is the first
    of them tokenized, each after an <|endoftext|>."""
    import datasets  # noqa: PLC0415  (half a second: only this test needs it)

    hub = fineweb.Flags()
    rows = list(datasets.load_dataset(hub.dataset, name=hub.name, split=hub.split, streaming=True).take(2))
    assert all(isinstance(row["text"], str) and len(row["text"]) > 100 for row in rows)
    s = fineweb.main(["--out-dir", str(tmp_path), "--max-tokens", "2000", "--shard-size", "2000", "--workers", "1"])
    want = [EOT, *enc.encode_ordinary(rows[0]["text"]), EOT, *enc.encode_ordinary(rows[1]["text"])][:2000]
    assert s["tokens"] == 2000 and np.load(s["files"][0]).tolist() == want

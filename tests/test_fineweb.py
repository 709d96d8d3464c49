"""fineweb.py: the shards are exactly tiktoken's EOT-prefixed encoding of the input, in order;
.bin headers are llm.c's; a killed run resumes byte-identically; bad input is a one-line error."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

import fineweb
from train_gpt2 import EOT, UserError

ROOT = __import__("conftest").ROOT
SHARD = 100_000  # small shards: the 1.6M-token sample gives 16 full ones and a partial one


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
    return {name: open(os.path.join(out_dir, name), "rb").read() for name in sorted(os.listdir(out_dir))}


@pytest.fixture(scope="session")
def parquet_files(shared_data):
    return sorted(str(p) for p in (shared_data / "fineweb_sample").glob("*.parquet"))


@pytest.fixture(scope="session")
def parquet_tokens(parquet_files, enc):
    """The reference: texts read with pyarrow directly, encoded by tiktoken's own batch API."""
    texts = [t for f in parquet_files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
    parts = []
    for ids in enc.encode_ordinary_batch(texts, num_threads=2):
        parts += [EOT, *ids]
    return np.array(parts, dtype=np.uint16)


@pytest.fixture(scope="session")
def parquet_run(tmp_path_factory, shared_data):
    """One uninterrupted run over the parquet sample, shared by the tests that compare against it."""
    out = tmp_path_factory.mktemp("parquet_run") / "shards"
    fineweb.main(
        [
            "--input",
            str(shared_data / "fineweb_sample" / "*.parquet"),
            "--out-dir",
            str(out),
            "--shard-size",
            str(SHARD),
            "--workers",
            "2",
        ]
    )
    return out


def test_parquet_sample_is_tiktoken_encoding_in_order(parquet_run, parquet_tokens, shared_data):
    reference = json.loads((shared_data / "reference" / "reference_numbers.json").read_text())["fineweb_sample"]
    assert len(parquet_tokens) == reference["gpt2_tokens_with_one_eot_per_doc"] == 1_606_780
    shards = ordered(read_shards(parquet_run))
    assert [len(s) for s in shards] == [SHARD] * 16 + [6_780]  # the last, partial shard is written
    assert all(s.dtype == np.uint16 for s in shards)
    np.testing.assert_array_equal(np.concatenate(shards), parquet_tokens)
    manifest = json.loads((parquet_run / "edufineweb_manifest.json").read_text())
    assert manifest["complete"] and sum(s["documents"] for s in manifest["shards"]) == reference["documents"]


def test_tinyshakespeare_is_one_document(tmp_path, shared_data, enc):
    text = (shared_data / "tinyshakespeare" / "input.txt").read_text()
    expected = np.array([EOT] + enc.encode_ordinary(text), dtype=np.uint16)
    assert len(expected) == 338_025 + 1
    fineweb.main(
        [
            "--input",
            str(shared_data / "tinyshakespeare" / "input.txt"),
            "--out-dir",
            str(tmp_path),
            "--shard-size",
            str(SHARD),
        ]
    )
    shards = ordered(read_shards(tmp_path))
    assert [len(s) for s in shards] == [SHARD, SHARD, SHARD, 38_026]
    np.testing.assert_array_equal(np.concatenate(shards), expected)


def test_bin_format_has_llmc_header_and_same_tokens(tmp_path, shared_data, enc):
    text = (shared_data / "tinyshakespeare" / "input.txt").read_text()
    expected = np.array([EOT] + enc.encode_ordinary(text), dtype=np.uint16)
    fineweb.main(
        [
            "--input",
            str(shared_data / "tinyshakespeare" / "input.txt"),
            "--out-dir",
            str(tmp_path),
            "--shard-size",
            "150000",
            "--format",
            "bin",
        ]
    )
    shards = read_shards(tmp_path, "bin")  # checks magic, version, count, zero padding and file size
    assert list(shards) == ["edufineweb_train_000001.bin", "edufineweb_train_000002.bin", "edufineweb_val_000000.bin"]
    assert [len(s) for s in ordered(shards)] == [150_000, 150_000, 38_026]
    np.testing.assert_array_equal(np.concatenate(ordered(shards)), expected)


def test_txt_and_jsonl_globs_in_order_with_text_field(tmp_path, enc):
    src = tmp_path / "src"
    src.mkdir()
    (src / "b.txt").write_bytes("second file\r\nkeeps its CRLF\n".encode())
    (src / "a.txt").write_text("first file, sorted before b")
    rows = [
        {"content": "caf\u00e9 \u2603 <|endoftext|> is plain text here", "id": 1},
        {"content": "", "id": 2},
        {"content": "x " * 40, "id": 3},
    ]
    (src / "c.jsonl").write_text(json.dumps(rows[0]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[1:]) + "\n")
    docs = ["first file, sorted before b", "second file\r\nkeeps its CRLF\n"] + [r["content"] for r in rows]
    expected = np.array([t for d in docs for t in [EOT, *enc.encode_ordinary(d)]], dtype=np.uint16)

    out = tmp_path / "out"
    # shards of 7 tokens: documents split across shards, the long one across several
    fineweb.main(
        [
            "--input",
            str(src / "*.txt"),
            str(src / "c.jsonl"),
            "--text-field",
            "content",
            "--out-dir",
            str(out),
            "--shard-size",
            "7",
        ]
    )
    shards = ordered(read_shards(out))
    assert all(len(s) == 7 for s in shards[:-1]) and 0 < len(shards[-1]) <= 7
    np.testing.assert_array_equal(np.concatenate(shards), expected)
    manifest = json.loads((out / "edufineweb_manifest.json").read_text())
    assert sum(s["documents"] for s in manifest["shards"]) == len(docs)


def test_resume_after_sigkill_is_byte_identical(tmp_path, parquet_files, parquet_tokens):
    # the sample four times over (6.4M tokens, 129 shards) and one worker: the kill lands mid-run
    args = ["--input", *parquet_files * 4, "--out-dir", "out", "--shard-size", "50000"]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "fineweb.py"), *args, "--workers", "1"],
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    manifest_path = tmp_path / "out" / "edufineweb_manifest.json"
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            if manifest_path.exists() and len(json.loads(manifest_path.read_text())["shards"]) >= 3:
                break
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its pool workers, nothing else
        proc.wait()
    killed = json.loads(manifest_path.read_text())
    assert not killed["complete"] and 3 <= len(killed["shards"]) < 129, "the kill did not land mid-run"

    cwd = os.getcwd()
    os.chdir(tmp_path)  # the same command, relative --out-dir included
    try:
        fineweb.main([*args, "--workers", "2"])
    finally:
        os.chdir(cwd)
    fresh = tmp_path / "fresh"
    fineweb.main(["--input", *parquet_files * 4, "--out-dir", str(fresh), "--shard-size", "50000", "--workers", "2"])
    # every file, manifest included, and no leftover temporary files
    assert file_bytes(tmp_path / "out") == file_bytes(fresh)
    np.testing.assert_array_equal(np.concatenate(ordered(read_shards(fresh))), np.tile(parquet_tokens, 4))


def test_max_tokens_stops_exactly_then_resumes(tmp_path, parquet_files, parquet_run, parquet_tokens):
    args = ["--input", *parquet_files, "--out-dir", str(tmp_path), "--shard-size", str(SHARD), "--workers", "2"]
    fineweb.main([*args, "--max-tokens", "250001"])  # stops inside a document
    shards = ordered(read_shards(tmp_path))
    assert [len(s) for s in shards] == [SHARD, SHARD, 50_001]
    np.testing.assert_array_equal(np.concatenate(shards), parquet_tokens[:250_001])

    before = {p: os.stat(tmp_path / p).st_mtime_ns for p in os.listdir(tmp_path)}
    assert fineweb.main([*args, "--max-tokens", "250001"])["nothing_to_do"]
    assert {p: os.stat(tmp_path / p).st_mtime_ns for p in os.listdir(tmp_path)} == before

    fineweb.main(args)  # without the limit: the partial shard is redone and the rest follows
    assert file_bytes(tmp_path) == file_bytes(parquet_run)


def test_max_shards(tmp_path, parquet_files, parquet_run):
    fineweb.main(
        ["--input", *parquet_files, "--out-dir", str(tmp_path), "--shard-size", str(SHARD), "--max-shards", "2"]
    )
    shards = {n: b for n, b in file_bytes(tmp_path).items() if n.endswith(".npy")}
    assert sorted(shards) == ["edufineweb_train_000001.npy", "edufineweb_val_000000.npy"]
    assert all(shards[n] == file_bytes(parquet_run)[n] for n in shards)


def test_hub_path_streams_through_datasets(tmp_path, monkeypatch, parquet_files, parquet_run):
    import datasets

    real_load_dataset = datasets.load_dataset
    calls = []

    def local_hub(path, name=None, split=None, streaming=False):
        # the Hub stands in as local parquet, still a streamed datasets.IterableDataset
        calls.append((path, name, split, streaming))
        return real_load_dataset("parquet", data_files=parquet_files, split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", local_hub)
    args = ["--out-dir", str(tmp_path), "--shard-size", str(SHARD), "--workers", "2"]
    fineweb.main([*args, "--max-tokens", "333333"])  # and resume through the stream's skip
    summary = fineweb.main(args)
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)] * 2
    assert summary["complete"] and summary["tokens"] == 1_606_780
    shards = lambda d: {n: b for n, b in file_bytes(d).items() if n.endswith(".npy")}  # noqa: E731
    assert shards(tmp_path) == shards(parquet_run)


def test_tokenize_docs_matches_tiktoken(enc, shared_data):
    text = (shared_data / "tinyshakespeare" / "input.txt").read_text()
    docs = [text[i : i + 5000 + 37 * i % 9000] for i in range(0, len(text), 9000)] + ["", "\u00e9\n"]
    expected = [t for d in docs for t in [EOT, *enc.encode_ordinary(d)]]
    tokens = fineweb.tokenize_docs(docs, workers=2)  # spans several batches of BATCH_CHARS
    assert tokens.dtype == np.uint16 and tokens.tolist() == expected


def test_pool_reads_only_a_bounded_amount_ahead(enc):
    # memory must not grow with the dataset: the input is read at most 2 * workers batches ahead
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
    assert pulled <= (2 * 2 + 1) * 10


def _bad_parquet(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"this is not parquet")
    return [str(path)]


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda tmp, data: [str(tmp / "nothing*.parquet")], "no files match"),
        (lambda tmp, data: [str(tmp / "missing.txt")], "does not exist"),
        (lambda tmp, data: [str(tmp)], "is a directory"),
        (lambda tmp, data: [str(data / "reference" / "reference_numbers.json")], "unknown file type"),
        (lambda tmp, data: _bad_parquet(tmp), "not a readable parquet file"),
        (
            lambda tmp, data: [str(data / "fineweb_sample" / "batch_000001.parquet"), "--text-field", "body"],
            "has no 'body' column",
        ),
    ],
    ids=["glob-matches-nothing", "missing-file", "directory", "unknown-type", "not-parquet", "missing-column"],
)
def test_bad_input_is_one_line_error(tmp_path, shared_data, make_args, message):
    with pytest.raises(UserError, match=message) as e:
        fineweb.main(["--input", *make_args(tmp_path, shared_data), "--out-dir", str(tmp_path / "out")])
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()  # checked before anything is written


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"text": "fine"}\n{"text": "broken\n', "line 2 is not valid JSON"),
        (b'{"text": "fine"}\n{"body": "no text"}\n', "line 2 has no 'text' field"),
        (b'{"text": "fine"}\n{"text": null}\n', "line 2: the text is NoneType"),
        (b'{"text": "caf\xe9 latin-1"}\n', "not UTF-8"),
    ],
    ids=["bad-json", "missing-field", "null-text", "not-utf8"],
)
def test_bad_jsonl_is_one_line_error(tmp_path, content, message):
    (tmp_path / "docs.jsonl").write_bytes(content)
    with pytest.raises(UserError, match=message) as e:
        fineweb.main(["--input", str(tmp_path / "docs.jsonl"), "--out-dir", str(tmp_path / "out"), "--workers", "1"])
    assert "\n" not in str(e.value)


def test_unwritable_out_dir(tmp_path):
    (tmp_path / "doc.txt").write_text("hello")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match="cannot write to --out-dir"):  # a folder inside a file: fails even as root
        fineweb.main(["--input", str(tmp_path / "doc.txt"), "--out-dir", str(tmp_path / "a_file" / "shards")])


def test_manifest_from_other_config_or_corrupt(tmp_path):
    (tmp_path / "doc.txt").write_text("hello world, " * 20)
    args = ["--input", str(tmp_path / "doc.txt"), "--out-dir", str(tmp_path / "out"), "--workers", "1"]
    fineweb.main([*args, "--shard-size", "10"])
    before = file_bytes(tmp_path / "out")
    with pytest.raises(UserError, match=r"different configuration \(shard_size 10 there, 20 now\)"):
        fineweb.main([*args, "--shard-size", "20"])
    with pytest.raises(UserError, match=r"different configuration \(format 'npy' there, 'bin' now\)"):
        fineweb.main([*args, "--shard-size", "10", "--format", "bin"])
    with (tmp_path / "doc.txt").open("a") as f:
        f.write("one more line")  # the input changed: skipping by document count would be wrong
    with pytest.raises(UserError, match=r"different configuration \(source "):
        fineweb.main([*args, "--shard-size", "10"])
    assert file_bytes(tmp_path / "out") == before  # refused without touching anything
    (tmp_path / "out" / "edufineweb_manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="not a readable manifest"):
        fineweb.main([*args, "--shard-size", "10"])


def test_missing_shard_is_redone(tmp_path, shared_data):
    args = [
        "--input",
        str(shared_data / "tinyshakespeare" / "input.txt"),
        "--out-dir",
        str(tmp_path),
        "--shard-size",
        "100000",
    ]
    fineweb.main(args)
    before = file_bytes(tmp_path)
    os.remove(tmp_path / "edufineweb_train_000002.npy")
    fineweb.main(args)
    assert file_bytes(tmp_path) == before


def test_hub_dataset_that_cannot_be_opened(tmp_path):
    # the real datasets.load_dataset, offline (conftest): refused with the library's reason
    with pytest.raises(UserError, match="cannot open no-such-user/no-such-dataset"):
        fineweb.main(["--dataset", "no-such-user/no-such-dataset", "--out-dir", str(tmp_path)])


def test_cli_prints_one_line_and_exits_1(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "fineweb.py"), "--input", "missing.txt"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert r.stderr == "error: --input missing.txt does not exist\n"
    assert not (tmp_path / "edu_fineweb10B").exists()

"""support/documents.py: fineweb.py's inputs read as documents (a .txt whole, a .jsonl or .parquet
row each, a UTF-8 byte-order mark dropped), a resumed run's skip that passes over whole files
unread, and bad input refused in one line that names the file
(and the line). fineweb.py's runs over these inputs, end to end: test_fineweb.py."""

import json

import pytest

from support import documents
from support.cli import UserError
from support.documents import check_inputs, expand_inputs, hub_documents, local_documents, read_documents


@pytest.mark.parametrize(
    "make_paths, text_field, message",
    [
        (lambda tmp, data: [str(tmp / "nothing*.parquet")], "text", r"nothing\*.parquet' matches no file"),
        (lambda tmp, data: [str(tmp / "missing.txt")], "text", "missing.txt' matches no file"),
        (lambda tmp, data: [str(tmp)], "text", "is a directory"),
        (lambda tmp, data: [str(data.encoder_json)], "text", "unknown file type"),
        (lambda tmp, data: [str(tmp / "bad.parquet")], "text", "not a readable parquet file"),
        (lambda tmp, data: [str(data.fineweb)], "body", "has no 'body' column"),
        (lambda tmp, data: [str(tmp / "binary.txt")], "text", "binary.txt holds NUL bytes"),
        (lambda tmp, data: [str(tmp / "latin1.jsonl")], "text", r"latin1.jsonl is not UTF-8 text \(byte 13"),
    ],
    ids=[
        "glob-matches-nothing",
        "missing-file",
        "directory",
        "unknown-type",
        "not-parquet",
        "missing-column",
        "binary",
        "latin-1",
    ],
)
def test_bad_input_is_one_line_error(tmp_path, assets, make_paths, text_field, message):
    """Found before any work: when the names are expanded, or in check_inputs' first bytes and row."""
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "caf\u00e9 au lait"}\n'.encode("latin-1"))
    with pytest.raises(UserError, match=message) as e:
        check_inputs(expand_inputs(make_paths(tmp_path, assets)), text_field)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"text": "fine"}\n{"text": "broken\n', r"docs\.jsonl line 2 is not valid JSON \(Invalid control character"),
        (b'{"text": "fine"}\n{"body": "no text"}\n', "line 2 has no 'text' field: choose one with --text-field"),
        (b'{"text": "fine"}\n{"text": null}\n', "line 2: the text is NoneType, not a string"),
        (b'{"text": "fine"}\n{"text": "a\x00b"}\n', "line 2 holds NUL characters: not UTF-8 text"),
        (b'{"text": "caf\xe9 latin-1"}\n', "docs.jsonl is not UTF-8 text"),
    ],
    ids=["bad-json", "missing-field", "null-text", "nul", "not-utf8"],
)
def test_bad_jsonl_is_one_line_error(tmp_path, content, message):
    (tmp_path / "docs.jsonl").write_bytes(content)
    docs = read_documents(str(tmp_path / "docs.jsonl"), "text")
    with pytest.raises(UserError, match=message) as e:
        assert next(docs) == "fine" and next(docs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_utf8_byte_order_mark_is_not_part_of_the_first_document(tmp_path, suffix):
    text = "First words of the file.\nSecond line."
    content = text if suffix == ".txt" else json.dumps({"text": text}) + "\n"
    (tmp_path / f"doc{suffix}").write_bytes(b"\xef\xbb\xbf" + content.encode())
    assert list(read_documents(str(tmp_path / f"doc{suffix}"), "text")) == [text]


def test_a_resumed_runs_skip_passes_over_whole_files_and_rows(tmp_path, assets, monkeypatch):
    """local_documents(skip=n) is every document after the first n; whole files skipped are not read."""
    (tmp_path / "a.txt").write_text("the first file")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(3)))
    parquet = str(assets.fineweb)
    paths = [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), parquet, str(tmp_path / "a.txt")]
    every = list(local_documents(paths, "text"))
    assert every[:4] == ["the first file", "row 0", "row 1", "row 2"] and every[-1] == "the first file"
    rows = len(every) - 5
    for skip in (0, 1, 3, 4, 4 + rows, 5 + rows):
        assert list(local_documents(paths, "text", skip=skip)) == every[skip:], skip
    read, real = [], documents.read_documents
    monkeypatch.setattr(documents, "read_documents", lambda path, field: read.append(path) or real(path, field))
    assert list(local_documents(paths, "text", skip=4 + rows)) == ["the first file"]
    assert read == [str(tmp_path / "b.jsonl"), paths[3]]  # the parquet file passed over unread


def test_hub_dataset_that_cannot_be_opened(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def not_found(path, **kwargs):  # what datasets raises for a name the Hub does not have
        raise FileNotFoundError(f"Dataset '{path}' doesn't exist on the Hub or cannot be accessed.")

    monkeypatch.setattr(datasets, "load_dataset", not_found)
    monkeypatch.setattr(documents, "hub_offline", lambda variables: ("hub", None))  # online
    with pytest.raises(UserError, match="cannot open no-such-user/no-such-dataset .*doesn't exist on the Hub"):
        hub_documents("no-such-user/no-such-dataset", "sample-10BT", "train", "text")

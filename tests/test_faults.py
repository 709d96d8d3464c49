"""Faults and bad input thrown at the real scripts: kills at any moment, broken checkpoints,
failing writes, non-finite steps, a dying DDP rank, and malformed data. Each one must end in
either an exact continuation or a one-line error; nothing finished is ever lost.

Faults whose test lives with its script's other tests (test_train.py, test_fineweb.py,
test_hellaswag.py) are not repeated here; the Reliability table in README.md names them all."""

import errno
import json

import numpy as np
import pytest

import fineweb
import hellaswag
from train_gpt2 import EOT, UserError

ROOT = __import__("conftest").ROOT


class FullDisk:
    """A writable file that takes `room` bytes, then fails like a full disk (ENOSPC)."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        n = len(memoryview(data).cast("B"))
        if n > self.room:
            self.f.write(bytes(memoryview(data).cast("B")[: self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= n
        return self.f.write(data)

    def __getattr__(self, name):  # flush, fileno, close, ... of the real file
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fail_nth_write(monkeypatch, module, suffix, n, room=1000):
    """Make the n-th file that `module` opens for writing with a name ending in `suffix` run out
    of disk after `room` bytes. Only that module's open() is replaced."""
    opened = []

    def open_(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if "w" in mode and str(path).endswith(suffix):
            opened.append(path)
            if len(opened) == n:
                return FullDisk(f, room)
        return f

    monkeypatch.setattr(module, "open", open_, raising=False)
    return opened


# ----------------------------------------------------------------------------------------------
# fineweb.py


def test_fineweb_disk_full_mid_run_keeps_finished_shards_and_resumes(tmp_path, monkeypatch, shared_data, enc):
    text_path = shared_data / "tinyshakespeare" / "input.txt"
    expected = np.array([EOT] + enc.encode_ordinary(text_path.read_text()), dtype=np.uint16)  # tiktoken directly
    out = tmp_path / "out"
    args = ["--input", str(text_path), "--out-dir", str(out), "--shard-size", "100000", "--workers", "1"]
    opened = fail_nth_write(monkeypatch, fineweb, ".npy.tmp", 3)  # the third shard hits a full disk
    with pytest.raises(UserError) as e:
        fineweb.main(args)
    msg = str(e.value)
    assert len(opened) == 3 and "\n" not in msg
    assert "No space left on device" in msg and "rerun the same command" in msg
    # the two finished shards and their manifest are untouched; the half-written one is gone
    manifest = json.loads((out / "edufineweb_manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["edufineweb_val_000000.npy", "edufineweb_train_000001.npy"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*(s["file"] for s in manifest["shards"]), "edufineweb_manifest.json"])  # fmt: skip
    np.testing.assert_array_equal(np.load(out / "edufineweb_train_000001.npy"), expected[100_000:200_000])

    monkeypatch.undo()  # space freed: the same command continues after the finished shards
    summary = fineweb.main(args)
    assert summary["complete"] and summary["new_tokens"] == len(expected) - 200_000
    shards = [np.load(out / f) for f in summary["files"]]
    np.testing.assert_array_equal(np.concatenate(shards), expected)


# ----------------------------------------------------------------------------------------------
# hellaswag.py


@pytest.mark.parametrize("label", [4, -1, True, None], ids=["4", "-1", "bool", "missing"])
def test_hellaswag_label_out_of_range_is_named(tmp_path, shared_data, label):
    # a string label is refused in test_hellaswag.py; these are the other wrong labels
    lines = (shared_data / "hellaswag" / "hellaswag_val.jsonl").read_text().splitlines()[:3]
    row = json.loads(lines[1])
    row["label"] = label
    if label is None:
        del row["label"]
    (tmp_path / "h.jsonl").write_text("\n".join([lines[0], json.dumps(row), lines[2]]) + "\n")
    with pytest.raises(hellaswag.HellaSwagDataError, match=r"h\.jsonl, line 2: label .* is not an int from 0 to 3"):
        hellaswag.load_examples(str(tmp_path / "h.jsonl"))

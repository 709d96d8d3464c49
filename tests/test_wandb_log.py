"""--wandb-project: rank 0 mirrors log.jsonl to a wandb run (offline here, read back from its .wandb file),
a resume continues it, a missing package is one line, and a wandb that fails or hangs never stops training."""

import contextlib
import json
import struct
import sys
import threading
import time
from pathlib import Path

import pytest

import train_gpt2
from helpers import assert_one_line_error, cli, random_shards, read_log, tiny_args, torchrun, user_error
from support import run_log

wandb = pytest.importorskip("wandb")  # an optional dependency (requirements-dev.txt)
wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")

# A .wandb file: a 7-byte header, then LevelDB's log format: 32 KiB blocks of chunks, each a 7-byte header
# (crc32c, length, type: 1 whole, 2/3/4 first/middle/last part) and its bytes, the block's tail padding.
BLOCK, CHUNK_HEADER, FULL, LAST = 32768, 7, 1, 4


def wandb_records(path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, parts = 7, []
    while True:
        if BLOCK - pos % BLOCK < CHUNK_HEADER:
            pos += BLOCK - pos % BLOCK
        if pos + CHUNK_HEADER > len(data):
            break
        _, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        parts.append(data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length])
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record
    assert not parts  # no record cut short


def offline_runs(wandb_dir):
    """The offline runs under wandb_dir, oldest first: id, project, name, config, history rows, exit code."""
    runs = []
    for run_dir in sorted(Path(wandb_dir).glob("wandb/offline-run-*")):
        (path,) = run_dir.glob("*.wandb")
        run = {"dir": run_dir, "config": {}, "history": [], "exit_code": None}
        for _ in range(1200):  # wandb flushes the last blocks after run.finish() returns: wait for the exit record
            with contextlib.suppress(Exception):  # a block half written
                records = list(wandb_records(path))
                if any(r.WhichOneof("record_type") == "exit" for r in records):
                    break
            time.sleep(0.1)
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run.update(id=r.run.run_id, project=r.run.project, name=r.run.display_name)
            elif kind == "config":
                run["config"].update({item.key: json.loads(item.value_json) for item in r.config.update})
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                run["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
            elif kind == "exit":
                run["exit_code"] = r.exit.exit_code
        runs.append(run)
    return runs


def assert_mirrors(run, records):
    """The wandb run holds the header's config as its config, every other record as a history row, in order."""
    header = [r for r in records if r.get("event") == "header"][-1]
    for key, value in header["config"].items():
        assert run["config"][key] == value, key
    assert run["config"]["header"]["run_id"] == header["run_id"]
    expected = [r for r in records if "event" not in r]
    assert len(run["history"]) == len(expected)
    for row, record in zip(run["history"], expected, strict=True):
        assert {k.split("/")[0] for k in row} == {k for k, v in record.items() if v is not None}
        for key, value in record.items():
            if key == "samples":  # a table of text, written beside the run
                table = json.loads((run["dir"] / "files" / row["samples/path"]).read_text())
                assert table["columns"] == ["sample"] and [r[0] for r in table["data"]] == value
            elif value is not None:
                assert row[key] == value, (key, record)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline into a temporary WANDB_DIR, no API key or server, git not read; torn down after the test."""
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_SERVICE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)  # restored (to unset) after the test, whatever wandb set meanwhile
    env = dict(WANDB_MODE="offline", WANDB_DIR=tmp_path / "wandb_dir", WANDB_CONFIG_DIR=tmp_path / "wandb_config")
    env.update(WANDB_CACHE_DIR=tmp_path / "wandb_cache", WANDB_DATA_DIR=tmp_path / "wandb_data")
    env.update(WANDB_DISABLE_GIT="true", WANDB_ERROR_REPORTING="false", WANDB_SILENT="true")
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    yield tmp_path / "wandb_dir"
    wandb.teardown()


def test_a_run_and_its_resume_are_one_wandb_run_holding_what_log_jsonl_records(tmp_path, offline, monkeypatch, assets):
    """Every kind of record; the run's wandb id (a new run: a new one); --wandb-project '' turns it off;
    WANDB_DIR names where wandb's files go, else the --out-dir."""
    data, out = random_shards(tmp_path / "data"), tmp_path / "tiny-run"
    flags = "--wandb-project tiny --eval-every 3 --sample-every 3 --num-samples 2 --max-new-tokens 4"
    flags += " --hellaswag-every 3 --hellaswag-limit 4 --max-steps 4"
    assert train_gpt2.main(tiny_args(data, out, *flags.split(), "--hellaswag-data", assets.hellaswag)) == 0
    assert train_gpt2.main(["--resume", out, "--max-steps", 6]) == 0
    first, resumed = offline_runs(offline)
    records, steps = read_log(out)
    headers = [r for r in records if r.get("event") == "header"]
    assert first["project"] == resumed["project"] == "tiny" and first["name"] == "tiny-run"  # the --out-dir's name
    assert first["id"] == resumed["id"] == headers[0]["run_id"] == headers[1]["run_id"]
    assert first["exit_code"] == resumed["exit_code"] == 0 and headers[1]["config"]["wandb_project"] == "tiny"
    assert_mirrors(first, records[: records.index(headers[1])])
    assert_mirrors(resumed, records[records.index(headers[1]) :])
    kinds = {k for row in first["history"] + resumed["history"] for k in row}
    assert {"train_loss", "lr", "grad_norm", "tok_per_sec", "tokens", "val_loss", "hellaswag", "samples/path"} <= kinds
    assert [row["step"] for row in first["history"] + resumed["history"] if "train_loss" in row] == list(range(6))
    assert resumed["config"]["max_steps"] == 6  # the allowed change, in the resumed run's config
    assert not (out / "wandb").exists()  # WANDB_DIR names where wandb's files go

    assert train_gpt2.main(["--resume", out, "--max-steps", 7, "--wandb-project", ""]) == 0
    assert len(offline_runs(offline)) == 2 and sorted(read_log(out)[1]) == list(range(7))
    monkeypatch.delenv("WANDB_DIR")
    assert train_gpt2.main(tiny_args(data, tmp_path / "new", "--wandb-project", "tiny", "--max-steps", 2)) == 0
    (new,) = offline_runs(tmp_path / "new")
    assert new["id"] != first["id"] and new["id"] == read_log(tmp_path / "new")[0][0]["run_id"]


def test_flag_without_the_package_is_one_line_at_start(tmp_path, monkeypatch):
    """Missing (None in sys.modules), the flag is refused at start; a run without it never needs wandb."""
    data, out = random_shards(tmp_path / "data"), tmp_path / "out"
    monkeypatch.setitem(sys.modules, "wandb", None)
    run = lambda *extra: cli(*tiny_args(data, out, "--max-steps", 1, *extra))  # noqa: E731

    line = assert_one_line_error(run("--wandb-project", "tiny"), "--wandb-project", "pip install wandb")
    assert "--wandb-project ''" in line  # what a --resume that would take the run's project needs
    assert not out.exists() and "step" not in line
    plain = run()
    assert plain.returncode == 0 and "wandb" not in plain.stdout + plain.stderr, plain.stderr[-2000:]


@pytest.mark.parametrize(
    "failure",
    [
        "ImportError(\"cannot import name 'BaseModel' from 'pydantic'\")",  # a dependency of the wrong version
        "TypeError('Descriptors cannot be created directly.')",  # protobuf's, after an upgrade under wandb
    ],
)
def test_an_installed_wandb_that_cannot_be_imported_is_one_line_at_start(tmp_path, monkeypatch, failure):
    broken = tmp_path / "site" / "wandb"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(f"raise {failure}\n")
    for name in [n for n in sys.modules if n == "wandb" or n.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)  # put back after the test
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    data, out = random_shards(tmp_path / "data"), tmp_path / "out"
    msg = user_error(tiny_args(data, out, "--wandb-project", "tiny"))
    assert msg.startswith("--wandb-project: the wandb package is installed but cannot be imported")
    assert failure.split("(")[0] in msg and "pip install --force-reinstall wandb" in msg
    assert not out.exists()


def test_wandb_failing_after_start_leaves_training_and_log_complete(tmp_path, offline, monkeypatch, capsys):
    calls = []

    def failing_log(self, data, *args, **kwargs):
        calls.append(data)
        raise RuntimeError("wandb crashed")

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", failing_log)
    data, out = random_shards(tmp_path / "data"), tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, out, "--wandb-project", "tiny")) == 0
    records, steps = read_log(out)
    assert sorted(steps) == list(range(6)) and [r["step"] for r in records if "val_loss" in r] == [0, 4, 6]
    warnings = [r["warning"] for r in records if r.get("event") == "warning"]
    assert len(warnings) == 1 and "RuntimeError: wandb crashed" in warnings[0] and len(calls) == 1
    assert f"warning: {warnings[0]}" in capsys.readouterr().err
    (run,) = offline_runs(offline)
    assert run["exit_code"] == 1 and run["history"] == []  # finished as failed, with what reached it


def test_a_hung_wandb_never_holds_a_step(tmp_path, offline, monkeypatch, capsys):
    """Stuck in its first log call: every step runs, the end waits WANDB_FINISH_TIMEOUT; released, it logs the rest."""
    release, entered = threading.Event(), threading.Event()
    real_log = wandb.sdk.wandb_run.Run.log

    def stuck_log(self, *args, **kwargs):
        entered.set()
        assert release.wait(120)
        return real_log(self, *args, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", stuck_log)
    monkeypatch.setattr(run_log, "WANDB_FINISH_TIMEOUT", 0.5)
    data, out = random_shards(tmp_path / "data"), tmp_path / "out"
    try:
        assert train_gpt2.main(tiny_args(data, out, "--wandb-project", "tiny")) == 0
        assert entered.is_set()
        records, steps = read_log(out)
        assert sorted(steps) == list(range(6))
        (warning,) = [r["warning"] for r in records if r.get("event") == "warning"]
        assert "wandb has not finished uploading after 0.5 s" in warning and warning in capsys.readouterr().err
    finally:
        release.set()
        for thread in threading.enumerate():
            if thread.name == "wandb":
                thread.join(60)
    (run,) = offline_runs(offline)
    assert_mirrors(run, records)
    assert run["exit_code"] == 0


@pytest.mark.slow
def test_under_torchrun_only_rank_0_logs(tmp_path, offline):
    data, out = random_shards(tmp_path / "data", train_lengths=(321, 257), val_length=257), tmp_path / "ddp"
    args = tiny_args(
        data, out, "--total-batch-size", 128, "--max-steps", 3, "--eval-every", 3, "--wandb-project", "tiny"
    )
    proc = torchrun(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = offline_runs(offline)  # one wandb run, rank 0's
    records, _ = read_log(out)
    assert records[0]["config"]["world_size"] == 2
    assert_mirrors(run, records)

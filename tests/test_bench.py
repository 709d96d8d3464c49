"""bench.py end to end on toy sizes: every section runs, the table and the JSON agree, and the
numbers hold up against arithmetic done here by hand. No speed is asserted: CI machines vary."""

import json
import math
import os
import stat

import pytest
import tiktoken

import hellaswag
from bench import parse_args, plan
from helpers import assert_one_line_error, cli, signal_on, snapshot
from support.cli import UserError


@pytest.mark.slow
def test_tiny_bench_writes_table_and_json(tmp_path, assets):
    pq = pytest.importorskip("pyarrow.parquet")  # the fineweb section reads the parquet sample
    out = tmp_path / "bench.json"
    args = ("--tiny", "--out", out, "--docs", assets.fineweb, "--hellaswag-data", assets.hellaswag)
    # a fresh process: the loader's memory. About 80 s idle on 2 cores: 600 s guards a hang, with room for 5x slower
    r = cli(*args, script="bench.py", cwd=tmp_path, process=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["table"] in r.stdout  # the printed table is the one saved
    assert report["table"].startswith("| benchmark | ours | baseline |")
    assert set(report["sections"]) == {"ceiling", "loader", "fineweb", "train", "ladder", "hellaswag", "sample"}
    assert not [name for name, s in report["sections"].items() if "skipped" in s]
    # the shards went to a temporary folder, now gone; the ladder's picture lies beside the JSON
    assert sorted(os.listdir(tmp_path)) == ["bench.json", "ladder.png"]

    rows = report["rows"]
    assert len(report["table"].splitlines()) == len(rows) + 2
    names = " | ".join(row["name"] for row in rows)
    for wanted in (
        "matmul ceiling fp32",
        "loader",
        "fineweb.py",
        "ours vs transformers",
        "bf16 vs fp32",
        "hellaswag",
        "KV cache",
    ):
        assert wanted in names
    assert sum(row["baseline"] is not None for row in rows) >= 2  # ours vs transformers, bf16 vs fp32 at least
    for row in rows:
        s = row["ours"]
        assert 0 < s["min"] <= s["median"] <= s["max"] and math.isfinite(s["max"]), row["name"]
        if row["baseline"] is not None:
            assert row["baseline"]["median"] > 0
            assert row["ratio"] == pytest.approx(s["median"] / row["baseline"]["median"])
            assert f"{row['ratio']:.2f}x" in report["table"]

    # training: toy config n_layer 2, n_head 2, n_embd 64, T 32, B 2, vocab 50304, by hand:
    # 6 * (50304*64 + 2*(12*64^2 + 13*64) + 2*64) + 12 * 2 layers * 2 heads * 32 head_dim * T 32
    train = report["sections"]["train"]["tiny"]
    assert train["flops_per_token"] == 6 * 3_319_552 + 49_152 == 19_966_464
    for variant in ("ours fp32 eager", "hf fp32 eager", "ours bf16 eager", "hf bf16 eager"):
        tok, step = train["tok_per_sec"][variant], train["step_s"][variant]
        assert tok["max"] == pytest.approx(2 * 32 / step["min"])  # tokens per step over the fastest step
        assert 0 < train["mfu"][variant]["median"]

    # loader: 2 shards of 200,000 tokens, B x T (+1) a batch, then 2 into the next epoch: on a CPU B 1 x T 1024,
    # (200,000 - 1) // 1024 = 195 batches a shard (a GPU reads the gpt2 config's larger B); 2 shard switches
    loader = report["sections"]["loader"]
    assert loader["T"] == 1024 and (loader["B"] == 1 or report["machine"]["device"] != "cpu")
    assert loader["batches"] == 2 * ((200_000 - 1) // (loader["B"] * 1024)) + 2 and loader["switches"] == 2
    # a start's data checks on 100 shards of 100M tokens, timed with the manifest and without it
    identity = loader["data_identity"]
    assert (identity["shards"], identity["shard_tokens"]) == (100, 100_000_000)
    assert identity["start_seconds"]["n"] >= 1 and identity["start_reading_every_shard_seconds"]["n"] == 1
    assert any(row["name"].startswith("a start's data checks: 100 shards") for row in rows)

    # fineweb: the first 20 documents of the sample, counted with tiktoken called directly
    enc = tiktoken.get_encoding("gpt2")
    texts = pq.read_table(assets.fineweb, columns=["text"]).column("text").to_pylist()
    assert report["sections"]["fineweb"]["tokens"] == sum(len(enc.encode_ordinary(t)) for t in texts[:20])

    assert report["sections"]["hellaswag"]["examples_per_round"] == 8
    assert report["sections"]["sample"]["new_tokens"] == 16


@pytest.mark.parametrize("flag, value", [("--only", ""), ("--only", "train,"), ("--configs", "")])
def test_an_empty_name_is_refused_naming_the_choices_not_read_as_all(flag, value):
    with pytest.raises(UserError) as e:
        parse_args([flag, value])
    said = str(e.value)
    assert said.startswith(f"{flag} {value!r} names an empty ") and f"leave {flag} out" in said
    example = said.split("(e.g. ")[1].split(")")[0].split()  # the comma list it gives parses as those names
    fixed = parse_args(example)
    names = fixed.only if flag == "--only" else fixed.configs
    assert names == example[1].split(",") and len(names) == 2 and fixed.named == (flag == "--only")


def test_ctrl_c_while_torch_loads_is_one_line(tmp_path):
    proc, out, err = signal_on("import torch", "--tiny", "--out", tmp_path / "b.json", script="bench.py")
    assert proc.returncode == 130 and err.strip() == "interrupted", err


@pytest.mark.parametrize(
    "made, argv, words",
    [
        (None, "--only speed", ["--only speed: unknown section, choose from ceiling, loader,", "ladder, hellaswag"]),
        (
            "results/notes.txt",
            "--only ladder --out {tmp}/results",
            ["--out {tmp}/results is a folder", "--out {tmp}/results/bench.json"],
        ),
        (
            "results.json",
            "--only ceiling --out {tmp}/results.json",
            ["--out {tmp}/results.json: a file bench.py did not write is there", "pass another --out"],
        ),
        ("ladder.png/", "--only ladder", ["the ladder draws {tmp}/ladder.png, and something else is there"]),
        (
            "a_file",
            "--only ceiling --out {tmp}/a_file/b.json",
            ["--out {tmp}/a_file/b.json: {tmp}/a_file is a file, not"],
        ),
        (None, "--only ceiling,fineweb --docs {tmp}/none/*.parquet", ["--docs", "none/*.parquet' matches no file"]),
        (
            None,
            "--only ceiling,hellaswag --hellaswag-data {tmp}/hs.jsonl",
            ["--hellaswag-data", "hs.jsonl cannot be read: No such file or directory"],
        ),
    ],
)
def test_a_mistake_is_one_line_before_anything_is_measured_or_written(tmp_path, made, argv, words):
    """ceiling comes first in a run and is not measured: the --out, the ladder's picture and the data are
    checked before it; nothing in the folder changes."""
    if made and made.endswith("/"):
        (tmp_path / made).mkdir()
    elif made:  # a file of the user's
        (tmp_path / made).parent.mkdir(exist_ok=True)
        (tmp_path / made).write_text("mine")
    before, argv = snapshot(tmp_path), argv.format(tmp=tmp_path).split(" ")
    out = [] if "--out" in argv else ["--out", tmp_path / "bench.json"]
    r = cli("--tiny", *argv, *out, script="bench.py", cwd=tmp_path)
    line = assert_one_line_error(r, *(word.format(tmp=tmp_path) for word in words))
    assert "--input" not in line and snapshot(tmp_path) == before


def test_out_in_a_read_only_folder_is_refused_before_anything_is_measured(tmp_path, read_only):
    folder = read_only(tmp_path)
    r = cli("--tiny", "--only", "ceiling", "--out", folder / "bench.json", script="bench.py", cwd=folder)
    assert_one_line_error(r, f"cannot write in {folder}", "Read-only file system", "pass an --out in a writable folder")


def test_out_that_is_a_fifo_bench_did_not_write_is_left_alone(tmp_path):
    out = tmp_path / "results.json"
    os.mkfifo(out)
    r = cli("--tiny", "--only", "ceiling", "--out", out, script="bench.py", cwd=tmp_path)
    assert_one_line_error(r, f"--out {out}: a file bench.py did not write is there", "pass another --out")
    assert os.listdir(tmp_path) == ["results.json"] and stat.S_ISFIFO(os.lstat(out).st_mode)


def test_out_that_an_earlier_run_wrote_is_replaced(tmp_path):
    out = tmp_path / "bench.json"
    for only in ("ceiling", "sample"):
        r = cli("--tiny", "--only", only, "--out", out, script="bench.py", cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
    assert list(json.loads(out.read_text())["sections"]) == ["sample"]
    assert os.listdir(tmp_path) == ["bench.json"]


def test_named_section_without_data_is_refused_the_default_run_skips_it(monkeypatch, tmp_path):
    monkeypatch.setattr(hellaswag, "DEFAULT_CACHE_DIR", str(tmp_path))
    with pytest.raises(UserError) as e:
        plan(parse_args(["--only", "ceiling,fineweb,hellaswag"]), shared=None)
    assert str(e.value) == (
        "--only fineweb: no documents: pass --docs 'files/*.parquet'; "
        "--only hellaswag: no HellaSwag data: pass --hellaswag-data path/to/hellaswag_val.jsonl"
    )
    _, skipped = plan(parse_args([]), shared=None)
    assert skipped == {
        "fineweb": "no documents: pass --docs 'files/*.parquet'",
        "hellaswag": "no HellaSwag data: pass --hellaswag-data path/to/hellaswag_val.jsonl",
    }


@pytest.mark.slow  # bench.py and the compile check it starts: two processes
def test_compile_that_does_not_work_is_refused_before_anything_is_measured(tmp_path, monkeypatch):
    """A run that compiles where torch.compile cannot (no C++ compiler): one line naming --no-compile."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # for bench.py's compile probe, a process
    args = ("--tiny", "--device", "cpu", "--only", "ladder", "--compile", "--out", tmp_path / "bench.json")
    r = cli(*args, script="bench.py", cwd=tmp_path)
    assert_one_line_error(r, "torch.compile does not work on this cpu", "No working C++ compiler", "pass --no-compile")
    assert os.listdir(tmp_path) == []


def test_a_target_not_met_says_what_it_means():
    from benchmarks.report import comparison, missed, table  # noqa: PLC0415  bench's own modules, this test's alone
    from benchmarks.settings import IF_MISSED, TARGETS  # noqa: PLC0415  as above

    assert IF_MISSED.keys() == TARGETS.keys()  # every target has its line
    rows = [
        comparison("bf16", [1.2, 1.3], [1.0, 1.0], "tok/s", "bf16_vs_fp32"),  # 1.25x < 1.7x
        comparison("kv", [6.0], [1.0], "tok/s", "kv_cache"),  # 6x >= 5x: met
        comparison("loader", [2.0, 2.0], None, "ms", "loader_switch_ms", higher_is_better=False),
        comparison("ceiling", [100.0], None, "GFLOP/s"),  # no target
    ]
    assert [r["met"] for r in rows] == [False, True, False, None]
    assert [r["target"] for r in rows] == [1.7, 5.0, 1.0, None]
    assert table(rows).count("**no**") == 2
    assert missed(rows) == [f"- bf16: {IF_MISSED['bf16_vs_fp32']}", f"- loader: {IF_MISSED['loader_switch_ms']}"]

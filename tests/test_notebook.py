"""play.ipynb, run headless on training logs made up and real (being written, resumed, several runs),
reports the numbers the log holds; the committed notebook is clean."""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import train_gpt2
from helpers import ROOT, headers

NOTEBOOK = ROOT / "play.ipynb"
PNGS = ("loss.png", "hellaswag.png", "throughput.png")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A python3 kernel of this interpreter (its kernelspec first on JUPYTER_PATH), one for the module's runs
    (a start costs more than a run; each run resets its namespace); skipped without the notebook packages."""
    for module in ("nbformat", "nbclient", "ipykernel", "matplotlib"):
        pytest.importorskip(module)
    from jupyter_client.manager import KernelManager  # noqa: PLC0415  (optional: skipped above without it)

    base = tmp_path_factory.mktemp("jupyter")
    spec = base / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "Python 3", "language": "python"}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(base))
        km = KernelManager(kernel_name="python3")
        km.start_kernel()
        yield km
        km.shutdown_kernel(now=True)


def run_notebook(kernel, log_path, cwd, **params):
    """play.ipynb run in kernel, in folder cwd, with injected parameters; -> (the executed nb, its `summary`,
    its `BASELINES`)."""
    import nbformat  # noqa: PLC0415  (optional: kernel skips without it)
    from nbclient import NotebookClient  # noqa: PLC0415  (optional: kernel skips without it)
    from nbformat.v4 import new_code_cell  # noqa: PLC0415  (optional: kernel skips without it)

    nb = nbformat.read(NOTEBOOK, as_version=4)
    i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    values = {"log_path": str(log_path), **params}
    nb.cells.insert(i + 1, new_code_cell("\n".join(f"{k} = {v!r}" for k, v in values.items())))
    nb.cells.insert(0, new_code_cell(f"%reset -f\nimport os\nos.chdir({str(cwd)!r})"))  # as a fresh kernel there
    nb.cells.append(new_code_cell("print(json.dumps({'summary': summary, 'baselines': BASELINES}))"))
    NotebookClient(nb, km=kernel, timeout=120).execute()
    said = json.loads("".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("name") == "stdout"))
    return nb, said["summary"], said["baselines"]


def notebook_error(kernel, log_path, cwd):
    """What the notebook stopped with, run as run_notebook does: its one line, no traceback of its code."""
    from nbclient.exceptions import CellExecutionError  # noqa: PLC0415  (optional: kernel skips without it)

    with pytest.raises(CellExecutionError) as e:
        run_notebook(kernel, log_path, cwd)
    assert "Traceback" not in str(e.value) and "Cell In" not in str(e.value)
    return str(e.value)


def jupyter_execute(cwd, play_log):
    """`PLAY_LOG=play_log jupyter execute play.ipynb` in folder cwd: the CompletedProcess."""
    env = {**os.environ, "PLAY_LOG": str(play_log)}
    command = [sys.executable, "-m", "jupyter", "execute", str(NOTEBOOK)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_pngs(folder):
    from matplotlib.image import imread  # noqa: PLC0415  (optional: kernel skips without it)

    for name in PNGS:
        path = folder / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        h, w = imread(path).shape[:2]
        assert h > 100 and w > 100, (name, h, w)
    assert not list(folder.glob(".*.tmp")), "a temporary PNG was left behind"


def text_of(nb, stream=None):
    """What the notebook's code cells printed (to stream alone, where named)."""
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    return "".join(o.get("text", "") for o in outputs if stream in (None, o.get("name")))


def header(resumed_from=None):
    config = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 64, "total_batch_size": 1024}
    versions = {"torch": "2.13.0"}
    return {"event": "header", "config": config, "versions": versions, "device": "cpu", "resumed_from": resumed_from}


def step_record(step, loss, dt_ms=100.0):
    return {
        "step": step,
        "train_loss": loss,
        "lr": 6e-4 * min(1, (step + 1) / 10),
        "grad_norm": 1.0 + 0.01 * step,
        "dt_ms": dt_ms,
        "tok_per_sec": 1024 / (dt_ms / 1000),
        "mfu": None,
        "tokens": (step + 1) * 1024,
        "epoch": 0,
    }


def write_log(folder, records, tail=""):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def clean_records():
    """One run of 50 steps: val every 20 steps and at the end, HellaSwag at 20 and at the end."""
    records = [header()]
    val = {0: 10.9, 20: 6.5, 40: 6.2, 49: 6.3}
    hella = {20: 0.27, 49: 0.26}
    for s in range(50):
        if s in val:
            records.append({"step": s, "val_loss": val[s]})
        if s in hella:
            records.append({"step": s, "hellaswag": hella[s]})
        records.append(step_record(s, 10.0 - 0.1 * s))
    return records


def test_committed_notebook_is_clean():
    nbformat = pytest.importorskip("nbformat")
    text = NOTEBOOK.read_text()
    nb = nbformat.reads(text, as_version=4)
    nbformat.validate(nb)
    assert "parameters" in nb.cells[0].metadata.get("tags", []), "the first cell must be the papermill parameters cell"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "commit the notebook with its outputs cleared"
    # no machine paths
    assert not re.search(r"(?<![\w.])/(work|home|tmp|Users|root|mnt)/|[A-Za-z]:\\\\", text)
    assert nb.metadata.kernelspec.name == "python3"


def test_a_log_still_being_written_summary_baselines_and_pngs(tmp_path, kernel, assets):
    """A clean run's log with two records whose step or value is not a number (passed over and named), then a
    NaN val loss at step 50 (as RunLog writes one) and step 50's record half written."""
    records = clean_records()
    records.insert(5, {"step": "3", "train_loss": 1.0})  # a hand-edited or foreign record: line 6
    records.insert(9, {"step": 7, "train_loss": "low"})  # line 10
    partial = json.dumps(step_record(50, 5.0))[:40]
    log = write_log(tmp_path / "run", [*records, {"step": 50, "val_loss": "NaN"}], tail=partial)
    nb, s, baselines = run_notebook(kernel, tmp_path / "run", tmp_path)  # the run folder works as well as the file
    assert s["passed_over"] == ["line 6 (step '3')", "line 10 (step 7)"]
    assert "passed over, a step or a value not a number: line 6 (step '3'), line 10 (step 7)" in text_of(nb)
    assert s["last_step"] == 49
    assert s["tokens"] == 50 * 1024
    assert s["last_train_loss"] == pytest.approx(10.0 - 4.9)
    assert s["last_val_loss"][0] == 50 and math.isnan(s["last_val_loss"][1])
    assert s["best_val_loss"] == [40, 6.2]
    assert s["best_hellaswag"] == [20, 0.27]
    assert s["step_time_s"] == pytest.approx(50 * 0.1)
    assert (s["redone_steps"], s["skipped_lines"], s["partial_last_line"]) == (0, 0, True)
    # the baselines are the published ones, kept in one place
    ref = assets.reference["build_nanogpt_plot_baselines"]
    assert baselines["gpt2_val_loss"]["124M"] == ref["openai_gpt2_val_loss_on_fineweb_edu_val_shard"]["124M"]
    gpt2_124m = assets.reference["hellaswag_gpt2_reference_accuracy"]["gpt2_124M"]["completion_style_this_script"]
    assert baselines["gpt2_hellaswag"] == {**ref["hellaswag_gpt2"], "124M": gpt2_124m["acc_norm"]}
    assert baselines["gpt3_hellaswag"] == ref["hellaswag_gpt3"]
    assert_pngs(log.parent)
    # the figures are shown in the notebook too, and nothing complained on stderr
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == len(PNGS)
    assert text_of(nb, "stderr") == ""


def test_resumed_log_keeps_the_last_record_per_step(tmp_path, kernel):
    # run 1 (val every 5 steps, a checkpoint after 20) killed while writing step record 30
    val_1 = {0: 10.9, 5: 9.0, 10: 8.0, 15: 7.0, 20: 6.0, 25: 5.0, 30: 4.0}
    first = [header()]
    for s in range(30):
        first += [{"step": s, "val_loss": val_1[s]}] if s in val_1 else []
        first.append(step_record(s, 8.0, dt_ms=100.0))
    first.append({"step": 30, "val_loss": val_1[30]})
    killed = json.dumps(step_record(30, 8.0))[:25]
    # run 2 resumes from that checkpoint and redoes step records 20.. (starting on a fresh line)
    second = [header(resumed_from=20)] + [step_record(s, 4.0, dt_ms=50.0) for s in range(20, 25)]
    second += [{"step": 25, "val_loss": 6.5}] + [step_record(s, 4.0, dt_ms=50.0) for s in range(25, 28)]
    path = write_log(tmp_path / "run", first, tail=killed + "\n" + "".join(json.dumps(r) + "\n" for r in second))

    _, s, _ = run_notebook(kernel, path, tmp_path)
    # step records 0..19 from run 1 and 20..27 from run 2; run 1's 28, 29 and val at 30 are gone
    assert s["last_step"] == 27
    assert s["tokens"] == 28 * 1024
    assert s["last_train_loss"] == 4.0
    assert s["last_val_loss"] == [25, 6.5]  # run 2's, over run 1's 5.0
    assert s["best_val_loss"] == [20, 6.0]  # run 1's eval at the checkpoint still counts
    assert s["step_time_s"] == pytest.approx(20 * 0.1 + 8 * 0.05)
    assert s["redone_steps"] == 10  # run 1's step records 20..29
    assert s["skipped_lines"] == 1  # the killed line
    assert s["partial_last_line"] is False
    assert_pngs(path.parent)


@pytest.mark.parametrize("records", [[], [header()]], ids=["empty", "header_only"])
def test_an_empty_log_is_said_in_one_line_and_draws_nothing(tmp_path, kernel, records):
    log = write_log(tmp_path / "run", records)
    line = f"NothingToDraw: {log} holds no step or eval record yet: nothing to draw; run this again once the run"
    assert line in notebook_error(kernel, log, tmp_path)
    assert os.listdir(log.parent) == ["log.jsonl"]  # no blank figure saved


def test_missing_log_is_a_clear_error(tmp_path, kernel):
    said = notebook_error(kernel, tmp_path / "nowhere", tmp_path)
    assert f"no training log at {tmp_path / 'nowhere'}" in said and "set log_path" in said
    # an absolute path: no such note (a relative one's: test_jupyter_execute_on_a_folder_that_is_not_there_...)
    assert f"this notebook's folder, {tmp_path})" not in said


def test_a_checkpoint_as_the_log_names_its_run_folder_in_one_line(tmp_path, kernel):
    ckpt = tmp_path / "log" / "ckpt_000006.pt"
    write_log(ckpt.parent, clean_records())
    ckpt.write_bytes(b"PK\x03\x04 a torch.save zip")
    line = f"NothingToDraw: {ckpt} is a checkpoint: set log_path (or PLAY_LOG) to its run folder, {ckpt.parent}"
    assert line in notebook_error(kernel, ckpt, tmp_path)


def test_jupyter_execute_on_a_folder_that_is_not_there_ends_in_one_line(tmp_path, kernel):
    """README's `PLAY_LOG=log jupyter execute play.ipynb` before a run made log/: the notebook's own error is
    one line, the last one (jupyter execute itself still prints the cell it stopped in above it)."""
    r = jupyter_execute(tmp_path, "no_such_log")  # relative: from the notebook's folder
    assert r.returncode == 1
    said = f"NothingToDraw: no training log at {ROOT / 'no_such_log'} (a relative path starts from this notebook's"
    assert r.stderr.strip().splitlines()[-1].startswith(said), r.stderr[-2000:]
    assert "FileNotFoundError" not in r.stderr and "---> " not in r.stderr  # no traceback of the notebook's code


def test_a_run_with_hellaswag_off_says_why_where_the_curve_would_be(tmp_path, kernel):
    why = "cannot download HellaSwag from https://huggingface.co (HF_HUB_OFFLINE is set); pass --hellaswag-data X"
    records = clean_records()
    records[0]["config"]["hellaswag_off"] = why  # as train_gpt2.py writes it (test_hellaswag.py)
    log = write_log(tmp_path / "run", [r for r in records if "hellaswag" not in r])
    nb, s, _ = run_notebook(kernel, log, tmp_path)
    assert s["hellaswag_off"] == why and s["best_hellaswag"] is None
    assert f"HellaSwag was off for this run: {why}" in text_of(nb)
    assert_pngs(log.parent)


def expected_summary(path):
    """The summary by the contract's plain rule: complete lines only, the last record per step counts."""
    lines = path.read_text().split("\n")[:-1]  # whatever follows the last newline is unfinished
    steps, val, hella = {}, {}, {}
    for r in map(json.loads, filter(str.strip, lines)):
        if "train_loss" in r:
            steps[r["step"]] = r
        if "val_loss" in r:
            val[r["step"]] = r["val_loss"]
        if "hellaswag" in r:
            hella[r["step"]] = r["hellaswag"]
    last = steps[max(steps)]
    # HellaSwag records only appear where hellaswag.py and its data are there: none is fine too
    best = lambda d, pick: [pick(d, key=d.get), d[pick(d, key=d.get)]] if d else None  # noqa: E731
    return {
        "last_step": max(steps),
        "tokens": last["tokens"],
        "last_train_loss": last["train_loss"],
        "last_val_loss": [max(val), val[max(val)]],
        "best_val_loss": best(val, min),
        "best_hellaswag": best(hella, max),
        "step_time_s": sum(r["dt_ms"] for r in steps.values()) / 1000,
    }


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, assets, enc):
    """The folder of a run of 12 steps, checkpoints after 6 and 12, then a resume from 6 that redoes 6..11."""
    data = tmp_path_factory.mktemp("shards")
    text = assets.shakespeare.read_text()[:20000]
    tokens = np.array([enc.eot_token] + enc.encode_ordinary(text), dtype=np.uint16)
    np.save(data / "edufineweb_val_000000.npy", tokens[:2048])
    np.save(data / "edufineweb_train_000001.npy", tokens[2048:])
    out = tmp_path_factory.mktemp("run")
    flags = "--device cpu --n-layer 2 --n-head 2 --n-embd 32 --block-size 64 -B 4 -T 32 --total-batch-size 128"
    flags += " --max-steps 12 --warmup-steps 2 --max-lr 3e-3 --eval-every 4 --val-tokens 512 --hellaswag-every 6"
    flags += " --hellaswag-limit 8 --sample-every 0 --ckpt-every 6 --keep-ckpts 0"
    args = ["--data-dir", data, "--out-dir", out, *flags.split(), "--hellaswag-data", assets.hellaswag]
    assert train_gpt2.main(list(map(str, args))) == 0
    assert train_gpt2.main([*map(str, args), "--resume", str(out / "ckpt_000006.pt")]) == 0
    return out


def test_jupyter_execute_prints_the_summary_table(real_run, tmp_path, kernel, assets):
    """`jupyter execute` shows no cell output: the summary table of a real resumed run still reaches the terminal,
    the log's numbers by the plain rule (the last record of each step)."""
    log = real_run / "log.jsonl"
    assert [h["resumed_from"] for h in headers(real_run)] == [None, 6]
    r = jupyter_execute(tmp_path, real_run)
    assert r.returncode == 0, r.stderr
    rows = {line[:18].strip(): line[18:] for line in r.stdout.splitlines() if len(line) > 18}
    want = expected_summary(log)
    ref = assets.reference["build_nanogpt_plot_baselines"]
    gpt2_loss = ref["openai_gpt2_val_loss_on_fineweb_edu_val_shard"]["124M"]
    gpt2_hs = assets.reference["hellaswag_gpt2_reference_accuracy"]["gpt2_124M"]["completion_style_this_script"]
    assert f"summary of {log}" in r.stdout
    assert rows["last step"] == f"{want['last_step']} of 12"
    assert want["tokens"] == 12 * 128 and rows["tokens seen"] == "1,536 (1.536K)"  # not (0.000B)
    assert rows["last train loss"] == f"{want['last_train_loss']:.4f}"
    for key, name in (("last_val_loss", "last val loss"), ("best_val_loss", "best val loss")):
        step, value = want[key]
        assert rows[name] == f"{value:.4f} at step {step}   (OpenAI GPT-2 124M: {gpt2_loss})"
    step, acc = want["best_hellaswag"]
    assert rows["best HellaSwag"] == (
        f"{acc:.4f} at step {step}   (OpenAI GPT-2 124M: {gpt2_hs['acc_norm']}, GPT-3: {ref['hellaswag_gpt3']['124M']})"
    )
    assert rows["wall time"].endswith(f"({want['step_time_s']:,.0f} s of training steps)")
    assert_pngs(log.parent)


def test_play_ipynb_on_a_read_only_run_folder_prints_its_summary(tmp_path, kernel, read_only):
    log = write_log(tmp_path / "run", clean_records())
    read_only(log.parent)
    nb, s, _ = run_notebook(kernel, log, tmp_path)
    assert s["last_step"] == 49 and s["best_val_loss"] == [40, 6.2]
    said = text_of(nb)
    for name in PNGS:
        assert f"could not save {name} in {log.parent} (Read-only file system)" in said
    assert os.listdir(log.parent) == ["log.jsonl"]


def test_play_ipynb_shows_the_last_run_and_names_the_other_runs(tmp_path, kernel):
    """Run A, then run B killed after 5 steps and restarted from 0: B's restart drawn alone, A named."""

    def run(run_id, steps, loss, restarted=False, val=None):
        records = [{**header(), "run_id": run_id, "restarted": restarted}]
        for s in range(steps):
            records += [{"step": s, "val_loss": val}] if val is not None and s == 0 else []
            records.append(step_record(s, loss))
        return records

    log = write_log(tmp_path / "run", run("A", 10, 9.0, val=9.5) + run("B", 5, 8.0) + run("B", 7, 7.0, True, 7.5))
    nb, s, _ = run_notebook(kernel, log, tmp_path)
    assert (s["run_id"], s["other_runs"], s["restarts"]) == ("B", ["A"], 1)
    assert (s["last_step"], s["last_train_loss"], s["last_val_loss"], s["redone_steps"]) == (6, 7.0, [0, 7.5], 0)
    said = text_of(nb)
    assert "the log also holds run A (10 steps, last val loss 9.5000): not shown; this is run B" in said
    assert "restarted from step 0 1 time(s)" in said

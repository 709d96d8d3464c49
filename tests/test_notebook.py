"""play.ipynb runs headless against training logs (clean, still being written, resumed) and
reports the numbers the log holds; the committed notebook is clean."""

import json
import os
import re
import sys

import nbformat
import pytest
from matplotlib.image import imread
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell

ROOT = __import__("conftest").ROOT
NOTEBOOK = ROOT / "play.ipynb"
PNGS = ("loss.png", "hellaswag.png", "throughput.png")


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A python3 kernelspec that runs this interpreter, first on JUPYTER_PATH: a kernelspec in the
    user's own Jupyter folders must not decide which Python the notebook runs in."""
    base = tmp_path_factory.mktemp("jupyter")
    spec = base / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "Python 3", "language": "python"}))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(base)
    yield
    if old is None:
        del os.environ["JUPYTER_PATH"]
    else:
        os.environ["JUPYTER_PATH"] = old


def run_notebook(log_path, cwd, **params):
    """Execute play.ipynb with papermill-style injected parameters; returns (executed nb, what the
    notebook's `summary` and `BASELINES` hold at the end)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    values = {"log_path": str(log_path), **params}
    nb.cells.insert(i + 1, new_code_cell("\n".join(f"{k} = {v!r}" for k, v in values.items())))
    nb.cells.append(new_code_cell("print(json.dumps({'summary': summary, 'baselines': BASELINES}))"))
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    last = nb.cells[-1].outputs
    return nb, json.loads("".join(o.get("text", "") for o in last if o.get("name") == "stdout"))


def assert_pngs(folder):
    for name in PNGS:
        path = folder / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        h, w = imread(path).shape[:2]
        assert h > 100 and w > 100, (name, h, w)
    assert not list(folder.glob(".*.tmp")), "a temporary PNG was left behind"


def stderr_of(nb):
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("name") == "stderr")


# ----------------------------------------------------------------------------------------------
# Synthetic logs in the contract's format, with values chosen so the expected summary is known


def header(resumed_from=None):
    config = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 64, "total_batch_size": 1024}
    return {"event": "header", "config": config, "versions": {"torch": "2.13.0"}, "device": "cpu", "resumed_from": resumed_from}


def step_record(step, loss, dt_ms=100.0):
    return {
        "step": step, "train_loss": loss, "lr": 6e-4 * min(1, (step + 1) / 10), "grad_norm": 1.0 + 0.01 * step,
        "dt_ms": dt_ms, "tok_per_sec": 1024 / (dt_ms / 1000), "mfu": None, "tokens": (step + 1) * 1024, "epoch": 0,
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
    text = NOTEBOOK.read_text()
    nb = nbformat.reads(text, as_version=4)
    nbformat.validate(nb)
    assert "parameters" in nb.cells[0].metadata.get("tags", []), "the first cell must be the papermill parameters cell"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "commit the notebook with its outputs cleared"
    # no machine paths: absolute POSIX paths under the usual roots, or Windows drive paths
    assert not re.search(r"(?<![\w.])/(work|home|tmp|Users|root|mnt)/|[A-Za-z]:\\\\", text)
    assert nb.metadata.kernelspec.name == "python3"


def test_clean_log_summary_baselines_and_pngs(tmp_path, kernel_env, shared_data):
    log = write_log(tmp_path / "run", clean_records())
    nb, out = run_notebook(log, tmp_path)
    s = out["summary"]
    assert s["last_step"] == 49
    assert s["tokens"] == 50 * 1024
    assert s["last_train_loss"] == pytest.approx(10.0 - 4.9)
    assert s["last_val_loss"] == [49, 6.3]
    assert s["best_val_loss"] == [40, 6.2]
    assert s["best_hellaswag"] == [20, 0.27]
    assert s["step_time_s"] == pytest.approx(50 * 0.1)
    assert (s["redone_steps"], s["skipped_lines"], s["partial_last_line"]) == (0, 0, False)
    # the baselines are the published ones, kept in one place
    ref = json.loads((shared_data / "reference" / "reference_numbers.json").read_text())["build_nanogpt_plot_baselines"]
    assert out["baselines"]["gpt2_val_loss"]["124M"] == ref["openai_gpt2_val_loss_on_fineweb_edu_val_shard"]["124M"]
    assert out["baselines"]["gpt2_hellaswag"] == ref["hellaswag_gpt2"]
    assert out["baselines"]["gpt3_hellaswag"] == ref["hellaswag_gpt3"]
    assert_pngs(log.parent)
    # the figures are shown in the notebook too, and nothing complained on stderr
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == len(PNGS)
    assert stderr_of(nb) == ""


def test_log_still_being_written(tmp_path, kernel_env):
    # the writer is midway through step 50's record: no newline yet
    partial = json.dumps(step_record(50, 5.0))[:40]
    log = write_log(tmp_path / "run", clean_records(), tail=partial)
    _, out = run_notebook(tmp_path / "run", tmp_path)  # the run folder works as well as the file
    s = out["summary"]
    assert s["partial_last_line"] is True
    assert s["skipped_lines"] == 0
    assert s["last_step"] == 49 and s["tokens"] == 50 * 1024
    assert_pngs(log.parent)


def test_resumed_log_keeps_the_last_record_per_step(tmp_path, kernel_env):
    # run 1 trains steps 0..29 (loss 8.0), checkpoints at 19, and is killed mid-way through writing
    # step 30; run 2 resumes from 19, redoes steps 20.. (loss 4.0) and has reached step 25
    first = [header()] + [step_record(s, 8.0, dt_ms=100.0) for s in range(30)]
    first.insert(21, {"step": 20, "val_loss": 7.5})
    first.append({"step": 25, "val_loss": 7.0})
    second = [header(resumed_from=19), {"step": 20, "val_loss": 4.5}] + [step_record(s, 4.0, dt_ms=50.0) for s in range(20, 26)]
    killed = json.dumps(step_record(30, 8.0))[:25]  # the resume header lands on this line
    path = tmp_path / "run" / "log.jsonl"
    write_log(path.parent, first, tail=killed)
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in second))
    assert sum(1 for line in path.read_text().splitlines() if '"event": "header"' in line) == 2

    _, out = run_notebook(path, tmp_path)
    s = out["summary"]
    # steps 0..19 from run 1 and 20..25 from run 2; run 1's steps 26..29 are gone with it
    assert s["last_step"] == 25
    assert s["tokens"] == 26 * 1024
    assert s["last_train_loss"] == 4.0
    assert s["last_val_loss"] == [20, 4.5]  # run 1's val at 25 was dropped, its val at 20 replaced
    assert s["best_val_loss"] == [20, 4.5]
    assert s["step_time_s"] == pytest.approx(20 * 0.1 + 6 * 0.05)
    assert s["redone_steps"] == 10  # run 1's records for steps 20..29
    assert s["skipped_lines"] == 0 and s["partial_last_line"] is False
    assert_pngs(path.parent)


def test_missing_log_is_a_clear_error(tmp_path, kernel_env):
    from nbclient.exceptions import CellExecutionError

    with pytest.raises(CellExecutionError, match="no training log at .*set log_path"):
        run_notebook(tmp_path / "nowhere", tmp_path)

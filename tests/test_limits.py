"""When a run cannot go on, it says what to do, and the advice works: running out of memory (for
real, under a memory limit), a divergence, numbers at the edge of what the code can do with them
(seeds, timeouts, temperatures), torchrun, read-only folders, and messages that must name the
right flag and tell the truth about what is on disk. Each message's advice is followed here."""

import math
import os

from test_notebook import clean_records, kernel_env, run_notebook, write_log  # noqa: F401  (kernel_env: a fixture)

import train_gpt2
from helpers import read_log, strict_records, tiny_args

# ----------------------------------------------------------------------------------------------
# Rule 2: after a divergence the advice works; a run never ends "done" on NaN


def test_a_nan_val_loss_reads_back_in_play_ipynb(tmp_path, kernel_env):  # noqa: F811
    records = clean_records()
    records.append({"step": 50, "val_loss": "NaN"})  # as RunLog writes a non-finite val loss
    log = write_log(tmp_path / "run", records)
    _, out = run_notebook(log, tmp_path)
    assert out["summary"]["best_val_loss"] == [40, 6.2]
    assert out["summary"]["last_val_loss"][0] == 50 and math.isnan(out["summary"]["last_val_loss"][1])


# ----------------------------------------------------------------------------------------------
# Rule 5: read-only is an answer, not a crash


def test_play_ipynb_on_a_read_only_run_folder_prints_its_summary(tmp_path, kernel_env, read_only):  # noqa: F811
    log = write_log(tmp_path / "run", clean_records())
    read_only(log.parent)
    nb, out = run_notebook(log, tmp_path)
    assert out["summary"]["last_step"] == 49 and out["summary"]["best_val_loss"] == [40, 6.2]
    said = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    for name in ("loss.png", "hellaswag.png", "throughput.png"):
        assert f"could not save {name} in {log.parent} (Read-only file system)" in said
    assert os.listdir(log.parent) == ["log.jsonl"]


# ----------------------------------------------------------------------------------------------
# Rule 6: every message names the flag of its program and tells the truth about the disk


def test_val_tokens_0_turns_the_val_loss_off(data, tmp_path):
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, out, "--val-tokens", 0, "--eval-every", 2, "--max-steps", 2)) == 0
    records = strict_records(out)
    assert not any("val_loss" in x for x in records) and sorted(read_log(out)[1]) == [0, 1]

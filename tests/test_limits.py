"""When a run cannot go on, it says what to do, and the advice works: running out of memory (for
real, under a memory limit), a divergence, numbers at the edge of what the code can do with them
(seeds, timeouts, temperatures), torchrun, read-only folders, and messages that must name the
right flag and tell the truth about what is on disk. Each message's advice is followed here."""

import math
import os
import time

import pytest
from test_notebook import clean_records, kernel_env, run_notebook, write_log  # noqa: F401  (kernel_env: a fixture)

import train_gpt2
from helpers import ranks_without_agent, read_log, strict_records, tiny_args, torchrun, user_error

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
# Rule 3: numbers checked for what the code can do with them


# rank 0's disk takes 8 s per checkpoint: longer than the 3 s --ddp-timeout
SLOW_DISK = """
import os, sys, time
import train_gpt2
from support import checkpoints, common
write = checkpoints.write_atomic
def slow(path, *args, **kwargs):
    if path.endswith(".pt") and os.environ["RANK"] == "0":
        time.sleep(8)
    return write(path, *args, **kwargs)
checkpoints.write_atomic = slow  # the name save_checkpoint calls
common.run_cli(lambda: train_gpt2.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_short_ddp_timeout_survives_slow_checkpoints_and_long_samples(data, tmp_path):
    """Rank 0 writes checkpoints alone (8 s each here) and samples take seconds: with --ddp-timeout 3
    a healthy job finishes, because the other rank waits in the fence, and every rank samples."""
    out = tmp_path / "out"
    args = tiny_args(
        data,
        out,
        "--max-steps",
        4,
        "--ckpt-every",
        2,
        "--eval-every",
        2,
        "--sample-every",
        2,
        "--num-samples",
        256,
        "--max-new-tokens",
        48,
        "--ddp-timeout",
        3,
    )
    t0 = time.time()
    r = torchrun(*args, wrap=SLOW_DISK)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert time.time() - t0 > 16  # the slow writes happened: two checkpoints of 8 s
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_000002.pt", "ckpt_000004.pt"]
    assert [len(x["samples"]) for x in read_log(out)[0] if "samples" in x] == [256, 256]


# ----------------------------------------------------------------------------------------------
# Rule 4: under torchrun a mistake is said once, and every rank exits the same way


@pytest.mark.parametrize("mistake", ["flag", "out-dir"])
@pytest.mark.slow
def test_torchrun_says_a_mistake_once_and_every_rank_exits_1(data, tmp_path, mistake):
    out = tmp_path / "out"
    extra = ["--seed", -1] if mistake == "flag" else []
    if mistake == "out-dir":  # found by rank 0 alone
        out.mkdir()
        (out / "log.jsonl").write_text("another run's\n")
    args = [*map(str, tiny_args(data, out, "--max-steps", 2, *extra))]
    r = torchrun(*args)
    said = (r.stdout + r.stderr).count("error: ")
    assert r.returncode != 0 and said == 1, r.stderr[-3000:]
    assert 'train_gpt2.py", line' not in r.stderr  # no worker's traceback (torchrun's own follows)
    # each rank's own exit code: torchrun stops the others once one has failed, so the two ranks
    # run here as torchrun would start them (its environment variables), without its agent
    codes, outputs = ranks_without_agent(args)
    assert codes == [1, 1], outputs
    assert [sum(o.count("error: ") for o in output) for output in outputs] == [1, 0], outputs


def test_dry_run_runs_the_start_up_checks_and_writes_nothing(data, tmp_path, capsys):
    out = tmp_path / "new" / "out"
    args = tiny_args(data, out, "--sample-every", 2, "--eval-every", 2)
    assert train_gpt2.main(args + ["--dry-run"]) == 0
    assert "dry run: the flags, the data, --out-dir and the sampling check are fine" in capsys.readouterr().out
    assert not (tmp_path / "new").exists()
    assert "--prompt" in user_error(args + ["--dry-run", "--prompt", "word " * 100])  # the sampling check ran
    assert "does not exist" in user_error(tiny_args(tmp_path / "no_data", out, "--dry-run"))  # the data checks ran
    assert not (tmp_path / "new").exists()


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

"""--resume, through real runs of train_gpt2.py: which checkpoint it continues from (support/run_folder.py),
the recipe it takes from that checkpoint (support/resume.py), and that the resumed run is the one it
continues, bit for bit."""

import re
import shutil
import signal

import pytest

import train_gpt2
from helpers import (
    ROOT,
    at_step,
    checkpoint_bytes,
    headers,
    read_log,
    refused_before_step_0,
    run_ids,
    snapshot,
    strict_records,
    tiny_args,
    torch_loads,
    torchrun,
    user_error,
)
from support.checkpoints import load_checkpoint
from support.resume import ALLOWED_CHANGES

# ----------------------------------------------------------------------------------------------
# Which checkpoint --resume continues from: the newest that loads


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_resume_skips_a_damaged_newest_checkpoint_in_one_line(short_run, tmp_path, capsys, damage):
    data, out = short_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    raw = bytearray((run / "ckpt_000002.pt").read_bytes())
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    else:  # the file whole, but zeros over the middle of a tensor
        raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64)
    (run / "ckpt_000002.pt").write_bytes(raw)
    assert train_gpt2.main(tiny_args(data, run, "--max-steps", 2, "--resume", "--eval-every", 0)) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipping" in err[0] and "ckpt_000002.pt" in err[0], err
    assert ("cannot be loaded safely (truncated" if damage == "truncated" else "is corrupt: its ") in err[0]
    assert [h["resumed_from"] for h in headers(run)] == [None, 1]
    first, again = [r for r in read_log(run)[0] if r.get("step") == 1 and "train_loss" in r]  # step 1, then redone
    assert (again["train_loss"], again["grad_norm"]) == (first["train_loss"], first["grad_norm"])


# ----------------------------------------------------------------------------------------------
# The recipe comes from the checkpoint: flags left out take its values, a contradiction is
# refused, a change it allows is said


@pytest.fixture
def run4(data, tmp_path):
    """4 of 8 steps done, warm-up 5, checkpoint every 2 steps."""
    out = tmp_path / "run"
    args = tiny_args(data, out, "--max-steps", 4, "--warmup-steps", 5, "--ckpt-every", 2, "--eval-every", 0)
    assert train_gpt2.main(args) == 0
    return out


@pytest.mark.parametrize(
    "given", ["--total-batch-size 128", "-T 8", "--weight-decay 0.05", "--warmup-steps 2", "--seed 3", "--n-embd 64"]
)
def test_a_contradicting_recipe_flag_on_resume_is_refused(data, run4, given):
    before, (flag, value) = snapshot(run4), given.split()
    msg = user_error(tiny_args(data, run4, "--max-steps", 8, "--warmup-steps", 5, "--resume", flag, value))
    flag = {"-T": "--seq-len"}.get(flag, flag)
    assert f"{flag} {value} contradicts the " in msg and f"leave {flag} out" in msg
    assert snapshot(run4) == before


def test_resume_takes_the_runs_data_and_eval_settings(data, run4, capsys):
    # `--resume run` alone: the run's data folder and evals, not the defaults' edu_fineweb10B (which
    # is not there) and HellaSwag every 250 steps; a setting given on resume wins from there on
    assert train_gpt2.main(["--resume", str(run4), "--max-steps", "6", "--device", "cpu", "--sample-every", "5"]) == 0
    assert "note: continuing with the run's --data-dir" in capsys.readouterr().out
    records, steps = read_log(run4)
    header = [r for r in records if r.get("event") == "header"][-1]["config"]
    assert header["data_dir"] == str(data) and header["ckpt_every"] == 2 and header["val_tokens"] == 256
    assert header["eval_every"] == 0 and header["hellaswag_every"] == 0 and header["sample_every"] == 5
    assert sorted(steps) == list(range(6)) and not any("val_loss" in r for r in records)
    assert sorted(p.name for p in run4.glob("ckpt_*.pt"))[-1] == "ckpt_000006.pt"


def test_a_relative_data_dir_resumes_from_another_working_directory(data, tmp_path, monkeypatch):
    work = tmp_path / "work"
    shutil.copytree(data, work / "shards")
    monkeypatch.chdir(work)
    assert train_gpt2.main(tiny_args("shards", "run", "--max-steps", 2, "--ckpt-every", 2, "--eval-every", 0)) == 0
    monkeypatch.chdir(tmp_path)
    assert train_gpt2.main(["--resume", str(work / "run"), "--max-steps", "4", "--device", "cpu"]) == 0
    assert sorted(read_log(work / "run")[1]) == [0, 1, 2, 3]


def test_a_mistyped_resume_path_names_the_nearest_folder_and_its_checkpoints(data, run4):
    for typo in (run4 / "ckpt_000009.pt", run4 / "ckpts" / "ckpt_000004.pt"):
        said = f"--resume {typo} does not exist; {run4} holds ckpt_000004.pt, ckpt_000002.pt"
        refused_before_step_0(tiny_args(data, run4, "--resume", typo), run4, said)


def test_max_steps_below_the_checkpoint_is_refused(data, run4):
    msg = user_error(tiny_args(data, run4, "--max-steps", 3, "--warmup-steps", 5, "--resume"))
    assert "--max-steps 3" in msg and "4 steps" in msg


@pytest.mark.parametrize("max_lr", [1e-3, 6e-3])  # lower: the way on after a divergence; higher: lr-bound
def test_another_max_lr_on_resume_is_allowed_and_said_in_output_and_header(data, run4_with_val_loss, capsys, max_lr):
    args = tiny_args(data, run4_with_val_loss, "--max-steps", 6, "--warmup-steps", 2, "--ckpt-every", 2)
    assert train_gpt2.main(args + ["--resume", "--max-lr", max_lr, "--eval-every", 2]) == 0
    said = capsys.readouterr().out
    assert f"note: --max-lr 0.003 -> {max_lr} on resume" in said and "note: --max-steps 4 -> 6 on resume" in said
    header = [x for x in strict_records(run4_with_val_loss) if x.get("event") == "header"][-1]
    assert header["changed_on_resume"] == {"max_lr": [3e-3, max_lr], "max_steps": [4, 6]}
    lr = train_gpt2.get_lr(5, max_lr, max_lr / 10, 2, 6)  # the new peak's schedule
    assert read_log(run4_with_val_loss)[1][5]["lr"] == pytest.approx(lr)


@pytest.mark.parametrize("doc", ["README.md", "docs/training.md", "docs/reliability.md"])
def test_the_docs_name_the_changes_resume_allows_and_only_those(doc):
    """Where a doc lists the changes --resume allows ("allowed and said"), it names each flag
    support.resume.ALLOWED_CHANGES takes with a note, and no other."""
    text = (ROOT / doc).read_text().replace("\n", " ")
    [clause] = [c for c in re.split(r"(?<=\.)\s+|;", text) if "allowed and said" in c]
    allowed = {"-B" if name == "batch_size" else "--" + name.replace("_", "-") for name in ALLOWED_CHANGES}
    assert set(re.findall(r"`(-B|--[a-z-]+)`", clause)) == allowed, clause


def test_tokens_count_stays_right_after_resume_with_another_B(data, run4, tmp_path, capsys):
    args = tiny_args(data, run4, "--max-steps", 6, "--warmup-steps", 5, "--resume", "-B", 4, "--eval-every", 0)
    assert train_gpt2.main(args) == 0
    assert "note: --batch-size 2 -> 4 on resume" in capsys.readouterr().out
    steps = read_log(run4)[1]
    assert [steps[s]["tokens"] for s in range(6)] == [64 * (s + 1) for s in range(6)]
    # one micro-batch of 4 rows instead of two of 2: the same 64 tokens a step, summed in another
    # order, so the uninterrupted run's losses up to float rounding
    ref = tmp_path / "ref"
    assert train_gpt2.main(tiny_args(data, ref, "--max-steps", 6, "--warmup-steps", 5, "--eval-every", 0)) == 0
    uninterrupted = read_log(ref)[1]
    for s in (4, 5):
        assert steps[s]["train_loss"] == pytest.approx(uninterrupted[s]["train_loss"], rel=1e-6, abs=0), s
        assert steps[s]["grad_norm"] == pytest.approx(uninterrupted[s]["grad_norm"], rel=1e-5, abs=0), s


@pytest.mark.parametrize("resume, out", [("run", "other"), ("", "run")], ids=["a run's folder", "''"])
def test_a_resume_naming_a_run_folder_with_another_out_dir_or_nothing_is_refused(data, run4, tmp_path, resume, out):
    before, (resume, out) = snapshot(run4), (tmp_path / resume if resume else "", tmp_path / out)
    msg = user_error(tiny_args(data, out, "--max-steps", 6, "--warmup-steps", 5, "--resume", resume))
    if resume:
        assert "is a run's folder" in msg and f"--resume --out-dir {run4}" in msg and not out.exists()
    else:
        assert msg.startswith("--resume '' names nothing:")
    assert snapshot(run4) == before


def test_resume_of_a_transformers_folder_is_refused_as_a_model_pointing_to_init_from(data, hf_tiny_dir, tmp_path):
    # save_pretrained's folder (export_hf.py's too) is a model: no run starts inside it
    before = snapshot(hf_tiny_dir)
    args = tiny_args(data, tmp_path / "out", "--resume", hf_tiny_dir)
    del args[2:4]  # no --out-dir: --resume names the folder alone
    msg = user_error(args)
    assert (
        msg == f"--resume {hf_tiny_dir} is a transformers model, not a run: train from it via --init-from {hf_tiny_dir}"
    )
    assert snapshot(hf_tiny_dir) == before
    init = tiny_args(data, tmp_path / "out", "--max-steps", 1, "--eval-every", 0, "--init-from", hf_tiny_dir)
    assert train_gpt2.main(init) == 0  # the advice, followed


# ----------------------------------------------------------------------------------------------
# A checkpoint continues its own run: in its run's folder or a new one, never another run's


@pytest.fixture
def two_runs(data, tmp_path):
    """Run A: 4 steps with checkpoints at 2 and 4; run B: another finished run of 6 steps."""
    a, b = tmp_path / "A", tmp_path / "B"
    common = ["--warmup-steps", 2, "--ckpt-every", 2, "--eval-every", 0]
    assert train_gpt2.main(tiny_args(data, a, "--max-steps", 4, *common)) == 0
    assert train_gpt2.main(tiny_args(data, b, "--max-steps", 6, "--seed", 7, *common)) == 0
    return a, b


@pytest.mark.parametrize("keep", ["checkpoints and log", "log only", "checkpoint only"])
def test_resume_of_a_checkpoint_into_another_runs_folder_is_refused(data, two_runs, keep):
    a, b = two_runs
    if keep == "log only":
        for p in b.glob("ckpt_*.pt"):
            p.unlink()
    if keep == "checkpoint only":
        (b / "log.jsonl").unlink()
    before = snapshot(a.parent)
    line = user_error(tiny_args(data, b, "--max-steps", 8, "--warmup-steps", 2, "--resume", a / "ckpt_000002.pt"))
    assert f"--resume {a / 'ckpt_000002.pt'} continues run " in line and f"--out-dir {b} holds another" in line
    assert ("log.jsonl" in line) == (keep != "checkpoint only") and ("ckpt_000006.pt" in line) == (keep != "log only")
    assert f"--out-dir {a} (the run's own folder)" in line
    assert snapshot(a.parent) == before  # B's checkpoints and log untouched, nothing appended


def test_a_checkpoint_with_no_meta_beside_the_one_resumed_counts_as_another_runs(data, two_runs, tmp_path):
    """--resume CKPT into its own folder, which holds a checkpoint copied in without its meta (whose run is
    unknown): refused as another run's, pointing to a new --out-dir only (not to the folder it is in); followed,
    the run continues there."""
    a, b = two_runs
    (own,) = run_ids(a)
    shutil.copy(b / "ckpt_000006.pt", a / "ckpt_000006.pt")
    args = ["--max-steps", 6, "--warmup-steps", 2, "--eval-every", 0, "--resume", a / "ckpt_000004.pt"]
    msg = refused_before_step_0(tiny_args(data, a, *args), a, f"--out-dir {a} holds another run (ckpt_000006.pt)")
    assert msg.endswith("pass a new or empty --out-dir")
    assert train_gpt2.main(tiny_args(data, tmp_path / "new", *args)) == 0 and run_ids(tmp_path / "new") == {own}


def test_resume_of_a_checkpoint_into_a_new_folder_continues_the_run_there(data, two_runs, tmp_path, capsys):
    a, _ = two_runs
    new = tmp_path / "C"
    new.mkdir()
    (new / "notes.txt").write_text("the user's notes")  # empty of runs: fine
    before = snapshot(a)
    args = ["--max-steps", 6, "--warmup-steps", 2, "--eval-every", 0, "--ckpt-every", 2]
    assert train_gpt2.main(tiny_args(data, new, *args, "--resume", a / "ckpt_000002.pt")) == 0
    assert f"note: run {load_checkpoint(str(a / 'ckpt_000002.pt'))['run_id']} continues from" in capsys.readouterr().out
    assert snapshot(a) == before
    # the same steps as the run continued in its own folder from that checkpoint
    own = tmp_path / "own"
    shutil.copytree(a, own)
    (own / "ckpt_000004.pt").unlink()
    assert train_gpt2.main(tiny_args(data, own, *args, "--resume")) == 0
    moved, in_place = read_log(new)[1], read_log(own)[1]
    assert sorted(moved) == [2, 3, 4, 5]
    assert [moved[s]["train_loss"] for s in moved] == [in_place[s]["train_loss"] for s in moved]
    assert run_ids(new) == run_ids(a) and (new / "notes.txt").read_text() == "the user's notes"


# ----------------------------------------------------------------------------------------------
# Going back to an earlier checkpoint in the run's folder starts a new line of the run


@pytest.fixture
def run9(data, tmp_path):
    """9 steps with checkpoints at 3, 6 and 9, --keep-ckpts 3."""
    out = tmp_path / "run"
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 9, "--ckpt-every", 3, "--keep-ckpts", 3)) == 0
    return out


def test_going_back_to_an_earlier_checkpoint_loses_none_and_plain_resume_continues_the_new_line(
    run9, monkeypatch, capsys
):
    """--resume ckpt_3 --max-lr 3e-4 stopped by Ctrl-C at step 4 sets the old line's 6 and 9 aside and keeps
    the 3 it started from; a plain --resume then continues the new line's 5, not the old line's 9."""
    old = checkpoint_bytes(run9)
    at_step(monkeypatch, {4: lambda: signal.raise_signal(signal.SIGINT)})
    branch = ["--resume", str(run9 / "ckpt_000003.pt"), "--out-dir", str(run9), "--max-lr", "3e-4"]
    assert train_gpt2.main(branch) == 128 + signal.SIGINT
    monkeypatch.undo()
    assert old.keys() <= checkpoint_bytes(run9).keys()  # every checkpoint's bytes, unchanged, somewhere
    assert sorted(p.name for p in run9.glob("ckpt_*.pt")) == ["ckpt_000003.pt", "ckpt_000005.pt"]
    assert headers(run9)[-1]["set_aside"] == ["aside_1/ckpt_000006.pt", "aside_1/ckpt_000009.pt"]
    assert f"are now in {run9 / 'aside_1'}/" in capsys.readouterr().out
    branched = checkpoint_bytes(run9)
    assert train_gpt2.main(["--resume", "--out-dir", str(run9), "--device", "cpu"]) == 0
    assert f"resuming from {run9 / 'ckpt_000005.pt'} at step 5" in capsys.readouterr().out
    assert [(h["resumed_from"], h["config"]["max_lr"]) for h in headers(run9)] == [(None, 3e-3), (3, 3e-4), (5, 3e-4)]
    now = checkpoint_bytes(run9)  # the new line has 3 of its own (5, 6, 9): the 3 it started from is pruned
    assert {h for h, p in branched.items() if p.name != "ckpt_000003.pt"} <= now.keys()
    assert sorted(str(p.relative_to(run9)) for p in now.values()) == [
        "aside_1/ckpt_000006.pt",
        "aside_1/ckpt_000009.pt",
        "ckpt_000005.pt",
        "ckpt_000006.pt",
        "ckpt_000009.pt",
    ]


def test_a_dry_run_of_going_back_moves_nothing_and_says_where_it_would(run9, capsys):
    before = snapshot(run9)
    assert train_gpt2.main(["--resume", str(run9 / "ckpt_000003.pt"), "--out-dir", str(run9), "--dry-run"]) == 0
    assert snapshot(run9) == before
    assert (
        f"the checkpoints it passes over (ckpt_000006.pt .. ckpt_000009.pt) would be set aside in {run9 / 'aside_1'}/"
        in capsys.readouterr().out
    )


# ----------------------------------------------------------------------------------------------
# A run killed before its first checkpoint has nothing to continue from


class Killed(BaseException):
    """The process dies here (a spot instance reclaimed): nothing after it runs in the loop."""


@pytest.fixture
def dead_run(data, tmp_path, monkeypatch):
    """(its folder, its run id, its log): a run killed at step 3, before its first checkpoint."""
    out = tmp_path / "out"
    at_step(monkeypatch, {3: lambda: (_ for _ in ()).throw(Killed())})
    with pytest.raises(Killed):
        train_gpt2.main(tiny_args(data, out, "--ckpt-every", 0))
    monkeypatch.undo()
    assert sorted(read_log(out)[1]) == [0, 1, 2] and not list(out.glob("ckpt_*.pt"))
    return out, headers(out)[0]["run_id"], (out / "log.jsonl").read_bytes()


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_it_anew_with_its_flags_and_log_kept_aside(
    dead_run, capsys
):
    out, run_id, dead_log = dead_run
    (out / f"log.jsonl.{run_id}").write_text("a file of the user's at the first name\n")
    # what a spot script repeats, with none of the run's flags: the dead run's own, a given one winning
    assert train_gpt2.main(["--out-dir", out, "--device", "cpu", "--resume", "--max-steps", 5]) == 0
    said = capsys.readouterr().out
    assert (
        f"stopped before its first checkpoint: it starts anew with its flags; its log is now {out}/log.jsonl.{run_id}1"
        in said
    )
    assert "note: continuing with the run's --block-size 64, --n-layer 2, --n-head 2, --n-embd 32, " in said
    assert (out / f"log.jsonl.{run_id}1").read_bytes() == dead_log  # kept whole, beside the user's file
    assert (out / f"log.jsonl.{run_id}").read_text() == "a file of the user's at the first name\n"
    assert sorted(read_log(out)[1]) == list(range(5)) and headers(out)[0]["run_id"] != run_id
    assert headers(out)[0]["config"]["n_embd"] == 32


def test_a_dry_run_of_that_resume_changes_nothing_and_says_what_the_run_would_do(data, dead_run, capsys):
    out, run_id, _ = dead_run
    (out / ".ckpt_000002.pt.tmp").write_bytes(b"a checkpoint write cut short")
    before = snapshot(out.parent)
    assert train_gpt2.main(tiny_args(data, out, "--resume", "--dry-run")) == 0
    assert snapshot(out.parent) == before  # no log renamed, no temporary removed, no lock file
    assert f"its log would be set aside as {out}/log.jsonl.{run_id} (not in a dry run)" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# A run folder holds one run, and a run writes over nothing it did not write


@pytest.mark.parametrize("kind", ["another run's, by its meta", "a copy with no meta"])
def test_a_checkpoint_not_the_folders_own_is_set_aside_unopened_and_never_pruned(
    data, two_runs, monkeypatch, capsys, kind
):
    """Another run's checkpoint (its meta names that run), or a checkpoint copied without its meta (this run's
    ckpt_2 as ckpt_6), at the newest name and at an older one: passed over in one line each, never opened (the
    only torch.load is of the checkpoint resumed), set aside, and out of reach of pruning (--keep-ckpts 1)."""
    a, b = two_runs
    (own,), (theirs_id,) = run_ids(a), run_ids(b)
    meta = kind == "another run's, by its meta"
    source = b / "ckpt_000006.pt" if meta else a / "ckpt_000002.pt"
    for step in (0, 6):  # older and newer than the 4 it resumes from
        shutil.copy(source, a / f"ckpt_00000{step}.pt")
        if meta:
            shutil.copy(b / "meta_000006.json", a / f"meta_00000{step}.json")
    copied, loads = source.read_bytes(), torch_loads(monkeypatch)
    args = tiny_args(data, a, "--max-steps", 8, "--warmup-steps", 2, "--eval-every", 0, "--ckpt-every", 2, "--resume")
    capsys.readouterr()
    assert train_gpt2.main([*args, "--keep-ckpts", "1"]) == 0
    assert loads == [(str(a / "ckpt_000004.pt"), False)]
    why = f"it holds run {theirs_id}" if meta else "it has no meta_000006.json (a copy?)"
    (line,) = capsys.readouterr().err.splitlines()
    assert (
        line
        == f"warning: skipping {a / 'ckpt_000006.pt'}: {why}, not this folder's run {own} (which its log.jsonl records)"
    )
    assert [h["resumed_from"] for h in headers(a)] == [None, 4] and run_ids(a) == {own}
    kept, aside = sorted(p.name for p in a.glob("*_0*")), sorted(p.name for p in (a / "aside_1").iterdir())
    assert kept == ["ckpt_000006.pt", "ckpt_000008.pt", "meta_000006.json", "meta_000008.json"]
    assert aside == ["ckpt_000000.pt", "ckpt_000006.pt"] + (["meta_000000.json", "meta_000006.json"] if meta else [])
    assert all((a / "aside_1" / f"ckpt_00000{s}.pt").read_bytes() == copied for s in (0, 6))


def test_a_folder_with_none_of_its_runs_checkpoints_left_is_refused(data, two_runs, tmp_path):
    a, b = two_runs
    for path in a.glob("ckpt_*.pt"):
        path.unlink()
    shutil.copy(b / "ckpt_000006.pt", a / "ckpt_000006.pt")  # only another run's checkpoint is left
    args = ["--max-steps", 8, "--warmup-steps", 2, "--eval-every", 0, "--ckpt-every", 2]
    msg = refused_before_step_0(tiny_args(data, a, *args, "--resume"), a, f"none of the 1 checkpoints in {a}")
    assert msg.endswith("pass it as --resume CKPT with a new --out-dir")
    assert len(headers(a)) == 1
    # the advice: that run continues in a folder of its own
    assert train_gpt2.main(tiny_args(data, tmp_path / "new", *args, "--resume", a / "ckpt_000006.pt")) == 0
    assert sorted(read_log(tmp_path / "new")[1]) == [6, 7] and run_ids(tmp_path / "new") == run_ids(b)


@pytest.mark.slow
def test_under_torchrun_a_file_not_the_runs_is_said_once_and_kept(data, two_runs):
    a, _ = two_runs
    (a / "ckpt_000005.pt").write_bytes(b"the user's own bytes")
    before = snapshot(a)
    r = torchrun(*tiny_args(data, a, "--max-steps", 6, "--warmup-steps", 2, "--eval-every", 0, "--resume"))
    said = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error: ")]
    assert r.returncode != 0 and len(said) == 1, r.stderr[-3000:]
    assert said[0].startswith(f"error: {a / 'ckpt_000005.pt'} is no checkpoint of train_gpt2.py") and "(mv " in said[0]
    assert snapshot(a) == before  # rank 0 decided before anything was written, and every rank stopped

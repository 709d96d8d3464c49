"""The run's folder, one run's: the names it writes (ckpt_<step>.pt, each with its meta_<step>.json,
log.jsonl, the lock), the claim at start (the lock; another run's folder refused; which checkpoint
--resume continues, the ones its line passes over set aside), the checkpoint's atomic write, and
pruning. Whose a checkpoint is, its meta says, unopened. Ownership is decided once, at the claim:
after it the folder holds this run's line alone, and pruning trusts it."""

import contextlib
import json
import os
import re
import shlex
import sys

import torch

from support.checkpoints import load_training_checkpoint
from support.cli import UserError
from support.files import check_folder, disk_error, existing_part, lock_folder, log_records, unlock_folder, write_atomic

# ----------------------------------------------------------------------------------------------
# The names a run writes: its log.jsonl, its checkpoints and their metas, their temporary files, its lock

CHECKPOINT_NAME = re.compile(r"ckpt_(\d+)\.pt")  # checkpoint_path's names; the group: the step
UNFINISHED = re.compile(r"\.(ckpt_\d+\.pt|meta_\d+\.json)\.tmp")  # write_atomic's temporary names of those
LOCK_FILE = ".train_gpt2.lock"  # in --out-dir while a run holds it; its text names that run's process


def checkpoint_path(out_dir, step):
    """The name the checkpoint of `step` steps done is written under."""
    return os.path.join(out_dir, f"ckpt_{step:06d}.pt")


def meta_path(path):
    """The name of the meta beside checkpoint path (ckpt_000009.pt: meta_000009.json)."""
    return os.path.join(os.path.dirname(path), f"meta_{step_of_name(path):06d}.json")


def run_of(path):
    """The run id checkpoint path's meta names, read without opening the checkpoint; None where it has
    no meta that reads (a copy of the checkpoint alone)."""
    try:
        with open(meta_path(path), encoding="utf-8") as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def log_path(out_dir):
    """The run's log: one JSON record a line (support.run_log)."""
    return os.path.join(out_dir, "log.jsonl")


def step_of_name(path):
    """The step a checkpoint's file name says (ckpt_000009.pt: 9), None for another name."""
    match = CHECKPOINT_NAME.fullmatch(os.path.basename(path))
    return int(match[1]) if match else None


def checkpoint_paths(out_dir):
    """The checkpoints in out_dir (by name), newest (most steps) first."""
    if not os.path.isdir(out_dir):
        return []
    found = [(step, name) for name in os.listdir(out_dir) if (step := step_of_name(name)) is not None]
    return [os.path.join(out_dir, name) for _, name in sorted(found, reverse=True)]


def checkpoints_near(path):
    """For a checkpoint or run's folder named that does not exist (a step or a folder mistyped): the
    nearest folder that does and the checkpoints in it, as the end of a line."""
    folder = existing_part(path)
    if not os.path.isdir(folder):
        return f": {folder} is a file, not a folder"
    found = [os.path.basename(p) for p in checkpoint_paths(folder)]
    held = ", ".join(found[:3]) + (" ..." if len(found) > 3 else "") if found else "no checkpoint (ckpt_*.pt)"
    return f"; {folder} holds {held}"


def free_name(path, tag):
    """A name beside path that nothing holds, to set path aside to: path.TAG, then path.TAG1, ..."""
    aside, n = f"{path}.{tag}", 1
    while os.path.lexists(aside):
        aside, n = f"{path}.{tag}{n}", n + 1
    return aside


ZIP = b"PK\x03\x04"  # how torch.save's zip begins


def head(path):
    """The first 4 bytes of the file at path (ZIP for a checkpoint); b"" if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError:
        return b""


# ----------------------------------------------------------------------------------------------
# What stands at a name the run writes, checked at start


def check_names_at_start(out_dir, records):
    """At start, with the folder held: what a user put at a name the run writes is never written
    over. A file at a checkpoint's name that is no zip as torch.save writes (a user's text: no run
    to continue), and a log.jsonl that does not begin with a run's header (the user's, or a damaged
    one: this run's records would follow steps of no known run), are refused, each named with the
    `mv` that sets it aside. records: the log's."""
    log, what = log_path(out_dir), "is no checkpoint of train_gpt2.py (not the zip torch.save writes)"
    found = [(p, what) for p in checkpoint_paths(out_dir) if head(p) != ZIP]
    if head(log) and (records or [{}])[0].get("event") != "header":
        found.append((log, "is not this run's (its first line is not a run's header)"))
    if found:
        path, what = found[0]
        raise UserError(
            f"{path} {what}, and this run writes a file by that name: move it aside "
            f"(mv {shlex.quote(path)} {shlex.quote(free_name(path, 'aside'))}), then run the same command again"
        )


# ----------------------------------------------------------------------------------------------
# Whose a file is: decided here, at the claim, by the log's records and the metas


def log_runs(records):
    """The ids of the runs a log.jsonl's records (support.files.log_records) record a trained or
    skipped step of, in order. A start that failed before its first step (its header, perhaps a
    step-0 eval) is no run."""
    runs, current = [], None
    for record in records:
        if record.get("event") == "header":
            current = record.get("run_id")
        elif any(key in record for key in ("train_loss", "skipped", "scaler_skipped")) and current not in runs:
            runs.append(current)
    return runs


def newest_of_its_run(out_dir, records, load, then):
    """(path, checkpoint) of the newest checkpoint in out_dir that its meta says is of the folder's run
    (the last run its log's records record steps of; without one, any run's) and that loads
    (load(path)): only those are opened. One with no meta (a copy) is of no known run, passed over as
    another run's is, each said in one warning line naming it and why. (None, None) for a folder with
    no checkpoint; with checkpoints but none of these, refused in one line (then: what to do instead)."""
    paths, run = checkpoint_paths(out_dir), (log_runs(records) or [None])[-1]
    for path in paths:
        held = run_of(path)
        if run is None or held == run:
            try:
                return path, load(path)
            except UserError as e:
                why = str(e)
        else:
            why = f"it holds run {held}" if held else f"it has no {os.path.basename(meta_path(path))} (a copy?)"
            why += f", not this folder's run {run} (which its log.jsonl records)"
        print(f"warning: skipping {path}: {why}", file=sys.stderr)
    if paths:
        raise UserError(
            f"none of the {len(paths)} checkpoints in {out_dir} can be used (see the warnings above): {then}"
        )
    return None, None


# ----------------------------------------------------------------------------------------------
# One run per folder: the claim at start (given back at the end), and what --resume continues


def claim_out_dir(out_dir, resume, on_exit, dry_run=False):
    """An out-dir belongs to one run, decided here, once, by rank 0 at start: it is locked for the run
    (support.files.lock_folder), given back as on_exit (the run's ExitStack) closes; a new run or
    --resume CKPT next to another run's files is refused (check_owner); what --resume continues
    ("latest" or a checkpoint's path) is picked, and the checkpoints not of its line set aside
    (set_aside). Returns (the records of its log.jsonl, read here, once; the checkpoint's path; the
    checkpoint; the paths set_aside moved checkpoints to), (records, None, None, []) for a new run. A run
    killed before its first checkpoint starts anew: ([], None, {"train_config": its flags, from its log's
    header}, []). A dry run makes, writes, renames and removes nothing: it checks the folder as it
    finds it (or none), and is refused where the real run would be."""
    if not out_dir:
        raise UserError(
            "--out-dir '' names no folder: pass the folder for the run's log and checkpoints (--out-dir log)"
        )
    check_folder(out_dir, "--out-dir")
    note = " (rank 0 of a torchrun job)" if "RANK" in os.environ else ""  # the lock's text: rank 0 holds it for the job
    try:  # a dry run too: refused where the real run would be
        on_exit.callback(unlock_folder, lock_folder(out_dir, LOCK_FILE, "run", note, dry_run))
    except OSError as e:
        raise UserError(f"cannot create or open --out-dir {out_dir}: {e.strerror}") from None
    if os.path.isdir(out_dir) and not os.access(out_dir, os.W_OK):  # refused now, not after the whole start-up
        ckpt = resume if resume != "latest" else next(iter(checkpoint_paths(out_dir)), None)  # what it would resume
        fix = f"continue the run elsewhere with --resume {ckpt} --out-dir NEW_DIR" if ckpt else "pass another --out-dir"
        raise UserError(f"--out-dir {out_dir} is read-only or another user's: make it writable, or {fix}")
    records = list(log_records(log_path(out_dir)))  # with the folder held: no other run changes it meanwhile
    check_names_at_start(out_dir, records)
    path, ckpt = None, None
    if resume == "latest":
        then = "to continue another run from one of them, pass it as --resume CKPT with a new --out-dir"
        path, ckpt = newest_of_its_run(out_dir, records, load_training_checkpoint, then)
        log = log_path(out_dir)
        if path is None and (runs := log_runs(records)):
            # killed before its first checkpoint: nothing to continue, so the same command starts it
            # anew with its flags (a spot script that repeats --resume goes on); its log is kept aside
            aside, run = free_name(log, runs[-1]), runs[-1]
            header = next(r for r in records if r.get("event") == "header" and r.get("run_id") == run)
            ckpt, records = {"train_config": header.get("config", {})}, []  # records: of the log set aside
            if not dry_run:
                os.rename(log, aside)
            said = f"would be set aside as {aside} (not in a dry run)" if dry_run else f"is now {aside}"
            print(f"note: run {run} stopped before its first checkpoint: it starts anew with its flags; its log {said}")
        elif path is None:
            print(f"no checkpoint in {out_dir} to resume from: starting a new run")
    elif resume:
        if not os.path.exists(resume):
            raise UserError(
                f"--resume {resume} does not exist{checkpoints_near(resume)}: pass a checkpoint or a run's folder"
            )
        path, ckpt = resume, load_training_checkpoint(resume)
    if resume != "latest":  # a new run's folder, or the one --resume CKPT continues in: no other run's
        check_owner(out_dir, records, path, ckpt)
    for name in [] if dry_run else [n for n in os.listdir(out_dir) if UNFINISHED.fullmatch(n)]:
        print(f"removing the unfinished {name}")  # a checkpoint write of this run cut short by a kill
        os.remove(os.path.join(out_dir, name))  # the folder is writable: checked above
    moved = set_aside(out_dir, path, ckpt["step"], ckpt.get("run_id"), dry_run) if path is not None else []
    return records, path, ckpt, moved


def set_aside(out_dir, path, step, run_id, dry_run):
    """--resume of path (of run run_id, at step) continues a line of the run in out_dir: the checkpoints
    there not of that line (from its step on; not of run_id by their meta; all of them for a path from
    another folder) move, each with its meta, into out_dir/aside_<n>/, where no pick, prune or write
    reaches them, said in one line. After that the folder holds the line's checkpoints alone: pruning
    trusts it. Returns where they now are, as paths in out_dir (aside_1/ckpt_000009.pt), for the log."""
    here, start = os.path.realpath(os.path.dirname(path) or ".") == os.path.realpath(out_dir), os.path.realpath(path)
    passed = [
        p
        for p in checkpoint_paths(out_dir)
        if (step_of_name(p) >= step or not here or run_of(p) != run_id) and os.path.realpath(p) != start
    ]
    if not passed:
        return []
    n = 1
    while os.path.lexists(aside := os.path.join(out_dir, f"aside_{n}")):
        n += 1
    moved = [os.path.join(aside, os.path.basename(p)) for p in reversed(passed)]  # oldest first
    names = os.path.basename(moved[0]) + (f" .. {os.path.basename(moved[-1])}" if len(moved) > 1 else "")
    print(
        f"note: --resume {path} starts a new line of the run at step {step}: the checkpoints it passes "
        f"over ({names}) {'would be set aside in' if dry_run else 'are now in'} {aside}/, out of reach of "
        f"--resume, pruning and new checkpoints{' (not in a dry run)' if dry_run else ''}"
    )
    if dry_run:
        return []
    os.mkdir(aside)
    for old, new in zip(reversed(passed), moved, strict=True):
        os.rename(old, new)
        with contextlib.suppress(FileNotFoundError):  # one with no meta: none to move
            os.rename(meta_path(old), meta_path(new))
    return [os.path.relpath(p, out_dir) for p in moved]


def check_owner(out_dir, records, path, ckpt):
    """A new run (path None) or --resume CKPT (path, its checkpoint ckpt) into an --out-dir holding
    another run's files is refused before anything is written: its checkpoints would be overwritten or
    pruned, its log mixed with this run's. Another run's: a checkpoint whose meta names another run or
    none (a copy), and a log.jsonl recording another run's steps. A folder new to the run is fine, and said."""
    run_id, folder = (ckpt.get("run_id", path), os.path.dirname(path) or ".") if path else (None, out_dir)
    theirs = [os.path.basename(log_path(out_dir))] if any(r != run_id for r in log_runs(records)) else []
    for p in checkpoint_paths(out_dir):
        if run_id is None or run_of(p) != run_id and os.path.realpath(p) != os.path.realpath(path):
            theirs.append(os.path.basename(p))
    elsewhere = os.path.realpath(folder) != os.path.realpath(out_dir)
    if theirs:
        fix = f", or --out-dir {folder} (the run's own folder)" if elsewhere else ""
        fix = ", or continue it with --resume" if path is None else fix
        more = f" and {len(theirs) - 3} more" if len(theirs) > 3 else ""
        raise UserError(
            (f"--resume {path} continues run {run_id}, but " if path else "")
            + f"--out-dir {out_dir} holds another run ({', '.join(theirs[:3])}{more}): its checkpoints would be "
            f"overwritten and its log mixed with this run's; pass a new or empty --out-dir{fix}"
        )
    if elsewhere and not checkpoint_paths(out_dir):
        print(
            f"note: run {run_id} continues from {path} in --out-dir {out_dir}; its log and checkpoints up to "
            f"step {ckpt.get('step')} stay in {folder}"
        )


# ----------------------------------------------------------------------------------------------
# The checkpoint's write, and pruning


def save_checkpoint(ckpt, out_dir, keep, trained):
    """Write meta_<step>.json, then ckpt_<step>.pt, each atomically (a kill mid-write never leaves a
    half file under the real name, and a checkpoint under its name always has its meta), then prune to
    the newest `keep`. What stands at the name was checked at start to be a checkpoint (check_names_at_start)."""
    path = checkpoint_path(out_dir, ckpt["step"])
    meta = {"run_id": ckpt["run_id"], "step": ckpt["step"], "train_config": ckpt["train_config"]}
    try:
        write_atomic(meta_path(path), lambda f: json.dump(meta, f, indent=1), mode="w")
        write_atomic(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as e:
        cause = e if isinstance(e, OSError) else e.__context__  # torch.save wraps a failed write, and a stop signal
        if isinstance(cause, KeyboardInterrupt):
            raise cause from None
        if not isinstance(cause, OSError):
            raise  # not the disk: a bug, keep its traceback
        if not os.path.exists(path):  # the meta of a checkpoint not written (not of one rewritten in place)
            with contextlib.suppress(OSError):
                os.remove(meta_path(path))
        earlier = next((p for p in checkpoint_paths(out_dir) if p != path), None)
        anew = f"start the run again in a new --out-dir (no earlier checkpoint is in {out_dir})"
        then = f"continue with --resume (from {earlier}, intact)" if earlier else anew
        raise disk_error(cause, f"checkpoint {path}", then) from None
    prune(out_dir, keep, trained, ckpt["run_id"])
    print(f"wrote {path}")
    return path


def known_good(out_dir, trained):
    """out_dir's checkpoints whose weights are known good, newest first: checkpoint N holds the weights
    step N trains from, good when trained[N] (support.divergence.note_trained), not if skipped or untrained."""
    return [path for path in checkpoint_paths(out_dir) if trained.get(step_of_name(path), False)]


def prune(out_dir, keep, trained, run_id):
    """Delete the checkpoints in out_dir beyond the newest `keep` (0: none), each with its meta: the
    folder holds this run's line alone (the claim saw to it), and a file put there since
    is kept unless its meta names run_id (read, never the checkpoint). The newest known good one
    (trained: the run log's, known_good) stays too while none of the newest `keep` is known good yet
    (until a newer one has trained): after a divergence, diverged_advice sends the user to it."""
    found = checkpoint_paths(out_dir)
    if keep <= 0 or len(found) <= keep:
        return
    good = known_good(out_dir, trained)
    kept = [path for path in found[:keep] if path in good] or good[:1]
    for old in found[keep:]:
        if old not in kept and run_of(old) == run_id:
            os.remove(old)  # the checkpoint first: a kill between the two leaves a meta of no checkpoint, harmless
            with contextlib.suppress(FileNotFoundError):
                os.remove(meta_path(old))

"""The run's folder and who owns it: one run per --out-dir, locked while it trains, what it holds
(its checkpoints by name, the runs its log records), and a start that fails leaves the folder as it
found it."""

import json
import os
import re
import shlex
import sys

from support import file_lock
from support.cli import UserError
from support.files import disk_error, no_follow, refuse_link
from support.shards import SHARD_NAME


def checkpoint_paths(out_dir):
    """The ckpt_NNNNNN.pt files in out_dir, newest (most steps) first."""
    if not os.path.isdir(out_dir):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(out_dir) if (m := re.fullmatch(r"ckpt_(\d+)\.pt", n))]
    return [os.path.join(out_dir, n) for _, n in sorted(found, reverse=True)]


def checkpoint_path(out_dir, step):
    """The name the checkpoint of `step` steps done is written under."""
    return os.path.join(out_dir, f"ckpt_{step:06d}.pt")


def step_of_name(path):
    """The step a checkpoint's file name says (ckpt_000009.pt: 9), None for another name."""
    m = re.fullmatch(r"ckpt_(\d+)\.pt", os.path.basename(path))
    return int(m.group(1)) if m else None


def aside_name(path, tag):
    """A name not taken beside path, path.TAG (then path.TAG1, ...): where an `mv` the user is
    told to run sets a file aside without overwriting anything."""
    aside, n = f"{path}.{tag}", 1
    while os.path.lexists(aside):
        aside, n = f"{path}.{tag}{n}", n + 1
    return aside


def move_aside(path, tag):
    """The `mv` command that sets path aside to a name not taken (aside_name), quoted for the shell."""
    return f"mv {shlex.quote(path)} {shlex.quote(aside_name(path, tag))}"


def unfinished_write(path):
    """Whether the file at a checkpoint's temporary name is what a write of this program cut short
    leaves there: empty, or the beginning of the zip torch.save writes (a regular file)."""
    try:
        if not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return b"PK\x03\x04".startswith(head)


def missing_folders(path):
    """The folders of path that do not exist yet, deepest first: those os.makedirs would create."""
    path, missing = os.path.abspath(path), []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


LOCK_FILE = ".train_gpt2.lock"  # in --out-dir while a run holds it; its text names that run's process


_claim = {}  # this process's hold on its --out-dir (claim_out_dir), given back by release_out_dir


def claim_out_dir(out_dir, resume):
    """An out-dir belongs to one run: a new run next to another run's checkpoints would have them
    pruned instead of its own and its log drawn as one curve with theirs, so it is refused. The
    folder is locked for this process's life (lock_out_dir), and what it holds is noted, so that a
    start that fails leaves it as it was (release_out_dir). Rank 0 alone claims it."""
    check_not_data_folder(out_dir, f"--out-dir {out_dir}")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create --out-dir {out_dir}: {e.strerror}") from None
    if _claim:  # an earlier run of this process that did not end through main: its hold goes first
        release_out_dir()
    check_no_links(out_dir)
    fd = lock_out_dir(out_dir, "continue with --resume" if resume else "start again")
    log = os.path.join(out_dir, "log.jsonl")
    _claim.update(out_dir=out_dir, fd=fd, log=os.path.getsize(log) if os.path.isfile(log) else None)
    _claim.update(checkpoints=_file_stats(checkpoint_paths(out_dir)))
    names = os.listdir(out_dir)
    theirs = sorted(n for n in names if re.fullmatch(r"ckpt_\d+\.pt", n))
    check_log_header(log)
    runs, unreadable = log_runs(log)
    if os.path.lexists(log) and (theirs or runs or unreadable):
        theirs = sorted([*theirs, "log.jsonl"])
    if theirs and not resume:
        raise UserError(
            f"--out-dir {out_dir} holds another run ({', '.join(theirs[:3])}): continue it with --resume, "
            f"or pass a new --out-dir"
        )
    if os.path.lexists(log) and "log.jsonl" not in theirs:
        print(f"note: {log} holds only the start of a run that never trained a step: this run's records follow it")
    for name in names:  # a checkpoint write of this run cut short by a kill: never complete
        if re.fullmatch(r"\.ckpt_\d+\.pt\.tmp", name):
            path = os.path.join(out_dir, name)
            if not unfinished_write(path):  # not what a write of ours leaves: someone's file, kept
                raise UserError(
                    f"{path} is not a checkpoint write of train_gpt2.py's cut short (not the start of torch.save's "
                    f"zip), and this run writes its checkpoints through that name: move it aside "
                    f"({move_aside(path, 'aside')}), then run the same command again"
                )
            print(f"removing the unfinished {name}")
            try:
                os.remove(os.path.join(out_dir, name))
            except OSError as e:  # a read-only folder: the run could write nothing there either
                raise disk_error(e, f"to --out-dir {out_dir} (removing {name})", "continue with --resume") from None


WRITTEN_NAMES = re.compile(r"log\.jsonl|ckpt_\d+\.pt|\.ckpt_\d+\.pt\.tmp")  # besides LOCK_FILE: lock_out_dir's


def check_no_links(out_dir):
    """Before anything is written: no name this run writes (or removes, as a killed write's
    temporary file) in out_dir is a symbolic link, a checkpoint's name of a later step included, for
    the log would be appended to the file a link names, outside the folder, and a checkpoint's
    rename would delete a link the run did not make (support.files.LinkedName, one line)."""
    for name in sorted(os.listdir(out_dir)):
        if WRITTEN_NAMES.fullmatch(name):
            refuse_link(os.path.join(out_dir, name))


def run_header(line):
    """The run's header record a log.jsonl line holds (a dict with "event": "header"), else None."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("event") == "header" else None


def check_log_header(log):
    """A log.jsonl whose first line is not a run's header (cut short, garbage, blank, no run_id)
    while later lines record steps would have this run's records appended after steps of no known
    run (two runs in one log, play.ipynb drawing "run None"): refused in one line naming the `mv`
    that sets it aside. A log of a header alone, or no step, is left to claim_out_dir."""
    try:
        with open(log, "rb") as f:
            first, _, rest = f.read().partition(b"\n")
    except OSError:  # none, a folder, unreadable: claim_out_dir's to judge
        return
    if (run_header(first) or {}).get("run_id"):
        return
    if not any(_is_step_record(line) for line in rest.split(b"\n")):
        return
    raise UserError(
        f"{log}: its first line is not a run's header (damaged?): move it aside "
        f"({move_aside(log, 'bad')}) and continue with --resume, or pass a new --out-dir"
    )


def data_files(folder):
    """The token shards and fineweb.py manifests (and journals) in folder: what makes it a data folder."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [n for n in names if SHARD_NAME.fullmatch(n) or re.fullmatch(r"\.?.+_manifest\.(json|journal)", n)]


def check_not_data_folder(folder, said):
    """A data folder is never a run's folder: a run's log, lock and checkpoints written among the
    shards (or a data folder pruned as a run's) mix the two. said: the flag and folder, as given."""
    found = data_files(folder)
    if found:
        raise UserError(
            f"{said} holds token shards or a fineweb manifest ({', '.join(found[:2])}): a data folder is never a "
            f"run's: pass it as --data-dir, and another --out-dir for the run"
        )


def data_dir_problem(data_dir, out_dir):
    """A run's folder is never a data folder: --data-dir the --out-dir, or a folder that holds a
    run's checkpoints or log, is refused (check_args), before anything is written. None if fine."""
    if os.path.realpath(data_dir) == os.path.realpath(out_dir):
        return (
            f"--data-dir and --out-dir are the same folder {data_dir}: a data folder is never a run's folder: "
            f"pass another --out-dir for the run"
        )
    found = [os.path.basename(p) for p in checkpoint_paths(data_dir)[:2]]
    if os.path.lexists(os.path.join(data_dir, "log.jsonl")):
        found.append("log.jsonl")
    if found:
        return (
            f"--data-dir {data_dir} holds a run's files ({', '.join(found)}): a run's folder is not a data folder: "
            f"move the shards to a folder of their own and pass it as --data-dir"
        )
    return None


def lock_out_dir(out_dir, then):
    """Hold an exclusive lock on out_dir while this process lives: support.file_lock.lock_folder on
    its LOCK_FILE, with flock (or msvcrt.locking on Windows), which the OS releases when the process
    ends, a SIGKILL included (no stale lock to remove by hand); where neither exists, the file itself
    is the lock (support.file_lock.acquire). A second run into the folder, new or --resume, is
    refused in one line naming the process that holds it (the file's text); so is a symbolic link at
    the lock file's name, never followed. Returns the locked file's descriptor; None where the file
    system has no locks (said in a warning)."""
    try:
        return file_lock.lock_folder(out_dir, LOCK_FILE, _holder_note())
    except file_lock.Held as e:
        holder = e.holder or "a process that is just starting"
        fix = f" ({e.fix})" if e.fix else ""
        raise UserError(
            f"--out-dir {out_dir} is in use by another run ({holder}): wait for it to end, or pass another "
            f"--out-dir{fix}"
        ) from None
    except file_lock.Symlink as e:
        raise UserError(
            f"--out-dir {out_dir}: {e}, where train_gpt2.py keeps its lock file; a lock file is never written "
            f"through a link: remove the link (not what it points to), then {then}"
        ) from None
    except file_lock.NoLocks as e:
        print(
            f"warning: cannot lock --out-dir {out_dir} ({e}): a second run started into it would not be stopped",
            file=sys.stderr,
        )
        return None
    except OSError as e:
        if os.path.isdir(os.path.join(out_dir, LOCK_FILE)):  # not the disk: a folder stands where the lock file goes
            raise UserError(
                f"--out-dir {out_dir} holds a folder named {LOCK_FILE}, where train_gpt2.py keeps its lock "
                f"file: rename or remove that folder, then {then}"
            ) from None
        raise disk_error(e, f"to --out-dir {out_dir} (its lock file {LOCK_FILE})", then) from None


def _holder_note():
    """What the lock file's text adds after the pid: under torchrun, that rank 0 holds it for the job."""
    return " (rank 0 of a torchrun job)" if "RANK" in os.environ else ""


def check_out_dir_held():
    """Before every checkpoint and log record this process writes to its --out-dir: the folder must
    still be this run's (support.file_lock.keep_folder: LOCK_FILE must be the file this process
    locked, same device and inode, for a user can delete it, a "stale lock" habit from other tools,
    or replace it, and a second run would then lock a new file and write beside this one). If it is
    gone or another that no one holds, it is locked again and the run goes on, said in a warning
    (stopping would throw away the steps since the last checkpoint for nothing); if another run
    holds it now (or it cannot be locked again), this run stops in one line and writes nothing more
    there, leaving that run's lock and records alone (release_out_dir)."""
    fd = _claim.get("fd")
    if fd is None or _claim.get("lost"):
        return
    out_dir = _claim["out_dir"]
    path = os.path.join(out_dir, LOCK_FILE)
    why = "leave it in place: it is no stale lock, the OS frees it when its run ends"
    try:
        new = file_lock.keep_folder(fd, out_dir, LOCK_FILE, _holder_note())
    except (file_lock.Held, file_lock.Symlink, file_lock.NoLocks, OSError) as e:
        _claim["lost"] = True
        if isinstance(e, file_lock.Held):
            now = f"another run holds it now ({e.holder or 'a process that is just starting'})"
        else:
            now = f"it cannot be locked again ({getattr(e, 'strerror', None) or e})"
        raise UserError(
            f"{path} was deleted or replaced while this run trained, and {now}: this run stops here and writes "
            f"nothing more to {out_dir}, so that one run alone writes there ({why})"
        ) from None
    if new != fd:
        _claim["fd"] = new
        print(f"warning: {path} was deleted while this run trained: locked again ({why})", file=sys.stderr, flush=True)


def release_out_dir():
    """As the process ends (train_gpt2.main's finally): a start that failed (an exception on its
    way out) before its first step and before any checkpoint leaves the folder as it found it:
    the log records it added are cut off again (the log removed, if it made it), so that the same
    command retried does not find "another run" there. Then the lock is given back: its file is
    removed only if it is still the one this process locked (a user may have deleted it and
    another run made its own). A run that lost its folder to another (check_out_dir_held) touches
    nothing there."""
    claim = dict(_claim)
    _claim.clear()
    if not claim:
        return
    try:
        if sys.exc_info()[0] is not None and not claim.get("lost"):
            undo_failed_start(claim)
    finally:
        if claim["fd"] is not None:
            file_lock.unlock_folder(claim["fd"], claim["out_dir"], LOCK_FILE)


def undo_failed_start(claim):
    """Cut log.jsonl back to what it held at claim_out_dir, unless the run logged a step or wrote a
    checkpoint since (then there is a run to continue)."""
    out_dir, before = claim["out_dir"], claim["log"]
    log = os.path.join(out_dir, "log.jsonl")
    if _file_stats(checkpoint_paths(out_dir)) != claim["checkpoints"] or not os.path.isfile(log):
        return
    try:
        with open(log, "rb+", opener=no_follow) as f:  # a link put at its name is not this run's log
            f.seek(before or 0)
            added = [line for line in f.read().split(b"\n") if line.strip()]
            if any(_is_step_record(line) for line in added):
                return
            if before is not None:
                f.truncate(before)
        if before is None:
            os.remove(log)
    except (OSError, UserError):
        pass  # a read-only or vanished folder: nothing this run could have changed either


def _file_stats(paths):
    """{path: (inode, size, mtime)}: a file written since is told apart from one that was there."""
    stats = {}
    for path in paths:
        try:
            st = os.stat(path)
            stats[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            pass
    return stats


def _is_step_record(line):
    """Whether a line of log.jsonl records a step: trained, skipped, or skipped by fp16's loss scaler."""
    return any(key in line for key in (b'"train_loss"', b'"skipped"', b'"scaler_skipped"'))


def log_runs(path):
    """(the ids of the runs log.jsonl records a trained or skipped step of, in order; whether it
    holds a line that is not a record of ours). A start that failed before its first step (its
    header, perhaps a step-0 eval) is no run. A line cut short (by a kill, a full disk, a log cut in
    place) after a record of ours is passed over where it is the last line or the next is a run's
    header: the start, or the reopen, that ended it on its own line (RunLog.open)."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return [], False
    except OSError:  # a folder named log.jsonl, an unreadable file: someone's
        return [], True
    runs, current, records, cut = [], None, 0, False
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if not (line.startswith(b"{") and line.endswith(b"}")):
            if not records or cut:
                return runs, True
            cut = True  # ours cut short, if the last line or a header follows
            continue
        if cut and b'"header"' not in line:
            return runs, True
        records, cut = records + 1, False
        if b'"header"' in line:
            try:
                record = json.loads(line)
            except ValueError:
                return runs, True
            if isinstance(record, dict) and record.get("event") == "header":
                current = record.get("run_id")
                continue
        if _is_step_record(line) and current not in runs:
            runs.append(current)
    return runs, False


def remove_made_folders(made):
    """Remove the folders a refused start created (missing_folders' list), while still empty: a
    typo'd flag leaves no empty --out-dir behind, and a folder the run wrote to stays."""
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:
            break

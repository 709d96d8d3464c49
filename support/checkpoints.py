"""Checkpoint files as plain dicts: a run's training state written atomically, pruned to this run's
newest few (keeping one known good), loaded without running code, the random-number state they
carry, and which files in a run's folder are the run's own (to write over, to resume from)."""

import os
import pickle
import random
import re
import sys
import zipfile

import numpy as np
import torch
import torch.distributed as dist

from support.common import UserError, disk_error, first_line, refuse_link, write_atomic
from support.ddp import fence
from support.divergence import check_finite_state, checkpoint_health
from support.out_dir import (
    check_out_dir_held,
    checkpoint_path,
    checkpoint_paths,
    log_runs,
    move_aside,
    run_header,
    step_of_name,
)
from support.out_of_memory import oom_phase
from support.signals import StopRequest


def checkpoint_header(path):
    """A checkpoint's dict with its tensors mapped, not read (mmap reads only the small pickled
    part): its run_id and step, cheaply. None if it cannot be read as a checkpoint."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return ckpt if isinstance(ckpt, dict) else None


def run_id_of(path):
    """The run a checkpoint belongs to (None if it cannot be read)."""
    return (checkpoint_header(path) or {}).get("run_id")


# ----------------------------------------------------------------------------------------------
# Whose a file is: a run writes only over its own files, and resumes only from its own folder's


def not_this_runs(path, run_id, step=None):
    """Why the file at path, a name this run writes (the checkpoint of `step`, or with step None
    the log), is not this run's own and must not be overwritten; None if it is, or if nothing is
    there. A checkpoint is this run's when it loads (its pickled part) and holds run_id and the
    step its name says; the log, when it begins with a run's header (or is empty). run_id None:
    a new run, whose id no file holds yet. A symbolic link there is refused (LinkedName): it is
    neither read through nor replaced."""
    refuse_link(path)
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path):
        return "it is not a file"
    if step is None:
        with open(path, "rb") as f:
            first = f.readline()
        return None if not first or run_header(first) else "its first line is not a run's header"
    held = checkpoint_header(path)
    if held is None or "step" not in held:
        if damaged_of_run(path, run_id):  # this run's own, damaged on disk or cut short in a copy
            return None
        return "it is not a checkpoint train_gpt2.py can load: truncated, corrupt or another program's"
    if held.get("run_id") != run_id:
        return f"it holds run {held.get('run_id')}" + (f", not this run's {run_id}" if run_id else "")
    if held["step"] != step:
        return f"it holds step {held['step']}, not the {step} its name says"
    return None


def damaged_of_run(path, run_id):
    """Whether a checkpoint that does not load is still recognisably run_id's: torch.save's zip
    writes the pickled part (data.pkl, which holds the run id as its text) first, so a file cut
    short or damaged past it still begins with the zip and names the run in its first MiB. A run
    id is random: no file of anyone else's holds it."""
    if not run_id:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(2**20)
    except OSError:
        return False
    return head.startswith(b"PK\x03\x04") and run_id.encode() in head


def check_names_to_write(out_dir, run_id, steps):
    """Before step 0: each file at a name this run may write, its log.jsonl and the checkpoint of
    each of `steps` (a signal checkpoints whichever step it comes at), is this run's own
    (not_this_runs); the first that is not stops the run in one line naming it and the `mv` that
    sets it aside."""
    log = os.path.join(out_dir, "log.jsonl")
    targets = [(log, None)] + [
        (path, step) for path in checkpoint_paths(out_dir) if (step := step_of_name(path)) in steps
    ]
    for path, step in targets:
        if step is not None and path != checkpoint_path(out_dir, step):
            continue  # ckpt_9.pt: not a name this run writes
        why = not_this_runs(path, run_id, step)
        if why:
            what = "appends its records" if step is None else f"may write its step {step} checkpoint"
            raise UserError(
                f"{path} is not this run's ({why}), and this run {what} there: move it aside "
                f"({move_aside(path, 'aside')}), then run the same command again"
            )


def folder_run(out_dir):
    """The run out_dir belongs to and what says so: the last run its log.jsonl records steps of;
    with none, the one run its readable checkpoints hold; (None, None) with neither. A folder with
    no log whose checkpoints hold two runs is refused in one line naming both."""
    runs, _ = log_runs(os.path.join(out_dir, "log.jsonl"))
    if runs and runs[-1] is not None:
        return runs[-1], "its log.jsonl"
    held = {}  # run id -> its newest checkpoint here
    for path in checkpoint_paths(out_dir):
        run_id = run_id_of(path)
        if run_id is not None:
            held.setdefault(run_id, path)
    if len(held) > 1:
        (a, pa), (b, pb) = list(held.items())[:2]
        raise UserError(
            f"{out_dir} holds checkpoints of two runs and no log.jsonl to say which run the folder is ({pa}: run "
            f"{a}; {pb}: run {b}): move one run's checkpoints to a folder of their own, then run the same command again"
        )
    return next(iter(held), None), "its checkpoints"


def newest_of_its_run(out_dir, load, then):
    """(path, checkpoint) of the newest checkpoint in out_dir that loads (load(path)), holds the
    folder's run (folder_run) and the step its name says; each one passed over is said in one
    warning line naming the file and why. (None, None) for a folder with no checkpoint; with
    checkpoints but none of these, refused in one line (then: what to do instead, where another
    run's or a misnamed one was passed over)."""
    paths = checkpoint_paths(out_dir)
    if not paths:
        return None, None
    run, said_by = folder_run(out_dir)
    others = False
    for path in paths:
        try:
            ckpt = load(path)
        except UserError as e:
            print(f"warning: skipping {path}: {e}", file=sys.stderr)
            continue
        held_run = ckpt.get("run_id")
        if run is not None and held_run is not None and held_run != run:  # one with no run_id: of no other run
            why = f"it holds run {held_run}, not this folder's run {run} (which {said_by} records)"
        elif ckpt.get("step") != step_of_name(path):
            why = f"it holds step {ckpt.get('step')}, not the {step_of_name(path)} its name says"
        else:
            return path, ckpt
        print(f"warning: skipping {path}: {why}", file=sys.stderr)
        others = True
    message = f"none of the {len(paths)} checkpoints in {out_dir} can be loaded: see the warnings above"
    if others:
        message = (
            f"none of the {len(paths)} checkpoints in {out_dir} is one of the folder's run that loads and holds the "
            f"step its name says: see the warnings above; {then}"
        )
    raise UserError(message)


def save_checkpoint(ckpt, out_dir, keep):
    """Write ckpt_<step>.pt atomically (a kill mid-write never leaves a half checkpoint under the
    real name), then delete this run's checkpoints beyond the newest `keep`: another run's
    files are never touched, nor a symbolic link at a checkpoint's name (write_atomic refuses one
    at the name it writes)."""
    check_out_dir_held()  # the folder is still this run's (its lock file deleted: locked again, or stop)
    path = checkpoint_path(out_dir, ckpt["step"])
    # a file put at this name since the start's check (check_names_to_write) is kept, not replaced:
    # one lstat, and a read of the pickled part only when a file is there (the run's own, rewritten
    # when a signal comes at the step it resumed from)
    why = not_this_runs(path, ckpt["run_id"], ckpt["step"])
    if why:
        earlier = [p for p in checkpoint_paths(out_dir) if p != path and run_id_of(p) == ckpt["run_id"]]
        then = f"continue with --resume (from {earlier[0]})" if earlier else "start again with --resume"
        raise UserError(
            f"{path} was put there while this run trained and is not this run's ({why}): it stays as it is and "
            f"this run stops without its step {ckpt['step']} checkpoint: move it aside "
            f"({move_aside(path, 'aside')}), then {then}"
        )
    try:
        write_atomic(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as e:
        cause = e if isinstance(e, OSError) else e.__context__  # torch.save wraps a failed write
        if not isinstance(cause, OSError):
            raise  # not the disk: a bug, keep its traceback
        earlier = [p for p in checkpoint_paths(out_dir) if p != path]
        then = (
            f"continue with --resume (from {earlier[0]}, intact)"
            if earlier
            else "start again with --resume (no checkpoint was written before this one)"
        )
        raise disk_error(cause, f"checkpoint {path}", then) from None
    if keep > 0 and len(found := checkpoint_paths(out_dir)) > keep:
        # the newest known good one stays too while none of the newest `keep` is known good yet (one
        # more file, until a newer one has trained): after a divergence, diverged_advice sends the
        # user to it
        health = checkpoint_health(out_dir)
        kept = [path for path, good in health[:keep] if good] or [path for path, good in health if good][:1]
        for old in found[keep:]:
            if old not in kept and not os.path.islink(old) and run_id_of(old) == ckpt["run_id"]:
                try:
                    os.remove(old)  # a link at its name is no file this run wrote: kept
                except OSError as e:  # another user's file in a shared (sticky) folder: kept, the run goes on
                    print(f"warning: could not remove {old} ({e.strerror}): kept", file=sys.stderr, flush=True)
    return path


def save_training_state(ckpt, out_dir, keep, master_process, ddp):
    """Every rank calls it; rank 0 writes ckpt, the training state as one plain dict (train_gpt2.py
    gathers it where it checkpoints), to out_dir (save_checkpoint: atomic, pruned to this run's
    newest `keep`) while the other ranks wait in the fence, not in a collective that times out.
    Weights or a val loss that are not finite are never saved (check_finite_state). Returns the
    path written on rank 0, else None."""
    oom_phase("writing the checkpoint", step=ckpt["step"], out_dir=out_dir)
    check_finite_state(ckpt, out_dir)
    path = None
    with StopRequest.during_write(checkpoint_path(out_dir, ckpt["step"]), say=master_process):
        if master_process:
            try:
                path = save_checkpoint(ckpt, out_dir, keep)
            except RuntimeError as e:  # torch.save's writer wraps a stop signal raised inside it: a stop
                if isinstance(e.__context__, KeyboardInterrupt):
                    raise e.__context__ from None
                raise
            print(f"wrote {path}")
        fence(ddp)
    return path


def load_checkpoint(path, mmap=False):
    """Our checkpoint as a dict of tensors and plain values. weights_only=True: a checkpoint
    carrying pickled code is refused instead of run. mmap: the tensors are mapped, not read (a
    dry run's check, which needs only the small pickled part)."""
    try:
        # torch.save writes a zip with a CRC per tensor, which torch.load never checks: without
        # this, a flipped bit on disk loads as silently wrong weights
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap) if bad is None else None
    except FileNotFoundError:
        raise UserError(f"checkpoint {path} does not exist") from None
    except Exception as e:
        if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e):
            raise UserError(refused_pickle(path, e)) from None
        first = first_line(e)
        raise UserError(
            f"checkpoint {path} cannot be loaded safely (truncated, corrupt or not ours): {first}"
        ) from None
    if bad is not None:
        raise UserError(f"checkpoint {path} is corrupt: its {bad} fails the zip CRC check")
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"checkpoint {path} is not a train_gpt2.py checkpoint (no model / model_config)")
    return ckpt


def refused_pickle(path, e):
    """The line for a file torch.load(weights_only=True) refuses for the Python objects it pickles
    (torch's own advice, weights_only=False, would run code from a file no one vouched for)."""
    what = re.search(r"GLOBAL (\S+)", str(e))
    return (
        f"{path} is not a checkpoint written by train_gpt2.py (or is one of an older format): it pickles Python "
        f"objects ({what.group(1) if what else 'not tensors or plain values'}), which are never loaded here, for "
        f"loading them can run code from the file; pass a train_gpt2.py checkpoint, or a transformers GPT-2 as its "
        f"folder (config.json beside its weights, as save_pretrained writes it)"
    )


def load_training_checkpoint(path):
    """A checkpoint that holds a run's training state, not just weights."""
    ckpt = load_checkpoint(path)
    missing = [k for k in ("optimizer", "step", "data", "rng") if k not in ckpt]
    if missing:
        raise UserError(
            f"checkpoint {path} has no training state ({', '.join(missing)}): "
            f"start a new run from its weights with --init-from {path}"
        )
    return ckpt


def get_rng_state(device_type):
    """Every random generator's state, as tensors and plain values (weights_only-loadable)."""
    # numpy's state holds a numpy array, which weights_only loading refuses: keep it as a tensor
    _, key, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos)}
    numpy_state.update(has_gauss=int(has_gauss), gauss=float(gauss))
    return {
        "python": random.getstate(),
        "numpy": numpy_state,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None,
    }


def set_rng_state(state, device_type):
    random.setstate(state["python"])
    s = state["numpy"]
    np.random.set_state(("MT19937", s["key"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["gauss"]))
    torch.set_rng_state(state["torch"])
    if device_type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])


def all_rng_states(device_type, ddp, ddp_world_size):
    """Every rank's RNG state, gathered on every rank: a checkpoint resumes each rank's draws."""
    if not ddp:
        return [get_rng_state(device_type)]
    states = [None] * ddp_world_size
    dist.all_gather_object(states, get_rng_state(device_type))
    return states

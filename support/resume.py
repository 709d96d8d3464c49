"""What --resume continues with: the recipe and settings it takes from the checkpoint (which one:
support.run_folder.claim_out_dir), the changes it allows, and the optimizer, data position and loss
scale it restores."""

import argparse
import os
import time

import torch.distributed as dist

from support.checkpoints import load_training_checkpoint
from support.cli import UserError, same_on_every_rank
from support.ddp import fence
from support.out_of_memory import oom_phase
from support.run_folder import claim_out_dir
from support.shards import check_same_data

# The roles a flag has on --resume, declared by the dataclass of each flag in train_gpt2.py (FLAGS; a flag
# with neither is the machine's or this job's: the device, dtype, compile, --peak-flops and
# --ddp-timeout, --out-dir, --init-from, ...; a run may continue on another machine).
# The recipe: left out, a flag takes the checkpoint's value, so that `--resume` alone continues
# the run as it was; given with another value it is a contradiction, refused, except for the
# changes in ALLOWED_CHANGES, which are allowed and said.
RECIPE = "recipe"
# A run setting: left out, the run's (a resumed run reads the same data and evaluates as before,
# rather than the defaults' edu_fineweb10B and HellaSwag every 250 steps, and logs to the same
# wandb project); given, it changes from here on (--wandb-project '' stops the logging to wandb).
RUN_SETTING = "run setting"

ALLOWED_CHANGES = {
    "max_steps": "the cosine schedule is re-stretched from here to the new last step",
    "batch_size": "the same batch in other micro-batches: equal up to float rounding, not bitwise",
    "max_lr": "the schedule goes on from here with the new peak (after a divergence: from an earlier checkpoint)",
    "min_lr": "the cosine ends at the new floor",
}


def resume_folder(resume, out_dir):
    """--resume <a run's folder> continues that run where it is: returns the flags that says, as
    {"out_dir": that folder, "resume": "latest"} (its newest checkpoint); {} for any other --resume;
    '' (a script's empty variable) and a transformers folder (config.json: a model, not a run) refused.
    out_dir: the --out-dir given, None if none was."""
    if resume == "":
        raise UserError("--resume '' names nothing: pass a checkpoint, a run's folder, or --resume alone (its newest)")
    if resume in (None, "latest") or not os.path.isdir(resume):
        return {}
    if os.path.exists(os.path.join(resume, "config.json")):
        raise UserError(f"--resume {resume} is a transformers model, not a run: train from it via --init-from {resume}")
    if out_dir is not None and os.path.realpath(out_dir) != os.path.realpath(resume):
        raise UserError(
            f"--resume {resume} is a run's folder, --out-dir {out_dir} another: continue that "
            f"run with --resume --out-dir {resume}, or name the checkpoint to start from"
        )
    return {"out_dir": resume, "resume": "latest"}


def reconcile_resume(args, given, roles, config, ckpt_path):
    """The recipe and settings config (a checkpoint's train_config) against the command line (roles:
    {flag: RECIPE, RUN_SETTING or None}); refuses contradictions. Returns the flags config sets, {flag:
    its value} (the recipe's and the run settings left out), and the allowed changes, {flag:
    [config's value, new value]}. ckpt_path None: config is the flags of a run killed before its first
    checkpoint, started anew, in which the given ones win."""
    differ = {n: config[n] for n in roles if roles[n] and n in config and config[n] != getattr(args, n)}
    taken = {n: value for n, value in differ.items() if n not in given}
    changes = {n: [v, getattr(args, n)] for n, v in differ.items() if n in given and roles[n] == RECIPE and ckpt_path}
    for name, (was, new) in changes.items():
        if name not in ALLOWED_CHANGES:
            flag, preset = "--" + name.replace("_", "-"), given[name]  # preset: "FILE, line N" that set it, or ""
            where, fix = (f" ({preset})", "drop that line") if preset else ("", f"leave {flag} out")
            message = (
                f"{flag} {new}{where} contradicts the {was} that {ckpt_path} was trained with: "
                f"{fix} to continue the run as it was, or start a new run in another --out-dir"
            )
            raise same_on_every_rank(UserError(message))
    return taken, changes


def resume_checkpoint(out_dir, resume, dry_run, args, given, roles, ddp, master_process, on_exit):
    """Rank 0 claims out_dir and picks the checkpoint resume names ("latest", a path, or None: a new
    run; claim_out_dir), so that every rank loads the same one (multi-node: the out-dir
    must be shared); a mistake it finds there ends every rank alike, said once, while the others wait
    in the fence. args, the command line's flags, are reconciled with the checkpoint's by roles
    (reconcile_resume); a run killed before its first checkpoint takes its log header's flags, the
    given ones winning. Returns (path, checkpoint, the run's id, args with the flags it sets, the
    allowed changes, rank 0's log records, where set_aside moved checkpoints to); for a new run (None,
    None, a new id, args, {}, records, []). on_exit: the run's ExitStack."""
    oom_phase("loading the checkpoint")
    # picked: rank 0's path, its error, and the flags the run goes on with (a run started anew: its log header's)
    picked, ckpt, records, moved = [None, None, {}], None, [], []
    if master_process:
        try:
            records, picked[0], ckpt, moved = claim_out_dir(out_dir, resume, on_exit, dry_run)
            picked[2] = ckpt.get("train_config", {}) if ckpt else {}
        except UserError as e:
            picked[1] = str(e)
    if ddp:
        dist.broadcast_object_list(picked, src=0, group=fence(ddp))
    if picked[1] is not None:
        raise same_on_every_rank(UserError(picked[1]))
    path = picked[0]
    ckpt = (ckpt or load_training_checkpoint(path)) if path else None  # rank 0 loaded it as it picked it
    # a new run's id: when, and bytes no other has
    run_id = ckpt.get("run_id", path) if path else f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(4).hex()}"
    taken, changes = reconcile_resume(args, given, roles, picked[2], path)
    if master_process:  # what it changed (allowed), and took: a run started anew each flag, a resumed one the settings
        for name, (old, new) in changes.items():
            print(f"note: --{name.replace('_', '-')} {old} -> {new} on resume: {ALLOWED_CHANGES[name]}")
        said = taken if path is None else {n: v for n, v in taken.items() if roles[n] == RUN_SETTING}
        if said:
            flags = ", ".join(f"--{name.replace('_', '-')} {value!r}" for name, value in said.items())
            print(f"note: continuing with the run's {flags} (flags left out on --resume are the run's)")
        if path is not None:
            print(f"resuming from {path} at step {ckpt['step']}")
    return path, ckpt, run_id, argparse.Namespace(**{**vars(args), **taken}), changes, records, moved


def restore_training_state(ckpt, ckpt_path, optimizer, loader, scaler, max_steps):
    """The optimizer, data position and fp16's loss scaler as a checkpoint left them (a checkpoint of
    a bf16 or fp32 run has no scaler: fp16 starts at its first scale), on the data it was trained on
    (the loader's identity); returns the step to start at and the last val loss. A max_steps (the run's
    last step) below it is refused. A new run (ckpt None) starts at 0. No random state: after the
    model's init nothing in the recipe draws from the global generators (the shard order comes from
    (seed, epoch), samples from their own seeded generator, and the model has no dropout)."""
    oom_phase("loading the checkpoint")
    if ckpt is None:
        return 0, None
    if max_steps < ckpt["step"]:
        raise same_on_every_rank(
            UserError(f"--max-steps {max_steps} is below the {ckpt['step']} steps {ckpt_path} has done")
        )
    check_same_data(ckpt["data_identity"], loader.identity, ckpt_path, os.path.dirname(loader.shards[0]))
    optimizer.load_state_dict(ckpt["optimizer"])
    loader.load_state_dict(ckpt["data"])
    if scaler.is_enabled() and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    return ckpt["step"], ckpt.get("val_loss")

"""What --resume continues with: the recipe and settings it takes from the checkpoint (which one:
support.out_dir.pick_checkpoint), the changes it allows, and the optimizer, data position and RNG
state it restores."""

import os
import time

import torch.distributed as dist

from support.checkpoints import load_training_checkpoint, set_rng_state
from support.cli import UserError, same_on_every_rank
from support.ddp import fence
from support.out_dir import pick_checkpoint
from support.shards import check_same_data, data_identity

_restart = {}  # the run_id of the run this process restarts (resume_checkpoint), for restore_training_state


# value, so `--resume` alone continues the run as it was; a flag given with another value is a
# contradiction, refused, except for the changes below, which are allowed and reported.
RECIPE_FLAGS = (
    "total_batch_size",
    "seq_len",
    "max_lr",
    "min_lr",
    "warmup_steps",
    "max_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "adam_eps",
    "grad_clip",
    "seed",
    "no_shuffle",
    "n_layer",
    "n_head",
    "n_embd",
    "vocab_size",
    "block_size",
    "batch_size",
)


ALLOWED_CHANGES = {
    "max_steps": "the cosine schedule is re-stretched from here to the new last step",
    "batch_size": "the same batch in other micro-batches: equal up to float rounding, not bitwise",
    "max_lr": "the schedule goes on from here with the new peak (after a divergence: from an earlier checkpoint)",
    "min_lr": "the cosine ends at the new floor",
}


# reads the same data and evaluates as before, rather than the defaults' edu_fineweb10B and
# HellaSwag every 250 steps, and logs to the same wandb project); given, they change from here on
# (--wandb-project '' stops the logging to wandb). The device, dtype, compile, --peak-flops and
# --ddp-timeout are the machine's: a run may continue on another one.
RUN_SETTINGS = (
    "data_dir",
    "eval_every",
    "val_tokens",
    "hellaswag_every",
    "hellaswag_limit",
    "hellaswag_data",
    "sample_every",
    "ckpt_every",
    "keep_ckpts",
    "prompt",
    "num_samples",
    "max_new_tokens",
    "temperature",
    "top_k",
    "deterministic",
    "wandb_project",
    "wandb_run_name",
)


def reconcile_resume(args, given, ckpt, ckpt_path):
    """Fill args from the checkpoint's recipe and settings; refuse contradictions. Returns the
    allowed changes as {flag: [checkpoint's value, new value]} and the settings taken from the
    checkpoint as {flag: value}."""
    old, changes = ckpt.get("train_config", {}), {}
    taken = {n: old[n] for n in RUN_SETTINGS if n in old and n not in given and old[n] != getattr(args, n)}
    for name, value in taken.items():
        setattr(args, name, value)
    for name in RECIPE_FLAGS:
        if name not in old or old[name] == getattr(args, name):
            continue
        flag = "--" + name.replace("_", "-")
        if name not in given:
            setattr(args, name, old[name])
        elif name not in ALLOWED_CHANGES:
            message = (
                f"{flag} {getattr(args, name)} contradicts the {old[name]} that {ckpt_path} was trained with: "
                f"leave {flag} out to continue the run as it was, or start a new run in another --out-dir"
            )
            raise same_on_every_rank(UserError(message))
        else:
            changes[name] = [old[name], getattr(args, name)]
    if args.max_steps < ckpt["step"]:
        raise UserError(f"--max-steps {args.max_steps} is below the {ckpt['step']} steps {ckpt_path} has done")
    return changes, taken


def resume_checkpoint(args, given, ddp, master_process, claim=None):
    """(path, checkpoint, allowed changes, settings taken from it) for --resume, else (None, None,
    {}, {}). Rank 0 claims the out-dir first (claim(), if given) and picks the checkpoint, so that
    every rank loads the same one (multi-node: the out-dir must be shared); a mistake it finds
    there ends every rank alike, said once. The other ranks wait in the fence (see fence)."""
    picked = [None, None, None]  # the checkpoint's path, rank 0's error, the run to restart
    _restart.clear()
    if master_process:
        try:
            if claim is not None:
                claim()
            max_steps = args.max_steps if "max_steps" in given else None  # else the checkpoint's
            picked[0], _, picked[2] = pick_checkpoint(args.resume, args.out_dir, max_steps, load_training_checkpoint)
        except UserError as e:
            picked[1] = str(e)
    if ddp:
        dist.broadcast_object_list(picked, src=0, group=fence(ddp, args.ddp_timeout))
    if picked[1] is not None:
        raise same_on_every_rank(UserError(picked[1]))
    if picked[2] is not None:  # a restart from step 0: a new start of the same run, with its recipe
        restart = picked[2]
        _restart["run_id"] = restart["run_id"]
        old = restart["config"]
        changes, taken = reconcile_resume(args, given, {"train_config": old, "step": 0}, f"run {restart['run_id']}")
        if "init_from" not in given and old.get("init_from", "scratch") != "scratch":
            args.init_from = old["init_from"]  # a run that started from pretrained weights starts from them again
        args.resume = None
        return None, None, changes, taken
    if picked[0] is None:
        return None, None, {}, {}
    ckpt = load_training_checkpoint(picked[0])
    return picked[0], ckpt, *reconcile_resume(args, given, ckpt, picked[0])


def restore_training_state(ckpt, ckpt_path, optimizer, loader, ddp_rank, device_type, scaler=None):
    """The optimizer, data position, this rank's RNG and fp16's loss scaler as a checkpoint left
    them (a checkpoint of a bf16 or fp32 run has no scaler: fp16 starts at its first scale); returns the
    step to start at, the run's id (a new, unique one for a new run: the seeds are untouched) and
    the last val loss."""
    data_dir = os.path.dirname(loader.shards[0])
    loader.identity = data_identity(data_dir)  # what this run trains on; its checkpoints record it
    if ckpt is None:  # a restarted run keeps its id
        return 0, _restart.pop("run_id", None) or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(4).hex()}", None
    if ckpt.get("data_identity") is not None:
        check_same_data(ckpt["data_identity"], loader.identity, ckpt_path, data_dir)
    optimizer.load_state_dict(ckpt["optimizer"])
    loader.load_state_dict(ckpt["data"])
    if scaler is not None and scaler.is_enabled() and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    if ddp_rank < len(ckpt["rng"]):
        set_rng_state(ckpt["rng"][ddp_rank], device_type)
    if ddp_rank == 0:
        print(f"resuming from {ckpt_path} at step {ckpt['step']}")
    return ckpt["step"], ckpt.get("run_id", ckpt_path), ckpt.get("val_loss")


def report_resume(changes, taken):
    """Say what a resumed run changed (allowed) and what it took from the checkpoint."""
    for name, (old, new) in changes.items():
        print(f"note: --{name.replace('_', '-')} {old} -> {new} on resume: {ALLOWED_CHANGES[name]}")
    if taken:
        flags = ", ".join(f"--{name.replace('_', '-')} {value!r}" for name, value in taken.items())
        print(f"note: continuing with the run's {flags} (flags left out on --resume are the checkpoint's)")

"""Checkpoint files as plain dicts: written atomically, pruned to the newest few of this run, found,
loaded without running code, and judged healthy or not from the run's log; the random-number
state they carry, and the fence other ranks wait in while rank 0 writes one."""

import datetime
import errno
import math
import os
import random
import re
import zipfile
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist

from support.common import HF_NAMES, UserError, first_line, log_records, same_on_every_rank, write_atomic


def checkpoint_paths(out_dir):
    """The ckpt_NNNNNN.pt files in out_dir, newest (most steps) first."""
    if not os.path.isdir(out_dir):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(out_dir) if (m := re.fullmatch(r"ckpt_(\d+)\.pt", n))]
    return [os.path.join(out_dir, n) for _, n in sorted(found, reverse=True)]


def find_model(spec):
    """("transformers", name or folder) or ("checkpoint", file) for a model given on the command
    line; a training run's folder means its newest checkpoint, said in a note."""
    if spec not in HF_NAMES and os.path.isdir(spec) and not os.path.exists(os.path.join(spec, "config.json")):
        found = checkpoint_paths(spec)
        if not found:
            raise UserError(f"{spec} holds neither a transformers model (config.json) nor our checkpoints (ckpt_*.pt)")
        print(f"{spec} is a training run's folder: using its newest checkpoint, {found[0]}")
        spec = found[0]
    if spec in HF_NAMES or os.path.isdir(spec):
        return "transformers", spec
    if os.path.isfile(spec):
        return "checkpoint", spec
    # most often a checkpoint's step mistyped: say which ones its folder holds
    folder = os.path.dirname(spec) or "."
    found = [os.path.basename(p) for p in checkpoint_paths(folder)]
    there = f"; {folder} holds {', '.join(found[:3])}" + (" ..." if len(found) > 3 else "") if found else ""
    raise UserError(f"{spec!r} does not exist, and is not a GPT-2 name ({', '.join(HF_NAMES)}){there}")


def disk_error(e, what, then):
    """One line for a failed write; 'make room' only when the disk is really full."""
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    fix = "make room on the disk" if full else "make --out-dir writable"
    return UserError(f"cannot write {what} ({getattr(e, 'strerror', None) or e}): {fix}, then {then}")


def train_config_of(path):
    """The flags a checkpoint was saved with ({} if it cannot be read); mmap reads only the small
    pickled part, not the tensors."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("train_config") or {}
    except Exception:
        return {}


def run_id_of(path):
    """The run a checkpoint belongs to; mmap reads only the small pickled part, not the tensors."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("run_id")
    except Exception:
        return None


def save_checkpoint(ckpt, out_dir, keep):
    """Write ckpt_<step>.pt atomically (a kill mid-write never leaves a half checkpoint under the
    real name), then delete this run's checkpoints beyond the newest `keep`: another run's
    files are never touched."""
    from support.out_dir import check_out_dir_held  # here: out_dir imports this module

    check_out_dir_held()  # the folder is still this run's (its lock file deleted: locked again, or stop)
    path = os.path.join(out_dir, f"ckpt_{ckpt['step']:06d}.pt")
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
            if old not in kept and run_id_of(old) == ckpt["run_id"]:
                os.remove(old)
    return path


def save_training_state(step, run):
    """Rank 0 writes the checkpoint of `step` steps done: the weights and model config, and all
    that continues the run as if it never stopped: the optimizer, the data position, every rank's
    RNG state, fp16's loss scaler, the flags (train_config), the run's id and its last val loss. `run`
    is the training script's Run (model, optimizer, loader, args, dist_info, device, run_id, val_loss,
    scaler)."""
    dist_info, args = run.dist_info, run.args
    check_finite_state(step, run)
    rng = all_rng_states(run.device.split(":")[0], dist_info.ddp, dist_info.ddp_world_size)
    if dist_info.master_process:
        ckpt = {"model": run.model.state_dict(), "model_config": asdict(run.model.config), "step": step}
        ckpt.update(optimizer=run.optimizer.state_dict(), data=run.loader.state_dict(), rng=rng)
        ckpt.update(data_identity=getattr(run.loader, "identity", None))  # the shards the run started on
        if getattr(run, "scaler", None) is not None and run.scaler.is_enabled():  # fp16: the scale and its growth
            ckpt.update(scaler=run.scaler.state_dict())
        # an absolute --data-dir: `--resume` from another working directory reads the same data
        ckpt.update(train_config={**vars(args), "data_dir": os.path.abspath(args.data_dir)})
        ckpt.update(world_size=dist_info.ddp_world_size, run_id=run.run_id, val_loss=run.val_loss)
        path = save_checkpoint(ckpt, args.out_dir, args.keep_ckpts)
        print(f"wrote {path}")
    fence(dist_info.ddp)  # the other ranks wait for the write here, not in a collective that times out
    return path if dist_info.master_process else None


def check_finite_state(step, run):
    """Weights or a val loss that are not finite are never saved as a checkpoint, and a run that
    has them is not done: it stops, saying which checkpoint to go on from. The same decision on
    every rank (the weights are the same, the val loss all-reduced)."""
    bad = [name for name, p in run.model.named_parameters() if not torch.isfinite(p).all()]
    val_loss = run.val_loss
    if not bad and (val_loss is None or math.isfinite(val_loss)):
        return
    what = f"the weights after {step} steps are not finite ({bad[0]})" if bad else f"the val loss is {val_loss}"
    advice = diverged_advice(run.args.out_dir, run.args.max_lr)
    raise same_on_every_rank(UserError(f"{what}: the run diverged and stopped, writing no checkpoint of it; {advice}"))


def checkpoint_health(out_dir):
    """[(path, known good)] of out_dir's checkpoints, newest first, from its log. Checkpoint N holds
    the weights step N trains from: known good when the log's last record of step N (a resumed run
    redoes steps) is a trained step, or one fp16's loss scaler skipped (its loss was finite, only the
    scaled gradients overflowed), not a skipped one (a NaN or inf) nor missing (not trained yet)."""
    trained = {}
    for record in log_records(os.path.join(out_dir, "log.jsonl")):
        if any(k in record for k in ("train_loss", "scaler_skipped", "skipped")):
            trained[record.get("step")] = "skipped" not in record
    health = []
    for path in checkpoint_paths(out_dir):
        step = int(re.findall(r"\d+", os.path.basename(path))[-1])
        health.append((path, trained.get(step, False)))
    return health


def diverged_max_lr(out_dir, since_step):
    """The --max-lr that diverged from step since_step: that of the latest run in out_dir's log that
    trained on from since_step or earlier and had a non-finite step or val loss. A run resumed later
    than since_step (from weights that had already gone bad) does not count: lowering its lr is not
    what the weights of since_step need. None when the log records no such run."""
    found, max_lr, start = None, None, None
    for record in log_records(os.path.join(out_dir, "log.jsonl")):
        if record.get("event") == "header":
            max_lr, start = (record.get("config") or {}).get("max_lr"), record.get("resumed_from") or 0
            continue
        val_loss = record.get("val_loss", 0.0)  # a NaN is the string "NaN" (strict JSON)
        bad = "skipped" in record or not (isinstance(val_loss, (int, float)) and math.isfinite(val_loss))
        if bad and start is not None and start <= since_step and isinstance(max_lr, (int, float)):
            found = max_lr
    return found


def diverged_advice(out_dir, max_lr):
    """What to do after a divergence: go on from the newest checkpoint whose weights are known good
    (checkpoint_health) with an --max-lr below the one that diverged from it (diverged_max_lr; else
    max_lr, this run's), an allowed change on --resume; with none, start anew."""
    good = [path for path, known_good in checkpoint_health(out_dir) if known_good]
    since = int(re.findall(r"\d+", os.path.basename(good[0]))[-1]) if good else 0
    max_lr = diverged_max_lr(out_dir, since) or max_lr
    if good:
        return (
            f"continue from {good[0]}, the newest checkpoint whose weights trained without a NaN or inf, with "
            f"a lower learning rate: --resume {good[0]} --max-lr LR, LR below {max_lr:g}"
        )
    return (
        f"no checkpoint in {out_dir} holds weights that trained without a NaN or inf: start a new run with "
        f"a lower --max-lr (below {max_lr:g}) in a new --out-dir"
    )


FENCE_TIMEOUT = 3600  # seconds the other ranks wait for what rank 0 does alone (a checkpoint write)


_fence_group = []


def fence(ddp, timeout=None):
    """Under torchrun, every rank waits here until all arrive, for up to FENCE_TIMEOUT seconds (or
    --ddp-timeout if longer): after work that rank 0 does alone, so that the other ranks do not
    wait for it in a collective that --ddp-timeout ends. The first call, made by every rank at
    start, creates the gloo group the fence waits in; timeout: the run's --ddp-timeout."""
    if not ddp:
        return None
    if not _fence_group:
        seconds = max(FENCE_TIMEOUT, timeout or 0)
        _fence_group.append(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds)))
    dist.barrier(group=_fence_group[0])
    return _fence_group[0]


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
        first = first_line(e)
        raise UserError(
            f"checkpoint {path} cannot be loaded safely (truncated, corrupt or not ours): {first}"
        ) from None
    if bad is not None:
        raise UserError(f"checkpoint {path} is corrupt: its {bad} fails the zip CRC check")
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"checkpoint {path} is not a train_gpt2.py checkpoint (no model / model_config)")
    return ckpt


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

"""Checkpoint files as plain dicts: a run's training state written atomically, pruned to this run's
newest few (keeping one known good), and loaded without running code. Which files in a run's folder
are the run's own is support/run_folder.py's."""

import mmap
import os
import pickle
import re
import struct
import zipfile
import zlib

import torch

from support.cli import UserError, first_line
from support.ddp import fence
from support.divergence import known_good
from support.files import disk_error, write_atomic
from support.run_folder import checkpoint_path, checkpoint_paths, run_id_of

MODEL_CONFIG_KEYS = {"block_size", "vocab_size", "n_layer", "n_head", "n_embd"}  # train_gpt2.py's GPTConfig


def save_checkpoint(ckpt, out_dir, keep, trained):
    """Write ckpt_<step>.pt atomically (a kill mid-write never leaves a half checkpoint under the
    real name), then prune: delete this run's checkpoints beyond the newest `keep`. What stands at
    the name was checked at start to be a checkpoint (support.run_folder.check_names_at_start)."""
    path = checkpoint_path(out_dir, ckpt["step"])
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
            else f"start the run again in a new --out-dir (no earlier checkpoint is in {out_dir})"
        )
        raise disk_error(cause, f"checkpoint {path}", then) from None
    prune(out_dir, keep, ckpt["run_id"], trained)
    return path


def prune(out_dir, keep, run_id, trained):
    """Delete run_id's checkpoints in out_dir beyond the newest `keep` (0: none). The newest known
    good one (trained: the run log's, support.divergence.known_good) stays too while none of the
    newest `keep` is known good yet (one more file, until a newer one has trained): after a
    divergence, diverged_advice sends the user to it. Another run's files are never touched."""
    found = checkpoint_paths(out_dir)
    if keep <= 0 or len(found) <= keep:
        return
    good = known_good(out_dir, trained)
    kept = [path for path in found[:keep] if path in good] or good[:1]
    for old in found[keep:]:
        if old not in kept and run_id_of(old) == run_id:
            os.remove(old)


def save_training_state(ckpt, out_dir, keep, master_process, ddp, trained, stop):
    """Every rank calls it; rank 0 writes ckpt, the training state as one plain dict (train_gpt2.py
    gathers it, and checks it is finite, where it checkpoints), to out_dir (save_checkpoint: atomic,
    pruned to this run's newest `keep`; trained: the log's, note_trained) while the other ranks wait
    in the fence, not in a collective that times out; stop: the run's StopRequest, told of the write.
    Returns the path written on rank 0, else None."""
    path = None
    with stop.during_write(checkpoint_path(out_dir, ckpt["step"]), say=master_process):
        if master_process:
            try:
                path = save_checkpoint(ckpt, out_dir, keep, trained)
            except RuntimeError as e:  # torch.save's writer wraps a stop signal raised inside it: a stop
                if isinstance(e.__context__, KeyboardInterrupt):
                    raise e.__context__ from None
                raise
            print(f"wrote {path}")
        fence(ddp)
    return path


def load_checkpoint(path, mmap=False):
    """Our checkpoint as a dict of tensors and plain values, its file read once (crc_failure, then
    torch.load). weights_only=True: a checkpoint carrying pickled code is refused instead of run.
    mmap: the tensors are mapped, not read (for the weights alone: sample.py, export_hf.py, ...).
    Its model_config is checked here, once, for every reader."""
    try:
        bad = crc_failure(path)
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
    shape = ckpt.get("model_config") if isinstance(ckpt, dict) else None
    if not isinstance(shape, dict) or set(shape) != MODEL_CONFIG_KEYS or "model" not in ckpt:
        raise UserError(f"checkpoint {path} is not a train_gpt2.py checkpoint (no model / GPT model_config)")
    return ckpt


def crc_failure(path):
    """The first file in a checkpoint's zip whose bytes fail its CRC, else None. torch.save writes
    a CRC per tensor, which torch.load never checks: without this, a flipped bit on disk loads as
    silently wrong weights. One pass over a memory map of the file, no copy of it; torch.save stores
    each file uncompressed, so its CRC is over its bytes as they lie in the zip."""
    with open(path, "rb") as f, zipfile.ZipFile(f) as zf, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for info in zf.infolist():  # each file's data follows its 30-byte local header, name and extra field
            start = info.header_offset + 30 + sum(struct.unpack_from("<HH", m, info.header_offset + 26))
            with memoryview(m)[start : start + info.compress_size] as data:
                if zlib.crc32(data) != info.CRC:
                    return info.filename


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
    """A checkpoint that holds a run's training state, not just weights: read, not mapped (pruned later)."""
    ckpt = load_checkpoint(path)
    missing = [k for k in ("optimizer", "step", "data") if k not in ckpt]
    if missing:
        raise UserError(
            f"checkpoint {path} has no training state ({', '.join(missing)}): "
            f"start a new run from its weights with --init-from {path}"
        )
    return ckpt

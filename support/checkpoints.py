"""The checkpoint's file format: a plain dict of tensors and plain values in torch.save's zip, loaded
without running code, its CRCs checked. Where checkpoints are written, and whose they are, is
support/run_folder.py's."""

import mmap
import pickle
import re
import struct
import zipfile
import zlib

import torch

from support.cli import UserError, first_line

MODEL_CONFIG_KEYS = {"block_size", "vocab_size", "n_layer", "n_head", "n_embd"}  # train_gpt2.py's GPTConfig


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
            # not torch's own advice, weights_only=False: that would run code from a file no one vouched for
            what = re.search(r"GLOBAL (\S+)", str(e))
            raise UserError(
                f"{path} is not a checkpoint written by train_gpt2.py (or is one of an older format): it pickles "
                f"Python objects ({what.group(1) if what else 'not tensors or plain values'}), which are never "
                f"loaded here, for loading them can run code from the file; pass a train_gpt2.py checkpoint, or a "
                f"transformers GPT-2 as its folder (config.json beside its weights, as save_pretrained writes it)"
            ) from None
        raise UserError(
            f"checkpoint {path} cannot be loaded safely (truncated, corrupt or not ours): {first_line(e)}"
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

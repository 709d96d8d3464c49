"""Where a model named on the command line (--init-from, sample.py, export_hf.py, hellaswag.py
-m) lives: an OpenAI GPT-2 name, a transformers folder, our checkpoint or a run's folder, and its
shape read without its weights."""

import json
import os

from support.checkpoints import load_checkpoint
from support.cli import UserError
from support.files import log_records
from support.hf_interop import HF_NAMES, check_hub_reachable, hub_name_is_cached
from support.run_folder import checkpoints_near, log_path, newest_of_its_run

GPT2_BLOCK_SIZE = 1024  # n_positions of every OpenAI GPT-2 (gpt2 .. gpt2-xl)
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def find_model(spec):
    """("transformers", name or folder, None) or ("checkpoint", file, its dict, tensors mapped) for a
    model given on the command line; a training run's folder means its newest checkpoint, said in a
    note: as --resume takes it, the newest that loads of the folder's run by its meta (one passed over
    is said in a warning: support.run_folder.newest_of_its_run)."""
    if spec not in HF_NAMES and os.path.isdir(spec) and not os.path.exists(os.path.join(spec, "config.json")):
        then = "name the checkpoint file to use instead of the folder"
        records = log_records(log_path(spec))  # read as the folder's run is looked for
        newest, ckpt = newest_of_its_run(spec, records, lambda path: load_checkpoint(path, mmap=True), then)
        if newest is None:
            raise UserError(f"{spec} holds neither a transformers model (config.json) nor our checkpoints (ckpt_*.pt)")
        print(f"{spec} is a training run's folder: using its newest checkpoint, {newest}")
        return "checkpoint", newest, ckpt
    if spec in HF_NAMES or os.path.isdir(spec):
        return "transformers", spec, None
    if os.path.isfile(spec):
        return "checkpoint", spec, load_checkpoint(spec, mmap=True)
    # most often a checkpoint's step or a folder mistyped: say what the nearest folder holds
    raise UserError(f"{spec!r} does not exist, and is not a GPT-2 name ({', '.join(HF_NAMES)}){checkpoints_near(spec)}")


def block_size_of(spec):
    """The window (block_size) of a model as sample.py takes it, found and read without its
    weights (its --dry-run): a checkpoint's zip CRCs and pickle (weights_only; the tensors mapped,
    not read), a transformers folder's config.json beside its weights, a GPT-2 name in the local
    cache or on a Hub that answers."""
    kind, path, ckpt = find_model(spec)
    if kind == "checkpoint":
        return ckpt["model_config"]["block_size"]
    if path in HF_NAMES and not os.path.isdir(path):
        if not hub_name_is_cached(path):
            check_hub_reachable(path)
        return GPT2_BLOCK_SIZE
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}/config.json cannot be read ({e}): not a transformers model folder") from None
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        raise UserError(f"{path}/config.json is not a transformers GPT-2's (model_type gpt2)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in HF_WEIGHTS):
        raise UserError(f"{path} holds a config.json but no weights ({', '.join(HF_WEIGHTS)})")
    return config.get("n_positions", GPT2_BLOCK_SIZE)

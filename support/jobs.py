"""The command line's jobs besides training, --sample-from and --export-hf: what their --dry-run
checks (the model found and readable, the prompt, the export's folder) without loading weights,
sampling or writing, and what a Ctrl-C during one says."""

import json
import os
from contextlib import contextmanager

from support.checkpoints import find_model, load_checkpoint
from support.common import GPT2_VOCAB, HF_NAMES, UserError
from support.hf_interop import check_export_target, check_hub_reachable, hub_name_is_cached
from support.sampling import encode_prompt, note_if_samples_stop_early

GPT2_BLOCK_SIZE = 1024  # n_positions of every OpenAI GPT-2 (gpt2 .. gpt2-xl)
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def model_config_of(spec):
    """{"block_size", "vocab_size"} of a model as --sample-from and --export-hf take it, found and
    read without its weights: a checkpoint's zip CRCs and pickle (weights_only; the tensors mapped,
    not read), a transformers folder's config.json beside its weights, a GPT-2 name in the local
    cache or on a Hub that answers."""
    kind, path = find_model(spec)
    if kind == "checkpoint":
        config = load_checkpoint(path, mmap=True)["model_config"]
        if not isinstance(config, dict) or not {"block_size", "vocab_size"} <= set(config):
            raise UserError(f"checkpoint {path}: its model_config is not a GPT config ({config!r:.80})")
        return config
    if path in HF_NAMES and not os.path.isdir(path):
        if not hub_name_is_cached(path):
            check_hub_reachable(path)
        return {"block_size": GPT2_BLOCK_SIZE, "vocab_size": GPT2_VOCAB}
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}/config.json cannot be read ({e}): not a transformers model folder") from None
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        raise UserError(f"{path}/config.json is not a transformers GPT-2's (model_type gpt2)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in HF_WEIGHTS):
        raise UserError(f"{path} holds a config.json but no weights ({', '.join(HF_WEIGHTS)})")
    return {"block_size": config.get("n_positions", GPT2_BLOCK_SIZE), "vocab_size": config.get("vocab_size")}


def nearest_folder(path):
    """path, or the nearest of its parents that exists: where writing it would create something."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def dry_run_job(args, enc):
    """--dry-run of --sample-from or --export-hf (the flags already checked): every check the job
    makes before its slow part, then a line saying so. No weights are loaded, nothing is sampled
    or written. enc: the tokenizer (sampling only; None for an export)."""
    if args.sample_from:
        config = model_config_of(args.sample_from)
        tokens = encode_prompt(enc, args.prompt, config["block_size"])
        note_if_samples_stop_early(len(tokens), args.max_new_tokens, config["block_size"])
        print(f"dry run: {args.sample_from}, the prompt and the sampling flags are fine; nothing was sampled")
        return 0
    ckpt_path, out_dir = args.export_hf
    config = model_config_of(ckpt_path)
    if config["vocab_size"] < GPT2_VOCAB:
        raise UserError(f"vocab_size {config['vocab_size']} is smaller than GPT-2's {GPT2_VOCAB}: cannot export")
    target = check_export_target(out_dir)
    folder = nearest_folder(target if os.path.exists(target) else os.path.dirname(target))
    if not os.access(folder, os.W_OK):
        raise UserError(
            f"cannot write the export to {out_dir}: {folder} is not writable; choose a folder you can write to"
        )
    print(f"dry run: {ckpt_path} can be exported to {out_dir}; nothing was written")
    return 0


@contextmanager
def said_on_interrupt(message):
    """A Ctrl-C inside is reported with message (run_cli prints a KeyboardInterrupt's own words)."""
    try:
        yield
    except KeyboardInterrupt as e:
        if str(e):
            raise  # it says something already
        raise KeyboardInterrupt(message) from None

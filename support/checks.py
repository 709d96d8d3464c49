"""The checks that refuse bad flags and data before step 0, not hours in: numbers the code cannot
use, a device the machine lacks, too little data, shards of another tokenizer, and the shards'
fingerprints that tie a checkpoint to the data it was trained on."""

import glob
import json
import math
import os
import re
import shlex
import sys

import torch

from support.common import GPT2_VOCAB, UserError, same_on_every_rank, shard_fingerprint
from support.wandb_log import wandb_problem

MAX_DDP_TIMEOUT = 1e9  # seconds: torch turns --ddp-timeout into int64 nanoseconds (larger ones overflow)
# seconds: c10d counts the timeout in whole milliseconds (below 1 ms it is 0, and every wait fails at
# once), and the ranks of a job take about a second to join even on one machine
MIN_DDP_TIMEOUT = 1
MAX_VOCAB_SIZE = 2**16  # token shards hold uint16 ids: a larger vocabulary has rows no token can reach


def check_args(args, world_size, given=frozenset()):
    """Bad numbers as one-line errors, before any process starts waiting on another. given: the
    flags on the command line (a default the user never chose is judged more kindly)."""

    def need(ok, message):
        if not ok:
            raise same_on_every_rank(UserError(message))

    for name, value in vars(args).items():  # nan passes every comparison below: refuse it first
        need(
            not isinstance(value, float) or math.isfinite(value),
            f"--{name.replace('_', '-')} must be a finite number, not {value}",
        )
    positive = (
        "batch_size",
        "seq_len",
        "total_batch_size",
        "max_steps",
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "num_samples",
        "max_new_tokens",
    )
    for name in positive:
        need(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    for name in (
        "warmup_steps",
        "weight_decay",
        "grad_clip",
        "eval_every",
        "val_tokens",
        "hellaswag_every",
        "sample_every",
        "ckpt_every",
        "keep_ckpts",
        "temperature",
        "top_k",
    ):
        need(getattr(args, name) >= 0, f"--{name.replace('_', '-')} must be 0 or more, not {getattr(args, name)}")
    need(args.max_lr > 0, f"--max-lr must be above 0, not {args.max_lr}")
    need(
        args.min_lr is None or 0 <= args.min_lr <= args.max_lr,
        f"--min-lr {args.min_lr} must be between 0 and --max-lr {args.max_lr}",
    )
    for name in ("beta1", "beta2"):
        need(0 <= getattr(args, name) < 1, f"--{name} must be in [0, 1), not {getattr(args, name)}")
    need(args.adam_eps > 0, f"--adam-eps must be above 0, not {args.adam_eps}")
    need(
        MIN_DDP_TIMEOUT <= args.ddp_timeout <= MAX_DDP_TIMEOUT,
        f"--ddp-timeout must be a number of seconds from {MIN_DDP_TIMEOUT} (the ranks take about a second to "
        f"join) to {MAX_DDP_TIMEOUT:.0e} (about 31 years: torch counts it in nanoseconds), not {args.ddp_timeout}",
    )
    # numpy's generators (the shard order) take 0 .. 2**32 - 1; torch's (sampling) -2**63 .. 2**64 - 1
    low, high = (-(2**63), 2**64 - 1) if getattr(args, "sample_from", None) else (0, 2**32 - 1)
    need(low <= args.seed <= high, f"--seed must be between {low} and {high:,}, not {args.seed}")
    need(args.peak_flops is None or args.peak_flops > 0, f"--peak-flops must be above 0, not {args.peak_flops}")
    need(
        args.hellaswag_limit is None or args.hellaswag_limit >= 1,
        f"--hellaswag-limit {args.hellaswag_limit}: give a positive number of examples",
    )
    need(args.n_embd % args.n_head == 0, f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    need(args.vocab_size >= GPT2_VOCAB, f"--vocab-size {args.vocab_size} is smaller than GPT-2's {GPT2_VOCAB} tokens")
    need(
        args.vocab_size <= MAX_VOCAB_SIZE,
        f"--vocab-size {args.vocab_size} is more than the {MAX_VOCAB_SIZE:,} token ids a shard can hold (uint16): "
        f"pass at most {MAX_VOCAB_SIZE} (GPT-2 has {GPT2_VOCAB:,} tokens; the default 50304 pads them to a "
        f"multiple of 128)",
    )
    need(
        not (args.resume and args.init_from != "scratch"),
        f"--init-from {args.init_from} starts a new run, --resume continues one: pass one of them",
    )
    if not args.resume and "warmup_steps" not in given:  # on resume the checkpoint's value counts
        last_lr = args.max_lr * args.max_steps / args.warmup_steps if args.warmup_steps else args.max_lr
        need(
            args.warmup_steps < args.max_steps,
            f"--max-steps {args.max_steps} ends inside the default {args.warmup_steps}-step warm-up (lr would "
            f"never pass {last_lr:.1e}): pass --warmup-steps below --max-steps",
        )
    micro = args.batch_size * args.seq_len * world_size
    need(
        args.total_batch_size % micro == 0,
        f"--total-batch-size {args.total_batch_size:,} is not a multiple of B*T*world_size = "
        f"{args.batch_size}*{args.seq_len}*{world_size} = {micro:,}: change --batch-size, --seq-len or "
        f"--total-batch-size",
    )
    if getattr(args, "wandb_project", None):  # optional: the package is checked only when asked for
        problem = wandb_problem(args.wandb_project)
        need(problem is None, problem)
    elif getattr(args, "wandb_run_name", None) and not args.resume:  # on --resume the run's project counts
        need(False, f"--wandb-run-name {args.wandb_run_name} names a wandb run: pass --wandb-project too")


def check_init_shape(args, given, config, master_process=True):
    """A model flag given with --init-from that differs from the model it loads (config, a dict) is
    not used: said in a note, not dropped without a word."""
    for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
        if args.init_from != "scratch" and name in given and getattr(args, name) != config[name] and master_process:
            print(
                f"note: --{name.replace('_', '-')} {getattr(args, name)} is not used: --init-from {args.init_from} "
                f"brings its own shape ({name} {config[name]})"
            )


TRAIN_BYTES_PER_PARAMETER = 16  # fp32 weights, their gradients and AdamW's two moments


def device_memory(device):
    """(bytes, what they are) of the memory a model on device lives in: a CUDA GPU's own, else the
    machine's RAM (a CPU's, and MPS's, which shares it); (None, None) where it cannot be read."""
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the GPU's memory ({props.name})"
    names = getattr(os, "sysconf_names", {})
    if "SC_PHYS_PAGES" in names and "SC_PAGE_SIZE" in names:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's memory"
    return None, None


def check_model_fits(shape, device):
    """A new model (shape: the model flags) whose parameters alone, trained (TRAIN_BYTES_PER_PARAMETER
    each), exceed the device's memory is refused before it is built: building it could run for
    minutes (--n-layer 1000000) before failing, and the failure could not tell which flag made it
    big. The flag named is the one behind most of the parameters."""
    memory, what = device_memory(device)
    C = shape["n_embd"]
    parts = {
        "--n-embd": shape["vocab_size"] * C,  # the token embedding: its rows are the vocabulary, fixed
        "--block-size": shape["block_size"] * C,  # the position embedding
        "--n-layer or --n-embd": shape["n_layer"] * (12 * C * C + 13 * C),
    }
    n = sum(parts.values()) + 2 * C  # and the final LayerNorm
    if memory is not None and n * TRAIN_BYTES_PER_PARAMETER > memory:
        raise UserError(
            f"the model flags make {n:,} parameters, {n * TRAIN_BYTES_PER_PARAMETER / 2**30:,.0f} GiB to train "
            f"(weights, gradients and AdamW's two moments, {TRAIN_BYTES_PER_PARAMETER} bytes each), more than "
            f"the {memory / 2**30:,.0f} GiB of {what}: lower {max(parts, key=parts.get)}"
        )


def check_device(device, has_cuda, has_mps):
    """--device names a device this machine has."""
    device_type = device.split(":")[0]
    if device_type not in ("cuda", "mps", "cpu"):
        raise UserError(f"unknown device {device!r}: use cuda, cuda:N, mps or cpu")
    if device_type == "cuda" and not has_cuda:
        raise UserError("--device cuda was asked for but CUDA is not available: use --device cpu")
    if device_type == "mps" and not has_mps:
        raise UserError("--device mps was asked for but MPS is not available: use --device cpu")


def check_data(args, tokens_per_epoch, val_tokens, master_process):
    """Too little data for the flags is refused before step 0; a short val set or repeated data is said."""
    T = args.seq_len
    if tokens_per_epoch < args.total_batch_size:  # one step would see the same tokens twice
        raise UserError(
            f"the train shards in {args.data_dir} hold {tokens_per_epoch:,} usable tokens, fewer than "
            f"one step's --total-batch-size {args.total_batch_size:,}: write more data or lower --total-batch-size"
        )
    if args.eval_every > 0 and args.val_tokens > 0:  # --val-tokens 0: no val loss, as --eval-every 0
        if args.val_tokens < T:
            raise UserError(
                f"--val-tokens {args.val_tokens} is less than one sequence of -T {T} tokens: pass at least {T}, "
                f"or --val-tokens 0 to train without val loss"
            )
        if val_tokens is None or len(val_tokens) < T + 1:
            raise UserError(
                f"no val shard (*_val_NNNNNN.npy or .bin) with {T + 1} tokens in {args.data_dir}: fineweb.py "
                f"writes one (its shard 0), or pass --eval-every 0 to train without val loss"
            )
        if master_process and len(val_tokens) < args.val_tokens + 1:
            print(f"note: the val shards hold only {len(val_tokens) - 1:,} of the --val-tokens {args.val_tokens:,}")
    run_tokens = args.max_steps * args.total_batch_size
    if master_process and run_tokens > tokens_per_epoch:
        print(
            f"warning: this run trains on {run_tokens:,} tokens but the train shards hold {tokens_per_epoch:,} "
            f"usable ones: the data repeats ({run_tokens / tokens_per_epoch:.2f} epochs)",
            file=sys.stderr,
        )


def find_shards(data_dir, split, required=False):
    """The {prefix}_{split}_{index}.npy (or .bin) shards in data_dir, in name order."""
    if os.path.isfile(data_dir):  # a text file or one shard where the folder of shards goes
        raise UserError(
            f"--data-dir {data_dir} is a file, not a folder of shards: pass the folder that holds the "
            f"shards, or tokenize a text file with `python fineweb.py --input {data_dir} --out-dir DIR` "
            f"and pass --data-dir DIR"
        )
    if not os.path.isdir(data_dir):
        raise UserError(f"data folder {data_dir} does not exist: write shards with fineweb.py or pass --data-dir")
    check_fineweb_finished(data_dir)
    names = sorted(n for n in os.listdir(data_dir) if re.fullmatch(rf".+_{split}_\d+\.(npy|bin)", n))
    if len({os.path.splitext(n)[1] for n in names}) > 1:
        raise UserError(f"{data_dir} holds both .npy and .bin {split} shards: keep one format")
    if required and not names:
        raise UserError(
            f"no {split} shards (*_{split}_NNNNNN.npy or .bin) in {data_dir}: write them with "
            f"`python fineweb.py` or pass --data-dir"
        )
    return [os.path.join(data_dir, n) for n in names]


def check_fineweb_finished(data_dir):
    """A folder whose fineweb.py manifest says it is unfinished (fineweb.py still writing it, or
    stopped by a kill or an error) is refused, naming the command that finishes it: a run would
    train on what is there, and could not be resumed once fineweb.py adds the rest. A stop at
    --max-tokens / --max-shards is finished as asked. Data is finished only if fineweb.py said so:
    a folder holding fineweb.py's journal (.{prefix}_manifest.journal: fineweb.py started it) whose
    manifest is deleted or unreadable is refused too, with the command its journal's first line
    (the manifest as it began) gives. Shards with no journal (llm.c's, the user's own) are not
    fineweb.py's to judge."""
    names, readable = os.listdir(data_dir), set()
    for name in sorted(n for n in names if n.endswith("_manifest.json")):
        try:
            with open(os.path.join(data_dir, name), encoding="utf-8") as f:
                manifest = json.load(f)
            config, finished = manifest["config"], manifest["complete"] or manifest.get("limit") is not None
            command = fineweb_command(config, data_dir)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
            continue  # not fineweb.py's manifest
        readable.add(name)
        if not finished:
            raise UserError(
                f"--data-dir {data_dir} is unfinished: its {name} says fineweb.py has not written all of its "
                f"input (it is still writing, or it was stopped); finish it with `{command}` (or wait for the "
                f"fineweb.py writing it), then start the run"
            )
    for journal in sorted(n for n in names if re.fullmatch(r"\..+_manifest\.journal", n)):
        name = journal[1 : -len(".journal")] + ".json"
        if name in readable:
            continue
        state = "cannot be read" if name in names else "is missing"
        try:
            with open(os.path.join(data_dir, journal), encoding="utf-8") as f:
                command = fineweb_command(json.loads(f.readline())["manifest"]["config"], data_dir)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
            raise UserError(
                f"--data-dir {data_dir} is unfinished: fineweb.py's journal {journal} is there, and its manifest "
                f"{name} {state}, so fineweb.py never said it finished, nor can it finish it: write the data again "
                f"with fineweb.py into a new --out-dir, then start the run on it"
            ) from None
        first = "" if name not in names else f"delete the unreadable {name}, then "
        raise UserError(
            f"--data-dir {data_dir} is unfinished: fineweb.py's journal {journal} is there, and its manifest "
            f"{name} {state}, so fineweb.py never said it finished; {first}finish it with `{command}` (it "
            f"rebuilds the manifest from the journal), then start the run"
        )


def fineweb_command(config, data_dir):
    """The fineweb.py command that writes (and, rerun, finishes) the shards a manifest's config
    describes into data_dir: its flags that differ from fineweb.py's defaults."""
    source, command = config["source"], ["python", "fineweb.py"]
    if "input" in source:
        paths = [entry["path"] if isinstance(entry, dict) else entry[0] for entry in source["input"]]
        folders, kinds = {os.path.dirname(p) for p in paths}, {os.path.splitext(p)[1] for p in paths}
        pattern = os.path.join(*folders, "*" + "".join(kinds)) if len(folders) == len(kinds) == 1 else None
        if len(paths) > 3 and pattern and sorted(glob.glob(pattern)) == paths:
            paths = [pattern]  # fineweb.py expands the glob itself
        command += ["--input", *paths]
    else:
        defaults = {"dataset": "HuggingFaceFW/fineweb-edu", "name": "sample-10BT", "split": "train"}
        for key, default in defaults.items():
            if source.get(key) != default:
                command += [f"--{key}", source.get(key) or ""]
    command += ["--out-dir", data_dir]
    defaults = {"text_field": "text", "prefix": "edufineweb", "shard_size": 100_000_000, "format": "npy"}
    for key, default in defaults.items():  # fineweb.py's defaults
        if config.get(key, default) != default:
            command += [f"--{key.replace('_', '-')}", str(config[key])]
    return shlex.join(command)


def check_batch_fits(batches_per_epoch, sizes, chunk, data_dir, split):
    """A batch is cut from one shard, never across two: at least one shard must hold one."""
    if batches_per_epoch == 0:
        raise UserError(
            f"the largest {split} shard in {data_dir} holds {max(sizes):,} tokens, fewer than the "
            f"{chunk + 1:,} that one batch (B*T*world_size + 1) needs: lower --batch-size or --seq-len, "
            f"or write bigger shards (fineweb.py --shard-size)"
        )


def check_same_shards(saved, names):
    """A checkpoint's data position means something only in the shards it was saved with."""
    if saved != names:
        raise UserError(
            f"the checkpoint's data position refers to {len(saved)} shards ({saved[0]}, ...), but the data "
            f"folder holds {len(names)} others: resume with the same shards, or start a new run from its "
            f"weights with --init-from"
        )


def data_identity(data_dir):
    """What a run's data is: {split: [fingerprint of each shard, in name order]} for train and val."""
    return {split: [shard_fingerprint(p) for p in find_shards(data_dir, split)] for split in ("train", "val")}


def check_same_data(saved, now, ckpt_path, data_dir):
    """A checkpoint continues only on the data its run started on (data_identity): shards written
    again (another --shard-size, other input), added or removed would put its data position in
    other tokens, and change the val set under it. Refused, naming the first shard that differs."""
    for split in ("train", "val"):
        was = {name: (size, digest) for name, size, digest in saved.get(split, [])}
        is_ = {name: (size, digest) for name, size, digest in now.get(split, [])}
        for name in sorted(set(was) | set(is_)):
            if was.get(name) == is_.get(name):
                continue
            if name not in is_:
                what = f"{name} is missing"
            elif name not in was:
                what = f"{name} is new (the run's data had no such shard)"
            elif was[name][0] != is_[name][0]:
                what = f"{name} is {is_[name][0]:,} bytes, the run's was {was[name][0]:,}"
            else:
                what = f"{name} holds other tokens than the run's (the same size)"
            raise same_on_every_rank(
                UserError(
                    f"--data-dir {data_dir} is not the data {ckpt_path} was trained on: {what}; resume on the "
                    f"run's own shards, or start a new run from its weights with --init-from {ckpt_path} in a new "
                    f"--out-dir"
                )
            )


def recorded_max_ids(data_dir):
    """{shard path: its largest token id} as fineweb.py recorded them in data_dir's manifests, for
    the shards whose fingerprint still matches the one recorded with it: a start can then check
    token ids from metadata instead of reading every shard in full. Shards without a matching
    record (llm.c .bin files, hand-made shards, older manifests) are left out, to be read."""
    known = {}
    for name in sorted(n for n in os.listdir(data_dir) if n.endswith("_manifest.json")):
        try:
            with open(os.path.join(data_dir, name), encoding="utf-8") as f:
                shards = json.load(f)["shards"]
            records = {s["file"]: (s["bytes"], s["fingerprint"], int(s["max_id"])) for s in shards if "max_id" in s}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not fineweb.py's manifest, or one from before it recorded ids: the shards are read
        for file, (size, digest, max_id) in records.items():
            path = os.path.join(data_dir, file)
            if os.path.isfile(path) and shard_fingerprint(path)[1:] == [size, digest]:
                known[path] = max_id
    return known


def check_token_ids(tokens, vocab_size, path, max_id=None):
    """An id the model has no embedding row for crashes the step whose batch holds it (a device
    assert on CUDA), possibly hours in: a shard of another tokenizer is refused up front. max_id:
    the shard's largest id as recorded when it was written (recorded_max_ids); else it is read."""
    if vocab_size is None or not len(tokens):
        return
    if (top := int(tokens.max()) if max_id is None else max_id) >= vocab_size:
        raise UserError(
            f"{path}: token id {top} is not below the model's vocab_size {vocab_size}: "
            f"written with another tokenizer? rewrite it with fineweb.py"
        )

"""The checks that refuse bad flags before step 0, not hours in: numbers the code cannot use, a
model too big for the device's memory, too little data for the batch and the run."""

import os
import sys

import torch

from support.cli import UserError, flag_type, same_on_every_rank
from support.gpu import TRAIN_BYTES_PER_PARAMETER
from support.shards import GPT2_VOCAB, MAX_VOCAB_SIZE
from support.wandb_log import wandb_problem


class Number:
    """The types of the scripts' number flags (flag_type), each beside its flag in its parser."""

    COUNT = flag_type(int, lambda n: n >= 0, "0 or more")  # steps, tokens, checkpoints: 0 is never / none
    POSITIVE = flag_type(int, lambda n: n >= 1, "at least 1")  # sizes and counts the code divides or loops by
    AMOUNT = flag_type(float, lambda x: x >= 0, "0 or more")  # weight decay, clip, temperature: 0 turns it off
    ABOVE_ZERO = flag_type(float, lambda x: x > 0, "above 0")
    FRACTION = flag_type(float, lambda x: 0 <= x < 1, "in [0, 1)")  # AdamW's betas
    FINITE = flag_type(float, lambda x: True, "finite")
    SEED = flag_type(int, lambda n: 0 <= n < 2**32, f"between 0 and {2**32 - 1:,}")  # numpy's generators (shard order)
    TORCH_SEED = flag_type(int, lambda n: -(2**63) <= n < 2**64, f"between {-(2**63)} and {2**64 - 1:,}")  # sample.py's
    # c10d counts the timeout in whole milliseconds (below 1 ms it is 0, and every wait fails at
    # once), the ranks of a job take about a second to join even on one machine, and torch turns the
    # seconds into int64 nanoseconds, which larger ones overflow
    DDP_SECONDS = flag_type(
        float,
        lambda x: 1 <= x <= 1e9,
        "a number of seconds from 1 (the ranks take about a second to join) to 1e+09 (about 31 years: torch "
        "counts it in nanoseconds)",
    )


def check_args(args, world_size, given, warmup_lr):
    """The flags against one another and the machine, as one-line errors before the run does
    anything (each flag's own range is its type's, at parse time). given: the flags given ({flag:
    "FILE, line N" of a preset, or ""}); warmup_lr(step, max_lr, warmup_steps): the recipe's warm-up."""

    def need(ok, message):
        if not ok:
            raise same_on_every_rank(UserError(message))

    need(
        args.min_lr is None or 0 <= args.min_lr <= args.max_lr,
        f"--min-lr {args.min_lr} must be between 0 and --max-lr {args.max_lr}",
    )
    need(args.n_embd % args.n_head == 0, f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    need(args.vocab_size >= GPT2_VOCAB, f"--vocab-size {args.vocab_size} is smaller than GPT-2's {GPT2_VOCAB} tokens")
    need(
        args.vocab_size <= MAX_VOCAB_SIZE,
        f"--vocab-size {args.vocab_size} is more than the {MAX_VOCAB_SIZE:,} token ids a shard can hold (uint16): "
        f"pass at most {MAX_VOCAB_SIZE} (GPT-2 has {GPT2_VOCAB:,} tokens; the default 50304 pads them to a "
        f"multiple of 128)",
    )
    preset = f" ({given['init_from']})" if given.get("init_from") else ""  # the preset's line that set it
    need(
        not (args.resume and args.init_from != "scratch"),
        f"--init-from {args.init_from}{preset} starts a new run, --resume continues one: pass one of them",
    )
    micro = args.batch_size * args.seq_len * world_size
    need(
        args.total_batch_size % micro == 0,
        f"--total-batch-size {args.total_batch_size:,} is not a multiple of B*T*world_size = "
        f"{args.batch_size}*{args.seq_len}*{world_size} = {micro:,}: change --batch-size, --seq-len or "
        f"--total-batch-size",
    )
    if args.wandb_project:  # optional: the package is checked only when asked for
        problem = wandb_problem(args.wandb_project)
        need(problem is None, problem)
    elif args.wandb_run_name and not args.resume:  # on --resume the run's project counts
        need(False, f"--wandb-run-name {args.wandb_run_name} names a wandb run: pass --wandb-project too")
    check_warmup(args, given, warmup_lr)


def check_warmup(args, given, warmup_lr):
    """A --max-steps that ends inside the warm-up (warmup_lr: the recipe's, for the lr the run's
    last step reaches). The default warm-up is refused: a short run forgot it. One asked for is
    said in a note (by rank 0), not
    refused: a run may be the first part of a longer one, continued by --resume with a larger
    --max-steps (the warm-up's lr does not depend on --max-steps, so the parts train as one run
    would), but the lr then never reaches --max-lr, which a run meant whole should hear at start."""
    if args.warmup_steps < args.max_steps:
        return
    fit = min(max(1, args.max_steps // 10), args.max_steps - 1)  # to advise: a tenth of the run, inside it
    last_lr = warmup_lr(args.max_steps - 1, args.max_lr, args.warmup_steps)
    if not args.resume and "warmup_steps" not in given:  # on resume the checkpoint's value counts
        raise same_on_every_rank(
            UserError(
                f"--max-steps {args.max_steps} ends inside the default {args.warmup_steps}-step warm-up (lr would "
                f"never pass {last_lr:.1e}): pass --warmup-steps below --max-steps (e.g. --warmup-steps {fit})"
            )
        )
    if os.environ.get("RANK", "0") == "0":
        print(
            f"note: --max-steps {args.max_steps} ends inside the {args.warmup_steps}-step warm-up (--warmup-steps): "
            f"the lr climbs to {last_lr:.1e}, never to --max-lr {args.max_lr:.1e}; fine for the start of a longer "
            f"run continued with --resume and a larger --max-steps, else pass --warmup-steps {fit}"
        )


def check_init_shape(args, given, config, master_process=True):
    """A model flag given with --init-from that differs from the model it loads (config, a dict) is
    not used: said in a note, not dropped without a word."""
    for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
        if args.init_from != "scratch" and name in given and getattr(args, name) != config[name] and master_process:
            print(
                f"note: --{name.replace('_', '-')} {getattr(args, name)} is not used: --init-from {args.init_from} "
                f"brings its own shape ({name} {config[name]})"
            )


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

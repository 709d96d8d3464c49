"""The checks that refuse bad flags before step 0, not hours in: numbers the code cannot use, a
model too big for the device's memory, too little data for the batch and the run."""

import os
import sys
from dataclasses import fields

from support.cli import UserError, same_on_every_rank
from support.gpu import TRAIN_BYTES_PER_PARAMETER, device_memory
from support.shards import GPT2_VOCAB, MAX_VOCAB_SIZE
from support.wandb_log import wandb_problem


def need(ok, message):
    """A check's one-line refusal, said alike by every rank of a torchrun job."""
    if not ok:
        raise same_on_every_rank(UserError(message))


def check_args(recipe, world_size, resume, init_from, given, warmup_lr):
    """The recipe (a Recipe, on --resume the checkpoint's with the changes given) against itself and the
    machine, and --init-from against --resume, before the run does anything (each flag's range is its
    type's). given: {flag given: "FILE, line N" of its preset, or ""}; warmup_lr: the recipe's. A
    --max-steps inside the default warm-up is refused (a short run forgot it), inside one asked for said:
    a run continued by --resume with a larger --max-steps trains as one would, but the lr never reaches
    --max-lr in a run meant whole."""
    r = recipe
    need(
        r.min_lr is None or 0 <= r.min_lr <= r.max_lr, f"--min-lr {r.min_lr} must be between 0 and --max-lr {r.max_lr}"
    )
    preset = f" ({given['init_from']})" if given.get("init_from") else ""  # the preset's line that set it
    need(
        not (resume and init_from != "scratch"),
        f"--init-from {init_from}{preset} starts a new run, --resume continues one: pass one of them",
    )
    micro = r.batch_size * r.seq_len * world_size
    need(
        r.total_batch_size % micro == 0,
        f"--total-batch-size {r.total_batch_size:,} is not a multiple of B*T*world_size = "
        f"{r.batch_size}*{r.seq_len}*{world_size} = {micro:,}: change --batch-size, --seq-len or "
        f"--total-batch-size",
    )
    if r.warmup_steps < r.max_steps:
        return
    fit = min(max(1, r.max_steps // 10), r.max_steps - 1)  # to advise: a tenth of the run, inside it
    last_lr = warmup_lr(r.max_steps - 1, r.max_lr, r.warmup_steps)
    need(
        resume or "warmup_steps" in given,  # on resume the checkpoint's value counts
        f"--max-steps {r.max_steps} ends inside the default {r.warmup_steps}-step warm-up (lr would never pass "
        f"{last_lr:.1e}): pass --warmup-steps below --max-steps (e.g. --warmup-steps {fit})",
    )
    if os.environ.get("RANK", "0") == "0":
        print(
            f"note: --max-steps {r.max_steps} ends inside the {r.warmup_steps}-step warm-up (--warmup-steps): "
            f"the lr climbs to {last_lr:.1e}, never to --max-lr {r.max_lr:.1e}; fine for the start of a longer "
            f"run continued with --resume and a larger --max-steps, else pass --warmup-steps {fit}"
        )


def check_wandb(project, run_name, resume):
    """--wandb-project's package and name (optional: checked only when asked for), and a run name
    without a project (on --resume the run's project counts)."""
    need(project or resume or not run_name, f"--wandb-run-name {run_name} names a wandb run: pass --wandb-project too")
    problem = wandb_problem(project) if project else None
    need(problem is None, problem)


def check_built_model(config, flags, seq_len, init_from, given, master_process):
    """The model the run trains (config: its GPTConfig) against the flags: -T within its block_size, and
    a model flag given (flags: the model flags as a GPTConfig) that --init-from's model does not have
    said in a note, not dropped without a word."""
    need(seq_len <= config.block_size, f"--seq-len {seq_len} is longer than the model's block_size {config.block_size}")
    for f in fields(config):
        mine, its = getattr(flags, f.name), getattr(config, f.name)
        if f.name in given and mine != its and master_process:
            print(
                f"note: --{f.name.replace('_', '-')} {mine} is not used: --init-from {init_from} brings its own "
                f"shape ({f.name} {its})"
            )


def check_model(config, device):
    """A new model's flags (config: their GPTConfig), before it is built: the heads split the width, the
    vocabulary holds GPT-2's and fits a shard's uint16, and the parameters alone, trained
    (TRAIN_BYTES_PER_PARAMETER each), fit the device's memory: building a model too big could run for
    minutes (--n-layer 1000000) before failing, and the failure could not tell which flag made it big.
    The flag named is the one behind most of the parameters."""
    C, V = config.n_embd, config.vocab_size
    need(C % config.n_head == 0, f"--n-embd {C} is not a multiple of --n-head {config.n_head}")
    need(V >= GPT2_VOCAB, f"--vocab-size {V} is smaller than GPT-2's {GPT2_VOCAB} tokens")
    need(
        V <= MAX_VOCAB_SIZE,
        f"--vocab-size {V} is more than the {MAX_VOCAB_SIZE:,} token ids a shard can hold (uint16): pass at most "
        f"{MAX_VOCAB_SIZE} (GPT-2 has {GPT2_VOCAB:,} tokens; the default 50304 pads them to a multiple of 128)",
    )
    parts = {
        "--n-embd": V * C,  # the token embedding: its rows are the vocabulary, fixed
        "--block-size": config.block_size * C,  # the position embedding
        "--n-layer or --n-embd": config.n_layer * (12 * C * C + 13 * C),
    }
    n = sum(parts.values()) + 2 * C  # and the final LayerNorm
    memory, what = device_memory(device)
    if memory is not None:  # None: unknown
        need(
            n * TRAIN_BYTES_PER_PARAMETER <= memory,
            f"the model flags make {n:,} parameters, {n * TRAIN_BYTES_PER_PARAMETER / 2**30:,.0f} GiB to train "
            f"(weights, gradients and AdamW's two moments, {TRAIN_BYTES_PER_PARAMETER} bytes each), more than "
            f"the {memory / 2**30:,.0f} GiB of {what}: lower {max(parts, key=parts.get)}",
        )


def check_data(data_dir, loader, val_tokens, n_val, total_batch_size, max_steps, master_process):
    """The data against the run, before step 0: too little for the flags is refused, a short val set
    or repeated data said. loader: the train loader (its T, its tokens_per_epoch); val_tokens: the val
    set read (None: no val shard), n_val the val tokens asked for (0: no val loss)."""
    T, tokens_per_epoch = loader.T, loader.tokens_per_epoch
    need(
        tokens_per_epoch >= total_batch_size,  # else one step would see the same tokens twice
        f"the train shards in {data_dir} hold {tokens_per_epoch:,} usable tokens, fewer than one step's "
        f"--total-batch-size {total_batch_size:,}: write more data or lower --total-batch-size",
    )
    if n_val > 0:
        need(
            n_val >= T,
            f"--val-tokens {n_val} is less than one sequence of -T {T} tokens: pass at least {T}, or --val-tokens 0 "
            f"to train without val loss",
        )
        need(
            val_tokens is not None and len(val_tokens) >= T + 1,
            f"no val shard (*_val_NNNNNN.npy or .bin) with {T + 1} tokens in {data_dir}: fineweb.py writes one (its "
            f"shard 0), or pass --eval-every 0 to train without val loss",
        )
        if master_process and len(val_tokens) < n_val + 1:
            print(f"note: the val shards hold only {len(val_tokens) - 1:,} of the --val-tokens {n_val:,}")
    run_tokens = max_steps * total_batch_size
    if master_process and run_tokens > tokens_per_epoch:
        print(
            f"warning: this run trains on {run_tokens:,} tokens but the train shards hold {tokens_per_epoch:,} "
            f"usable ones: the data repeats ({run_tokens / tokens_per_epoch:.2f} epochs)",
            file=sys.stderr,
        )

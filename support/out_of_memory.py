"""What to say when a run or an eval runs out of memory: one line saying during what, the flag to
lower, and what is on disk to go on from.

The scripts mark each phase of their work, naming it and the values its advice needs:

    with oom_phase("val loss", run=run, step=step):
        ...

An allocation that fails inside leaves with that phase attached to its exception (after any
phase inside it), and run_cli's out_of_memory hook (training_out_of_memory,
hellaswag_out_of_memory) words the innermost phase its script knows. The advice depends on the
marks alone, never on the names of the functions or variables the allocation failed in."""

from support.cli import memory_kind
from support.gpu import GiB, fitting_B, gpu_memory_of
from support.out_dir import checkpoint_paths


class oom_phase:
    """A context manager that marks a phase for the out-of-memory advice: an out-of-memory
    exception leaving it gets (name, values) added to its oom_phases, the innermost phase first."""

    def __init__(self, name, **values):
        self.name, self.values = name, values

    def __enter__(self):
        return self

    def __exit__(self, kind, e, traceback):
        if isinstance(e, Exception) and memory_kind(e) is not None:
            e.oom_phases = [*getattr(e, "oom_phases", []), (self.name, self.values)]
        return False  # the exception goes on to run_cli


def innermost_phase(e, names):
    """(name, values) of the innermost phase among names that e left, or (None, None)."""
    return next(((name, values) for name, values in getattr(e, "oom_phases", []) if name in names), (None, None))


# --- train_gpt2.py ---------------------------------------------------------------------------------

# the phases train_gpt2.py marks; their values: run (its Run), and step in the loop
TRAINING_PHASES = (
    "loading the checkpoint",
    "building the model",
    "reading the data",
    "start",  # the rest of the start-up: compile, DDP
    "sampling check",
    "training step",  # and first: whether it is this process's first step
    "val loss",
    "HellaSwag eval",
    "sampling",
    "writing the checkpoint",
    "sample-from",  # its value: args, the flags (no run)
)


def estimated_B(config, device, autocast_dtype, B, T):
    """(fitting_B below B, the GPU's bytes) where the estimate holds: the recipe's model (12 layers,
    768 wide) under autocast on a CUDA GPU; else (None, None). A B the estimate says fits has just
    run out: then the plain halving advice stands."""
    recipe = (config.n_layer, config.n_embd) == (12, 768)
    memory = gpu_memory_of(device) if recipe and autocast_dtype is not None else None
    fit = fitting_B(B, T, memory) if memory else None
    return (fit, memory) if fit and fit < B else (None, None)


def lower_B(run):
    """(the flag, the advice) for a smaller micro-batch: the estimate's B, else the next divisor down."""
    args, B = run.args, run.args.batch_size
    smaller = max(d for d in range(1, B) if B % d == 0) if B > 1 else None
    fit, memory = estimated_B(run.model.config, run.device, run.autocast_dtype, B, args.seq_len)
    why = f", which this GPU's {memory / GiB:.1f} GiB should fit, see docs/gpus.md" if fit else ""
    smaller = fit or smaller
    if not smaller:
        return None, "use a smaller model (--n-layer, --n-embd) or a shorter -T"
    return f"-B {smaller}", (
        f"lower -B (e.g. -B {smaller}{why}: the total batch stays {args.total_batch_size:,} tokens, accumulated "
        f"over more micro-steps)"
    )


def fewer_samples(n):
    """(the flag, the advice) for fewer samples at a time than --num-samples n."""
    return (f"--num-samples {n // 2}" if n > 1 else None), f"lower --num-samples {n}" + (f" (e.g. {n // 2})" * (n > 1))


def training_out_of_memory(e):
    """For run_cli: in which phase train_gpt2.py ran out of memory (the first step, an eval,
    sampling, ...), the flag to lower, and the checkpoint to go on from; None outside its phases."""
    phase, values = innermost_phase(e, TRAINING_PHASES)
    if phase is None:
        return None
    if phase == "loading the checkpoint":
        return "while loading the checkpoint: free memory for it"
    if phase == "sample-from":
        args = values["args"]
        return f"while sampling: {fewer_samples(args.num_samples)[1]} or --max-new-tokens {args.max_new_tokens}"
    run, step = values["run"], values.get("step")
    args = run.args
    if phase == "building the model":
        fix = "pick a smaller --init-from model" if args.init_from != "scratch" else "lower --n-layer or --n-embd"
        return f"while building the model: {fix if not args.resume else 'this run needs more memory than is free'}"
    if phase == "reading the data":
        return f"while reading the data: lower --val-tokens {args.val_tokens:,} or free memory"
    if phase == "start":
        return f"while starting: {lower_B(run)[1]}, or use a smaller model"
    if phase == "sampling check":  # before the log's first record: the same command with the lower setting
        return f"in the start-up sampling check: {fewer_samples(args.num_samples)[1]}"
    if phase == "training step":
        what = "in the first training step" if values["first"] else f"in training step {step}"
        what, (flag, fix) = f"{what} (-B {args.batch_size} rows of -T {args.seq_len})", lower_B(run)
    elif phase == "val loss":
        what, (flag, fix) = (
            f"in the val-loss eval at step {step} (it reads -B {args.batch_size} rows at a time)",
            lower_B(run),
        )
    elif phase == "HellaSwag eval":
        what, flag = f"in the HellaSwag eval at step {step}", "--hellaswag-every 0"
        fix = "turn it off with --hellaswag-every 0 (hellaswag.py --batch-tokens scores a checkpoint in less)"
    elif phase == "sampling":
        what, (flag, fix) = f"while sampling at step {step}", fewer_samples(args.num_samples)
        fix += f" or --max-new-tokens {args.max_new_tokens}"
    else:  # writing the checkpoint
        what, flag, fix = f"while writing the checkpoint of step {step}", None, "free host memory for it"
    newest = checkpoint_paths(args.out_dir)
    if not newest:
        return f"{what}: {fix}; no checkpoint was written yet: --resume {flag or ''} starts the run again".rstrip()
    return f"{what}: {fix}; {newest[0]} stands: continue from it with --resume" + (f" {flag}" if flag else "")


# --- hellaswag.py ----------------------------------------------------------------------------------


def hellaswag_out_of_memory(e):
    """For run_cli: hellaswag.py's flag to lower, from its "scoring HellaSwag" phase's batch_tokens."""
    phase, values = innermost_phase(e, ("scoring HellaSwag",))
    if phase is None:
        return None
    n = values["batch_tokens"]  # the one it used
    example = f" (e.g. --batch-tokens {n // 2})" if n and n > 1 else ""
    return f"while scoring HellaSwag: lower --batch-tokens{example}, or use a smaller --model"

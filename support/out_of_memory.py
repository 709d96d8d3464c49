"""What to say when a run or an eval runs out of memory: one line saying during what, the flag to
lower, and what is on disk to go on from.

A training run records its shape once its model is built (oom_run: the model, -B, -T, ...), and
marks each phase of its work as it begins, with the values of that phase alone, and goes on without
indenting the work under it:

    oom_phase("val loss", step=step)

run_cli's out_of_memory hook (training_out_of_memory, hellaswag_out_of_memory, sample_out_of_memory)
words the phase of its script marked last: the one in progress when the allocation failed. The advice depends on
the marks alone, never on the names of the functions or variables the allocation failed in. Every
phase a script marks has an entry in its script's advice table (tests/test_out_of_memory.py reads
the scripts' marks)."""

from functools import partial

from support.gpu import GiB, device_memory, fitting_B
from support.run_folder import checkpoint_paths

# module-level, not the run's: run_cli reads them after main() raised, marked by code with no handle on a run
_marked = {}  # phase name -> its values; the phase marked last is last
_run = {}  # oom_run's values: the training run the phases after it belong to


def oom_run(config, device, autocast_dtype, B, T, total_batch_size, out_dir):
    """Record the training run's shape, which the advice of its later phases reads: the model's
    config, where it runs, its autocast dtype (None: fp32), -B, -T, --total-batch-size, --out-dir."""
    _run.update(locals())  # the arguments, by name


def oom_phase(name, **values):
    """Mark phase `name`, with the values its advice reads, as the one now in progress."""
    _marked.pop(name, None)
    _marked[name] = values


def forget_phases():
    """A new start of a script in this process: no phase or run of an earlier one is in progress."""
    _marked.clear()
    _run.clear()


def advice(table):
    """The line of the phase among table's keys (a script's phases) marked last, from that phase's
    values; None before the first. With its table bound, a script's out_of_memory hook for run_cli."""
    name = next((name for name in reversed(_marked) if name in table), None)
    return None if name is None else table[name](**_marked[name])


# --- train_gpt2.py ---------------------------------------------------------------------------------


def lower_B():
    """(the flag, the advice) for a smaller micro-batch than the run's -B: the B the memory estimate
    fits where it holds (the recipe's model, 12 layers 768 wide, under autocast on a CUDA GPU), else
    the next divisor down; also when the estimate's B is not below -B (that B has just run out)."""
    config, B = _run["config"], _run["B"]
    recipe = (config.n_layer, config.n_embd) == (12, 768)
    on_gpu = recipe and _run["autocast_dtype"] is not None and _run["device"].startswith("cuda")
    memory = device_memory(_run["device"])[0] if on_gpu else None
    fit = fitting_B(B, _run["T"], memory) if memory else None
    why = f", which this GPU's {memory / GiB:.1f} GiB should fit, see docs/gpus.md" if fit and fit < B else ""
    smaller = fit if why else max((d for d in range(1, B) if B % d == 0), default=None)
    if not smaller:
        return None, "use a smaller model (--n-layer, --n-embd) or a shorter -T"
    return f"-B {smaller}", (
        f"lower -B (e.g. -B {smaller}{why}: the total batch stays {_run['total_batch_size']:,} tokens, accumulated "
        f"over more micro-steps)"
    )


def fewer_samples(n, fit=0):
    """(the flag, the advice) for fewer samples at a time than --num-samples n: half as many, or fewer
    where fit, the number the memory should hold (sample.py's estimate; 0: none), is lower."""
    m = max(1, min(n // 2, fit or n))
    return (f"--num-samples {m}" if n > 1 else None), f"lower --num-samples {n}" + (f" (e.g. {m})" * (n > 1))


def then_resume(what, flag, fix):
    """A mid-run phase's line: during what, the fix, and the checkpoint in the run's --out-dir to go on from."""
    newest = checkpoint_paths(_run["out_dir"])
    if not newest:
        with_flag = f" with {flag}" if flag else ""
        return f"{what}: {fix}; no checkpoint was written yet: start the run again{with_flag} in a new --out-dir"
    return f"{what}: {fix}; {newest[0]} stands: continue from it with --resume" + (f" {flag}" if flag else "")


def _building(init_from, resume):
    fix = "pick a smaller --init-from model" if init_from != "scratch" else "lower --n-layer or --n-embd"
    return f"while building the model: {fix if not resume else 'this run needs more memory than is free'}"


def _training_step(step, first):
    what = "in the first training step" if first else f"in training step {step}"
    return then_resume(f"{what} (-B {_run['B']} rows of -T {_run['T']})", *lower_B())


def _sampling(step, num_samples, max_new_tokens):
    flag, fix = fewer_samples(num_samples)
    return then_resume(f"while sampling at step {step}", flag, f"{fix} or --max-new-tokens {max_new_tokens}")


# each phase train_gpt2.py (and the support functions it calls) marks -> the line for it, from the
# values the phase carries (and, from "start" on, the run's: oom_run)
TRAINING_ADVICE = {
    "loading the checkpoint": lambda: "while loading the checkpoint: free memory for it",
    "building the model": _building,
    "reading the data": lambda val_tokens: f"while reading the data: lower --val-tokens {val_tokens:,} or free memory",
    "start": lambda: f"while starting: {lower_B()[1]}, or use a smaller model",  # compile, DDP
    # before the log's first record: the same command with the lower setting
    "sampling check": lambda num_samples: f"in the start-up sampling check: {fewer_samples(num_samples)[1]}",
    "training step": _training_step,
    "val loss": lambda step: then_resume(
        f"in the val-loss eval at step {step} (it reads -B {_run['B']} rows at a time)", *lower_B()
    ),
    "HellaSwag eval": lambda step: then_resume(
        f"in the HellaSwag eval at step {step}",
        "--hellaswag-every 0",
        "turn it off with --hellaswag-every 0 (hellaswag.py --batch-tokens scores a checkpoint in less)",
    ),
    "sampling": _sampling,
    "writing the checkpoint": lambda step: then_resume(
        f"while writing the checkpoint of step {step}", None, "free host memory for it"
    ),
}
training_out_of_memory = partial(advice, TRAINING_ADVICE)


# --- hellaswag.py ----------------------------------------------------------------------------------


def _scoring(batch_tokens):
    example = f" (e.g. --batch-tokens {batch_tokens // 2})" if batch_tokens and batch_tokens > 1 else ""
    return f"while scoring HellaSwag: lower --batch-tokens{example}, or use a smaller --model"


HELLASWAG_ADVICE = {"scoring HellaSwag": _scoring}  # batch_tokens: the one it used
hellaswag_out_of_memory = partial(advice, HELLASWAG_ADVICE)


# --- sample.py -------------------------------------------------------------------------------------

SAMPLE_ADVICE = {
    "drawing samples": lambda num_samples, max_new_tokens, fit: (
        f"while sampling: {fewer_samples(num_samples, fit)[1]} or --max-new-tokens {max_new_tokens}"
    )
}
sample_out_of_memory = partial(advice, SAMPLE_ADVICE)

"""
Everything a training run needs that is not the recipe, moved out of train_gpt2.py so that the
recipe reads top to bottom in one file: nothing here changes what the recipe computes.

It holds the checks that refuse bad flags and data before step 0, the run's folder and who owns
it, checkpoint files (save, prune, find, load) and what --resume takes from them, random-number
state, stop signals, the run log, the non-finite guard, conversion to and from transformers'
GPT-2 layout (state dicts in, state dicts out), and machine settings (glibc's allocator,
--deterministic, the peak-FLOPs table). It also holds what every script shares: the error type
and the command-line wrapper that prints it as one line, atomic writes, the offline probe.

It never imports train_gpt2: it works on plain values (state dicts, config dicts, paths, parsed
args). torch is imported inside the functions that use it, because fineweb.py shares this
module's error type and atomic writes and must start without loading torch.
"""

import ctypes
import errno
import json
import math
import os
import platform
import queue
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import zipfile
from dataclasses import asdict

import numpy as np

GPT2_VOCAB = 50257  # real GPT-2 vocabulary; ids >= this are padding and are never sampled
MAX_DDP_TIMEOUT = 1e9  # seconds: torch turns --ddp-timeout into int64 nanoseconds (larger ones overflow)
HF_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


# ----------------------------------------------------------------------------------------------
# What every script shares: one-line errors, atomic writes, the offline probe


class UserError(Exception):
    """A mistake in the user's input: reported as one line, exit code 1, no traceback.
    every_rank: every process of a torchrun job raises the same one (a flag, the recipe), so
    only rank 0 says it."""

    every_rank = False


def same_on_every_rank(error):
    """error, marked as one that every rank of a torchrun job raises alike (UserError.every_rank)."""
    error.every_rank = True
    return error


def first_line(e):
    """The first line of an exception's message (or its type's name): enough for a one-line error."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def write_atomic(path, write, mode="wb"):
    """write(f) into a hidden temporary file beside path, fsync it, then rename it over path:
    readers and a resumed run see the whole old file or the whole new one, never half of one.
    The temporary file is removed on any failure, a full disk and Ctrl-C included."""
    tmp = os.path.join(os.path.dirname(path) or ".", "." + os.path.basename(path) + ".tmp")
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it count
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):  # a full disk: give back the space the partial file holds
            os.remove(tmp)
        raise


def write_dir_atomic(out_dir, write, what, recheck=None):
    """write(tmp) fills a hidden folder beside out_dir, which then takes out_dir's place (a folder
    already there is renamed aside first and deleted last: the caller checked it may go). On any
    failure, a full disk, Ctrl-C and SIGTERM included, the hidden folders and the parents this
    made are removed and out_dir is as it was. recheck(), if given, runs right before the swap."""
    parent = os.path.dirname(out_dir)
    made = []  # parent folders this call creates, deepest first
    d = parent
    while not os.path.isdir(d):
        made.append(d)
        d = os.path.dirname(d)
    tmp = old = None

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt  # a kill mid-write cleans up as Ctrl-C does

    main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp_", dir=parent)
        # mkdtemp makes it private (0700): give it the mode of the folder it replaces, or else
        # the one os.mkdir would give a new folder
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, os.stat(out_dir).st_mode & 0o7777 if os.path.isdir(out_dir) else 0o777 & ~umask)
        write(tmp)
        if recheck:
            recheck()
        if os.path.isdir(out_dir) and os.listdir(out_dir):
            old = os.path.join(parent, f".old_{os.getpid()}_{os.path.basename(out_dir)}")
            os.replace(out_dir, old)
        try:
            os.replace(tmp, out_dir)
        except BaseException:
            if old:
                os.replace(old, out_dir)  # put the earlier folder back
                old = None
            raise
        tmp = None
        if old:
            shutil.rmtree(old)
    except BaseException as e:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        for d in made:
            try:
                os.rmdir(d)
            except OSError:
                pass  # not empty: someone else wrote there meanwhile
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":  # safetensors' failed write
            reason = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
            reason = re.sub(r".*I/O error: (.*) \(os error \d+\).*", r"\1", reason)  # safetensors' wording
            full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in reason
            fix = "make room or choose another folder" if full else "choose a folder you can write to"
            raise UserError(f"cannot write {what} to {out_dir} ({reason}): nothing was changed; {fix}") from None
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def offline_var(names=("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")):
    """The first of these variables set to a true value, as huggingface_hub reads them, or None."""
    return next((v for v in names if os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")), None)


def unreachable(url, timeout=3.0):
    """Why no TCP connection to url's host opens within timeout seconds, in words, or None. Offline,
    the Hub and HTTP clients retry for half a minute and then say nothing about offline use; this
    says it at once. With an https proxy set, the proxy is what must answer."""
    proxy = urllib.request.getproxies().get("https")
    parts = urllib.parse.urlsplit(proxy or url)
    host, port = parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443)
    outcome = []

    def probe():  # in a thread: a resolver that never answers must not hold the program either
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(e)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"no answer in {timeout:.0f} s"
    return None if outcome[0] is None else first_line(outcome[0])


class OutlivesItsReader:
    """sys.stdout / sys.stderr that survive their reader going away (`| head`, a `| tee` that died
    with the ssh session that started it, a terminal that hung up): the first write that fails
    (BrokenPipeError, EIO) points the stream at /dev/null and the program carries on, where print
    would raise and end it. A training run's record is log.jsonl and its checkpoints."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError:
            self._to_devnull()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            self._to_devnull()

    def _to_devnull(self):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())  # the same file descriptor, now writing nowhere
        os.close(devnull)

    def __getattr__(self, name):  # fileno, isatty, encoding, ... of the real stream
        return getattr(self.stream, name)


def run_cli(main, interrupted="interrupted", out_of_memory=None):
    """Run a script's main(): a UserError is one `error:` line and exit 1, Ctrl-C the one line
    `interrupted` and exit 130 (the shell's code for SIGINT); anything else is a bug and keeps
    its traceback. Output to a pipe that closes is dropped (OutlivesItsReader), not fatal.
    Running out of memory is one `error:` line too: out_of_memory(frames) says during what and
    which flag to lower (see out_of_memory_line). Under torchrun a mistake every rank makes
    alike (UserError.every_rank) is said by rank 0 alone."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises KeyboardInterrupt from here on
    sys.stdout, sys.stderr = OutlivesItsReader(sys.stdout), OutlivesItsReader(sys.stderr)
    try:
        code = main()
    except UserError as e:
        if not (e.every_rank and os.environ.get("RANK", "0") != "0"):
            print(f"error: {e}", file=sys.stderr)
        code = 1
    except Exception as e:
        memory = memory_kind(e)
        if memory is None:
            raise  # a bug: its traceback
        print(f"error: {out_of_memory_line(e, memory, out_of_memory)}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


def memory_kind(e):
    """'GPU memory' or 'host memory' when e (or what caused it) is an allocation that failed, else
    None. torch raises OutOfMemoryError on CUDA, a RuntimeError from its CPU allocator, and
    MemoryError comes from numpy and Python; torch.compile wraps what it meets in its own types."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if isinstance(e, MemoryError) or re.search(r"can't allocate memory|Cannot allocate memory", text):
            return "host memory"
        if type(e).__name__ == "OutOfMemoryError" or re.search(r"(CUDA|MPS backend|HIP) out of memory", text):
            return "GPU memory"
        e = e.__cause__ or e.__context__
    return None


def traceback_frames(e):
    """[(function name, its locals, its file's name)] of the frames e passed through, outermost first."""
    frames, tb = [], e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append((code.co_name, tb.tb_frame.f_locals, os.path.basename(code.co_filename)))
        tb = tb.tb_next
    return frames


def out_of_memory_line(e, memory, advice=None):
    """'out of host memory ...' and during what and what to lower, from advice(frames) (default:
    the advice of the script whose main() it is); else the allocator's own words, cut short."""
    said = re.sub(r"\[enforce fail at [^]]*\] *(err == 0\. *)?", "", first_line(e))
    said = re.sub(r"(Tried to allocate [\d.]+ [KMGT]iB)\..*", r"\1", said)  # CUDA's: the size, not its stats
    frames = traceback_frames(e)
    if advice is None:
        script = next((file for name, _, file in frames if name == "main"), None)
        advice = {"train_gpt2.py": training_out_of_memory, "hellaswag.py": hellaswag_out_of_memory}.get(script)
    where = advice([(name, local) for name, local, _ in frames]) if advice else None
    return f"out of {memory} {where}" if where else f"out of {memory} ({said})"


def hellaswag_out_of_memory(frames):
    """For out_of_memory_line: hellaswag.py's flag to lower."""
    if not any(name == "ending_losses" for name, _ in frames):
        return None
    n = next((f.get("batch_tokens") for name, f in frames if name == "ending_losses"), None)  # the one it used
    example = f" (e.g. --batch-tokens {n // 2})" if n and n > 1 else ""
    return f"while scoring HellaSwag: lower --batch-tokens{example}, or use a smaller --model"


def training_out_of_memory(frames):
    """For out_of_memory_line, from the frames of a train_gpt2.py run that ran out of memory: during
    what (the first step, an eval, sampling, ...), the flag to lower, and what is on disk to go on
    from; None where the frames hold no parsed flags."""
    names = {name for name, _ in frames}
    train = {k: v for name, f in frames if name in ("main", "train", "run_evals") for k, v in f.items()}
    args = train.get("args")
    if args is None or not hasattr(args, "batch_size"):
        return None
    B, step, start = args.batch_size, train.get("step"), train.get("start_step") or 0
    smaller = max(d for d in range(1, B) if B % d == 0) if B > 1 else None
    lower_B = (
        f"-B {smaller}" if smaller else None,
        f"lower -B (e.g. -B {smaller}: the total batch stays {args.total_batch_size:,} tokens, accumulated "
        f"over more micro-steps)"
        if smaller
        else "use a smaller model (--n-layer, --n-embd) or a shorter -T",
    )
    n = args.num_samples
    fewer = (f"--num-samples {n // 2}" if n > 1 else None, f"lower --num-samples {n}" + (f" (e.g. {n // 2})" * (n > 1)))
    if names & {"sample_text", "generate", "print_samples"}:
        if "run_evals" in names:
            what, (flag, fix) = f"while sampling at step {step}", fewer
            fix += f" or --max-new-tokens {args.max_new_tokens}"
        elif "prepare_side_evals" in names:
            what, (flag, fix) = "in the start-up sampling check", fewer
        else:
            return f"while sampling: {fewer[1]} or --max-new-tokens {args.max_new_tokens}"
    elif "evaluate_val_loss" in names:
        what, (flag, fix) = f"in the val-loss eval at step {step} (it reads -B {B} rows at a time)", lower_B
    elif "evaluate_all_ranks" in names:
        what, flag = f"in the HellaSwag eval at step {step}", "--hellaswag-every 0"
        fix = "turn it off with --hellaswag-every 0 (hellaswag.py --batch-tokens scores a checkpoint in less)"
    elif names & {"save_training_state", "save_checkpoint"}:
        what, flag, fix = f"while writing the checkpoint of step {step}", None, "free host memory for it"
    elif names & {"build_model", "load_model", "model_from_checkpoint", "from_pretrained"}:
        fix = "pick a smaller --init-from model" if args.init_from != "scratch" else "lower --n-layer or --n-embd"
        return f"while building the model: {fix if not args.resume else 'this run needs more memory than is free'}"
    elif names & {"resume_checkpoint", "load_training_checkpoint", "load_checkpoint"}:
        return "while loading the checkpoint: free memory for it"
    elif names & {"load_val_tokens", "load_shard"}:
        return f"while reading the data: lower --val-tokens {args.val_tokens:,} or free memory"
    elif step is not None:
        what = "in the first training step" if step == start else f"in training step {step}"
        what, (flag, fix) = f"{what} (-B {B} rows of -T {args.seq_len})", lower_B
    else:
        return f"while starting: {lower_B[1]}, or use a smaller model"
    if step is None:  # before the log's first record: the same command with the lower setting
        return f"{what}: {fix}"
    newest = checkpoint_paths(args.out_dir)
    if not newest:
        return f"{what}: {fix}; no checkpoint was written yet: --resume {flag or ''} starts the run again".rstrip()
    return f"{what}: {fix}; {newest[0]} stands: continue from it with --resume" + (f" {flag}" if flag else "")


# ----------------------------------------------------------------------------------------------
# Flags, data and prompts: refused before step 0, not hours in


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
        0 < args.ddp_timeout <= MAX_DDP_TIMEOUT,
        f"--ddp-timeout must be a number of seconds above 0 and at most {MAX_DDP_TIMEOUT:.0e} (about 31 years: "
        f"torch counts it in nanoseconds), not {args.ddp_timeout}",
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
    --max-tokens / --max-shards is finished as asked."""
    for name in sorted(n for n in os.listdir(data_dir) if n.endswith("_manifest.json")):
        try:
            with open(os.path.join(data_dir, name), encoding="utf-8") as f:
                manifest = json.load(f)
            config, finished = manifest["config"], manifest["complete"] or manifest.get("limit") is not None
            command = fineweb_command(config, data_dir)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
            continue  # not fineweb.py's manifest
        if not finished:
            raise UserError(
                f"--data-dir {data_dir} is unfinished: its {name} says fineweb.py has not written all of its "
                f"input (it is still writing, or it was stopped); finish it with `{command}` (or wait for the "
                f"fineweb.py writing it), then start the run"
            )


def fineweb_command(config, data_dir):
    """The fineweb.py command that writes (and, rerun, finishes) the shards a manifest's config
    describes into data_dir: its flags that differ from fineweb.py's defaults."""
    import glob
    import shlex

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


def shard_fingerprint(path, blocks=16, block=4096):
    """[name, bytes, digest] of a token shard: its size and a blake2b of its first and last
    `block` bytes (the header and the first tokens) and of `blocks` blocks spread evenly between.
    About 70 KB read whatever the shard's size: cheap enough for every start to check them all."""
    import hashlib

    size, digest = os.path.getsize(path), hashlib.blake2b(digest_size=16)
    fd = os.open(path, os.O_RDONLY)
    try:
        last = max(0, size - block)
        for i in range(blocks + 2):
            digest.update(os.pread(fd, block, last * i // (blocks + 1)))
    finally:
        os.close(fd)
    return [os.path.basename(path), size, digest.hexdigest()]


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


def check_token_ids(tokens, vocab_size, path):
    """An id the model has no embedding row for crashes the step whose batch holds it (a device
    assert on CUDA), possibly hours in: a shard of another tokenizer is refused up front."""
    if vocab_size is not None and len(tokens) and (top := int(tokens.max())) >= vocab_size:
        raise UserError(
            f"{path}: token id {top} is not below the model's vocab_size {vocab_size}: "
            f"written with another tokenizer? rewrite it with fineweb.py"
        )


def encode_prompt(enc, prompt, block_size):
    """The prompt's tokens; an empty prompt starts from <|endoftext|>, as a new document would."""
    tokens = enc.encode(prompt, allowed_special={"<|endoftext|>"}) if prompt else [enc.eot_token]
    if len(tokens) >= block_size:
        raise UserError(f"--prompt is {len(tokens)} tokens, the model reads at most {block_size - 1} before a new one")
    return tokens


def sample_text(
    model, enc, prompt, num_samples=4, max_new_tokens=32, temperature=1.0, top_k=50, seed=42, compile=False
):
    """Decode num_samples continuations of prompt; the same seed gives the same text.
    compile: a compiled (on CUDA, graph-captured) decode step, kept on the model for the next call."""
    import torch

    device = next(model.parameters()).device
    # a literal <|endoftext|> in the prompt is the token itself, as in the training data
    tokens = torch.tensor(enc.encode(prompt, allowed_special={"<|endoftext|>"}), dtype=torch.long, device=device)
    idx = tokens.unsqueeze(0).repeat(num_samples, 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature, top_k, generator, compile=compile)
    return [enc.decode(row.tolist()) for row in out]


def print_samples(model, enc, args):
    """--sample-from: samples of --prompt with the sampling flags, printed one per line."""
    block_size = model.config.block_size
    tokens = encode_prompt(enc, args.prompt, block_size)
    note_if_samples_stop_early(len(tokens), args.max_new_tokens, block_size)
    top_k = args.top_k or None  # 0: all
    texts = sample_text(
        model, enc, enc.decode(tokens), args.num_samples, args.max_new_tokens, args.temperature, top_k, args.seed
    )
    for i, text in enumerate(texts):
        print(f"sample {i}: {text}")


def note_if_samples_stop_early(n_prompt, max_new_tokens, block_size):
    """generate stops at the model's window: say so when the prompt and --max-new-tokens overrun it."""
    room = block_size - n_prompt
    if max_new_tokens > room:
        print(
            f"note: samples stop at the model's {block_size}-token window: {room} new tokens after the "
            f"{n_prompt}-token prompt, not --max-new-tokens {max_new_tokens}"
        )


# ----------------------------------------------------------------------------------------------
# The machine: its peak FLOP/s, its allocator, deterministic kernels

# peak dense bf16 tensor-core FLOP/s from NVIDIA's datasheets, matched in this order against
# torch.cuda.get_device_name(); anything else needs --peak-flops for an MFU figure
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),
    ("A100", 312e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


def peak_flops(device_name):
    for name, flops in PEAK_FLOPS:
        if name in device_name:
            return flops
    return None


def keep_freed_memory():
    """Make glibc's malloc keep the memory a CPU run frees, for the next step to reuse.

    On a CPU the activations and the (B, T, vocab) logits live in the C heap. glibc gives every
    block above its mmap threshold its own mmap and unmaps it when freed (and trims the heap's
    top likewise), so each step the kernel maps and zeroes those pages afresh: for small models
    that page faulting costs as much as the compute. Kept, the memory is reused (bench.py
    measures the gain). The cost: the heap holds its high-water mark, the step's and the evals'
    layouts side by side (about twice the peak RSS). A no-op where libc is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # macOS, musl: another allocator, nothing to set
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1


def set_deterministic(device_type):
    """Bitwise-reproducible training: the same seed, data and GPU count give the same losses and
    weights, run after run and across a --resume. On a CPU the kernels already are; on CUDA
    several default kernels add up partial sums in whatever order threads finish (atomics), so
    the last bits of the gradients change from run to run. Call before any CUDA work."""
    import torch
    import torch._inductor.config as inductor_config

    if device_type == "cuda":
        # cuBLAS reads this when it creates its handle (first matmul): a fixed workspace per
        # stream, without which its kernels may split a sum differently from call to call
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False  # benchmarking may pick another algorithm each run
        # SDPA: cuDNN attention's backward accumulates with atomics; flash and memory-efficient
        # attention switch to their deterministic backward under use_deterministic_algorithms
        torch.backends.cuda.enable_cudnn_sdp(False)
    # an op with no deterministic kernel now raises instead of running nondeterministically;
    # embedding backward and index_put take their sorted (deterministic) paths
    torch.use_deterministic_algorithms(True)
    # torch.compile: Inductor picks no kernel config by timing it where that changes the numerics
    inductor_config.deterministic = True


# ----------------------------------------------------------------------------------------------
# Checkpoints, resume and the out-dir


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
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("train_config") or {}
    except Exception:
        return {}


def run_id_of(path):
    """The run a checkpoint belongs to; mmap reads only the small pickled part, not the tensors."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("run_id")
    except Exception:
        return None


def save_checkpoint(ckpt, out_dir, keep):
    """Write ckpt_<step>.pt atomically (a kill mid-write never leaves a half checkpoint under the
    real name), then delete this run's checkpoints beyond the newest `keep`: another run's
    files are never touched."""
    import torch

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
    RNG state, the flags (train_config), the run's id and its last val loss. `run` is the training
    script's Run (model, optimizer, loader, args, dist_info, device, run_id, val_loss)."""
    dist_info, args = run.dist_info, run.args
    check_finite_state(step, run)
    rng = all_rng_states(run.device.split(":")[0], dist_info.ddp, dist_info.ddp_world_size)
    if dist_info.master_process:
        ckpt = {"model": run.model.state_dict(), "model_config": asdict(run.model.config), "step": step}
        ckpt.update(optimizer=run.optimizer.state_dict(), data=run.loader.state_dict(), rng=rng)
        ckpt.update(data_identity=getattr(run.loader, "identity", None))  # the shards the run started on
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
    import torch

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
    redoes steps) is a trained step, not a skipped one (a NaN or inf) nor missing (not trained yet)."""
    trained = {}
    try:
        with open(os.path.join(out_dir, "log.jsonl"), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if isinstance(record, dict) and ("train_loss" in record or "skipped" in record):
                    trained[record.get("step")] = "train_loss" in record
    except OSError:
        pass
    health = []
    for path in checkpoint_paths(out_dir):
        step = int(re.findall(r"\d+", os.path.basename(path))[-1])
        health.append((path, trained.get(step, False)))
    return health


def diverged_advice(out_dir, max_lr):
    """What to do after a divergence: go on from the newest checkpoint whose weights are known good
    (checkpoint_health) with a lower --max-lr, an allowed change on --resume; with none, start anew."""
    good = [path for path, known_good in checkpoint_health(out_dir) if known_good]
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
    import datetime

    import torch.distributed as dist

    if not _fence_group:
        seconds = max(FENCE_TIMEOUT, timeout or 0)
        _fence_group.append(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds)))
    dist.barrier(group=_fence_group[0])
    return _fence_group[0]


def load_checkpoint(path):
    """Our checkpoint as a dict of tensors and plain values. weights_only=True: a checkpoint
    carrying pickled code is refused instead of run."""
    import torch

    try:
        # torch.save writes a zip with a CRC per tensor, which torch.load never checks: without
        # this, a flipped bit on disk loads as silently wrong weights
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
        ckpt = torch.load(path, map_location="cpu", weights_only=True) if bad is None else None
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


def find_resume_checkpoint(resume, out_dir):
    """(path, checkpoint) for --resume: the given file, or for 'latest' the newest checkpoint in
    out_dir that loads; one that does not (cut short, corrupt) is reported and the previous one
    tried. (None, None) when out_dir has no checkpoint at all: the run starts from step 0."""
    if resume != "latest":
        return resume, load_training_checkpoint(resume)
    paths = checkpoint_paths(out_dir)
    for path in paths:
        try:
            return path, load_training_checkpoint(path)
        except UserError as e:
            print(f"warning: skipping {path}: {e}", file=sys.stderr)
    if paths:
        raise UserError(f"none of the {len(paths)} checkpoints in {out_dir} can be loaded: see the warnings above")
    print(f"no checkpoint in {out_dir} to resume from: starting a new run")
    return None, None


def missing_folders(path):
    """The folders of path that do not exist yet, deepest first: those os.makedirs would create."""
    path, missing = os.path.abspath(path), []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


LOCK_FILE = ".train_gpt2.lock"  # in --out-dir while a run holds it; its text names that run's process
_claim = {}  # this process's hold on its --out-dir (claim_out_dir), given back by release_out_dir


def claim_out_dir(out_dir, resume):
    """An out-dir belongs to one run: a new run next to another run's checkpoints would have them
    pruned instead of its own and its log drawn as one curve with theirs, so it is refused. The
    folder is locked for this process's life (lock_out_dir), and what it holds is noted, so that a
    start that fails leaves it as it was (release_out_dir). Rank 0 alone claims it."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create --out-dir {out_dir}: {e.strerror}") from None
    if _claim:  # an earlier run of this process that did not end through main: its hold goes first
        release_out_dir()
    fd = lock_out_dir(out_dir, "continue with --resume" if resume else "start again")
    log = os.path.join(out_dir, "log.jsonl")
    _claim.update(out_dir=out_dir, fd=fd, log=os.path.getsize(log) if os.path.isfile(log) else None)
    _claim.update(checkpoints=_file_stats(checkpoint_paths(out_dir)))
    names = os.listdir(out_dir)
    theirs = sorted(n for n in names if re.fullmatch(r"ckpt_\d+\.pt", n))
    runs, unreadable = log_runs(log)
    if os.path.lexists(log) and (theirs or runs or unreadable):
        theirs = sorted([*theirs, "log.jsonl"])
    if theirs and not resume:
        raise UserError(
            f"--out-dir {out_dir} holds another run ({', '.join(theirs[:3])}): continue it with --resume, "
            f"or pass a new --out-dir"
        )
    if os.path.lexists(log) and "log.jsonl" not in theirs:
        print(f"note: {log} holds only the start of a run that never trained a step: this run's records follow it")
    for name in names:  # a checkpoint write of this run cut short by a kill: never complete
        if re.fullmatch(r"\.ckpt_\d+\.pt\.tmp", name):
            print(f"removing the unfinished {name}")
            try:
                os.remove(os.path.join(out_dir, name))
            except OSError as e:  # a read-only folder: the run could write nothing there either
                raise disk_error(e, f"to --out-dir {out_dir} (removing {name})", "continue with --resume") from None


def lock_out_dir(out_dir, then):
    """Hold an exclusive lock on out_dir while this process lives: flock on its LOCK_FILE, which
    the OS releases when the process ends, a SIGKILL included (no stale lock to remove by hand).
    A second run into the folder, new or --resume, is refused in one line naming the process that
    holds it (the file's text). Returns the locked file's descriptor; None where the file system
    has no locks (said in a warning)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    path = os.path.join(out_dir, LOCK_FILE)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise disk_error(e, f"to --out-dir {out_dir} (its lock file {LOCK_FILE})", then) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "a process that is just starting"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise UserError(
                    f"--out-dir {out_dir} is in use by another run ({holder}): wait for it to end, or pass "
                    f"another --out-dir"
                ) from None
            print(
                f"warning: cannot lock --out-dir {out_dir} ({e.strerror}): a second run started into it would "
                f"not be stopped",
                file=sys.stderr,
            )
            return None
        try:  # the file locked must be the one at path: a run that ended removes its file, a newer run makes one
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    command = " ".join(["python", os.path.basename(sys.argv[0]), *sys.argv[1:]]).replace("\n", " ")
    command = command if len(command) <= 160 else command[:157] + "..."
    rank = " (rank 0 of a torchrun job)" if "RANK" in os.environ else ""
    holder = f"pid {os.getpid()}{rank} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}: {command}"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
    except OSError:
        pass  # a full disk: the lock holds all the same, unnamed
    return fd


def release_out_dir():
    """As the process ends (train_gpt2.main's finally): a start that failed (an exception on its
    way out) before its first step and before any checkpoint leaves the folder as it found it:
    the log records it added are cut off again (the log removed, if it made it), so that the same
    command retried does not find "another run" there. Then the lock is given back."""
    claim = dict(_claim)
    _claim.clear()
    if not claim:
        return
    try:
        if sys.exc_info()[0] is not None:
            undo_failed_start(claim)
    finally:
        if claim["fd"] is not None:
            try:
                os.remove(os.path.join(claim["out_dir"], LOCK_FILE))  # still held: no one locks it meanwhile
            except OSError:
                pass
            os.close(claim["fd"])


def undo_failed_start(claim):
    """Cut log.jsonl back to what it held at claim_out_dir, unless the run logged a step or wrote a
    checkpoint since (then there is a run to continue)."""
    out_dir, before = claim["out_dir"], claim["log"]
    log = os.path.join(out_dir, "log.jsonl")
    if _file_stats(checkpoint_paths(out_dir)) != claim["checkpoints"] or not os.path.isfile(log):
        return
    try:
        with open(log, "rb") as f:
            f.seek(before or 0)
            added = [line for line in f.read().split(b"\n") if line.strip()]
        if any(b'"train_loss"' in line or b'"skipped"' in line for line in added):
            return
        if before is None:
            os.remove(log)
        else:
            os.truncate(log, before)
    except OSError:
        pass  # a read-only or vanished folder: nothing this run could have changed either


def _file_stats(paths):
    """{path: (inode, size, mtime)}: a file written since is told apart from one that was there."""
    stats = {}
    for path in paths:
        try:
            st = os.stat(path)
            stats[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            pass
    return stats


def log_runs(path):
    """(the ids of the runs log.jsonl records a trained or skipped step of, in order; whether it
    holds a line that is not a record of ours). A start that failed before its first step (its
    header, perhaps a step-0 eval) is no run. A last line cut short by a kill is passed over."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return [], False
    except OSError:  # a folder named log.jsonl, an unreadable file: someone's
        return [], True
    runs, current, records = [], None, 0
    for i, line in enumerate(lines):
        line = line.strip()
        if not line:
            continue
        if not (line.startswith(b"{") and line.endswith(b"}")):
            if i == len(lines) - 1 and records:
                continue  # the last line, cut short by a kill
            return runs, True
        records += 1
        if b'"header"' in line:
            try:
                record = json.loads(line)
            except ValueError:
                return runs, True
            if isinstance(record, dict) and record.get("event") == "header":
                current = record.get("run_id")
                continue
        if (b'"train_loss"' in line or b'"skipped"' in line) and current not in runs:
            runs.append(current)
    return runs, False


def other_runs(out_dir, run_id, skip=None):
    """The files in out_dir of runs other than run_id: checkpoints (one whose run cannot be read
    counts) and log.jsonl when it records another run's steps or is not our log."""
    runs, unreadable = log_runs(os.path.join(out_dir, "log.jsonl"))
    found = ["log.jsonl"] if unreadable or any(r != run_id for r in runs) else []
    for path in checkpoint_paths(out_dir):
        if not (skip and os.path.realpath(path) == os.path.realpath(skip)) and run_id_of(path) != run_id:
            found.append(os.path.basename(path))
    return found


def check_resume_target(args, path, ckpt):
    """--resume CKPT continues CKPT's run in --out-dir: refused, before anything is written, when
    that folder holds another run (its checkpoints would be overwritten, pruned, and its log mixed
    with this one's); a folder new to the run is fine, and said."""
    if args.resume == "latest":  # the folder's own newest checkpoint: its run is the folder's
        return
    run_id, out_dir, folder = ckpt.get("run_id", path), args.out_dir, os.path.dirname(path) or "."
    others = other_runs(out_dir, run_id, skip=path)
    if others:
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        raise UserError(
            f"--resume {path} continues run {run_id}, but --out-dir {out_dir} holds another run "
            f"({', '.join(others[:3])}{more}): its checkpoints would be overwritten and its log mixed with this "
            f"run's; pass a new or empty --out-dir, or --out-dir {folder} (the run's own folder)"
        )
    if os.path.realpath(folder) != os.path.realpath(out_dir) and not checkpoint_paths(out_dir):
        print(
            f"note: run {run_id} continues from {path} in --out-dir {out_dir}; its log and checkpoints up to "
            f"step {ckpt.get('step')} stay in {folder}"
        )


def remove_made_folders(made):
    """Remove the folders a refused start created (missing_folders' list), while still empty: a
    typo'd flag leaves no empty --out-dir behind, and a folder the run wrote to stays."""
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:
            break


# The recipe a checkpoint was trained with. On --resume a flag left out takes the checkpoint's
# value, so `--resume` alone continues the run as it was; a flag given with another value is a
# contradiction, refused, except for the changes below, which are allowed and reported.
RECIPE_FLAGS = (
    "total_batch_size",
    "seq_len",
    "max_lr",
    "min_lr",
    "warmup_steps",
    "max_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "adam_eps",
    "grad_clip",
    "seed",
    "no_shuffle",
    "n_layer",
    "n_head",
    "n_embd",
    "vocab_size",
    "block_size",
    "batch_size",
)
ALLOWED_CHANGES = {
    "max_steps": "the cosine schedule is re-stretched from here to the new last step",
    "batch_size": "the same batch in other micro-batches: equal up to float rounding, not bitwise",
    "max_lr": "the schedule goes on from here with the new peak (after a divergence: from an earlier checkpoint)",
    "min_lr": "the cosine ends at the new floor",
}
# The run's other settings: left out on --resume they are the checkpoint's too (`--resume log_tiny`
# reads the same data and evaluates as before, rather than the defaults' edu_fineweb10B and
# HellaSwag every 250 steps, and logs to the same wandb project); given, they change from here on
# (--wandb-project '' stops the logging to wandb). The device, dtype, compile, --peak-flops and
# --ddp-timeout are the machine's: a run may continue on another one.
RUN_SETTINGS = (
    "data_dir",
    "eval_every",
    "val_tokens",
    "hellaswag_every",
    "hellaswag_limit",
    "hellaswag_data",
    "sample_every",
    "ckpt_every",
    "keep_ckpts",
    "prompt",
    "num_samples",
    "max_new_tokens",
    "temperature",
    "top_k",
    "deterministic",
    "wandb_project",
    "wandb_run_name",
)


def reconcile_resume(args, given, ckpt, ckpt_path):
    """Fill args from the checkpoint's recipe and settings; refuse contradictions. Returns the
    allowed changes as {flag: [checkpoint's value, new value]} and the settings taken from the
    checkpoint as {flag: value}."""
    old, changes = ckpt.get("train_config", {}), {}
    taken = {n: old[n] for n in RUN_SETTINGS if n in old and n not in given and old[n] != getattr(args, n)}
    for name, value in taken.items():
        setattr(args, name, value)
    for name in RECIPE_FLAGS:
        if name not in old or old[name] == getattr(args, name):
            continue
        flag = "--" + name.replace("_", "-")
        if name not in given:
            setattr(args, name, old[name])
        elif name not in ALLOWED_CHANGES:
            message = (
                f"{flag} {getattr(args, name)} contradicts the {old[name]} that {ckpt_path} was trained with: "
                f"leave {flag} out to continue the run as it was, or start a new run in another --out-dir"
            )
            raise same_on_every_rank(UserError(message))
        else:
            changes[name] = [old[name], getattr(args, name)]
    if args.max_steps < ckpt["step"]:
        raise UserError(f"--max-steps {args.max_steps} is below the {ckpt['step']} steps {ckpt_path} has done")
    return changes, taken


def resume_checkpoint(args, given, ddp, master_process, claim=None):
    """(path, checkpoint, allowed changes, settings taken from it) for --resume, else (None, None,
    {}, {}). Rank 0 claims the out-dir first (claim(), if given) and picks the checkpoint, so that
    every rank loads the same one (multi-node: the out-dir must be shared); a mistake it finds
    there ends every rank alike, said once. The other ranks wait in the fence (see fence)."""
    picked = [None, None]  # the checkpoint's path, rank 0's error
    if master_process:
        try:
            if claim is not None:
                claim()
            if args.resume:
                picked[0], found = find_resume_checkpoint(args.resume, args.out_dir)
                if found is not None:
                    check_resume_target(args, picked[0], found)
        except UserError as e:
            picked[1] = str(e)
    if ddp:
        import torch.distributed as dist

        dist.broadcast_object_list(picked, src=0, group=fence(ddp, args.ddp_timeout))
    if picked[1] is not None:
        raise same_on_every_rank(UserError(picked[1]))
    if picked[0] is None:
        return None, None, {}, {}
    ckpt = load_training_checkpoint(picked[0])
    return picked[0], ckpt, *reconcile_resume(args, given, ckpt, picked[0])


def restore_training_state(ckpt, ckpt_path, optimizer, loader, ddp_rank, device_type):
    """The optimizer, data position and this rank's RNG as a checkpoint left them; returns the
    step to start at, the run's id (a new, unique one for a new run: the seeds are untouched) and
    the last val loss."""
    data_dir = os.path.dirname(loader.shards[0])
    loader.identity = data_identity(data_dir)  # what this run trains on; its checkpoints record it
    if ckpt is None:
        return 0, f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(4).hex()}", None
    if ckpt.get("data_identity") is not None:
        check_same_data(ckpt["data_identity"], loader.identity, ckpt_path, data_dir)
    optimizer.load_state_dict(ckpt["optimizer"])
    loader.load_state_dict(ckpt["data"])
    if ddp_rank < len(ckpt["rng"]):
        set_rng_state(ckpt["rng"][ddp_rank], device_type)
    if ddp_rank == 0:
        print(f"resuming from {ckpt_path} at step {ckpt['step']}")
    return ckpt["step"], ckpt.get("run_id", ckpt_path), ckpt.get("val_loss")


def report_resume(changes, taken):
    """Say what a resumed run changed (allowed) and what it took from the checkpoint."""
    for name, (old, new) in changes.items():
        print(f"note: --{name.replace('_', '-')} {old} -> {new} on resume: {ALLOWED_CHANGES[name]}")
    if taken:
        flags = ", ".join(f"--{name.replace('_', '-')} {value!r}" for name, value in taken.items())
        print(f"note: continuing with the run's {flags} (flags left out on --resume are the checkpoint's)")


def get_rng_state(device_type):
    """Every random generator's state, as tensors and plain values (weights_only-loadable)."""
    import torch

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
    import torch

    random.setstate(state["python"])
    s = state["numpy"]
    np.random.set_state(("MT19937", s["key"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["gauss"]))
    torch.set_rng_state(state["torch"])
    if device_type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------------------------
# The run: stop signals, its log, the non-finite guard


class StopRequest:
    """SIGTERM (a spot instance reclaimed, a scheduler), SIGHUP (the terminal or ssh session that
    started the run went away) or Ctrl-C: the run stops at the next step boundary with a
    checkpoint, an eval in progress is cut short; a second Ctrl-C stops at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __init__(self):
        self.signum = 0
        for s in self.SIGNALS:
            if s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN:
                continue  # started under nohup: hangups are to be ignored, and are
            signal.signal(s, self.on_signal)

    def on_signal(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt  # the user does not want to wait: run_cli prints one line
        self.signum = signum
        print(f"caught {signal.Signals(signum).name}: stopping after this step with a checkpoint", flush=True)

    def __call__(self):  # this rank's request, for the evals to poll
        return self.signum != 0

    def agreed(self, device, ddp):
        """The signal every rank stops for (0: none), the same on every rank."""
        import torch
        import torch.distributed as dist

        signum = torch.tensor(self.signum, device=device)
        if ddp:
            dist.all_reduce(signum, op=dist.ReduceOp.MAX)
        return signum.item()


def versions():
    """The versions that decide a run's numerics, for the log's header."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numpy": np.__version__,
    }


WANDB_FINISH_TIMEOUT = 120  # seconds the end of a run waits for wandb to finish uploading


def wandb_problem(project):
    """Why --wandb-project cannot work, checked before step 0 (a failure after start is only a
    warning): the package missing (it is optional), or a name wandb refuses. None if fine."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        return (
            "--wandb-project needs the wandb package, which is not installed: pip install wandb, or leave "
            "--wandb-project out (on --resume, which takes the run's: --wandb-project '')"
        )
    if len(project) > 128 or set(project) & set("/\\#?%:"):
        return f"--wandb-project {project!r}: wandb takes up to 128 characters and none of / \\ # ? % :"
    return None


class WandbMirror:
    """The run log's records mirrored to a Weights & Biases run: the header's config as the run's
    config, every other record as a history row under the same names, plotted against its `step`.
    The wandb run's id is the run's id, so a resumed run continues the same wandb run and a new
    run starts a new one. wandb lives in a thread of its own (import, start, logging, finish): a
    step only puts its record on a queue and never waits for wandb or the network. Any failure
    stops the mirror; `error` then says why, and the run goes on with log.jsonl alone."""

    def __init__(self, project, name, run_id, folder):
        self.records, self.error, self.exit_code = queue.SimpleQueue(), None, 0
        start = (project, name, re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[-64:], folder)
        self.thread = threading.Thread(target=self.work, args=start, name="wandb", daemon=True)
        self.thread.start()

    def __call__(self, record):
        self.records.put(record)

    def work(self, project, name, wandb_id, folder):
        run = None
        try:
            import wandb

            os.makedirs(folder, exist_ok=True)
            # the console stays ours (every record is mirrored); create_new: a run of its own even
            # where the process has another one open (a notebook, tests calling main())
            settings = wandb.Settings(console="off", reinit="create_new")
            run = wandb.init(project=project, name=name, id=wandb_id, resume="allow", dir=folder, settings=settings)
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
            while (record := self.records.get()) is not None:
                if isinstance(record, threading.Event):  # flush()
                    record.set()
                elif record.get("event") == "header":  # a resumed run's may change --max-steps
                    header = {key: value for key, value in record.items() if key not in ("event", "config")}
                    run.config.update({**record["config"], "header": header}, allow_val_change=True)
                else:
                    run.log(self.row(wandb, record))
            run.finish(exit_code=self.exit_code)
        except Exception as e:  # whatever wandb raises: training goes on without it
            self.error = f"{type(e).__name__}: {first_line(e)}"
            if run is not None:
                try:
                    run.finish(exit_code=1)  # what reached wandb is kept, the run marked failed
                except Exception:
                    pass

    @staticmethod
    def row(wandb, record):
        """A record as a history row: samples as a table of text, missing values (mfu on a CPU) left out."""
        row = {key: value for key, value in record.items() if value is not None}
        if "samples" in row:
            row["samples"] = wandb.Table(columns=["sample"], data=[[text] for text in row["samples"]])
        return row

    def flush(self, timeout=60):
        """Wait until the records queued so far are logged; False if wandb failed or timeout passed."""
        done, deadline = threading.Event(), time.monotonic() + timeout
        self.records.put(done)
        while not done.wait(0.01):
            if self.error is not None or time.monotonic() > deadline:
                return False
        return True

    def finish(self, exit_code, timeout):
        """Log what is queued and finish the wandb run; True if it did within timeout seconds."""
        self.exit_code = exit_code
        self.records.put(None)
        self.thread.join(timeout)
        return not self.thread.is_alive()


def strict_json(value):
    """value with every non-finite float spelled as a string, "NaN", "Infinity" or "-Infinity": JSON
    has no such numbers (Python's NaN token breaks jq and other languages' readers), and
    float() reads these strings back."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {key: strict_json(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class RunLog:
    """log.jsonl: one JSON record per line, appended, never wiped, so a resumed run continues
    the same file (play.ipynb keeps the last record of each step). Each record is also printed
    as its console line: one record, built once, for the file and the screen, and with
    --wandb-project for a Weights & Biases run too (WandbMirror). Only rank 0's is enabled; the
    others' calls do nothing."""

    mirrored = []  # the logs with a wandb run to finish when the run ends (finish_wandb)

    def __init__(self, out_dir, enabled, max_steps):
        self.path, self.file, self.max_steps = os.path.join(out_dir, "log.jsonl"), None, max_steps
        self.out_dir, self.wandb = out_dir, None
        if not enabled:
            return
        try:
            self.file = open(self.path, "a")
            if self.file.tell() > 0:
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":  # a line cut short by a kill: start ours on a fresh line
                        self.file.write("\n")
        except OSError as e:
            raise disk_error(e, self.path, "start again") from None

    def header(self, run_id, device_name, resumed_from, changes, config):
        """The run's first record (and a resumed run's first in its turn): what ran, where, with what."""
        record = {"event": "header", "run_id": run_id, "device": device_name, "resumed_from": resumed_from}
        if self.file is not None and config.get("wandb_project"):
            name = config.get("wandb_run_name") or os.path.basename(os.path.abspath(self.out_dir))
            folder = os.environ.get("WANDB_DIR") or self.out_dir  # wandb's files beside the run's, unless set
            self.wandb = WandbMirror(config["wandb_project"], name, run_id, folder)
            RunLog.mirrored.append(self)
        self({**record, "changed_on_resume": changes or None, "versions": versions(), "config": config})

    def __call__(self, record):
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: stop now, the checkpoints written so far are intact
            raise disk_error(e, self.path, "continue with --resume") from None
        self.print(record)
        if self.wandb is not None and self.wandb.error is None:
            self.wandb(record)
        elif self.wandb is not None:  # wandb failed: said once, and the run goes on without it
            error, self.wandb = self.wandb.error, None
            self.warn(f"wandb stopped ({error}): the run goes on; log.jsonl holds every record")

    def warn(self, message):
        """A warning on the console and in the log, as a record of its own."""
        print(f"warning: {message}", file=sys.stderr, flush=True)
        try:
            self({"event": "warning", "warning": message})
        except UserError:
            pass  # the disk is full: the console has it

    @classmethod
    def finish_wandb(cls):
        """At the end of a run, done or not: the queued records logged and the wandb runs finished
        (failed if an exception is on its way out), waiting WANDB_FINISH_TIMEOUT seconds at most."""
        exit_code = 1 if sys.exc_info()[0] is not None else 0
        while cls.mirrored:
            log = cls.mirrored.pop()
            mirror, log.wandb = log.wandb, None
            if mirror is None:
                continue  # it failed, and said so
            if not mirror.finish(exit_code, WANDB_FINISH_TIMEOUT):
                log.warn(
                    f"wandb has not finished uploading after {WANDB_FINISH_TIMEOUT} s: left to it as the "
                    f"process exits; `wandb sync` on the run's folder under wandb/ uploads what did not go"
                )
            elif mirror.error is not None:
                log.warn(f"wandb stopped ({mirror.error}): log.jsonl holds every record")

    def print(self, record):
        step = record.get("step")
        if "train_loss" in record:
            mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] else "n/a"
            print(
                f"step {step:5d}/{self.max_steps} | loss {record['train_loss']:.6f} | lr {record['lr']:.4e} | "
                f"norm {record['grad_norm']:.4f} | dt {record['dt_ms']:.2f}ms | tok/s {record['tok_per_sec']:,.0f} | "
                f"mfu {mfu} | epoch {record['epoch']}",
                flush=True,
            )
        elif "val_loss" in record:
            print(f"step {step:5d} | val loss {record['val_loss']:.6f}")
        elif "hellaswag" in record:
            print(f"step {step:5d} | hellaswag acc_norm {record['hellaswag']:.4f} of {record['hellaswag_n']}")
        for i, text in enumerate(record.get("samples", ())):
            print(f"step {step:5d} | sample {i}: {text!r}")


MAX_BAD_STEPS = 3  # non-finite steps in a row: one is skipped as a bad batch, this many mean the run diverged


class NonFiniteGuard:
    """One NaN or inf (an overflow, a bad batch) in an update would spread to every weight: such a
    step is skipped. Every rank sees the same all-reduced loss and norm, so all skip it. Several
    in a row mean the run diverged: it stops with a checkpoint of the last good state."""

    def __init__(self, log, master_process, checkpoint, out_dir):
        self.log, self.master_process, self.checkpoint, self.out_dir = log, master_process, checkpoint, out_dir
        self.in_a_row, self.max_lr = 0, None

    def skip(self, step, loss, norm, lr):
        if math.isfinite(loss) and math.isfinite(norm):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.log({"step": step, "skipped": f"loss {loss}, grad norm {norm}", "lr": lr})
        if self.master_process:
            print(f"step {step:5d} | loss {loss} | norm {norm} | skipped ({self.in_a_row} in a row)")
        if self.in_a_row == MAX_BAD_STEPS:  # the weights and optimizer state are still those of the last good step
            path = self.checkpoint(step + 1) or os.path.join(self.out_dir, f"ckpt_{step + 1:06d}.pt")
            first = step + 1 - MAX_BAD_STEPS
            max_lr = self.max_lr or train_config_of(path).get("max_lr", math.nan)
            # the same weights failed on every batch: the weights (a learning rate too high), not the data
            raise same_on_every_rank(
                UserError(
                    f"{MAX_BAD_STEPS} steps in a row ({first} to {step}) had a non-finite loss or grad norm: "
                    f"stopped; {path} holds the weights they failed on (none of their updates was applied). "
                    f"If the data is at fault, --resume continues from it past these batches; else "
                    + diverged_advice(self.out_dir, max_lr)
                )
            )
        return True


def all_rng_states(device_type, ddp, ddp_world_size):
    """Every rank's RNG state, gathered on every rank: a checkpoint resumes each rank's draws."""
    if not ddp:
        return [get_rng_state(device_type)]
    import torch.distributed as dist

    states = [None] * ddp_world_size
    dist.all_gather_object(states, get_rng_state(device_type))
    return states


# ----------------------------------------------------------------------------------------------
# transformers' GPT-2: names it may fetch, folders an export may replace, and its weight layout

EXPORT_MARK = "train_gpt2.py --export-hf"  # config.json's "exported_by": a folder export_hf may replace
# everything save_pretrained writes for a GPT2LMHeadModel (shards and their index for big models)
EXPORT_FILES = re.compile(r"config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")
# transformers' GPT-2 stores these as Conv1D weights, i.e. transposed relative to nn.Linear
HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
TIED = ("transformer.wte.weight", "lm_head.weight")  # one tensor; its padding rows are not exported


def hub_name_is_cached(name):
    """The local Hugging Face cache holds the config and the weights of Hub model `name`."""
    from huggingface_hub import try_to_load_from_cache

    def cached(filename):
        return isinstance(try_to_load_from_cache(name, filename), str)  # else None or "known missing"

    return cached("config.json") and (cached("model.safetensors") or cached("pytorch_model.bin"))


def check_hub_reachable(name, timeout=3.0):
    """Refuse at once, in one line, to fetch `name` (not in the local cache) when offline use is
    set or the Hub does not answer: transformers would retry for half a minute, then not say why."""
    import urllib.error
    import urllib.request

    fix = "pass a local transformers GPT-2 directory instead (save_pretrained output, or --export-hf's)"
    var = offline_var(("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if var:
        raise UserError(
            f"{name!r} is not in the local Hugging Face cache and {var} is set: {fix}, or fill the cache once online"
        )
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        urllib.request.urlopen(f"{endpoint}/api/models/{name}", timeout=timeout).close()  # a few KB of metadata
    except (OSError, ValueError) as e:  # no network, a timeout, a bad HF_ENDPOINT, a proxy's or captive portal's 404
        if isinstance(e, urllib.error.HTTPError) and e.code == 429:
            return  # the Hub is there but busy: transformers waits and retries
        reason = f"HTTP {e.code}" if isinstance(e, urllib.error.HTTPError) else getattr(e, "reason", e)
        raise UserError(
            f"cannot reach the Hugging Face Hub ({endpoint}: {first_line(reason)}) and {name!r} is not "
            f"in the local cache: {fix}, or set HF_HUB_OFFLINE=1 with a cache that holds it"
        ) from None


def check_export_target(out_dir):
    """The absolute folder export_hf may write: a new one, an empty one, or an earlier export (only
    save_pretrained's plain files, config.json marked EXPORT_MARK), which is replaced."""
    given = str(out_dir)
    if os.path.islink(given) and not os.path.exists(given):
        raise UserError(f"--export-hf target {given} is a symbolic link to nothing: name a new folder")
    out_dir = os.path.realpath(given)  # a link to an earlier export: replace that folder, keep the link
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        example = os.path.splitext(given)[0] + "_hf"
        raise UserError(f"--export-hf target {given} is a file, not a folder: name a new folder, e.g. {example}")
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    foreign = [
        n
        for n in names
        if not (EXPORT_FILES.fullmatch(n) and os.path.isfile(p := os.path.join(out_dir, n)) and not os.path.islink(p))
    ]
    held = None
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        held = f"{foreign[0]}{more}"
    elif names:
        try:
            with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = None
        ours = (
            isinstance(config, dict) and config.get("model_type") == "gpt2" and config.get("exported_by") == EXPORT_MARK
        )
        held = None if ours else "a transformers model (its config.json has no exported_by mark)"
    if held:
        raise UserError(
            f"--export-hf target {given} is not empty and not an earlier export (it holds {held}): "
            f"name a new or empty folder; nothing was changed"
        )
    return out_dir


def check_state_dict(shapes, state_dict, source):
    """state_dict holds exactly the keys of shapes ({key: shape}), each with its shape: weights
    that do not fit a model are refused in one line naming the first key that differs."""
    missing, extra = sorted(set(shapes) - set(state_dict)), sorted(set(state_dict) - set(shapes))
    if missing or extra:
        what = f"key {missing[0]} is missing" if missing else f"unexpected key {extra[0]}"
        more = len(missing) + len(extra) - 1
        raise UserError(f"{source}: {what}" + (f" ({more} more keys differ)" if more else "") + ": not a GPT-2 of ours")
    for key, shape in shapes.items():
        if tuple(state_dict[key].shape) != tuple(shape):
            raise UserError(f"{source}: {key} has shape {tuple(state_dict[key].shape)}, expected {tuple(shape)}")


def state_dict_from_hf(sd_hf):
    """transformers' GPT-2 state dict in our layout: Conv1D weights transposed, the causal-mask
    buffers (not weights) dropped. Key names are the same in both."""
    skip = (".attn.bias", ".attn.masked_bias")
    return {k: v.t().contiguous() if k.endswith(HF_TRANSPOSED) else v for k, v in sd_hf.items() if not k.endswith(skip)}


def state_dict_to_hf(sd):
    """Our state dict in transformers' layout: Conv1D weights transposed, the vocab cut to GPT-2's
    50,257 rows (the padding rows were never a token)."""
    out = {}
    for k, v in sd.items():
        v = v.detach().float().cpu()
        v = v.t() if k.endswith(HF_TRANSPOSED) else v
        out[k] = v[:GPT2_VOCAB] if k in TIED else v
    return out


def load_hf_gpt2(name_or_dir):
    """(config dict, state dict in our layout) of OpenAI GPT-2 (gpt2, gpt2-medium, gpt2-large,
    gpt2-xl) or a local transformers GPT-2 directory (save_pretrained output)."""
    is_dir = os.path.isdir(name_or_dir)
    if name_or_dir not in HF_NAMES and not is_dir:
        raise UserError(f"{name_or_dir!r} is neither one of {', '.join(HF_NAMES)} nor a directory")
    local_only = not is_dir and hub_name_is_cached(name_or_dir)
    if not is_dir and not local_only:
        check_hub_reachable(name_or_dir)
    from transformers import GPT2LMHeadModel  # after the checks, which then answer in a second

    try:
        hf, info = GPT2LMHeadModel.from_pretrained(name_or_dir, output_loading_info=True, local_files_only=local_only)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load transformers GPT-2 from {name_or_dir!r}: {first_line(e)}") from None
    hc = hf.config
    if hc.activation_function not in ("gelu_new", "gelu_pytorch_tanh") or hc.layer_norm_epsilon != 1e-5:
        raise UserError(
            f"{name_or_dir}: activation {hc.activation_function!r} / layer_norm_epsilon "
            f"{hc.layer_norm_epsilon} differ from GPT-2's (gelu_new, 1e-5)"
        )
    config = dict(
        block_size=hc.n_positions, vocab_size=hc.vocab_size, n_layer=hc.n_layer, n_head=hc.n_head, n_embd=hc.n_embd
    )
    # transformers fills missing keys with random numbers and only warns: leave them out, to be refused
    sd_hf = {k: v for k, v in hf.state_dict().items() if k not in info["missing_keys"]}
    return config, state_dict_from_hf(sd_hf)


def save_hf_gpt2(config, sd, out_dir):
    """Write a model (config dict, our state dict) as a transformers GPT2LMHeadModel directory
    (vocab trimmed to 50257, tied embeddings). out_dir must be new, empty or an earlier export
    (check_export_target)."""
    if config["vocab_size"] < GPT2_VOCAB:
        raise UserError(f"vocab_size {config['vocab_size']} is smaller than GPT-2's {GPT2_VOCAB}: cannot export")
    given, out_dir = out_dir, check_export_target(out_dir)  # refuse before the slow part
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=GPT2_VOCAB,
            n_positions=config["block_size"],
            n_embd=config["n_embd"],
            n_layer=config["n_layer"],
            n_head=config["n_head"],
            activation_function="gelu_new",
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=True,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            exported_by=EXPORT_MARK,
        )
    )
    sd_hf = hf.state_dict()
    for k, v in state_dict_to_hf(sd).items():
        sd_hf[k].copy_(v)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its bar on stderr would bury a one-line error
    try:
        # checked again just before the swap: a file put there meanwhile is not ours to delete
        write_dir_atomic(out_dir, hf.save_pretrained, "the export", recheck=lambda: check_export_target(given))
    finally:
        if bar:
            hf_logging.enable_progress_bar()

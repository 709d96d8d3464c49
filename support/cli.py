"""The one line a mistake is reported in, for every script: the error type (UserError), the argument
parser that raises it (its flags: dataclass fields, add_flags; their number types, Number), and run_cli,
the wrapper around a script's main() that prints it, a Ctrl-C and an out-of-memory each as one line;
torch-free, as fineweb.py is."""

import argparse
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import field, fields


class UserError(Exception):
    """A mistake in the user's input: reported as one line, exit code 1, no traceback.
    every_rank: every process of a torchrun job raises the same one (a flag, the recipe, the data
    folder), so only each node's first process (LOCAL_RANK 0) says it: once on one machine, and on
    each node's own console, whose data folder may be the node's own."""

    every_rank = False


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a flag it cannot parse (a typo, `--keep-ckpts 1.5`) is a UserError: one `error:`
    line and exit 1, like every other mistake, not the whole usage before it. prog: the script's
    file name, for the --help the line points to; its description (the usage examples) as written."""

    def __init__(self, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs):
        super().__init__(formatter_class=formatter_class, **kwargs)

    def error(self, message):
        raise UserError(f"{message} (see python {self.prog} --help)")


def flag_type(kind, ok, says):
    """An argparse type for a number flag, declared beside it in a script's parser: text -> kind, refused
    in one line naming the flag (argparse's) unless it is finite and ok(value); says: what ok asks."""

    def parse(text):
        value = kind(text)  # no number at all: argparse says "invalid int value"
        if not math.isfinite(value):  # nan passes no comparison, and inf every upper-less one
            raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {says}, not {value}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" line
    return parse


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


def flag(default, help, type=None, **kwargs):
    """A dataclass field that is a flag too (add_flags); short: a second name (-B); flag_default: the flag's."""
    return field(default=default, metadata=dict(help=help, type=type, **kwargs))


def add_flags(group, cls):
    """Dataclass cls's fields (flag's) as flags of group (a parser or its argument group), --the-name, the
    default said in --help, not put in the namespace: parsed, that holds the flags given, only those. A bool
    is a switch; a field with a const may go without a value. Returns {field: its flag's default}."""
    defaults = {}
    for f in fields(cls):
        kwargs = {key: value for key, value in f.metadata.items() if value is not None}
        defaults[f.name] = kwargs.pop("flag_default", f.default)
        kwargs.update(help=f"{kwargs['help']} (default: {defaults[f.name]})", default=argparse.SUPPRESS)
        if f.type is bool:
            kwargs["action"] = "store_true"
        if "const" in kwargs:
            kwargs["nargs"] = "?"
        group.add_argument("--" + f.name.replace("_", "-"), *filter(None, [kwargs.pop("short", None)]), **kwargs)
    return defaults


EVERY_RANK_GRACE = 3.0  # seconds the other ranks wait before exiting on a mistake their node's first says


def same_on_every_rank(error):
    """error, marked as one that every rank of a torchrun job raises alike (UserError.every_rank)."""
    error.every_rank = True
    return error


def first_line(e):
    """The first line of an exception's message (or its type's name): enough for a one-line error."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class OutlivesItsReader:
    """sys.stdout / sys.stderr that survive their reader going away (`| head`, a `| tee` that died
    with the ssh session that started it, a terminal that hung up): the first write that fails
    (BrokenPipeError, EIO) points the stream at /dev/null and the program carries on, where print
    would raise and end it. A training run's record is log.jsonl and its checkpoints."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self._or_devnull("write", text)

    def flush(self):
        self._or_devnull("flush")

    def _or_devnull(self, method, *args):
        try:
            return getattr(self.stream, method)(*args)
        except OSError:  # the same file descriptor, now writing nowhere
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def __getattr__(self, name):  # fileno, isatty, encoding, ... of the real stream
        return getattr(self.stream, name)


def on_ctrl_c(signum, frame):
    """run_cli's Ctrl-C: KeyboardInterrupt, but not inside a finalizer (a __del__, where Python would print
    it and go on): that one is raised again 0.1 s later, outside it."""
    if any(f.f_code.co_name == "__del__" for f, _ in traceback.walk_stack(frame)):
        return threading.Thread(target=lambda: (time.sleep(0.1), signal.raise_signal(signum)), daemon=True).start()
    raise KeyboardInterrupt


def run_cli(main, interrupted="interrupted", out_of_memory=None):
    """Run a script's main(): a UserError is one `error:` line and exit 1, Ctrl-C the one line
    `interrupted` and exit 130 (the shell's code for SIGINT); anything else is a bug and keeps
    its traceback. Output to a pipe that closes is dropped (OutlivesItsReader), not fatal.
    Running out of memory is one `error:` line too: out_of_memory() says during what
    and which flag to lower (see out_of_memory_line). Under torchrun a mistake every rank makes
    alike (UserError.every_rank) is said once a node, by its LOCAL_RANK 0."""
    signal.signal(signal.SIGINT, on_ctrl_c)  # Ctrl-C raises KeyboardInterrupt from here on
    sys.stdout, sys.stderr = OutlivesItsReader(sys.stdout), OutlivesItsReader(sys.stderr)
    try:
        code = main()
    except UserError as e:
        if not (e.every_rank and os.environ.get("LOCAL_RANK", "0") != "0"):
            print(f"error: {e}", file=sys.stderr)
        else:  # torchrun ends the job when the first rank exits: give the speaker time to say it
            time.sleep(EVERY_RANK_GRACE)
        code = 1
    except Exception as e:
        memory = memory_kind(e)
        if memory is None:
            raise  # a bug: its traceback
        print(f"error: {out_of_memory_line(e, memory, out_of_memory)}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt as e:
        print(str(e) or interrupted, file=sys.stderr)  # its own words, if it has any (a second stop signal's)
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


def out_of_memory_line(e, memory, advice=None):
    """'out of host memory ...' and during what and what to lower, from advice() (the script's own,
    e.g. out_of_memory.training_out_of_memory, which reads the phase marked last); else the allocator's
    own words, cut short."""
    said = re.sub(r"\[enforce fail at [^]]*\] *(err == 0\. *)?", "", first_line(e))
    said = re.sub(r"(Tried to allocate [\d.]+ [KMGT]iB)\..*", r"\1", said)  # CUDA's: the size, not its stats
    where = advice() if advice else None
    return f"out of {memory} {where}" if where else f"out of {memory} ({said})"

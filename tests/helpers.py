"""Helpers the tests share (`from helpers import ...`): tiny runs and their logs, the scripts run as a
user runs them, tiny transformers models, one-line error checks, faults injected into a run."""

import contextlib
import errno
import hashlib
import io
import json
import os
import random
import re
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fineweb
import train_gpt2
from support.checkpoints import load_checkpoint
from support.cli import UserError
from support.presets import preset_lines

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30


def write_shard(path, tokens):
    """A shard written independently of fineweb.py: np.save of uint16 (.npy), or llm.c's .bin (256
    little-endian int32: magic 20240520, version 1, token count, zeros; then uint16 tokens)."""
    tokens = np.asarray(tokens, dtype=np.uint16)
    if str(path).endswith(".bin"):
        header = np.zeros(256, dtype="<i4")
        header[0], header[1], header[2] = 20240520, 1, len(tokens)
        with open(path, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype("<u2").tobytes())
    else:
        np.save(path, tokens)


def random_shards(folder, train_lengths=(600, 600), val_length=600, seed=0):
    """Shards of random GPT-2 token ids: train shards and one val shard."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_shard(folder / "rand_val_000000.npy", rng.integers(0, 50257, val_length))
    for i, n in enumerate(train_lengths, start=1):
        write_shard(folder / f"rand_train_{i:06d}.npy", rng.integers(0, 50257, n))
    return folder


def write_known_shards(folder, lengths, ext="npy", val_length=0):
    """Train shards whose tokens are distinct consecutive ids, so every token names its place."""
    folder.mkdir(parents=True, exist_ok=True)
    shards, start = [], 0
    if val_length:
        write_shard(folder / f"known_val_000000.{ext}", np.arange(60000, 60000 + val_length))
    for i, n in enumerate(lengths):
        tokens = np.arange(start, start + n)
        write_shard(folder / f"known_train_{i + 1:06d}.{ext}", tokens)
        shards.append(tokens)
        start += n
    return shards


TINY_RUN = [word for _, words in preset_lines(ROOT / "tests" / "tiny_run.txt") for word in words]


# texts a tokenizer can get wrong: spaces, line ends, digits, non-ASCII, emoji, control characters
UNICODE_TEXTS = [
    " leading space, trailing space ",
    "two  spaces,   three,\ttab\tand\u00a0no-break, trailing\n\n  ",
    "lines\nand\n\nblank lines\r\nwith CRLF\n",
    "digits 1234567890, 3.14159, 1e-5, 2026-11-26, $1,000.00; it's, we'll, they've, I'm, you'd, 'S",
    "non-ASCII: naïve café, Straße, Ωμέγα, Москва, 東京, 한국어, عربى, हिन्दी, \u00ad soft hyphen",
    "emoji 🤖👍🏽👩\u200d👩\u200d👧 and ✓ ✗ ∑ ∞, a lone surrogate-free \U0001f600",
    "controls \x00\x01\x1b[0m\x7f\x85",
    "",
]


def tiny_args(data_dir, out_dir, *extra):
    """tests/tiny_run.txt's flags (2 layers, 32 wide, on the CPU, 6 steps) on data_dir into out_dir, then
    extra (the later flag wins); listed, not passed as @tests/tiny_run.txt, so that a test can leave one out."""
    return ["--data-dir", str(data_dir), "--out-dir", str(out_dir), *TINY_RUN, *map(str, extra)]


def read_log(out_dir):
    """(all records, {step: its last step record}) of out_dir/log.jsonl: a resumed run repeats steps,
    the last counts; a line cut short by a kill is skipped."""
    records = []
    for line in open(os.path.join(out_dir, "log.jsonl")):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    steps = {r["step"]: r for r in records if "train_loss" in r or "skipped" in r or "scaler_skipped" in r}
    return records, steps


def strict_records(out):
    """log.jsonl read by a strict JSON reader (NaN and Infinity are not JSON): a bad line fails."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in (out / "log.jsonl").read_text().splitlines()]


def headers(out):
    """The header records of out/log.jsonl: one per start of a run in the folder (a resume adds one)."""
    return [r for r in read_log(out)[0] if r.get("event") == "header"]


def run_ids(out):
    """The run ids of the checkpoints in out: one run's folder holds one."""
    return {load_checkpoint(str(p))["run_id"] for p in out.glob("ckpt_*.pt")}


def checkpoint_bytes(folder):
    """{the sha256 of a checkpoint's bytes: its path} for each ckpt_*.pt anywhere under folder (set aside
    ones too): a checkpoint lost or written over is a digest gone."""
    return {hashlib.sha256(p.read_bytes()).hexdigest(): p for p in Path(folder).rglob("ckpt_*.pt")}


def torch_loads(monkeypatch):
    """[(path, mapped)] of each torch.load call from here on, as they come: the checkpoints read, and how."""
    loads, load = [], torch.load

    def counted(f, *args, **kwargs):
        loads.append((str(f), kwargs.get("mmap", False)))
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    return loads


def same_weights(a, b):
    """Two state dicts hold the same tensors, bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def hangup_default():
    """preexec_fn of a child a test sends SIGHUP: its default action, also under nohup (which ignores it)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


class Overran(BaseException):
    """cli()'s in-process run went past its timeout: a BaseException, so that no `except Exception` turns
    a hang into an exit 1."""


def cli(*args, script="train_gpt2.py", cwd=ROOT, process=False, timeout=300, **kwargs):
    """Run a script as a user would, in cwd; the CompletedProcess. By default in this process (runpy as
    __main__, its exit as python's, what it changed in the process put back); with process=True, an env
    or script "-c" (python -c's code), in a python process of its own."""
    argv = [str(a) for a in args]
    if process or script == "-c" or "env" in kwargs:
        command = [sys.executable, script if script == "-c" else str(ROOT / script), *argv]
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, **kwargs)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)}
    environ, folder, argv0 = dict(os.environ), os.getcwd(), sys.argv
    torch_state = torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision()
    rngs = random.getstate(), np.random.get_state(), torch.get_rng_state()
    out, err, code = io.StringIO(), io.StringIO(), 0

    def overran(signum, frame):
        raise Overran(f"{script} {' '.join(argv)} did not end within {timeout} s")

    signal.signal(signal.SIGALRM, overran)  # a run that a bug keeps going fails, as a process's timeout does
    signal.alarm(timeout)
    try:
        os.chdir(cwd)
        sys.argv = [str(ROOT / script), *argv]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as e:  # as python ends: None is 0, anything but a number is printed and is 1
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=err)
    finally:
        signal.alarm(0)
        os.chdir(folder)
        sys.argv = argv0
        os.environ.clear()
        os.environ.update(environ)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        torch.use_deterministic_algorithms(torch_state[0])
        torch.set_float32_matmul_precision(torch_state[1])
        random.setstate(rngs[0])
        np.random.set_state(rngs[1])
        torch.set_rng_state(rngs[2])
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def as_typed(command, *extra, cwd=ROOT):
    """A command a message advises, as typed: its `python SCRIPT ...` parts (&&) through cli() with extra
    added, the others by the shell; the CompletedProcess of the last part run (the first to fail)."""
    for part in command.split(" && "):
        argv = shlex.split(part)
        if argv[0] == "python":
            r = cli(*argv[2:], *extra, script=argv[1], cwd=cwd)
        else:
            r = subprocess.run(part, shell=True, cwd=cwd, capture_output=True, text=True)
        if r.returncode != 0:
            break
    return r


# The MiB of a 64 MiB tensor glibc mapped on its own, and the MiB the heap keeps once it is freed: after the
# script's imports, then after its main() (64 MiB is above the 32 MiB that glibc's mmap threshold may rise to)
MALLOC_PROBE = """
import ctypes, importlib, sys, torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def mapped_then_kept():
    x = torch.ones(16 * 2**20)
    mapped = libc.mallinfo2().hblkhd >> 20
    del x
    return mapped, libc.mallinfo2().arena >> 20
script = importlib.import_module(sys.argv[1])
before = mapped_then_kept()
assert script.main(sys.argv[2:]) in (0, None)
print(*before, *mapped_then_kept())
"""


def heap_before_and_after(module, args):
    """MALLOC_PROBE's [MiB mapped on its own, MiB the heap keeps] before and after `module`.main(args)."""
    proc = cli(MALLOC_PROBE, module, *args, script="-c", timeout=120)
    assert proc.returncode == 0, proc.stderr
    numbers = [int(v) for v in proc.stdout.split()[-4:]]
    return numbers[:2], numbers[2:]


def help_entries(text):
    """{each option string: its entry in a script's --help text, on one line}."""
    entries = re.split(r"\n  (?=-)", text.split("\noptions:\n", 1)[1])
    usage = {entry: re.split(r"\s{2,}", entry.strip(), maxsplit=1)[0] for entry in entries}  # "-B B, --batch-size B"
    return {
        flag: " ".join(entry.split()) for entry in entries for flag in re.findall(r"(?:^|, )(-[\w-]+)", usage[entry])
    }


def user_error(args, main=None):
    """main(args) (a script's; train_gpt2.main by default) must stop with a one-line UserError; returns its message."""
    with pytest.raises(UserError) as e:
        (main or train_gpt2.main)([str(a) for a in args])
    assert "\n" not in str(e.value)
    return str(e.value)


def assert_one_line_error(proc, *words, match=None):
    """A refused input as the user sees it: exit 1, one `error:` line holding each of words (and the regex
    match), after nothing but a progress bar's lines (tqdm's, with their [elapsed, rate])."""
    *bar, line = proc.stderr.strip().split("\n")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert line.startswith("error: ") and all(re.search(r"\[\d+:\d\d[,<]", b) for b in bar), proc.stderr[-2000:]
    for word in words:
        assert word in line, line
    assert match is None or re.search(match, line), line
    return line


def snapshot(folder):
    """Every entry under folder, hidden ones too: a file's bytes and mode, a folder's mode, a link's target
    (an empty folder left behind, a parent made and not removed, a replaced link: all show)."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel, mode = os.path.relpath(path, folder), os.lstat(path).st_mode
            if os.path.islink(path):
                state[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                state[rel] = ("dir", mode)
            else:
                state[rel] = ("file", mode, Path(path).read_bytes())
    return state


def refused_before_step_0(args, out, *words):
    """In-process: one UserError line, no step record in the log, the folder unchanged."""
    before = snapshot(out) if out.exists() else {}
    msg = user_error(args)
    for word in words:
        assert word in msg, msg
    after = snapshot(out) if out.exists() else {}
    assert {k: v for k, v in after.items() if k in before} == before  # nothing that existed is gone or changed
    if (out / "log.jsonl").exists() and "log.jsonl" not in before:
        assert not read_log(out)[1]
    return msg


# ----------------------------------------------------------------------------------------------
# Faults injected into a run in the test's process


class FullDisk:
    """A writable file that takes `room` bytes, then fails like a full disk (ENOSPC)."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        text = isinstance(data, str)  # a text-mode file (the log), else bytes or an array
        n = len(data) if text else memoryview(data).nbytes
        if n > self.room:
            self.f.write(data[: self.room] if text else bytes(memoryview(data).cast("B")[: self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= n
        return self.f.write(data)

    def __getattr__(self, name):  # flush, fileno, close, ... of the real file
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fail_nth_write(monkeypatch, module, suffix, n, room=1000):
    """The n-th file `module` opens for writing, its name ending in suffix, runs out of disk after room bytes."""
    opened = []

    def open_(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if ("w" in mode or "a" in mode) and str(path).endswith(suffix):
            opened.append(path)
            if len(opened) == n:
                return FullDisk(f, room)
        return f

    monkeypatch.setattr(module, "open", open_, raising=False)
    return opened


def at_step(monkeypatch, actions):
    """actions[step]() as training step `step` computes its lr (after its checkpoint, before its record)."""
    real = train_gpt2.get_lr

    def get_lr(step, *args):
        if step in actions:
            actions[step]()
        return real(step, *args)

    monkeypatch.setattr(train_gpt2, "get_lr", get_lr)


# ----------------------------------------------------------------------------------------------
# Scripts in the background, under torchrun, and as torchrun's ranks without its agent


def torchrun_command(*args, nproc=2, script="train_gpt2.py", wrap=None, launch=("--standalone",)):
    """torchrun's command line: nproc ranks a node of script, or of the python code wrap; launch: rendezvous flags."""
    program = ["--no-python", sys.executable, "-c", wrap] if wrap else [str(script)]
    launcher = [sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc_per_node={nproc}"]
    return [*launcher, *program, *map(str, args)]


def torchrun(*args, nproc=2, wrap=None, timeout=300, **kwargs):
    """Run train_gpt2.py (or `wrap`) under torchrun with `nproc` CPU ranks (gloo) to its end; the CompletedProcess."""
    command = torchrun_command(*args, nproc=nproc, wrap=wrap)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs)


def start_run(*args, torchrun=False, script="train_gpt2.py", **kwargs):
    """The Popen of a script (or a 2-rank torchrun of train_gpt2.py) started in the background, piped as text."""
    command = torchrun_command(*args) if torchrun else [sys.executable, str(ROOT / script), *map(str, args)]
    options = {"cwd": ROOT, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen(command, **{**options, **kwargs})


def started_until(said, *args, **kwargs):
    """start_run(*args, **kwargs), returned once the script has said `said`: a stdout line starting with it,
    or for "import M", python's import-time line of M or a module in it (PYTHONPROFILEIMPORTTIME, stderr)."""
    module = said.removeprefix("import ") if said.startswith("import ") else None
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"PYTHONPROFILEIMPORTTIME": "1"} if module else {})}
    proc = start_run(*args, env=env, **kwargs)
    guard = threading.Timer(300, proc.kill)  # a run that hangs before it says it: killed, its pipes end
    guard.start()
    wanted = rf"import time:.*\| +{module}(\.|$)" if module else re.escape(said)
    next((line for line in (proc.stderr if module else proc.stdout) if re.match(wanted, line)), None)
    guard.cancel()
    return proc


def signal_on(said, *args, signum=signal.SIGINT, times=1, **kwargs):
    """started_until(said, ...) sent signum `times` times (to its process group with start_new_session);
    -> (the Popen once ended (killed after 120 s), its stdout, its stderr without import-time lines)."""
    proc = started_until(said, *args, **kwargs)
    try:
        for _ in range(times):
            os.killpg(proc.pid, signum) if kwargs.get("start_new_session") else proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc, out, "".join(line for line in err.splitlines(keepends=True) if not line.startswith("import time:"))


def wait_for_step(proc, out, step, timeout=240):
    """Poll out/log.jsonl until it records training step `step`; the process must still be running then."""
    log, deadline = Path(out) / "log.jsonl", time.time() + timeout
    while time.time() < deadline:
        if log.exists() and f'"step": {step}, "train_loss"' in log.read_text():
            return
        if proc.poll() is not None:
            said = "\n".join(s[-3000:] for s in proc.communicate() if s)  # the pipes it has
            raise AssertionError(f"it ended (exit {proc.returncode}) before step {step} was logged:\n{said}")
        time.sleep(0.01)
    raise AssertionError(f"step {step} never logged")


def free_port():
    """A TCP port free on 127.0.0.1 now: a MASTER_PORT or a rendezvous endpoint."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ranks_without_agent(args, world_size=2, one_by_one=False, one_per_node=False, timeout=300):
    """train_gpt2.py's ranks with torchrun's variables, without its agent (which stops the others once one
    fails); one_by_one: each once the one before has ended; one_per_node: each rank LOCAL_RANK 0 of a node
    of its own. -> ([each rank's exit code], [each rank's (stdout, stderr)])."""
    env = {**os.environ, "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = []
    for rank in range(world_size):
        if rank and one_by_one:
            ranks[-1].wait(timeout=timeout)
        ranks.append(start_run(*args, env={**env, "RANK": str(rank), "LOCAL_RANK": str(0 if one_per_node else rank)}))
    outputs = [proc.communicate(timeout=timeout) for proc in ranks]
    return [proc.returncode for proc in ranks], outputs


# ----------------------------------------------------------------------------------------------
# Tiny transformers models


def perturb_norms_and_biases(name, p):
    """Random init leaves LayerNorms at 1/0 and biases at 0: move them off it, so that a test sees every weight."""
    if "ln" in name or name.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))


def save_tiny_hf_gpt2(path, n_embd=64, init=perturb_norms_and_biases):
    """A random transformers GPT2LMHeadModel (seed 0; 2 layers, 4 heads, n_embd wide, 128 positions, no
    dropout), each parameter then changed by init(name, p), saved with save_pretrained into path."""
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415  (after conftest sets the offline variables)

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_head=4, n_embd=n_embd, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init(name, p)
    model.save_pretrained(path)
    return path


def fineweb_stopped_after(monkeypatch, n, args):
    """fineweb.main(args) stopped by Ctrl-C (a KeyboardInterrupt) as its n-th shard is in place."""
    real, written = fineweb.write_shard, []

    def write_then_stop(path, tokens, fmt="npy"):
        real(path, tokens, fmt)
        written.append(path)
        if len(written) == n:
            raise KeyboardInterrupt

    monkeypatch.setattr(fineweb, "write_shard", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        fineweb.main(args)
    monkeypatch.undo()


def fineweb_killed_after(n, args):
    """fineweb.py args in a process SIGKILLed as its n-th shard is in place, before the manifest lists it."""
    script = (
        "import os, signal, sys\nimport fineweb\nreal, written = fineweb.write_shard, []\n"
        "def write_shard(path, tokens, fmt='npy'):\n    real(path, tokens, fmt)\n    written.append(path)\n"
        f"    if len(written) == {n}:\n        os.kill(os.getpid(), signal.SIGKILL)\n"
        "fineweb.write_shard = write_shard\nfineweb.main(sys.argv[1:])\n"
    )
    r = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr

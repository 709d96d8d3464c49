"""What every script shares, torch-free so that fineweb.py starts without loading torch: the error
type and the command-line wrapper that prints it as one line (a Ctrl-C as its own words), atomic
writes of files and folders and a failed write's one line, opening a file without following a
symbolic link at its name, the offline probe, the one-line
out-of-memory report, a run log's records, the default thread count."""

import argparse
import contextlib
import errno
import json
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

GPT2_VOCAB = 50257  # real GPT-2 vocabulary; ids >= this are padding and are never sampled
HF_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


class UserError(Exception):
    """A mistake in the user's input: reported as one line, exit code 1, no traceback.
    every_rank: every process of a torchrun job raises the same one (a flag, the recipe), so
    only rank 0 says it; "node": every process of a node raises it alike (its data folder, which
    may be the node's own), so each node's first process (LOCAL_RANK 0) says it."""

    every_rank = False


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a flag it cannot parse (a typo, `--keep-ckpts 1.5`) is a UserError: one `error:`
    line and exit 1, like every other mistake, not the whole usage before it. prog: the script's
    file name, for the --help the line points to."""

    def error(self, message):
        raise UserError(f"{message} (see python {self.prog} --help)")


EVERY_RANK_GRACE = 3.0  # seconds the other ranks wait before exiting on a mistake rank 0 says for them


def same_on_every_rank(error, node=False):
    """error, marked as one that every rank of a torchrun job (node: of a node) raises alike
    (UserError.every_rank)."""
    error.every_rank = "node" if node else True
    return error


def first_line(e):
    """The first line of an exception's message (or its type's name): enough for a one-line error."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def fsync_dir(folder):
    """Make the names in folder durable: a rename or a new file is an entry in its folder, which
    POSIX keeps in memory until the folder itself is fsynced. A no-op where a folder cannot be
    opened (Windows) or fsynced (some file systems)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder):
    """Every file under folder, then every folder in it, on disk (write_dir_atomic, before its swap)."""
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDWR)  # written by us; Windows fsyncs only writable ones
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # an open of a symbolic link fails; 0 where the OS lacks it


class LinkedName(UserError):
    """A symbolic link stands at the name of a file the program writes itself (its log, a
    checkpoint, a shard, a manifest, their temporary files): writing would reach the file the link
    names, outside the folder, and replacing it would delete a link the program did not make. So
    it is refused, naming the link, where it points and the `rm` that removes the link alone.
    elsewhere: the flag that names another folder (None: none to name)."""

    def __init__(self, path, elsewhere="--out-dir"):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        other = f", or use another {elsewhere}" if elsewhere else ""
        super().__init__(
            f"{path} is a symbolic link (to {target}): this run writes that file itself and never through a link: "
            f"remove the link (rm {shlex.quote(os.fspath(path))}; what it points to is kept){other}"
        )
        self.path, self.target = os.fspath(path), target


def refuse_link(path, elsewhere="--out-dir"):
    """Raise LinkedName if path is a symbolic link (to anything, or to nothing)."""
    if os.path.islink(path):
        raise LinkedName(path, elsewhere)


def no_follow(path, flags, elsewhere="--out-dir"):
    """An opener for open(): os.open that never follows a symbolic link at path (O_NOFOLLOW, or
    where the OS lacks it a check just before), refusing one as LinkedName."""
    if not NOFOLLOW:
        refuse_link(path, elsewhere)
    try:
        return os.open(path, flags | NOFOLLOW, 0o666)
    except OSError:
        refuse_link(path, elsewhere)  # ELOOP on Linux, EMLINK or EFTYPE elsewhere: the link, named
        raise


def _new_file(path, flags, elsewhere):
    """An opener that creates path afresh (O_CREAT | O_EXCL, which no symbolic link passes, dangling
    or not, and O_NOFOLLOW): a link there is refused; a file there (a killed write's, or a hard
    link) loses that name first, so that what another name of it holds is never overwritten."""
    try:
        return os.open(path, flags | os.O_EXCL | NOFOLLOW, 0o666)
    except FileExistsError:
        refuse_link(path, elsewhere)
        os.remove(path)
        return os.open(path, flags | os.O_EXCL | NOFOLLOW, 0o666)


def write_atomic(path, write, mode="wb", elsewhere="--out-dir"):
    """write(f) into a hidden temporary file beside path, fsync it, then rename it over path and
    fsync the folder: readers and a resumed run see the whole old file or the whole new one, never
    half of one, and after a crash (a power cut) still one of them. The temporary file is removed
    on any failure, a full disk and Ctrl-C included. A symbolic link at either name is refused
    (LinkedName; elsewhere: the flag for another folder): never written through, never replaced."""
    tmp = os.path.join(os.path.dirname(path) or ".", "." + os.path.basename(path) + ".tmp")
    refuse_link(path, elsewhere)  # renamed over, a link would be deleted, and not by the one who made it
    made = False
    try:
        with open(tmp, mode, opener=lambda name, flags: _new_file(name, flags, elsewhere)) as f:
            made = True
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it count
        refuse_link(path, elsewhere)  # one put there while this wrote
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")  # the rename itself on disk: a crash now keeps the new file
    except BaseException:
        if made and os.path.lexists(tmp) and not os.path.islink(tmp):  # a full disk: give back the space it holds
            os.remove(tmp)
        raise


def disk_error(e, what, then):
    """One line for a failed write; 'make room' only when the disk is really full."""
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    fix = "make room on the disk" if full else "make --out-dir writable"
    return UserError(f"cannot write {what} ({getattr(e, 'strerror', None) or e}): {fix}, then {then}")


def write_dir_atomic(out_dir, write, what, recheck=None):
    """write(tmp) fills a hidden folder beside out_dir, which then takes out_dir's place (a folder
    already there is renamed aside first and deleted last: the caller checked it may go). A mount
    point (`docker -v host:dir`, a tmpfs) cannot be renamed: the hidden folder is made inside it,
    and its files take the places of those there (a file of the earlier folder not written again
    is deleted). On any failure, a full disk, Ctrl-C and SIGTERM included, the hidden folders and
    the parents this made are removed and out_dir is as it was. recheck(tmp), if given, runs right
    before the swap (tmp: the hidden folder, which is inside a mount point)."""
    parent = os.path.dirname(out_dir)
    into = os.path.ismount(out_dir)
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
        tmp = tempfile.mkdtemp(prefix=".tmp_", dir=out_dir if into else parent)
        # mkdtemp makes it private (0700): give it the mode of the folder it replaces, or else
        # the one os.mkdir would give a new folder
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, os.stat(out_dir).st_mode & 0o7777 if os.path.isdir(out_dir) else 0o777 & ~umask)
        write(tmp)
        for name in os.listdir(tmp):  # a file some writer made private (safetensors' 0600) gets a new file's mode
            path = os.path.join(tmp, name)
            if os.path.isfile(path) and not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)
        fsync_tree(tmp)  # what write() wrote (save_pretrained does not fsync) on disk before the swap
        if recheck:
            recheck(tmp)
        if into:
            earlier = set(os.listdir(out_dir)) - {os.path.basename(tmp)}
            for name in os.listdir(tmp):
                os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
                earlier.discard(name)
            os.rmdir(tmp)
            tmp = None
            for name in earlier:
                os.remove(os.path.join(out_dir, name))
            fsync_dir(out_dir)
            return
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
        fsync_dir(parent or ".")  # the swap itself on disk
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


def default_workers():
    """The cores this process may run on (its affinity where the OS has one): the default thread count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def log_records(path):
    """The records (dicts) of a run's log.jsonl in order; a line cut short by a kill is passed over.
    Nothing when the file is missing or cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if isinstance(record, dict):
                    yield record
    except OSError:
        return


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
    Running out of memory is one `error:` line too: out_of_memory(the exception) says during what
    and which flag to lower (see out_of_memory_line). Under torchrun a mistake every rank makes
    alike (UserError.every_rank) is said by rank 0 alone (a node's: by its LOCAL_RANK 0)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises KeyboardInterrupt from here on
    sys.stdout, sys.stderr = OutlivesItsReader(sys.stdout), OutlivesItsReader(sys.stderr)
    try:
        code = main()
    except UserError as e:
        speaker = "LOCAL_RANK" if e.every_rank == "node" else "RANK"  # the process that says it
        if not (e.every_rank and os.environ.get(speaker, "0") != "0"):
            print(f"error: {e}", file=sys.stderr)
        elif e.every_rank:  # torchrun ends the job when the first rank exits: give the speaker time to say it
            time.sleep(EVERY_RANK_GRACE)
        code = 1
    except Exception as e:
        memory = memory_kind(e)
        if memory is None:
            raise  # a bug: its traceback
        print(f"error: {out_of_memory_line(e, memory, out_of_memory)}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt as e:
        print(str(e) or interrupted, file=sys.stderr)  # its own words, if it has any (signals.Interrupted)
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


@contextlib.contextmanager
def said_on_interrupt(message):
    """A Ctrl-C inside is reported with message (run_cli prints a KeyboardInterrupt's own words)."""
    try:
        yield
    except KeyboardInterrupt as e:
        if str(e):
            raise  # it says something already
        raise KeyboardInterrupt(message) from None


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
    """'out of host memory ...' and during what and what to lower, from advice(e) (the script's own,
    e.g. out_of_memory.training_out_of_memory, which reads the phase e left); else the allocator's
    own words, cut short."""
    said = re.sub(r"\[enforce fail at [^]]*\] *(err == 0\. *)?", "", first_line(e))
    said = re.sub(r"(Tried to allocate [\d.]+ [KMGT]iB)\..*", r"\1", said)  # CUDA's: the size, not its stats
    where = advice(e) if advice else None
    return f"out of {memory} {where}" if where else f"out of {memory} ({said})"

"""How the project writes and reads its own files, torch-free: atomic writes of files and folders
(a failed write in one line), the lock that holds a folder for one process, and jsonl read line by
line."""

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time

from support.cli import UserError, first_line

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
try:
    import msvcrt
except ImportError:  # not Windows
    msvcrt = None


def write_atomic(path, write, mode="wb"):
    """write(f) into a hidden temporary file beside path, fsync it, then rename it over path and
    fsync the folder: readers and a resumed run see the whole old file or the whole new one, never
    half of one, and after a crash (a power cut) still one of them. A link at path is replaced by
    the rename, never written through. The temporary file is removed on any failure, a full disk
    and Ctrl-C included."""
    tmp = os.path.join(os.path.dirname(path) or ".", "." + os.path.basename(path) + ".tmp")
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it count
        os.replace(tmp, path)
        with contextlib.suppress(OSError):  # the rename, an entry of the folder, on disk (Windows opens no folder)
            fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: give back the space it holds
            os.remove(tmp)
        raise


def existing_part(path):
    """path, or the nearest of its folders that exists ("." for a relative path none of whose do)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return path or "."


def check_folder(path, flag):
    """A folder flag whose path, or the nearest of its folders that exists, is a file: one line."""
    found = existing_part(path)
    if not os.path.isdir(found):
        where = f"{flag} {path}" if found == path else f"{flag} {path}: {found}"
        raise UserError(f"{where} is a file, not a folder: name a folder")


def disk_error(e, what, then):
    """One line for a failed write; 'make room' only when the disk is really full."""
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    fix = "make room on the disk" if full else "make --out-dir writable"
    return UserError(f"cannot write {what} ({getattr(e, 'strerror', None) or e}): {fix}, then {then}")


# the file each script names itself in, in a folder it holds (lock_folder's name), and what the other calls it
LOCK_HOLDERS = {".train_gpt2.lock": "a train_gpt2.py run", ".fineweb.lock": "a fineweb.py run"}


def lock_folder(folder, name, who, note="", dry_run=False):
    """Hold folder (made, parents too, where it is missing) for this process's life: a second `who`
    started into it is refused in one line naming the holder, whose pid, host, start and command
    (note: more on the pid) this writes to the file `name` in folder (by rename, as every write here).
    The lock is flock on the folder itself, or on Windows msvcrt.locking on NAME.msvcrt held open
    (Windows deletes no open file): a user's `rm` of a file cannot undo it, and the OS gives it back
    when the process ends, a kill included. Returns what unlock_folder takes; None where the file
    system cannot lock (some network file systems), said in a warning. dry_run: only whether another
    holds it; nothing is made or written."""
    path = os.path.join(folder, name)
    if dry_run and not os.path.exists(folder if fcntl else path + ".msvcrt"):
        return None  # no folder (on Windows no lock file): no process holds it
    made = missing_folders(folder)  # unlock_folder removes them while still empty
    os.makedirs(folder, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY) if fcntl else os.open(path + ".msvcrt", os.O_RDWR | os.O_CREAT)
    try:
        if fcntl:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, getattr(errno, "EDEADLOCK", errno.EDEADLK)):
            print(
                f"warning: cannot lock --out-dir {folder} ({e.strerror}): a second {who} started into it would not "
                f"be stopped",
                file=sys.stderr,
            )
            return None
        holder, by = "", f"another {who}"  # unnamed where its file was deleted by hand (or not written yet)
        for n, held_by in [(name, by), *LOCK_HOLDERS.items()]:  # held by the same script, or by the other
            with contextlib.suppress(OSError), open(os.path.join(folder, n), encoding="utf-8", errors="replace") as f:
                holder, by = f" ({f.readline(500).strip()})", held_by
                break
        raise UserError(
            f"--out-dir {folder} is in use by {by}{holder}: wait for it to end, or pass another --out-dir"
        ) from None
    if dry_run:
        return fd, None, made
    command = " ".join(["python", os.path.basename(sys.argv[0]), *sys.argv[1:]]).replace("\n", " ")
    command = command if len(command) <= 160 else command[:157] + "..."
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    holder = f"pid {os.getpid()}{note} on {socket.gethostname()}, since {since}: {command}"
    with contextlib.suppress(OSError):  # a full disk: the lock holds all the same, unnamed
        write_atomic(path, lambda f: f.write(holder.encode()))
    return fd, path, made


def unlock_folder(lock):
    """Give lock_folder's lock back (None: none was taken): the holder's file removed while the
    lock still keeps others out, then the lock (on Windows its file too, unless another process
    has it open), then the folders lock_folder made, if nothing was written there."""
    if lock is None:
        return
    fd, path, made = lock  # path None: a dry run's, which wrote no file
    if path:
        with contextlib.suppress(OSError):
            os.remove(path)
    os.close(fd)
    if not fcntl and path:
        with contextlib.suppress(OSError):
            os.remove(path + ".msvcrt")
    remove_made_folders(made)


def missing_folders(path):
    """The folders of path that do not exist yet, deepest first: those os.makedirs would create."""
    path, missing = os.path.abspath(path), []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_made_folders(made):
    """Remove the folders a refused or failed start created (missing_folders' list), while still empty:
    a typo'd flag leaves no empty --out-dir behind, and a folder written to stays."""
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:
            break


UNFINISHED = ".unfinished_export"  # in a folder whose files an export was moving when it stopped


def write_dir_atomic(out_dir, write, what):
    """write(tmp) fills a hidden folder made inside out_dir (a mount point too: nothing is renamed
    but files), whose files then take the places of those there, config.json last; the earlier
    export's config.json and its files not written again go first. A failure while writing, a full
    disk and Ctrl-C included, leaves out_dir as it was, less the hidden folder and the parents this
    made; one in the moves (a rename) leaves a folder without config.json, which never loads as a
    model, and the same command run again finishes it. Nothing is fsynced: a power cut may cost
    the export, which the checkpoint makes again."""
    made = missing_folders(out_dir)  # the folders this call creates
    tmp, left = None, "nothing was changed"
    try:
        os.makedirs(out_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp_", dir=out_dir)
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        new = sorted(os.listdir(tmp), key=lambda name: name == "config.json")  # config.json last
        for name in new:  # a file some writer made private (safetensors' 0600) gets a new file's mode
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        earlier = set(os.listdir(out_dir)) - {os.path.basename(tmp), *new, UNFINISHED}  # not written again
        left = f"{out_dir} has no config.json yet: run the command again"
        open(os.path.join(out_dir, UNFINISHED), "w").close()  # what lets the run again replace it
        for name in ["config.json", *earlier]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out_dir, name))
        for name in new:
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        os.rmdir(tmp)
        os.remove(os.path.join(out_dir, UNFINISHED))
    except BaseException as e:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_made_folders(made)  # one not empty stays: someone else wrote there meanwhile
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":  # safetensors' failed write
            reason = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
            reason = re.sub(r".*I/O error: (.*) \(os error \d+\).*", r"\1", reason)  # safetensors' wording
            full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in reason
            fix = "make room or choose another folder" if full else "choose a folder you can write to"
            raise UserError(f"cannot write {what} to {out_dir} ({reason}): {left}; {fix}") from None
        if isinstance(e, KeyboardInterrupt):
            as_it_was = f"{out_dir} is as it was" if left == "nothing was changed" else left
            raise KeyboardInterrupt(f"interrupted: {what} was not written ({as_it_was})") from None
        raise


def jsonl_rows(lines, source, error=UserError):
    """(line number, row) of each line of jsonl text that is not blank. A line that is not JSON, or
    that holds a NUL character (UTF-16 or a binary file read as UTF-8), raises error naming source
    and the line; with error None it is passed over (a line of our own log cut short by a kill)."""
    for lineno, line in enumerate(lines, 1):
        if "\0" in line:
            problem = "holds NUL characters: not UTF-8 text (UTF-16? binary?)"
        elif not line.strip():
            continue
        else:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                problem = f"is not valid JSON ({e.msg})"
            else:
                yield lineno, row
                continue
        if error is not None:
            raise error(f"{source} line {lineno} {problem}")


def log_records(path):
    """The records (dicts) of a run's log.jsonl in order; a line cut short by a kill is passed over.
    Nothing when the file is missing or cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from (record for _, record in jsonl_rows(f, path, error=None) if isinstance(record, dict))
    except OSError:
        return

"""Exclusive folder locks that a second process is refused by, and their refusals worded once:
flock where fcntl exists, msvcrt.locking on Windows. lock_folder and unlock_folder are the one code
path by which train_gpt2.py holds its --out-dir and fineweb.py its shards folder. Why this and not
the filelock package: docs/reliability.md, "The folder lock". A lock file is never opened through a
symbolic link, nor written through a second name."""

import errno
import os
import shlex
import socket
import sys
import time

from support.cli import UserError
from support.files import disk_error, no_follow, refuse_link

try:
    import fcntl
except ImportError:  # not a POSIX system
    fcntl = None
try:
    import msvcrt
except ImportError:  # not Windows
    msvcrt = None

BINARY = getattr(os, "O_BINARY", 0)  # Windows opens a descriptor in text mode unless told
MSVCRT_OFFSET = 2**30  # msvcrt's locks are mandatory: lock one byte far past the holder's text, so it stays readable
HOLDER_BYTES = 4096


class Held(Exception):
    """Another process holds the lock. holder: the text its file holds ("" while that process starts)."""

    def __init__(self, holder):
        super().__init__(holder)
        self.holder = holder


class NoLocks(Exception):
    """The file system (some network file systems), or the platform, cannot lock: the lock is not taken."""


def mechanism():
    """How this platform locks: "flock", "msvcrt", or None (it cannot)."""
    return "flock" if fcntl else "msvcrt" if msvcrt else None


def acquire(path):
    """An exclusive lock on the file at path (created if missing) for this process; returns its
    descriptor, to keep open while the lock is wanted. The OS gives the lock back when the process
    ends, a kill included: the file is only the place the lock lives. Held: another process has
    it; NoLocks: nothing here can lock; LinkedName: a symbolic link at path, never followed;
    OSError: path cannot be opened."""
    if mechanism() is None:
        raise NoLocks("this platform has neither flock nor msvcrt.locking")
    while True:
        fd = no_follow(path, os.O_RDWR | os.O_CREAT | BINARY)
        try:
            if not _lock(fd):
                raise Held(read_holder(fd))
            # the file locked must be the one at path: its holder removes it as it ends, a newer one
            # makes one; and no link may have taken its place between the check and the open
            same = held(fd, path)
            if not same:
                refuse_link(path)
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)


def _lock(fd):
    """Lock fd without waiting: True if taken, False if another process holds it."""
    try:
        if fcntl:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            os.lseek(fd, MSVCRT_OFFSET, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES, getattr(errno, "EDEADLOCK", errno.EDEADLK)):
            return False
        raise NoLocks(e.strerror or str(e)) from None


def read_holder(fd):
    """The text of the lock file open at fd: who holds it."""
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, HOLDER_BYTES).decode("utf-8", "replace").strip()


def write_holder(fd, text):
    """Replace the lock file's text with text, for a refused process to name its holder."""
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, text.encode()[:HOLDER_BYTES])


def held(fd, path):
    """Whether the file open at fd is the one at path: not deleted, not replaced (by a file or a
    link: the name itself is compared, not what it points to)."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False


def holder_text(note=""):
    """Who holds a lock, as its file says it: "pid N{note} on HOST, since TIME: COMMAND"."""
    command = " ".join(["python", os.path.basename(sys.argv[0]), *sys.argv[1:]]).replace("\n", " ")
    command = command if len(command) <= 160 else command[:157] + "..."
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"pid {os.getpid()}{note} on {socket.gethostname()}, since {since}: {command}"


def not_yours(path, advice):
    """The line for a file or folder this user may not write because another user owns it: whose it
    is, and advice; None where it is this user's (or the platform has no owners)."""
    try:
        uid = os.stat(path).st_uid
    except OSError:
        return None
    if not hasattr(os, "getuid") or uid == os.getuid():
        return None
    try:
        import pwd  # noqa: PLC0415  POSIX only: the owner's name

        whose = pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        whose = f"user {uid}"
    return f"{path} belongs to {whose} and this user may not write it: {advice}"


def lock_folder(folder, name, who, then, theirs, note=""):
    """Lock folder for this process's life through its file `name`, whose text then names this
    process (holder_text(note)) for a refused one to show. Returns the descriptor, to keep open and
    give to unlock_folder; None where nothing can lock (said in a warning). Every refusal is one
    UserError line worded here for both scripts, before anything is written: the folder in use by
    another `who` (naming it); a symbolic link or a second name (a hard link) at `name`; a folder
    of another user's (`theirs`: what to do then); else a disk error. then: what to do once the
    cause is gone."""
    path = os.path.join(folder, name)
    try:
        fd = acquire(path)
    except Held as e:
        holder = e.holder or "a process that is just starting"
        raise UserError(
            f"--out-dir {folder} is in use by another {who} ({holder}): wait for it to end, or pass another --out-dir"
        ) from None
    except NoLocks as e:
        print(
            f"warning: cannot lock --out-dir {folder} ({e}): a second {who} started into it would not be stopped",
            file=sys.stderr,
        )
        return None
    except OSError as e:
        denied = path if os.path.lexists(path) else folder  # another user's lock file, or folder
        if isinstance(e, PermissionError) and (line := not_yours(denied, theirs)):
            raise UserError(line) from None
        raise disk_error(e, f"to --out-dir {folder} (its lock file {name})", then) from None
    if os.fstat(fd).st_nlink > 1:  # a hard link: its text would overwrite the file's other name
        os.close(fd)
        raise UserError(
            f"{path} has a second name (a hard link), and a lock never writes through one: remove this name "
            f"(rm {shlex.quote(path)}; the other keeps its bytes), then {then}"
        )
    try:
        write_holder(fd, holder_text(note))
    except OSError:
        pass  # a full disk: the lock holds all the same, unnamed
    return fd


def unlock_folder(fd, folder, name):
    """Give lock_folder's lock back: its file removed while it is still the one fd locked (a user
    may have deleted it and another process made its own), then fd closed. Windows removes no open
    file: there the file stays, and the next lock takes it."""
    try:
        if held(fd, os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    except OSError:
        pass
    os.close(fd)

"""Exclusive file locks that a second process is refused by: flock where fcntl exists, msvcrt.locking
on Windows, and elsewhere an exclusive-create lock file that names its holder."""

import errno
import os
import re
import socket
import time

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
    """Another process holds the lock. holder: the text its file holds ("" while that process
    starts); fix: what the user can do where the lock cannot end with its process (else None)."""

    def __init__(self, holder, fix=None):
        super().__init__(holder)
        self.holder, self.fix = holder, fix


class NoLocks(Exception):
    """The file system cannot lock (some network file systems): the lock is not taken."""


def mechanism():
    """How this platform locks: "flock", "msvcrt" or "exclusive file" (see acquire)."""
    return "flock" if fcntl else "msvcrt" if msvcrt else "exclusive file"


def acquire(path):
    """An exclusive lock on the file at path (created if missing) for this process; returns its
    descriptor, to keep open while the lock is wanted. Held: another process has it. NoLocks: the
    file system has no locks. OSError: path cannot be opened.

    With flock or msvcrt the OS gives the lock back when the process ends, a kill included; the
    file itself is only the place the lock lives. Where neither exists the file is the lock: made
    with O_CREAT | O_EXCL, so of two processes one alone makes it; one left by a killed process is
    taken over when its text names a pid on this host that no longer runs (write_holder's text
    must begin "pid N" and say "on HOSTNAME,"); one of another host is refused, naming the file to
    delete once its run has ended. That takeover is not atomic: two processes that find the same
    stale file in the same instant can both take it."""
    if fcntl is None and msvcrt is None:
        return _acquire_exclusive_file(path)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | BINARY, 0o644)
        try:
            if not _lock(fd):
                raise Held(read_holder(fd))
            try:  # the file locked must be the one at path: its holder removes it as it ends, a newer one makes one
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
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


def _acquire_exclusive_file(path):
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | BINARY, 0o644)
        except FileExistsError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY | BINARY)
        except FileNotFoundError:
            continue  # its holder gave it back meanwhile
        try:
            holder = read_holder(fd)
            match = re.match(r"pid (\d+)\b.*? on ([^\s,]+),", holder)
            if not match or match[2] != socket.gethostname():  # another host's, or it is just starting
                starting = not match and time.time() - os.fstat(fd).st_mtime < 60
                raise Held(holder, None if starting else f"if no run is using it, delete {path}")
            if _alive(int(match[1])):
                raise Held(holder)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
        finally:
            os.close(fd)
        if same:  # a killed run's lock: taken over
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def _alive(pid):
    """Whether process pid runs on this host. Reached only where msvcrt is missing, so never on
    Windows, whose os.kill(pid, 0) would end the process instead of probing it."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, AttributeError):  # not ours to signal (alive), or no os.kill: cannot tell, so refuse
        return True
    return True


def read_holder(fd):
    """The text of the lock file open at fd: who holds it."""
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, HOLDER_BYTES).decode("utf-8", "replace").strip()


def write_holder(fd, text):
    """Replace the lock file's text with text, for a refused process to name its holder."""
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, text.encode()[:HOLDER_BYTES])

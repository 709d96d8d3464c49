"""Exclusive file locks that a second process is refused by: flock where fcntl exists, msvcrt.locking
on Windows, and elsewhere an exclusive-create lock file that names its holder. A folder's lock
(lock_folder, keep_folder, unlock_folder) is the one code path by which train_gpt2.py holds its
--out-dir and fineweb.py its shards folder. Why this and not the filelock package:
docs/reliability.md, "The folder lock". A lock file is never opened through a symbolic link."""

import errno
import os
import re
import socket
import sys
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
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a symbolic link at the name fails the open; 0 where the OS lacks it
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


class Symlink(Exception):
    """A symbolic link stands at the lock file's name: it is not followed (the lock's text would be
    written into the file it points to), and the lock is not taken. path: the link; target: where
    it points ("" if that cannot be read)."""

    def __init__(self, path):
        try:
            target = os.readlink(path)
        except OSError:
            target = ""
        super().__init__(f"{path} is a symbolic link" + (f" to {target}" if target else ""))
        self.path, self.target = path, target


def refuse_symlink(path):
    """Raise Symlink if path is a symbolic link (where O_NOFOLLOW is missing, the only guard)."""
    if os.path.islink(path):
        raise Symlink(path)


def _open(path, flags):
    """os.open(path, flags) that never follows a symbolic link at path: O_NOFOLLOW where the OS has
    it (an open that fails is checked for a link, whatever the errno: ELOOP, EMLINK, EFTYPE), else a
    check before the open (and acquire's check after it, for a link put there in between)."""
    refuse_symlink(path)
    try:
        return os.open(path, flags | NOFOLLOW | BINARY, 0o644)
    except OSError:
        refuse_symlink(path)
        raise


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
    delete once its run has ended; one whose pid runs is refused, naming the command that shows
    what that pid runs now (a pid is reused: after a reboot it may be any process) and the file to
    delete if it is not the holder. That takeover is not atomic: two processes that find the same
    stale file in the same instant can both take it."""
    if fcntl is None and msvcrt is None:
        return _acquire_exclusive_file(path)
    while True:
        fd = _open(path, os.O_RDWR | os.O_CREAT)
        try:
            if not _lock(fd):
                raise Held(read_holder(fd))
            # the file locked must be the one at path: its holder removes it as it ends, a newer one
            # makes one; and no link may have taken its place between the check and the open
            same = held(fd, path)
            if not same:
                refuse_symlink(path)
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
        try:  # O_EXCL fails on any name that exists, a symbolic link included: never followed
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | BINARY, 0o644)
        except FileExistsError:
            pass
        try:
            fd = _open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # its holder gave it back meanwhile
        try:
            holder = read_holder(fd)
            match = re.match(r"pid (\d+)\b.*? on ([^\s,]+),", holder)
            if not match or match[2] != socket.gethostname():  # another host's, or it is just starting
                starting = not match and time.time() - os.fstat(fd).st_mtime < 60
                raise Held(holder, None if starting else f"if no run is using it, delete {path}")
            pid = int(match[1])
            if pid == os.getpid():  # this process's own lock
                raise Held(holder)
            if _alive(pid):  # that run, or a process that took its pid since (after a reboot, say)
                raise Held(
                    holder,
                    f"if `ps -p {pid} -o args=` does not show that command, pid {pid} is another process now (the "
                    f"pid reused, or the file copied from another run's folder) and no run holds it: delete {path}",
                )
            same = held(fd, path)
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


def held(fd, path):
    """Whether the file open at fd is the one at path: not deleted, not replaced (by a file or a
    link: the name itself is compared, not what it points to)."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False


def holder_text(note=""):
    """Who holds a lock, as its file says it: "pid N{note} on HOST, since TIME: COMMAND". The
    exclusive-file lock reads the pid and host back (acquire)."""
    command = " ".join(["python", os.path.basename(sys.argv[0]), *sys.argv[1:]]).replace("\n", " ")
    command = command if len(command) <= 160 else command[:157] + "..."
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"pid {os.getpid()}{note} on {socket.gethostname()}, since {since}: {command}"


def lock_folder(folder, name, note=""):
    """Lock folder for this process's life: acquire on its file `name`, whose text then names this
    process (holder_text(note)) for a refused one to show. Returns the descriptor, to keep open and
    give to keep_folder and unlock_folder. Raises what acquire raises: Held, NoLocks, Symlink, OSError
    (a folder at the name: IsADirectoryError, or on Windows PermissionError)."""
    fd = acquire(os.path.join(folder, name))
    try:
        write_holder(fd, holder_text(note))
    except OSError:
        pass  # a full disk: the lock holds all the same, unnamed
    return fd


def keep_folder(fd, folder, name, note=""):
    """Whether folder is still held through fd, for a process to ask before each thing it writes
    there: its lock lives on a file a user can delete (a "stale lock" habit from other tools) or
    replace, and a second process would then lock a new file and write beside this one. Returns fd
    while the file at the name is the one fd locked; else that file (made if missing) is locked
    again and its descriptor returned, fd closed: the caller says so. Raises what lock_folder raises
    (fd then left open): Held when another process holds the new file."""
    if held(fd, os.path.join(folder, name)):
        return fd
    new = lock_folder(folder, name, note)
    os.close(fd)  # the lock on the file that was deleted: no other process can reach that file
    return new


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

"""support.file_lock, the one lock by which train_gpt2.py holds its --out-dir and fineweb.py its
shards folder (docs/reliability.md, "The folder lock"), on each of its mechanisms: flock, Windows'
msvcrt.locking (a stand-in with Windows' semantics, on flock), and the exclusive-create file left
where neither exists. A second holder is refused and told who holds the lock, the holder's text
surviving the refusal; a symbolic link at the lock's name is refused and what it points to left
untouched; a deleted lock file is seen by its holder; a folder's lock is given back only while it is
still the holder's. The scripts' own use of it: tests/test_out_dir.py (train_gpt2.py's --out-dir),
tests/test_fineweb.py, tests/test_portable.py."""

import errno
import os
import socket
import subprocess
import sys
import time

import pytest

from support import file_lock
from support.cli import UserError
from support.out_dir import LOCK_FILE, lock_out_dir


@pytest.fixture
def exclusive_file(monkeypatch, tmp_path):
    """support.file_lock as it is where neither fcntl nor msvcrt exists; the lock's path."""
    monkeypatch.setattr(file_lock, "fcntl", None)
    monkeypatch.setattr(file_lock, "msvcrt", None)
    return tmp_path / LOCK_FILE


def ended_pid():
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    return ended.pid  # no longer runs


def test_exclusive_file_lock_of_a_killed_run_on_this_host_is_taken_over(exclusive_file):
    exclusive_file.write_text(f"pid {ended_pid()} on {socket.gethostname()}, since 2026-11-25 12:00:00: python x.py")
    fd = file_lock.acquire(str(exclusive_file))
    try:
        ours = f"pid {os.getpid()} on {socket.gethostname()}, since now: ours"
        file_lock.write_holder(fd, ours)
        assert exclusive_file.read_text() == ours
        with pytest.raises(file_lock.Held) as held:  # now ours: refused to the next one, nothing to delete
            file_lock.acquire(str(exclusive_file))
        assert held.value.holder == ours and held.value.fix is None
    finally:
        os.close(fd)


def live_pid_fix(pid, path):
    return (
        f"if `ps -p {pid} -o args=` does not show that command, pid {pid} is another process now (the pid reused, "
        f"or the file copied from another run's folder) and no run holds it: delete {path}"
    )


def test_exclusive_file_lock_of_a_live_process_is_refused(exclusive_file):
    holder = f"pid {os.getppid()} (rank 0 of a torchrun job) on {socket.gethostname()}, since 2026-11-25: python x.py"
    exclusive_file.write_text(holder)
    with pytest.raises(file_lock.Held) as held:
        file_lock.acquire(str(exclusive_file))
    assert held.value.holder == holder and held.value.fix == live_pid_fix(os.getppid(), exclusive_file)
    assert exclusive_file.read_text() == holder


def test_a_lock_naming_a_live_unrelated_process_says_how_to_tell_and_what_to_do(exclusive_file):
    # a pid taken since by another process (a reboot), the lock file of a killed run still there
    other = subprocess.Popen(["sleep", "60"])
    try:
        out = exclusive_file.parent
        since = "since 2026-11-25 12:00:00"
        exclusive_file.write_text(
            f"pid {other.pid} on {socket.gethostname()}, {since}: python train_gpt2.py --out-dir {out}"
        )
        with pytest.raises(UserError) as e:  # as train_gpt2.py says it
            lock_out_dir(str(out), "rerun the same command")
        said = str(e.value)
        assert said.startswith(f"--out-dir {out} is in use by another run (pid {other.pid} on ")
        assert said.endswith(f"({live_pid_fix(other.pid, exclusive_file)})")
        shows = subprocess.run(said.split("`")[1], shell=True, capture_output=True, text=True)  # how to tell
        assert shows.returncode == 0 and shows.stdout.split() == ["sleep", "60"]  # not that command
        os.remove(said.rsplit("delete ", 1)[1][:-1])  # what to do
        fd = file_lock.acquire(str(exclusive_file))
        os.close(fd)
    finally:
        other.kill()
        other.wait()


def test_exclusive_file_lock_of_another_host_is_refused_naming_the_file(exclusive_file):
    holder = f"pid {ended_pid()} on another-host.example, since 2026-11-25 12:00:00: python x.py"
    exclusive_file.write_text(holder)
    with pytest.raises(file_lock.Held) as held:  # whether that pid runs there cannot be told from here
        file_lock.acquire(str(exclusive_file))
    assert held.value.holder == holder and held.value.fix == f"if no run is using it, delete {exclusive_file}"
    assert exclusive_file.read_text() == holder


@pytest.mark.parametrize("age", [0, 3600])
def test_exclusive_file_lock_without_a_holder_is_refused_while_it_can_be_starting(exclusive_file, age):
    exclusive_file.write_text("")  # made, not yet named (or its naming failed: a full disk)
    os.utime(exclusive_file, (time.time() - age, time.time() - age))
    with pytest.raises(file_lock.Held) as held:
        file_lock.acquire(str(exclusive_file))
    assert held.value.holder == ""
    assert held.value.fix == (None if age == 0 else f"if no run is using it, delete {exclusive_file}")


class WindowsLikeMsvcrt:
    """msvcrt.locking as Windows documents it, on top of flock (a lock per open file, as a Windows
    handle's is): it locks nbytes from the file's position and fails with EACCES, or EDEADLOCK,
    when another handle holds them. Records the (position, nbytes) it was asked to lock."""

    LK_UNLCK, LK_LOCK, LK_NBLCK = 0, 1, 2

    def __init__(self, fails_with):
        self.fails_with, self.locked = fails_with, []
        self.fcntl = pytest.importorskip("fcntl")  # the stand-in needs flock; Windows has the real msvcrt

    def locking(self, fd, mode, nbytes):
        assert mode == self.LK_NBLCK  # a run never waits for the lock
        self.locked.append((os.lseek(fd, 0, os.SEEK_CUR), nbytes))
        try:
            self.fcntl.flock(fd, self.fcntl.LOCK_EX | self.fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(self.fails_with, "Permission denied") from None


@pytest.mark.parametrize("fails_with", [errno.EACCES, errno.EDEADLOCK])
def test_msvcrt_lock_is_refused_to_a_second_holder_and_keeps_the_holder_readable(monkeypatch, tmp_path, fails_with):
    msvcrt = WindowsLikeMsvcrt(fails_with)
    monkeypatch.setattr(file_lock, "fcntl", None)
    monkeypatch.setattr(file_lock, "msvcrt", msvcrt)
    path = str(tmp_path / LOCK_FILE)
    assert file_lock.mechanism() == "msvcrt"
    fd = file_lock.acquire(path)
    try:
        # Windows' locks are mandatory: the byte locked lies past the holder's text, which others read
        assert msvcrt.locked == [(file_lock.MSVCRT_OFFSET, 1)] and file_lock.MSVCRT_OFFSET >= file_lock.HOLDER_BYTES
        file_lock.write_holder(fd, "pid 1 on host, since now: ours")
        with pytest.raises(file_lock.Held) as held:
            file_lock.acquire(path)
        assert held.value.holder == "pid 1 on host, since now: ours" and held.value.fix is None
    finally:
        os.close(fd)
    os.close(file_lock.acquire(path))  # given back with its handle, as when a run ends or is killed


# ----------------------------------------------------------------------------------------------
# Every mechanism: the holder named, a link never followed, a deleted file seen


@pytest.fixture(params=["flock", "msvcrt", "exclusive file"])
def mechanism(request, monkeypatch):
    """support.file_lock with each of its mechanisms; its name."""
    if request.param != "flock":
        monkeypatch.setattr(file_lock, "fcntl", None)
    if request.param == "msvcrt":
        monkeypatch.setattr(file_lock, "msvcrt", WindowsLikeMsvcrt(errno.EACCES))
    elif request.param == "flock":
        pytest.importorskip("fcntl")
    assert file_lock.mechanism() == request.param
    return request.param


def test_a_second_holder_is_refused_and_the_holders_text_survives_it(mechanism, tmp_path):
    """The holder's text is read by the refused process, and left as it was: a lock that opened its
    file with O_TRUNC on every try (the filelock package before 4.0) would erase it."""
    fd = file_lock.lock_folder(str(tmp_path), ".x.lock", " (rank 0 of a torchrun job)")
    try:
        text = (tmp_path / ".x.lock").read_text()
        assert text.startswith(f"pid {os.getpid()} (rank 0 of a torchrun job) on {socket.gethostname()}, since ")
        command = "python " + " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
        # a long command line (pytest given many files) is cut to 157 characters and "..."
        assert text.endswith(": " + (command if len(command) <= 160 else command[:157] + "..."))
        for _ in range(3):
            with pytest.raises(file_lock.Held) as held:
                file_lock.acquire(str(tmp_path / ".x.lock"))
            assert held.value.holder == text and held.value.fix is None
        assert (tmp_path / ".x.lock").read_text() == text
    finally:
        file_lock.unlock_folder(fd, str(tmp_path), ".x.lock")
    assert os.listdir(tmp_path) == []  # given back: its file removed
    file_lock.unlock_folder(file_lock.lock_folder(str(tmp_path), ".x.lock"), str(tmp_path), ".x.lock")


@pytest.mark.parametrize("points_to", ["a file", "nothing", "a folder"])
@pytest.mark.parametrize("nofollow", [True, False], ids=["O_NOFOLLOW", "no O_NOFOLLOW"])
def test_a_symlink_at_the_locks_name_is_refused_and_what_it_points_to_is_untouched(
    mechanism, tmp_path, monkeypatch, points_to, nofollow
):
    """Followed, the lock would write its holder's text into the file the link names (a user's file,
    a checkpoint). Refused on every mechanism, with O_NOFOLLOW and without it (Windows)."""
    if not nofollow:
        monkeypatch.setattr(file_lock, "NOFOLLOW", 0)
    target = tmp_path / "precious"
    if points_to == "a file":
        target.write_bytes(b"the user's bytes\n")
    elif points_to == "a folder":
        target.mkdir()
    (tmp_path / ".x.lock").symlink_to(target)
    with pytest.raises(file_lock.Symlink) as refused:
        file_lock.lock_folder(str(tmp_path), ".x.lock")
    assert str(refused.value) == f"{tmp_path / '.x.lock'} is a symbolic link to {target}"
    assert refused.value.path == str(tmp_path / ".x.lock") and "\n" not in str(refused.value)
    assert (tmp_path / ".x.lock").is_symlink()
    if points_to == "a file":
        assert target.read_bytes() == b"the user's bytes\n"
    elif points_to == "a folder":
        assert os.listdir(target) == []
    else:
        assert not os.path.lexists(target)  # nothing made where it points


def test_a_symlink_that_takes_the_name_between_the_check_and_the_open_is_refused(tmp_path, monkeypatch):
    """Without O_NOFOLLOW (Windows) a link can appear after the check: the file locked is then not
    the one at the name, and the lock is refused before anything is written to it."""
    monkeypatch.setattr(file_lock, "NOFOLLOW", 0)
    target = tmp_path / "precious"
    target.write_bytes(b"the user's bytes\n")
    real, calls = file_lock.refuse_symlink, []

    def link_after_the_check(path):
        calls.append(path)
        if len(calls) == 1:
            os.symlink(target, path)  # the check found nothing; the link comes now
            return
        real(path)

    monkeypatch.setattr(file_lock, "refuse_symlink", link_after_the_check)
    with pytest.raises(file_lock.Symlink):
        file_lock.lock_folder(str(tmp_path), ".x.lock")
    assert target.read_bytes() == b"the user's bytes\n"


def test_a_deleted_lock_file_is_seen_and_locked_again(mechanism, tmp_path):
    """keep_folder: the file at the name still the one locked (held), or a new one locked (the
    caller warns), or another process's lock, refused; unlock_folder leaves another's file alone."""
    folder, path = str(tmp_path), tmp_path / ".x.lock"
    fd = file_lock.lock_folder(folder, ".x.lock")
    assert file_lock.held(fd, str(path)) and file_lock.keep_folder(fd, folder, ".x.lock") == fd
    path.unlink()  # "a stale lock"
    assert not file_lock.held(fd, str(path))
    new = file_lock.keep_folder(fd, folder, ".x.lock")
    assert new != fd and file_lock.held(new, str(path))
    assert path.read_text().startswith(f"pid {os.getpid()} on ")
    with pytest.raises(OSError):
        os.fstat(fd)  # the lock on the deleted file, closed
    path.unlink()
    other = file_lock.lock_folder(folder, ".x.lock")  # another holder takes the name meanwhile
    try:
        with pytest.raises(file_lock.Held):
            file_lock.keep_folder(new, folder, ".x.lock")
        file_lock.unlock_folder(new, folder, ".x.lock")
        assert file_lock.held(other, str(path))  # the other holder's file, still there
    finally:
        file_lock.unlock_folder(other, folder, ".x.lock")
    assert not path.exists()


def test_a_lock_file_replaced_by_a_symlink_is_not_held(tmp_path):
    """held compares the name itself, not what it points to: a link to the locked file is not it."""
    fd = file_lock.lock_folder(str(tmp_path), ".x.lock")
    try:
        os.rename(tmp_path / ".x.lock", tmp_path / "moved")
        (tmp_path / ".x.lock").symlink_to(tmp_path / "moved")
        assert not file_lock.held(fd, str(tmp_path / ".x.lock"))
        with pytest.raises(file_lock.Symlink):
            file_lock.keep_folder(fd, str(tmp_path), ".x.lock")
    finally:
        os.close(fd)


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_locks_is_said_not_an_error_of_the_disk(tmp_path, monkeypatch, code):
    """flock failing for another reason than a holder (an NFS mount without its lock manager):
    NoLocks, which the scripts turn into a warning."""
    fcntl = pytest.importorskip("fcntl")

    class NoFlock:
        LOCK_EX, LOCK_NB = fcntl.LOCK_EX, fcntl.LOCK_NB

        @staticmethod
        def flock(fd, op):
            raise OSError(code, os.strerror(code))

    monkeypatch.setattr(file_lock, "fcntl", NoFlock)
    with pytest.raises(file_lock.NoLocks) as e:
        file_lock.lock_folder(str(tmp_path), ".x.lock")
    assert str(e.value) == os.strerror(code)

"""support.file_lock, the one lock by which train_gpt2.py holds its --out-dir and fineweb.py its
shards folder (docs/reliability.md, "The folder lock"), on each of its mechanisms: flock and
Windows' msvcrt.locking (a stand-in with Windows' semantics, on flock). A second holder is refused
and told who holds the lock, the holder's text surviving the refusal; a symbolic link at the lock's
name is refused and what it points to left untouched; a folder's lock is given back only while it
is still the holder's; a file system without locks is a warning. The scripts' own use of it:
tests/test_out_dir.py (train_gpt2.py's --out-dir), tests/test_fineweb.py, tests/test_portable.py."""

import errno
import os
import socket
import sys

import pytest

from support import file_lock, files
from support.files import LinkedName
from support.out_dir import LOCK_FILE


def lock_folder(folder, note=""):
    """file_lock.lock_folder on folder's .x.lock, as a script calls it."""
    return file_lock.lock_folder(str(folder), ".x.lock", "run", "start again", "use a folder of your own", note)


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
        assert held.value.holder == "pid 1 on host, since now: ours"
    finally:
        os.close(fd)
    os.close(file_lock.acquire(path))  # given back with its handle, as when a run ends or is killed


# ----------------------------------------------------------------------------------------------
# Every mechanism: the holder named, a link never followed, a deleted file seen


@pytest.fixture(params=["flock", "msvcrt"])
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
    fd = lock_folder(tmp_path, " (rank 0 of a torchrun job)")
    try:
        text = (tmp_path / ".x.lock").read_text()
        assert text.startswith(f"pid {os.getpid()} (rank 0 of a torchrun job) on {socket.gethostname()}, since ")
        command = "python " + " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
        # a long command line (pytest given many files) is cut to 157 characters and "..."
        assert text.endswith(": " + (command if len(command) <= 160 else command[:157] + "..."))
        for _ in range(3):
            with pytest.raises(file_lock.Held) as held:
                file_lock.acquire(str(tmp_path / ".x.lock"))
            assert held.value.holder == text
        assert (tmp_path / ".x.lock").read_text() == text
    finally:
        file_lock.unlock_folder(fd, str(tmp_path), ".x.lock")
    assert os.listdir(tmp_path) == []  # given back: its file removed
    file_lock.unlock_folder(lock_folder(tmp_path), str(tmp_path), ".x.lock")


@pytest.mark.parametrize("points_to", ["a file", "nothing", "a folder"])
@pytest.mark.parametrize("nofollow", [True, False], ids=["O_NOFOLLOW", "no O_NOFOLLOW"])
def test_a_symlink_at_the_locks_name_is_refused_and_what_it_points_to_is_untouched(
    mechanism, tmp_path, monkeypatch, points_to, nofollow
):
    """Followed, the lock would write its holder's text into the file the link names (a user's file,
    a checkpoint). Refused on every mechanism, with O_NOFOLLOW and without it (Windows)."""
    if not nofollow:
        monkeypatch.setattr(files, "NOFOLLOW", 0)
    target = tmp_path / "precious"
    if points_to == "a file":
        target.write_bytes(b"the user's bytes\n")
    elif points_to == "a folder":
        target.mkdir()
    (tmp_path / ".x.lock").symlink_to(target)
    with pytest.raises(LinkedName) as refused:
        lock_folder(tmp_path)
    assert str(refused.value).startswith(f"{tmp_path / '.x.lock'} is a symbolic link (to {target})")
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
    monkeypatch.setattr(files, "NOFOLLOW", 0)
    target = tmp_path / "precious"
    target.write_bytes(b"the user's bytes\n")
    real, calls = files.refuse_link, []

    def link_after_the_check(path, elsewhere="--out-dir"):
        calls.append(path)
        if len(calls) == 1:
            os.symlink(target, path)  # the check found nothing; the link comes now
            return
        real(path, elsewhere)

    monkeypatch.setattr(files, "refuse_link", link_after_the_check)  # the check no_follow makes first
    with pytest.raises(LinkedName):
        lock_folder(tmp_path)
    assert target.read_bytes() == b"the user's bytes\n"


def test_a_lock_is_given_back_only_while_its_file_is_the_holders(mechanism, tmp_path):
    """unlock_folder removes the lock's file only while it is the one the holder locked: a file
    another holder made at the name since (the first deleted by a user), or a link put there, stays."""
    folder, path = str(tmp_path), tmp_path / ".x.lock"
    fd = lock_folder(tmp_path)
    path.unlink()  # "a stale lock"
    other = lock_folder(tmp_path)  # another holder takes the name meanwhile
    file_lock.unlock_folder(fd, folder, ".x.lock")
    assert file_lock.held(other, str(path))  # the other holder's file, still there
    os.rename(path, tmp_path / "moved")
    path.symlink_to(tmp_path / "moved")  # the name itself is compared, not what it points to
    file_lock.unlock_folder(other, folder, ".x.lock")
    assert path.is_symlink() and (tmp_path / "moved").exists()


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_locks_is_said_not_an_error_of_the_disk(tmp_path, monkeypatch, capsys, code):
    """flock failing for another reason than a holder (an NFS mount without its lock manager): one
    warning, and the script goes on unlocked."""
    fcntl = pytest.importorskip("fcntl")

    class NoFlock:
        LOCK_EX, LOCK_NB = fcntl.LOCK_EX, fcntl.LOCK_NB

        @staticmethod
        def flock(fd, op):
            raise OSError(code, os.strerror(code))

    monkeypatch.setattr(file_lock, "fcntl", NoFlock)
    assert lock_folder(tmp_path) is None
    assert capsys.readouterr().err == (
        f"warning: cannot lock --out-dir {tmp_path} ({os.strerror(code)}): a second run started into it would not "
        f"be stopped\n"
    )


def test_a_platform_with_neither_flock_nor_msvcrt_runs_unlocked_said_in_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(file_lock, "fcntl", None)
    monkeypatch.setattr(file_lock, "msvcrt", None)
    assert file_lock.mechanism() is None and lock_folder(tmp_path) is None
    assert "neither flock nor msvcrt.locking): a second run started into it would not" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []

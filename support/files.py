"""How the project writes and reads its own files, torch-free: atomic writes of files and folders
(a failed write in one line), never through a symbolic link at the name written (no-follow opens),
and jsonl read line by line."""

import errno
import json
import os
import re
import shlex
import shutil
import tempfile

from support.cli import UserError, first_line


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


def write_dir_atomic(out_dir, write, what):
    """write(tmp) fills a hidden folder beside out_dir, which then takes out_dir's place (a folder
    already there is renamed aside first and deleted last: the caller checked it may go). A mount
    point (`docker -v host:dir`, a tmpfs) cannot be renamed: the hidden folder is made inside it,
    and its files take the places of those there (a file of the earlier folder not written again
    is deleted). On any failure, a full disk and Ctrl-C included, the hidden folders and the
    parents this made are removed and out_dir is as it was."""
    parent = os.path.dirname(out_dir)
    into = os.path.ismount(out_dir)
    made = []  # parent folders this call creates, deepest first
    d = parent
    while not os.path.isdir(d):
        made.append(d)
        d = os.path.dirname(d)
    tmp = old = None
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

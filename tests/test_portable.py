"""Without the POSIX-only names (as on Windows), simulated by a sitecustomize.py that removes them and
records in each child that they are gone: training, --resume, fineweb.py, hellaswag.py run, and a second
run into a running run's folder is refused."""

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import tiktoken

import fineweb
import hellaswag
import train_gpt2
from helpers import ROOT, assert_one_line_error, read_log, start_run, tiny_args, wait_for_step
from support.run_folder import LOCK_FILE

# Windows has none of these; the stand-in SIGBREAK is a signal Linux has that nothing else here uses
SITECUSTOMIZE = """
import atexit, json, os, signal, sys

import fcntl as _fcntl
import subprocess  # noqa: F401  imported before the stand-in below, which it would take for Windows


class _Msvcrt:  # Windows' msvcrt.locking, on flock: one byte locked per open file, EACCES when held
    LK_NBLCK = 2

    @staticmethod
    def locking(fd, mode, nbytes):
        try:
            _fcntl.flock(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(13, "Permission denied") from None


sys.modules["fcntl"] = None  # `import fcntl` raises ImportError, as on Windows
sys.modules["msvcrt"] = _Msvcrt  # the lock Windows takes, in a stand-in
del signal.SIGHUP
signal.SIGBREAK = signal.SIGUSR1  # Windows' Ctrl-Break, which has no Linux counterpart
NAMES = ("pread", "pwrite", "killpg", "sched_getaffinity", "fork", "forkpty", "getloadavg")
for name in NAMES:
    if hasattr(os, name):
        delattr(os, name)


def gone():
    files = sys.modules.get("support.files")  # which lock it took: flock, or msvcrt.locking without fcntl
    return {
        "pid": os.getpid(),
        "fcntl": "fcntl" in sys.modules and sys.modules["fcntl"] is None,  # what makes `import fcntl` fail
        "SIGHUP": not hasattr(signal, "SIGHUP"),
        "os": not any(hasattr(os, n) for n in NAMES),
        "lock": ("flock" if files.fcntl else "msvcrt" if files.msvcrt else None) if files else None,
    }


def record(when):
    with open(os.environ["PORTABLE_RECORD"], "a") as f:
        f.write(json.dumps({"when": when, **gone()}) + "\\n")


record("start")
atexit.register(record, "exit")
"""


@pytest.fixture
def posix_less(tmp_path):
    """(env for a subprocess without the POSIX-only names, a check that a process ran under it)."""
    folder = tmp_path / "posix_less"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    record = tmp_path / "posix_less_record.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env["PORTABLE_RECORD"] = str(record)

    def ran_without_them(pid, lock=None):
        records = [json.loads(line) for line in record.read_text().splitlines()]
        mine = {r["when"]: r for r in records if r["pid"] == pid}
        assert set(mine) == {"start", "exit"}, records  # the sitecustomize ran, and the process ended through exit
        for r in mine.values():
            assert r["fcntl"] and r["SIGHUP"] and r["os"], r
        if lock:
            assert mine["exit"]["lock"] == lock, mine

    return env, ran_without_them


def run(env, *args, script="train_gpt2.py"):
    """Run a script as a user would, in env; the CompletedProcess, with its pid."""
    proc = start_run(*args, script=script, env=env)
    stdout, stderr = proc.communicate(timeout=300)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    done.pid = proc.pid
    return done


@pytest.mark.slow
def test_training_and_resume_run_and_match_a_run_with_them(data, tmp_path, posix_less):
    env, ran_without_them = posix_less
    out = tmp_path / "out"
    first = run(env, *tiny_args(data, out, "--max-steps", 4, "--ckpt-every", 2))
    assert first.returncode == 0, first.stderr
    ran_without_them(first.pid, lock="msvcrt")
    assert not list(out.glob(LOCK_FILE + "*"))  # given back at the end: the holder's file and the one locked
    resumed = run(env, *tiny_args(data, out, "--max-steps", 6, "--ckpt-every", 2, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    ran_without_them(resumed.pid, lock="msvcrt")
    assert "resuming from" in resumed.stdout and "at step 4" in resumed.stdout
    # the reference: the same 6 steps in one run, in this process, with every POSIX name in place
    assert train_gpt2.main(tiny_args(data, tmp_path / "reference", "--max-steps", 6, "--ckpt-every", 2)) == 0
    _, steps = read_log(out)
    _, reference = read_log(tmp_path / "reference")
    assert sorted(steps) == list(range(6))
    assert [steps[s]["train_loss"] for s in range(6)] == [reference[s]["train_loss"] for s in range(6)]


@pytest.mark.slow
def test_a_second_run_into_a_running_runs_folder_is_refused(data, tmp_path, posix_less):
    env, ran_without_them = posix_less
    out = tmp_path / "out"
    first = start_run(*tiny_args(data, out, "--max-steps", 100000), env=env)
    try:
        wait_for_step(first, out, 1)
        second = run(env, *tiny_args(data, out, "--max-steps", 100000))  # unlocked, it would be "another run"
        line = assert_one_line_error(
            second, f"--out-dir {out} is in use by another run (pid {first.pid} on {socket.gethostname()}, since "
        )
        assert "pass another --out-dir" in line
        ran_without_them(second.pid)
        assert first.poll() is None  # the first run goes on, untouched
        first.send_signal(signal.SIGUSR1)  # Ctrl-Break (the stand-in): a checkpoint at the step boundary
        stdout, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 128 + signal.SIGUSR1, err
    assert "caught SIGUSR1: stopping after this step with a checkpoint" in stdout and list(out.glob("ckpt_*.pt"))
    ran_without_them(first.pid, lock="msvcrt")
    assert not list(out.glob(LOCK_FILE + "*"))


def test_fineweb_input_writes_the_tokens_of_the_text(tmp_path, posix_less, assets):
    env, ran_without_them = posix_less
    text = assets.shakespeare.read_text()[:20000]
    (tmp_path / "a.txt").write_text(text)
    out = tmp_path / "shards"
    r = run(
        env, "--input", tmp_path / "a.txt", "--out-dir", out, "--shard-size", 2000, "--prefix", "t", script="fineweb.py"
    )
    assert r.returncode == 0, r.stderr
    ran_without_them(r.pid)
    shards = sorted(out.glob("t_*_*.npy"), key=lambda p: p.name.split("_")[-1])
    assert len(shards) >= 2 and shards[0].name == "t_val_000000.npy"
    enc = tiktoken.get_encoding("gpt2")  # the reference: tiktoken itself, EOT before the document
    assert np.concatenate([np.load(p) for p in shards]).tolist() == [enc.eot_token, *enc.encode_ordinary(text)]


HOLD_THE_FOLDER = """
import sys
import fineweb
from support.files import lock_folder, unlock_folder

lock = lock_folder(sys.argv[1], fineweb.FOLDER_LOCK, "fineweb.py")
print("held", flush=True)
sys.stdin.read()  # until the test closes it
unlock_folder(lock)
"""


def test_fineweb_into_a_folder_another_fineweb_holds_is_refused(tmp_path, posix_less, assets):
    env, ran_without_them = posix_less
    out = tmp_path / "shards"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_FOLDER, str(out)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        before = sorted(os.listdir(out))
        r = run(env, "--input", assets.shakespeare, "--out-dir", out, script="fineweb.py")
        assert_one_line_error(r, f"--out-dir {out} is in use by another fineweb.py (pid {holder.pid} on ")
        ran_without_them(r.pid)
        assert sorted(os.listdir(out)) == before == [fineweb.FOLDER_LOCK, fineweb.FOLDER_LOCK + ".msvcrt"]
        holder.communicate("", timeout=60)
    finally:
        holder.kill()
    ran_without_them(holder.pid, lock="msvcrt")
    assert os.listdir(out) == []  # given back: the folder as it was


@pytest.mark.slow  # a process of its own: ~7 s of transformers
def test_hellaswag_scores_as_with_them(short_run, posix_less, assets, capsys):
    env, ran_without_them = posix_less
    args = ["-m", short_run[1], "--data", assets.hellaswag, "--limit", 6, "-d", "cpu"]
    r = run(env, *args, script="hellaswag.py")
    assert r.returncode == 0, r.stderr
    ran_without_them(r.pid)
    hellaswag.main(list(map(str, args)))  # the reference: the same in this process, every POSIX name in place
    expected = capsys.readouterr().out
    assert "6 examples" in r.stdout and "acc_norm" in r.stdout
    assert r.stdout[r.stdout.index("HellaSwag ") :] == expected[expected.index("HellaSwag ") :]

"""The safety features hold at their edges (docs/reliability.md, "At the edges"): a lock file a user
deletes does not let a second run into the folder, a run killed before its first checkpoint is
restarted as the run it was, data fineweb.py never said it finished is refused, and a stop signal
cuts in-training samples short."""

import shlex
import signal
import subprocess
import sys

import pytest
from test_notebook import header, kernel_env, run_notebook, step_record, write_log  # noqa: F401  (kernel_env: a fixture)

import fineweb
import train_gpt2
from helpers import ROOT, snapshot, tiny_args, user_error
from support.common import UserError

# ----------------------------------------------------------------------------------------------
# Data is finished only if fineweb.py said so

KILLED_FINEWEB = """
import os, signal, sys
import fineweb
real, written = fineweb.write_shard, []
def write_shard(path, tokens, fmt="npy"):  # SIGKILL as the 3rd shard is in place, before it is journaled
    real(path, tokens, fmt)
    written.append(path)
    if len(written) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
fineweb.write_shard = write_shard
fineweb.main(sys.argv[1:])
"""


@pytest.fixture
def killed_fineweb(tmp_path, shared_data):
    """(input, a shard folder fineweb.py was SIGKILLed writing, the same input written uninterrupted)."""
    text = tmp_path / "tiny.txt"
    text.write_text((shared_data / "tinyshakespeare" / "input.txt").read_text()[:40000])
    args = ["--input", str(text), "--shard-size", "2000", "--workers", "1"]
    r = subprocess.run(
        [sys.executable, "-c", KILLED_FINEWEB, *args, "--out-dir", str(tmp_path / "shards")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert (tmp_path / "shards" / ".edufineweb_manifest.journal").exists()
    fineweb.main([*args, "--out-dir", str(tmp_path / "whole")])
    return text, tmp_path / "shards", tmp_path / "whole"


def same_files(a, b):
    return snapshot(a) == snapshot(b) and len(snapshot(a)) > 3


@pytest.mark.parametrize("manifest", ["deleted", "unreadable"])
def test_a_fineweb_folder_with_a_journal_and_no_readable_manifest_is_refused_naming_the_command_that_finishes_it(
    killed_fineweb, tmp_path, manifest
):
    text, shards, whole = killed_fineweb
    path = shards / "edufineweb_manifest.json"
    path.unlink() if manifest == "deleted" else path.write_text('{"config": ')
    before = snapshot(tmp_path)
    said = user_error(tiny_args(shards, tmp_path / "run", "--max-steps", 2, "--eval-every", 0))
    state = "is missing" if manifest == "deleted" else "cannot be read"
    assert said.startswith(
        f"--data-dir {shards} is unfinished: fineweb.py's journal .edufineweb_manifest.journal is there, and its "
        f"manifest edufineweb_manifest.json {state}, so fineweb.py never said it finished; "
    )
    command = said.split("`")[1]
    assert command == f"python fineweb.py --input {text} --out-dir {shards} --shard-size 2000"
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()
    if manifest == "unreadable":
        assert f"delete the unreadable edufineweb_manifest.json, then finish it with `{command}`" in said
        path.unlink()
    fineweb.main(shlex.split(command)[2:])  # the command it names finishes the folder, as an uninterrupted run
    assert same_files(shards, whole)
    assert train_gpt2.main(tiny_args(shards, tmp_path / "run", "--max-steps", 2, "--eval-every", 0)) == 0


@pytest.mark.parametrize("fix", ["the journal put back", "those files deleted"])
def test_a_lost_fineweb_journal_is_said_and_either_fix_it_names_finishes_the_folder(killed_fineweb, tmp_path, fix):
    text, shards, whole = killed_fineweb
    journal = shards / ".edufineweb_manifest.journal"
    kept = journal.read_bytes()
    journal.unlink()  # a copy that skipped hidden files
    said = user_error(tiny_args(shards, tmp_path / "run", "--max-steps", 2, "--eval-every", 0))
    command = said.split("`")[1]  # the manifest says unfinished: the command that finishes it
    # the folder as it was, but for the lock file the killed run left: taken and given back, so removed
    before = {k: v for k, v in snapshot(tmp_path).items() if not k.endswith(fineweb.FOLDER_LOCK)}
    with pytest.raises(UserError) as e:
        fineweb.main(shlex.split(command)[2:])
    assert snapshot(tmp_path) == before
    assert str(e.value).startswith(
        f"{shards} holds 2 shard file(s) after the 0 its manifest lists (edufineweb_train_000001.npy, "
        "edufineweb_train_000002.npy), named as this configuration writes them: the journal that listed them, "
        ".edufineweb_manifest.journal, is gone"
    )
    assert "move those files away" not in str(e.value)
    assert "copy .edufineweb_manifest.journal back beside the manifest to keep them, or delete those files" in str(
        e.value
    )
    if fix == "the journal put back":
        journal.write_bytes(kept)
    else:
        for name in ("edufineweb_train_000001.npy", "edufineweb_train_000002.npy"):
            (shards / name).unlink()
    fineweb.main(shlex.split(command)[2:])
    assert same_files(shards, whole)

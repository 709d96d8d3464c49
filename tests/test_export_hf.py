"""export_hf.py: an export never deletes or overwrites what it did not write (docs/reliability.md,
rules 3 and 4): a target that is not a folder, sits under a file, or holds what no export wrote is
refused, by --dry-run as by the export, in the same line; a new folder, an empty one, an earlier
export (through a link too) and a mount point are written; a full disk or Ctrl-C leaves the target as
it was. --dry-run loads no weights and writes nothing. (What is written: test_hf_interop.py.)"""

import json
import os
import shutil
import signal
import subprocess

import pytest
import torch
from transformers import GPT2LMHeadModel

import export_hf
import support.hf_interop
from helpers import assert_one_line_error, cli, snapshot, user_error
from support.shards import GPT2_VOCAB
from train_gpt2 import load_model


def refused(ckpt, target):
    """The one line export_hf.py ckpt target is refused with, in this process: its --dry-run's too."""
    message = user_error([ckpt, target], export_hf.main)
    assert user_error([ckpt, target, "--dry-run"], export_hf.main) == message
    return message


@pytest.fixture
def run_copy(short_run, tmp_path):
    """A private copy of a tiny run's folder (ckpt_000001.pt, ckpt_000002.pt, log.jsonl) as tmp_path/log."""
    shutil.copytree(short_run[1], tmp_path / "log")
    assert {"ckpt_000001.pt", "ckpt_000002.pt", "log.jsonl"} <= set(os.listdir(tmp_path / "log"))
    return tmp_path / "log"


def provenance(hf_dir):
    """(checkpoint, step) an export's config.json says it came from."""
    config = json.loads((hf_dir / "config.json").read_text())
    return config["exported_from"], config["exported_step"]


def logits_match(hf_dir, ckpt):
    """The transformers model in hf_dir computes our checkpoint's logits."""
    ours = load_model(str(ckpt)).eval()
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    idx = torch.randint(0, GPT2_VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, _ = ours(idx)
        b = hf(idx).logits
    return (a[..., :GPT2_VOCAB] - b).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------------------------
# Refusals, by the export and its dry run alike


def test_the_checkpoints_own_folder_is_refused(run_copy, tmp_path, monkeypatch):
    # a run's folder as the target, relative and with a trailing slash: its checkpoints and log stay
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    message = refused("log/ckpt_000002.pt", "log/")
    assert "ckpt_000001.pt" in message and "not an earlier export" in message
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "kind", ["users_file", "subfolder", "foreign_hf_model", "export_plus_notes", "empty_config", "linked_file"]
)
def test_a_folder_no_export_wrote_is_refused(run_copy, tmp_path, hf_tiny_dir, kind):
    target = tmp_path / "victim"
    if kind == "users_file":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    elif kind == "subfolder":
        (target / "sub").mkdir(parents=True)
        (target / "sub" / "a.txt").write_text("mine")
    elif kind == "foreign_hf_model":  # a user's own save_pretrained output: same file names, not ours
        shutil.copytree(hf_tiny_dir, target)
    elif kind in ("export_plus_notes", "linked_file"):
        assert export_hf.main([str(run_copy / "ckpt_000001.pt"), str(target)]) == 0
        if kind == "export_plus_notes":  # an earlier export that the user has since added to
            (target / "README.md").write_text("my notes")
        else:  # an earlier export whose weights are a link to a file of the user's
            (target / "model.safetensors").unlink()
            (target / "model.safetensors").symlink_to(run_copy / "ckpt_000001.pt")
    elif kind == "empty_config":  # the right names, but config.json is not ours (or anyone's)
        target.mkdir()
        (target / "config.json").write_text("")
    before = snapshot(tmp_path)
    message = refused(run_copy / "ckpt_000002.pt", target)
    assert "victim" in message and "new or empty folder" in message
    assert kind != "users_file" or "notes.txt" in message
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "kind",
    [
        *("the_checkpoint_itself", "other_file", "dangling_link", "link_to_file", "under_a_file"),
        *("a_read_only_mount", "on_a_read_only_mount", "in_a_read_only_folder"),
    ],
)
def test_a_target_the_export_cannot_write_is_refused(run_copy, tmp_path, read_only, kind):
    """A read-only place is not guessed from the path: the dry run makes (and removes) the export's
    hidden folder where the export makes it, and fails at the same write."""
    target = run_copy / "ckpt_000002.pt" if kind == "the_checkpoint_itself" else tmp_path / "target"
    if kind in ("other_file", "under_a_file"):
        target.write_text("a file of mine")
    elif kind == "dangling_link":
        target.symlink_to(tmp_path / "nowhere")
    elif kind == "link_to_file":
        (tmp_path / "file.txt").write_text("mine")
        target.symlink_to(tmp_path / "file.txt")
    elif kind in ("a_read_only_mount", "on_a_read_only_mount"):  # root writes through a folder's mode, not a mount
        target.mkdir()
        read_only(target)
    elif kind == "in_a_read_only_folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        target.mkdir(0o555)  # left so: pytest removes an empty folder of any mode
    file = target if kind in ("the_checkpoint_itself", "under_a_file") else None
    if kind in ("under_a_file", "on_a_read_only_mount", "in_a_read_only_folder"):  # folders to be made in it
        target = target / "a" / "hf"
    before = snapshot(tmp_path)
    message = refused(run_copy / "ckpt_000002.pt", target)
    assert str(target) in message and (file is None or f"{file} is a file, not a folder" in message)
    assert "read_only" not in kind or "nothing was changed" in message
    assert snapshot(tmp_path) == before  # no hidden folder or parent left behind either


def test_an_empty_export_folder_name_is_refused_by_name_not_read_as_the_current_folder(run_copy, tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)  # an empty folder: '' read as it would be written into
    assert refused(run_copy / "ckpt_000002.pt", "").startswith("DIR '' names no folder") and os.listdir(here) == []


def test_a_transformers_model_is_refused_as_the_checkpoint(tmp_path, hf_tiny_dir):
    # (a checkpoint that is not there or cut short: find_model's lines, test_model_files.py)
    assert "is a transformers model already" in refused(hf_tiny_dir, tmp_path / "hf")
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# What it may write: a new folder, an empty one, an earlier export (replaced), through a link


def test_new_empty_and_earlier_export_folders(run_copy, tmp_path, capsys):
    before = snapshot(tmp_path)
    nested = tmp_path / "exports" / "a" / "b"
    assert export_hf.main([str(run_copy), str(nested), "--dry-run"]) == 0  # the run's folder: its newest checkpoint
    said = f"dry run: {run_copy / 'ckpt_000002.pt'} can be exported to {nested}; nothing was written"
    assert said in capsys.readouterr().out and snapshot(tmp_path) == before
    r = cli(run_copy / "ckpt_000001.pt", nested, script="export_hf.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = "its 47 padding rows of the vocabulary left out"  # the checkpoint's 50,304 rows, 50,257 exported
    said = f"the model of {run_copy / 'ckpt_000001.pt'} (step 1) and GPT-2's tokenizer; {rows}"
    assert r.stdout.strip() == f"wrote a transformers GPT-2 directory to {nested}: {said}"
    assert logits_match(nested, run_copy / "ckpt_000001.pt")
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing that was there changed
    assert all(k.startswith("exports") for k in set(after) - set(before))
    assert sorted(os.listdir(nested)) == [
        "config.json",
        "generation_config.json",
        "merges.txt",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
    ]
    assert oct(os.stat(nested).st_mode & 0o777) == oct(os.stat(nested.parent).st_mode & 0o777)  # not mkdtemp's 0700

    # the same folder again, from the other checkpoint: an earlier export is replaced, and says so; each
    # records in its config.json the checkpoint and step it came from
    assert provenance(nested) == (str(run_copy / "ckpt_000001.pt"), 1)
    r = cli(run_copy, nested, script="export_hf.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    said = f"the model of {run_copy / 'ckpt_000002.pt'} (step 2) and GPT-2's tokenizer; {rows}"
    assert r.stdout.strip().endswith(f"\nreplaced the earlier export in {nested}: {said}")
    assert provenance(nested) == (str(run_copy / "ckpt_000002.pt"), 2)
    assert logits_match(nested, run_copy / "ckpt_000002.pt")
    assert set(snapshot(tmp_path)) == set(after)  # no hidden folder left beside it

    # through a symbolic link: the folder it points to is replaced, the link stays
    (tmp_path / "link").symlink_to(nested)
    assert export_hf.main([str(run_copy / "ckpt_000001.pt"), str(tmp_path / "link")]) == 0
    assert os.readlink(tmp_path / "link") == str(nested)
    assert logits_match(nested, run_copy / "ckpt_000001.pt")

    # an empty folder is used as it is; a folder inside the run folder is fine too
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", run_copy / "hf"):
        assert export_hf.main([str(run_copy / "ckpt_000002.pt"), str(target)]) == 0
        assert logits_match(target, run_copy / "ckpt_000002.pt")
    assert {"ckpt_000001.pt", "ckpt_000002.pt", "log.jsonl"} <= set(os.listdir(run_copy))


def test_ctrl_c_during_an_export_says_nothing_was_exported(short_run, tmp_path, monkeypatch):
    """Ctrl-C while save_pretrained writes: the target is as it was, and the line says so."""

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", interrupted)
    target = tmp_path / "hf"
    r = cli(short_run[1] / "ckpt_000002.pt", target, script="export_hf.py")
    assert r.returncode == 130
    assert r.stderr.strip() == f"interrupted: the export was not written ({target} is as it was)"
    assert os.listdir(tmp_path) == []


def test_ctrl_c_inside_a_finalizer_as_the_export_starts_still_stops_it(short_run, tmp_path, monkeypatch):
    """Ctrl-C that lands in a finalizer (a __del__, which Python would print and ignore) as the export
    builds the model it writes: no traceback, no "wrote", exit 130, and the earlier export is as it was."""

    class Dropped:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)

    target = tmp_path / "hf"
    assert export_hf.main([str(short_run[1] / "ckpt_000001.pt"), str(target)]) == 0
    before = snapshot(tmp_path)
    building = support.hf_interop.hf_gpt2
    monkeypatch.setattr(support.hf_interop, "hf_gpt2", lambda *a, **k: (Dropped(), building(*a, **k))[1])
    r = cli(short_run[1] / "ckpt_000002.pt", target, script="export_hf.py")
    assert (r.returncode, r.stdout) == (130, "")
    assert r.stderr.strip() in (  # raised again 0.1 s later: as the model is built, or as it is written
        "interrupted: nothing was exported; run the command again",
        f"interrupted: the export was not written ({target} is as it was)",
    )
    assert snapshot(tmp_path) == before


def tmpfs(mnt, *options):
    """A tmpfs mounted at the new folder mnt (its mount options); the test is skipped where mounting is not allowed."""
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", *options, "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A real 64 KiB tmpfs, where the weights cannot fit."""
    yield from tmpfs(tmp_path / "small", "-o", "size=64k")


def test_real_full_disk_cli(short_run, small_disk, tmp_path):
    (small_disk / "keep.txt").write_text("mine")
    before = snapshot(small_disk)
    r = cli(short_run[1] / "ckpt_000002.pt", small_disk / "new" / "hf", script="export_hf.py", cwd=tmp_path)
    assert_one_line_error(r, "No space left on device", "nothing was changed")
    assert snapshot(small_disk) == before


@pytest.fixture
def mount_point(tmp_path, read_only):
    """A folder no rename can replace, as `docker -v host:/export` gives: a bind mount (every target
    is written the same way, so one kind of mount point stands for all)."""
    (tmp_path / "export").mkdir()
    yield read_only(tmp_path / "export", writable=True)


def test_an_export_into_a_mount_point_is_written_into_it(short_run, mount_point, capsys):
    """The dry run says it can; the export, and one over it, replace the files in it, nothing of ours left."""
    ckpt, ckpt_1 = short_run[1] / "ckpt_000002.pt", short_run[1] / "ckpt_000001.pt"
    assert export_hf.main([str(ckpt), str(mount_point), "--dry-run"]) == 0
    assert f"can be exported to {mount_point}; nothing was written" in capsys.readouterr().out
    assert os.listdir(mount_point) == []
    assert export_hf.main([str(ckpt), str(mount_point)]) == 0
    assert logits_match(mount_point, ckpt)
    written = sorted(os.listdir(mount_point))
    assert "model.safetensors" in written and not [n for n in written if n.startswith(".")]
    (mount_point / "special_tokens_map.json").write_text("{}")  # an earlier export's file this one does not write
    assert export_hf.main([str(ckpt_1), str(mount_point)]) == 0
    assert sorted(os.listdir(mount_point)) == written and logits_match(mount_point, ckpt_1)

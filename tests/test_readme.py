"""The README as a newcomer follows it: its first commands, in a fresh clone offline, train and sample;
its transformers snippet runs on an export."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, as_typed, cli, help_entries
from support.precision import pick_dtype

# the first block's install lines: the test runs in the environment it was installed into
INSTALL = ("python -m venv ", "pip install ")


def code_blocks(language):
    """The README's fenced code blocks in language, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S | re.M)


def commands(block):
    """A bash block's commands, a backslash's line joined to the next, blank and comment lines left out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def readme_text():
    """The README's prose and code on one line, each run of spaces and line ends one space."""
    return " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())


def test_first_block_is_the_laptop_run_on_shakespeare_shards_and_its_epochs_warning_is_explained(tmp_path):
    """The first block installs, makes shakespeare_* shards where configs/laptop.txt reads, trains and samples;
    the laptop run's warning that the data repeats, with its number of epochs, is the one the README explains."""
    cmds = commands(code_blocks("bash")[0])
    assert [c for c in cmds if c.startswith(INSTALL)] == cmds[:2]  # installing, then the run itself
    assert any(c.startswith("python train_gpt2.py @configs/laptop.txt") for c in cmds)
    assert cmds[-1].startswith("python sample.py log_tiny")
    (make,) = [c for c in cmds if c.startswith("python fineweb.py")]
    assert as_typed(make, "--out-dir", tmp_path / "shards").returncode == 0  # typed after: this --out-dir wins
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.npy"))[0] == "shakespeare_train_000001.npy"
    assert all(p.name.startswith("shakespeare_") for p in (tmp_path / "shards").iterdir())
    assert f"--data-dir {make.split('--out-dir ')[1].split()[0]}\n" in (ROOT / "configs" / "laptop.txt").read_text()
    args = ["@configs/laptop.txt", "--data-dir", tmp_path / "shards", "--out-dir", tmp_path / "log", "--dry-run"]
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    (warning,) = re.findall(r"the data repeats \([\d.]+ epochs\)", r.stderr)
    assert f"Its warning `{warning}` is expected" in readme_text()


def test_the_full_runs_next_commands_show_the_laptop_runs_beside_them():
    """README's export and notebook commands name the full run's folder (log); the laptop run's (log_tiny) are
    beside them."""
    text = readme_text()
    assert "python export_hf.py log/ckpt_019073.pt gpt2_ours" in text and "PLAY_LOG=log jupyter" in text
    assert "python export_hf.py log_tiny gpt2_ours" in text
    assert "(the laptop run's: `PLAY_LOG=log_tiny jupyter execute play.ipynb`)" in text


def test_dtype_auto_which_the_help_points_to_the_readme_for_is_defined_there_as_pick_dtype_picks(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert help_entries(cli("--help").stdout)["--dtype"].endswith("auto: see the README (default: auto)")
    said = (
        "`--dtype auto`, the default, is fp32 on a CPU or a Mac, bf16 on a CUDA GPU of compute capability 8.0 and "
        "up, fp16 with loss scaling on older ones"
    )
    assert said in readme_text()
    # the CUDA picks by compute capability (8.0, 9.0, 7.5): test_fake_gpu's tiny runs on an A100, H100 and T4
    assert [pick_dtype("auto", device)[0] for device in ("cpu", "mps")] == ["float32", "float32"]


@pytest.mark.slow  # the laptop run itself: minutes on 2 cores
def test_first_screen_commands_train_and_sample_in_a_fresh_clone_offline(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    assert not any((base / "shared" / "data").is_dir() for base in (clone, *clone.parents))  # no test data
    # a new user's environment offline: no test data or tiktoken cache, the Hub off, `python` this interpreter
    env = {k: v for k, v in os.environ.items() if k not in ("GPT2_TEST_DATA", "TIKTOKEN_CACHE_DIR")}
    path = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PATH=path)
    outputs = []
    for cmd in commands(code_blocks("bash")[0]):
        if cmd.startswith(INSTALL):
            continue
        r = subprocess.run(["bash", "-c", cmd], cwd=clone, env=env, capture_output=True, text=True, timeout=3000)
        assert r.returncode == 0, f"{cmd}\n{r.stderr[-3000:]}"
        outputs.append(r.stdout)
    records = [json.loads(line) for line in (clone / "log_tiny" / "log.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert val[0] > 10 and val[-1] < val[0] - 3  # a model that learned: 10.8 at init, about 6 by step 200
    assert max(r["step"] for r in records if "train_loss" in r) == records[0]["config"]["max_steps"] - 1
    assert "ROMEO:" in outputs[-1]  # the samples, each after the prompt
    (export,) = [c for b in code_blocks("bash") for c in commands(b) if c.startswith("python export_hf.py log_tiny")]
    r = subprocess.run(["bash", "-c", export], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and (clone / "gpt2_ours" / "config.json").is_file(), r.stderr[-3000:]
    assert subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout == ""


def test_transformers_snippet_runs_on_an_export(shakespeare_export, tmp_path, monkeypatch, capsys):
    (snippet,) = [b for b in code_blocks("python") if "from transformers" in b]
    shutil.copytree(shakespeare_export[1], tmp_path / "gpt2_ours")  # the name the README's export writes
    monkeypatch.chdir(tmp_path)  # in this process: the Hub is off here too (conftest), transformers loaded once
    exec(compile(snippet, "README.md", "exec"), {})
    assert "Hello, I'm a language model," in capsys.readouterr().out  # the pipeline's text: prompt, continuation


def test_every_test_the_docs_name_exists():
    """docs/ and README.md cite the tests that pin each rule: a test renamed or merged away leaves its
    citation pointing nowhere, so each test_* name they give is a test function (or file) of tests/."""
    tests = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    for path in (ROOT / "tests").glob("*.py"):
        tests |= set(re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
    cited = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name in re.findall(r"`[^`]*?\b(test_\w+)", path.read_text(encoding="utf-8")):
            cited.setdefault(name, path.name)
    assert {name: where for name, where in cited.items() if name not in tests and name != "test_X"} == {}

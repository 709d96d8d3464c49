"""bench.py --gpu-check: items run in order within --budget-s, one whose estimate does not fit is skipped
and says why, the JSON is whole after every item, and the tiny run goes through every item a CPU can run."""

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from bench import parse_args
from benchmarks.gpu_check import GUESS, GpuCheck, Item, junit_tests, run_items, write_report
from benchmarks.settings import RUNS
from helpers import ROOT, assert_one_line_error, cli
from support.cli import UserError

ITEM_NAMES = ["cuda_tier", "recipe", "ladder_7_to_10", "ladder_1_to_6", "ladder_11_12"]


class Stubs:
    """Stub items on a clock that moves by the seconds each takes; seen[name]: out's report as that item started."""

    def __init__(self, out):
        self.out, self.now, self.seen = out, 1000.0, {}
        self.clock = lambda: self.now

    def item(self, name, estimate_s, takes_s, fail=False):
        def run():
            self.seen[name] = json.loads(self.out.read_text())
            self.now += takes_s
            if fail:
                raise RuntimeError(f"{name} broke")
            return {"value": name}

        return Item(name, f"the {name} item", lambda: (estimate_s, "a stub's"), run)

    def run(self, items, budget_s=100, started=None):
        report = {"command": "python bench.py --gpu-check"}
        return run_items(items, report, budget_s, lambda r: write_report(self.out, r), self.clock, started)


@pytest.fixture
def stubs(tmp_path):
    return Stubs(tmp_path / "check.json")


def test_items_run_in_order_and_one_whose_estimate_does_not_fit_is_skipped_with_why(stubs):
    items = [
        stubs.item("a", 10, 30),  # 100 s left: runs, leaves 70
        stubs.item("b", 80, 5),  # 80 > 70: skipped
        stubs.item("c", 70, 20),  # 70 <= 70: runs, leaves 50
        stubs.item("d", 60, 1),  # 60 > 50: skipped
    ]
    report = stubs.run(items)
    assert [(e["name"], e["status"]) for e in report["items"]] == [
        ("a", "done"),
        ("b", "skipped"),
        ("c", "done"),
        ("d", "skipped"),
    ]
    assert set(stubs.seen) == {"a", "c"}  # a skipped item never ran
    b, d = report["items"][1], report["items"][3]
    assert b["why"] == "its estimate, 80 s (a stub's), is more than the 70 s left of --budget-s 100"
    assert d["why"] == "its estimate, 60 s (a stub's), is more than the 50 s left of --budget-s 100"
    assert [e.get("seconds") for e in report["items"]] == [30, None, 20, None]
    assert report["items"][0]["result"] == {"value": "a"} and report["to_do"] == []
    assert json.loads(stubs.out.read_text()) == report  # the file holds the final report


def test_the_budget_counts_from_the_start_given(stubs):
    """What ran before the items (torch's import, the compile check) is spent from the budget too."""
    report = stubs.run([stubs.item("a", 60, 1), stubs.item("b", 40, 1)], started=stubs.clock() - 50)
    assert [e["status"] for e in report["items"]] == ["skipped", "done"]
    assert report["items"][0]["why"].endswith("is more than the 50 s left of --budget-s 100")


def test_the_json_is_whole_after_every_item_and_holds_the_items_before(stubs, tmp_path):
    """The file as each item starts (what a kill then leaves): the items before it, the rest to do."""
    names = ["one", "two", "three"]
    stubs.run([stubs.item(name, 1, 1) for name in names])
    for k, name in enumerate(names):
        saved = stubs.seen[name]
        assert [e["name"] for e in saved["items"]] == names[:k]
        assert saved["to_do"] == names[k:]
        assert all(e["status"] == "done" for e in saved["items"])
    assert sorted(os.listdir(tmp_path)) == ["check.json"]  # no temporary file left beside it


def test_a_failing_item_is_recorded_and_the_next_one_runs(stubs):
    a, b = stubs.run([stubs.item("a", 1, 2, fail=True), stubs.item("b", 1, 1)])["items"]
    assert a["status"] == "failed" and a["error"] == "RuntimeError: a broke" and "raise RuntimeError" in a["traceback"]
    assert a["seconds"] == 2 and b["status"] == "done"
    assert json.loads(stubs.out.read_text())["items"][0]["error"] == "RuntimeError: a broke"


def test_estimates_use_the_first_compile_this_run_timed(tmp_path):
    """A default until a compile is timed, then the first one timed; max-autotune's rungs count 7 each."""
    s = {**RUNS["full"], "compile": [False, True]}
    check = GpuCheck(s, "cuda", "cuda", False, str(tmp_path), str(tmp_path / "ladder.png"))
    g = GUESS["cuda"]
    est, how = check.estimate_recipe()
    assert est == 2 * (g["start_s"] + g["compile_s"]) + 25 * g["recipe_step_s"]
    assert "a default until one is timed" in how
    check.timed_compile(100.0, "the recipe's step 0")
    check.timed_compile(5.0, "ladder rung 7")
    est, how = check.estimate_recipe()
    assert est == 2 * (g["start_s"] + 100) + 25 * g["recipe_step_s"] and "timed in the recipe's step 0" in how
    est11, how11 = check.estimate_ladder((11, 12), compiles_each=7)
    assert how11.startswith("14 compiles x 100 s") and est11 > 14 * 100
    # compile off: no compile counted
    off = GpuCheck({**s, "compile": [False]}, "cuda", "cuda", False, str(tmp_path), str(tmp_path / "ladder.png"))
    assert off.compile_estimate() == (0.0, "compile off")


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--gpu-check", "--budget-s", "0"], "--budget-s 0: pass a number of seconds above 0"),
        (["--gpu-check", "--budget-s", "-5"], "--budget-s -5: pass a number of seconds above 0"),
        (["--gpu-check", "--budget-s", "nan"], "--budget-s nan: pass a number of seconds above 0"),
        (["--budget-s", "60"], "--budget-s is the time of --gpu-check: pass --gpu-check too"),
        (["--gpu-check", "--only", "ladder"], "--gpu-check runs its own items: leave --only out"),
        (["--gpu-check", "--quick"], "leave --quick out"),
        (["--gpu-check", "--configs", "gpt2"], "leave --configs out"),
    ],
)
def test_gpu_check_flags_are_checked_before_anything_runs(argv, said):
    with pytest.raises(UserError, match=re.escape(said)):
        parse_args(argv)


def test_gpu_check_default_budget():
    assert parse_args(["--gpu-check"]).budget_s == 480  # a given one: test_a_tiny_budget_skips_every_item_and_says_why


def test_gpu_check_on_a_cpu_without_tiny_is_refused(tmp_path):
    r = cli("--gpu-check", "--device", "cpu", "--out", tmp_path / "check.json", script="bench.py", cwd=tmp_path)
    assert_one_line_error(r, "--gpu-check on cpu runs a GPU's sizes", "pass --tiny")
    assert os.listdir(tmp_path) == []


def test_a_tiny_budget_skips_every_item_and_says_why(tmp_path):
    out = tmp_path / "check.json"
    r = cli("--gpu-check", "--tiny", "--device", "cpu", "--budget-s", 1, "--out", out, script="bench.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("python bench.py --gpu-check") and report["budget_s"] == 1
    items = report["items"]
    assert [e["name"] for e in items] == ITEM_NAMES and report["to_do"] == []
    for e in items[:4]:
        assert e["status"] == "skipped" and "result" not in e, e
        assert e["why"].startswith(f"its estimate, {e['estimate_s']:.0f} s (") and "of --budget-s 1" in e["why"]
        assert f"{e['name']}: skipped ({e['why']})" in r.stdout
    assert items[4]["status"] == "not run on this device" and items[4]["why"].startswith("CUDA only")
    assert "ladder" not in report and sorted(os.listdir(tmp_path)) == ["check.json"]


def test_junit_outcomes_are_read_per_test(tmp_path):
    """pytest's own junit XML for a file with a pass, a failure and a skip."""
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n    pass\n"
    )
    xml = tmp_path / "out.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "test_three.py"]
    subprocess.run(cmd, cwd=tmp_path, capture_output=True, timeout=120)
    tests = junit_tests(xml)
    assert {name: t["outcome"] for name, t in tests.items()} == {
        "test_three::test_ok": "passed",
        "test_three::test_bad": "failed",
        "test_three::test_skipped": "skipped",
    }
    assert "one is not two" in tests["test_three::test_bad"]["message"]
    assert tests["test_three::test_skipped"]["message"] == "not here"
    assert all(t["seconds"] >= 0 for t in tests.values())


@pytest.mark.slow
def test_tiny_gpu_check_on_a_cpu_runs_every_item_a_cpu_can(tmp_path):
    out = tmp_path / "check.json"
    r = cli(
        "--gpu-check", "--tiny", "--device", "cpu", "--budget-s", 600, "--out", out, script="bench.py", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    items = {e["name"]: e for e in report["items"]}
    assert list(items) == ITEM_NAMES and report["to_do"] == []
    assert [e["status"] for e in report["items"]] == ["done"] * 4 + ["not run on this device"]
    assert sorted(os.listdir(tmp_path)) == ["check.json", "ladder.png"]
    assert report["machine"]["torch"] == torch.__version__
    if (ROOT / ".git").exists():  # the commit it ran, as git names it
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        assert report["commit"] in (head, head + "+changes")

    # the CUDA tier: pytest's outcome for every test in the file, skipped here without CUDA
    tier = items["cuda_tier"]["result"]
    tests = ast.parse((ROOT / "tests" / "test_cuda.py").read_text()).body
    names = {
        f"tests.test_cuda::{n.name}" for n in tests if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
    }
    assert {name.split("[")[0] for name in tier["tests"]} == names  # a parametrized test's cases by its name
    assert {t["outcome"] for t in tier["tests"].values()} == {"skipped"}
    assert all("needs a CUDA GPU" in t["message"] for t in tier["tests"].values())

    # the recipe: train_gpt2.py's own log read back; fp16 with its loss scale
    recipe, fp16 = items["recipe"]["result"]["recipe"], items["recipe"]["result"]["float16"]
    assert "random token ids" in items["recipe"]["result"]["data"]
    assert (recipe["dtype"], recipe["steps"], fp16["dtype"], fp16["steps"]) == ("bfloat16", 6, "float16", 3)
    assert recipe["losses_finite"] and fp16["losses_finite"] and len(recipe["losses"]) == 6
    assert fp16["loss_scales"] == [65536.0] * 3  # GradScaler's first scale, no overflow at this size
    assert recipe["tok_per_sec"]["n"] == 4 and recipe["tok_per_sec"]["median"] > 0  # 6 steps, the first 2 dropped
    assert recipe["step0_ms"] > 0 and recipe["peak_memory_gib"] is None  # no GPU memory on a CPU

    # the ladder: 7-10, then 1-6, one table (its rows' numbers: test_ladder.py's tiny ladder)
    rows = {row["rung"]: row for row in report["ladder"]["rungs"]}
    for k in (7, 8, 9, 1, 3, 5, 6):
        assert rows[k]["measured"], k
    assert rows[7]["loss_max_abs_diff"] == max(
        abs(a - b) for a, b in zip(rows[7]["losses"], rows[1]["losses"], strict=True)
    )
    assert not rows["7+"]["measured"] and report["ladder"]["losses_agree"]
    assert [row["rung"] for row in items["ladder_7_to_10"]["result"]["rungs"]] == [7, "7+", 8, 9, 10]
    assert report["ladder"]["table"] in r.stdout and report["ladder"]["headline"]["text"] in r.stdout
    assert (tmp_path / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# a child of --gpu-check starts a grandchild, each holding a lock on a file with its pid; then both sleep
HOLD = """
import fcntl, os, subprocess, sys, time
held = open(sys.argv[1], "w")
fcntl.flock(held, fcntl.LOCK_EX)
held.write(str(os.getpid()))
held.flush()
if len(sys.argv) > 3:
    subprocess.Popen([sys.executable, "-c", sys.argv[2], *sys.argv[3:]])
else:
    open(sys.argv[2], "w").close()
time.sleep(600)
"""

KILLED_MID_ITEM = """
import sys
from benchmarks.gpu_check import run_killable
run_killable([sys.executable, "-c", *sys.argv[1:]], timeout=120)
"""


def test_kill_9_of_bench_ends_its_child_and_what_that_started(tmp_path):
    """bench.py killed with -9 mid-item: its child and grandchild end within seconds (their locks free)."""
    fcntl = pytest.importorskip("fcntl")  # the locks that tell a process has ended: POSIX
    locks, ready = [tmp_path / "child.lock", tmp_path / "grandchild.lock"], tmp_path / "ready"
    child = [HOLD, locks[0], HOLD, locks[1], ready]  # the child starts the grandchild
    bench = subprocess.Popen([sys.executable, "-c", KILLED_MID_ITEM, *map(str, child)], cwd=ROOT)
    living = []
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert time.monotonic() < deadline and bench.poll() is None, "the child never started"
            time.sleep(0.05)
        bench.send_signal(signal.SIGKILL)
        bench.wait(timeout=30)

        def still_running():
            pids = []
            for lock in locks:
                with open(lock) as f:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        pids.append(int(lock.read_text()))
            return pids

        deadline = time.monotonic() + 120  # within seconds; the child would sleep 600 s
        while (living := still_running()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert living == [], "still running after bench.py was killed"
    finally:
        bench.kill()
        for pid in living:  # this test's own sleepers, by their pids
            os.kill(pid, signal.SIGKILL)

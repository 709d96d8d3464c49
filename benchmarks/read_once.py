"""A checkpoint found is a checkpoint read once: the start of `train_gpt2.py --resume --dry-run`, of
`sample.py RUN --max-new-tokens 1` and of `export_hf.py RUN DIR --dry-run` on a 124M checkpoint
(random weights, one training step, written by train_gpt2.py itself: optimizer state included),
this tree against another (--base: an older commit's files), interleaved rounds after a warm-up one
(the checkpoint in the page cache): wall time, median of the rounds, and the bytes each process
read (rchar of its /proc/self/io at exit: read() calls, imports included; the pages a memory map
touches are not counted). The floor, `python -c "import torch"` timed in the same rounds, is what
every command pays in either tree; "above floor" is the ratio of the two trees' times less it.
Linux only.

Usage:
    git worktree add /tmp/base 87b7da5 && python -m benchmarks.read_once --base /tmp/base
    # ~4 min on 2 CPU cores; 1.5 GB in a temporary folder, removed at the end
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks.timing import interleave

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# runs a script as `python script args` would, then writes its rchar to $RCHAR_TO as it exits
COUNTED = (
    "import atexit, os, runpy, sys\n"
    "def said():\n"
    "    with open('/proc/self/io') as f, open(os.environ['RCHAR_TO'], 'w') as out:\n"
    "        out.write(f.readline().split()[1])\n"
    "atexit.register(said)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def run(tree, args, tmp):
    """Run a script of tree (its folder: cwd, so its support/ is imported) -> the bytes it read."""
    env = {**os.environ, "RCHAR_TO": os.path.join(tmp, "rchar"), "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-c", COUNTED, *args], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(args)} in {tree} failed: {proc.stderr.strip()[-500:]}")
    with open(env["RCHAR_TO"]) as f:
        return int(f.read())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the other tree: a folder holding an older commit's files")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="read_once_")
    try:
        data, out = os.path.join(tmp, "data"), os.path.join(tmp, "run")
        os.makedirs(data)
        rng = np.random.default_rng(0)
        for name in ("rand_val_000000.npy", "rand_train_000001.npy"):
            np.save(os.path.join(data, name), rng.integers(0, 50257, 4000).astype(np.uint16))
        tiny = "-B 1 -T 32 --total-batch-size 32 --max-steps 1 --warmup-steps 0 --eval-every 0 --val-tokens 0"
        off = "--hellaswag-every 0 --sample-every 0 --ckpt-every 0 --device cpu"  # 124M: GPTConfig's defaults
        run(ROOT, ["train_gpt2.py", "--data-dir", data, "--out-dir", out, *tiny.split(), *off.split()], tmp)
        size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out) if n.endswith(".pt"))
        commands = {
            "train_gpt2.py --resume --dry-run": ["train_gpt2.py", "--resume", "--out-dir", out, "--dry-run"],
            "sample.py RUN --max-new-tokens 1": ["sample.py", out, "--max-new-tokens", "1", "--device", "cpu"],
            "export_hf.py RUN DIR --dry-run": ["export_hf.py", out, os.path.join(tmp, "hf"), "--dry-run"],
        }
        print(f"checkpoint: {size / 1e9:.2f} GB; wall: median of {args.rounds}; read: rchar / checkpoint size")
        print("| command | base wall s | this wall s | ratio | floor s | above floor | base read | this read |")
        print("|---|---|---|---|---|---|---|---|")
        trees = {"base": args.base, "this": ROOT}
        for label, command in commands.items():
            read = {}
            contenders = {k: lambda k=k, c=command, r=read: r.update({k: run(trees[k], c, tmp)}) for k in trees}
            contenders["floor"] = lambda: subprocess.run([sys.executable, "-c", "import torch"], check=True)
            times, _ = interleave(contenders, 1, args.rounds, "cpu", label)
            base, this, floor = (statistics.median(times[k]) for k in ("base", "this", "floor"))
            print(f"| `{label}` | {base:.2f} | {this:.2f} | {this / base:.2f}x | {floor:.2f} | ", end="")
            print(f"{(this - floor) / (base - floor):.2f}x | ", end="")
            print(f"{read['base'] / size:.2f}x | {read['this'] / size:.2f}x |")
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()

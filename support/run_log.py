"""The run's record: log.jsonl, one JSON record a line, printed as its console line and mirrored to
Weights & Biases when asked."""

import collections
import json
import math
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from support.cli import UserError
from support.file_lock import not_yours
from support.files import disk_error, no_follow
from support.out_dir import copy_advice, folder_gone
from support.wandb_log import WandbMirror


def versions():
    """The versions that decide a run's numerics, for the log's header."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numpy": np.__version__,
    }


WANDB_FINISH_TIMEOUT = 120  # seconds the end of a run waits for wandb to finish uploading


def strict_json(value):
    """value with every non-finite float spelled as a string, "NaN", "Infinity" or "-Infinity": JSON
    has no such numbers (Python's NaN token breaks jq and other languages' readers), and
    float() reads these strings back."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {key: strict_json(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class RunLog:
    """log.jsonl: one JSON record per line, appended, never wiped, so a resumed run continues
    the same file (play.ipynb keeps the last record of each step). Each record is also printed
    as its console line: one record, built once, for the file and the screen, and with
    --wandb-project for a Weights & Biases run too (WandbMirror). Only rank 0's is enabled; the
    others' calls do nothing."""

    mirrored = []  # the logs with a wandb run to finish when the run ends (finish_wandb)

    def __init__(self, out_dir, enabled, max_steps):
        self.path, self.file, self.max_steps = os.path.join(out_dir, "log.jsonl"), None, max_steps
        self.out_dir, self.wandb, self.first = out_dir, None, None
        self.clock = StepClock(max_steps)  # the step line's elapsed time and ETA
        if not enabled:
            return
        try:
            self.file = self.open()
        except PermissionError as e:
            theirs = not_yours(self.path, copy_advice(out_dir))  # a shared folder: a run another user started
            raise (UserError(theirs) if theirs else disk_error(e, self.path, "start again")) from None
        except OSError as e:
            raise disk_error(e, self.path, "start again") from None

    def open(self):
        """log.jsonl opened for appending, never through a symbolic link at its name (LinkedName):
        the records would go into the file it names, outside the run's folder. A last line cut short
        by a kill is ended first, so that ours starts on a fresh line."""
        file = open(self.path, "a", opener=no_follow)
        try:
            if file.tell() > 0:
                with open(self.path, "rb", opener=no_follow) as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        file.write("\n")
        except BaseException:
            file.close()
            raise
        return file

    def header(self, run_id, device_name, resumed_from, changes, config):
        """The run's first record (and a resumed run's first in its turn): what ran, where, with what."""
        record = {"event": "header", "run_id": run_id, "device": device_name, "resumed_from": resumed_from}
        if self.file is not None and config.get("wandb_project"):
            name = config.get("wandb_run_name") or os.path.basename(os.path.abspath(self.out_dir))
            folder = os.environ.get("WANDB_DIR") or self.out_dir  # wandb's files beside the run's, unless set
            self.wandb = WandbMirror(config["wandb_project"], name, run_id, folder)
            RunLog.mirrored.append(self)
        record = {**record, "changed_on_resume": changes or None, "versions": versions(), "config": config}
        self.first = record
        self.clock.cadences = {kind: config.get(flag, 0) for kind, flag in StepClock.EVALS.items()}
        self(record)

    def __call__(self, record):
        if self.file is None:
            return
        self.clock.saw(record)
        self.write(record)
        self.print(record)
        if self.wandb is not None and self.wandb.error is None:
            self.wandb(record)
        elif self.wandb is not None:  # wandb failed: said once, and the run goes on without it
            error, self.wandb = self.wandb.error, None
            self.warn(f"wandb stopped ({error}): the run goes on; log.jsonl holds every record")

    def write(self, record):
        line = json.dumps(strict_json(record), allow_nan=False) + "\n"
        try:
            if os.fstat(self.file.fileno()).st_nlink == 0:  # deleted since the last record
                line = self.reopen() + line
            self.file.write(line)
            self.file.flush()
        except OSError as e:  # a full disk: stop now, the checkpoints written so far are intact
            self.file = None
            raise disk_error(e, self.path, "continue with --resume") from None

    def reopen(self):
        """log.jsonl deleted while the run trains (by a user, or with its folder: noticed at the next
        record, one fstat each): written again at its path from here on, said in one warning. Returns
        the line to put first: the run's header again ("reopened"), which resume and play.ipynb read
        as the same run. A folder moved or deleted stops the run in one line saying where to resume."""
        self.file.close()
        self.file = None  # nothing more is written if the folder is gone or a link stands at the name
        if gone := folder_gone(self.out_dir):
            raise UserError(gone)
        self.file = self.open()
        print(f"warning: {self.path} was deleted while this run trained: written again from here on", file=sys.stderr)
        header = {**self.first, "reopened": "deleted"} if self.first else None
        return json.dumps(strict_json(header)) + "\n" if header else ""

    def warn(self, message):
        """A warning on the console and in the log, as a record of its own."""
        print(f"warning: {message}", file=sys.stderr, flush=True)
        try:
            self({"event": "warning", "warning": message})
        except UserError:
            pass  # the disk is full: the console has it

    @classmethod
    def finish_wandb(cls):
        """At the end of a run, done or not: the queued records logged and the wandb runs finished
        (failed if an exception is on its way out), waiting WANDB_FINISH_TIMEOUT seconds at most."""
        exit_code = 1 if sys.exc_info()[0] is not None else 0
        while cls.mirrored:
            log = cls.mirrored.pop()
            mirror, log.wandb = log.wandb, None
            if mirror is None:
                continue  # it failed, and said so
            if not mirror.finish(exit_code, WANDB_FINISH_TIMEOUT):
                log.warn(
                    f"wandb has not finished uploading after {WANDB_FINISH_TIMEOUT} s: left to it as the "
                    f"process exits; `wandb sync` on the run's folder under wandb/ uploads what did not go"
                )
            elif mirror.error is not None:
                log.warn(f"wandb stopped ({mirror.error}): log.jsonl holds every record")

    def print(self, record):
        step = record.get("step")
        if "train_loss" in record:
            mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] else "n/a"
            scale = f" | scale {record['loss_scale']:g}" if "loss_scale" in record else ""  # fp16's loss scale
            print(
                f"step {step:5d}/{self.max_steps} | loss {record['train_loss']:.6f} | lr {record['lr']:.4e} | "
                f"norm {record['grad_norm']:.4f} | dt {record['dt_ms']:.2f}ms | tok/s {record['tok_per_sec']:,.0f} | "
                f"mfu {mfu} | epoch {record['epoch']}{scale} | {self.clock.elapsed_and_eta(step)}",
                flush=True,
            )
        elif "val_loss" in record:
            print(f"step {step:5d} | val loss {record['val_loss']:.6f}")
        elif "hellaswag" in record:
            print(f"step {step:5d} | hellaswag acc_norm {record['hellaswag']:.4f} of {record['hellaswag_n']}")
        for i, text in enumerate(record.get("samples", ())):
            print(f"step {step:5d} | sample {i}: {text!r}")


def duration(seconds):
    """45s, 12m05s, 3h02m: a console line's time."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class StepClock:
    """The time a run has taken in this process and an estimate of what is left, for the step line
    (console only). ETA = the median of the last 50 steps' dt_ms (a process's first step, its
    compile, left out) x the steps left + for each eval the time it last took (from the record before
    it to its own) x the runs of it left: at each multiple of its cadence up to max_steps, and at
    max_steps. An eval not run yet in this process counts nothing; a checkpoint, a rare few seconds,
    is not counted."""

    EVALS = {"val_loss": "eval_every", "hellaswag": "hellaswag_every", "samples": "sample_every"}

    def __init__(self, max_steps, now=time.monotonic):
        self.max_steps, self.now, self.cadences = max_steps, now, {}
        self.started = self.last = now()
        self.step_seconds, self.eval_seconds = collections.deque(maxlen=51), {}

    def saw(self, record):
        """Called for every record as it is logged."""
        now = self.now()
        if "dt_ms" in record:
            self.step_seconds.append(record["dt_ms"] / 1000)
        for kind in self.EVALS.keys() & record.keys():
            self.eval_seconds[kind] = now - self.last
        self.last = now

    def elapsed_and_eta(self, step):
        elapsed, end = f"elapsed {duration(self.now() - self.started)}", self.max_steps
        steps = list(self.step_seconds)[1:]
        if not steps:
            return elapsed + " | eta --"
        left = statistics.median(steps) * (end - 1 - step)
        for kind, seconds in self.eval_seconds.items():
            if every := self.cadences.get(kind, 0):
                left += seconds * (end // every - step // every + (end % every != 0))
        return f"{elapsed} | eta {duration(left)}"

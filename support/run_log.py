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
from support.divergence import note_trained
from support.files import disk_error
from support.run_folder import log_path
from support.wandb_log import WandbMirror

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # the open of a symbolic link fails (Windows has no such flag)
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
    --wandb-project for a Weights & Biases run too (mirror). Only rank 0's is enabled; the others'
    calls do nothing. every: {"val_loss", "hellaswag", "samples": the steps between two} for the ETA;
    trained: note_trained's, of the records read at start and written since."""

    def __init__(self, out_dir, enabled, max_steps, every, records=()):
        self.path, self.file, self.max_steps = log_path(out_dir), None, max_steps
        self.out_dir, self.wandb, self.trained = out_dir, None, {}
        for record in records:
            note_trained(self.trained, record)
        self.clock = StepClock(max_steps, every)  # the step line's elapsed time and ETA
        if not enabled:
            return
        try:  # never through a symbolic link at its name: the records would go to the file it names
            self.file = open(self.path, "a", opener=lambda path, flags: os.open(path, flags | NOFOLLOW, 0o666))
            if self.file.tell() > 0:  # a last line cut short by a kill is ended: ours start on a fresh line
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        self.file.write("\n")
        except OSError as e:
            raise disk_error(e, self.path, "start again") from None

    def mirror(self, project, name, run_id, on_exit):
        """--wandb-project: the records from here on (the header first) mirrored to wandb project's run
        run_id, named name (None: the run folder's), finished as the run ends (on_exit: its ExitStack)."""
        if self.file is None or not project:
            return
        name = name or os.path.basename(os.path.abspath(self.out_dir))
        folder = os.environ.get("WANDB_DIR") or self.out_dir  # wandb's files beside the run's, unless set
        self.wandb = WandbMirror(project, name, run_id, folder)
        on_exit.callback(self.finish_wandb)  # what is queued is logged, the wandb run finished

    def header(self, run_id, device_name, resumed_from, changes, config, set_aside=None):
        """The run's first record (and a resumed run's first in its turn): what ran, where, with what;
        set_aside: where a new line of the run moved the checkpoints it passes over (out_dir.set_aside)."""
        record = {"event": "header", "run_id": run_id, "device": device_name, "resumed_from": resumed_from}
        record.update(changed_on_resume=changes or None, set_aside=set_aside or None)
        versions = dict(
            python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda, numpy=np.__version__
        )
        self({**record, "versions": versions, "config": config})  # the versions decide a run's numerics

    def __call__(self, record):
        if self.file is None:
            return
        self.clock.saw(record)
        try:
            self.file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: stop now, the checkpoints written so far are intact
            self.file = None
            raise disk_error(e, self.path, "continue with --resume") from None
        note_trained(self.trained, record)
        self.print(record)
        if self.wandb is not None and self.wandb.error is None:
            self.wandb(record)
        elif self.wandb is not None:  # wandb failed: said once, and the run goes on without it
            error, self.wandb = self.wandb.error, None
            self.warn(f"wandb stopped ({error}): the run goes on; log.jsonl holds every record")

    def warn(self, message):
        """A warning on the console and in the log, as a record of its own."""
        print(f"warning: {message}", file=sys.stderr, flush=True)
        try:
            self({"event": "warning", "warning": message})
        except UserError:
            pass  # the disk is full: the console has it

    def finish_wandb(self):
        """At the end of a run, done or not: the queued records logged and the wandb run finished
        (failed if an exception is on its way out), waiting WANDB_FINISH_TIMEOUT seconds at most."""
        exit_code = 1 if sys.exc_info()[0] is not None else 0
        mirror, self.wandb = self.wandb, None
        if mirror is None:
            return  # none, or it failed and said so
        if not mirror.finish(exit_code, WANDB_FINISH_TIMEOUT):
            self.warn(
                f"wandb has not finished uploading after {WANDB_FINISH_TIMEOUT} s: left to it as the "
                f"process exits; `wandb sync` on the run's folder under wandb/ uploads what did not go"
            )
        elif mirror.error is not None:
            self.warn(f"wandb stopped ({mirror.error}): log.jsonl holds every record")

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

    def __init__(self, max_steps, cadences, now=time.monotonic):
        self.max_steps, self.now, self.cadences = max_steps, now, cadences
        self.started = self.last = now()
        self.step_seconds, self.eval_seconds = collections.deque(maxlen=51), {}

    def saw(self, record):
        """Called for every record as it is logged."""
        now = self.now()
        if "dt_ms" in record:
            self.step_seconds.append(record["dt_ms"] / 1000)
        for kind in self.cadences.keys() & record.keys():
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

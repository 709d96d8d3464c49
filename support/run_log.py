"""The run's record: log.jsonl (one JSON record a line, printed as its console line and mirrored to
Weights & Biases when asked), and the guard that skips a non-finite step and stops a diverged run."""

import json
import math
import os
import platform
import sys

import numpy as np
import torch

from support.checkpoints import disk_error, diverged_advice, train_config_of
from support.common import UserError, same_on_every_rank
from support.out_dir import check_out_dir_held, log_runs
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
        self.out_dir, self.wandb = out_dir, None
        if not enabled:
            return
        try:
            self.file = open(self.path, "a")
            if self.file.tell() > 0:
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":  # a line cut short by a kill: start ours on a fresh line
                        self.file.write("\n")
        except OSError as e:
            raise disk_error(e, self.path, "start again") from None

    def header(self, run_id, device_name, resumed_from, changes, config):
        """The run's first record (and a resumed run's first in its turn): what ran, where, with what.
        restarted: a run the log already records steps of starts again from step 0 (it stopped before
        its first checkpoint): the records before this header are of a start it replaces."""
        record = {"event": "header", "run_id": run_id, "device": device_name, "resumed_from": resumed_from}
        if self.file is not None:
            record["restarted"] = resumed_from is None and run_id in log_runs(self.path)[0]
        if self.file is not None and config.get("wandb_project"):
            name = config.get("wandb_run_name") or os.path.basename(os.path.abspath(self.out_dir))
            folder = os.environ.get("WANDB_DIR") or self.out_dir  # wandb's files beside the run's, unless set
            self.wandb = WandbMirror(config["wandb_project"], name, run_id, folder)
            RunLog.mirrored.append(self)
        self({**record, "changed_on_resume": changes or None, "versions": versions(), "config": config})

    def __call__(self, record):
        if self.file is None:
            return
        check_out_dir_held()  # the folder is still this run's (its lock file deleted: locked again, or stop)
        try:
            self.file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: stop now, the checkpoints written so far are intact
            raise disk_error(e, self.path, "continue with --resume") from None
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
                f"mfu {mfu} | epoch {record['epoch']}{scale}",
                flush=True,
            )
        elif "val_loss" in record:
            print(f"step {step:5d} | val loss {record['val_loss']:.6f}")
        elif "hellaswag" in record:
            print(f"step {step:5d} | hellaswag acc_norm {record['hellaswag']:.4f} of {record['hellaswag_n']}")
        for i, text in enumerate(record.get("samples", ())):
            print(f"step {step:5d} | sample {i}: {text!r}")


MAX_BAD_STEPS = 3  # non-finite steps in a row: one is skipped as a bad batch, this many mean the run diverged


class NonFiniteGuard:
    """One NaN or inf (an overflow, a bad batch) in an update would spread to every weight: such a
    step is skipped. Every rank sees the same all-reduced loss and norm, so all skip it. Several
    in a row mean the run diverged: it stops with a checkpoint of the last good state.
    In fp16 (scaler: an enabled GradScaler) a finite loss whose gradients overflowed is the loss
    scale's doing, not divergence: the scaler skips the step and halves the scale, and the step is
    logged as {"scaler_skipped": ..., "loss_scale": the scale it overflowed at}, not counted as a bad
    step, unless the scale is already below 1 (then the gradients overflow unscaled: a bad step)."""

    def __init__(self, log, master_process, checkpoint, out_dir, scaler=None):
        self.log, self.master_process, self.checkpoint, self.out_dir = log, master_process, checkpoint, out_dir
        self.in_a_row, self.max_lr = 0, None
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None

    def skip(self, step, loss, norm, lr):
        if math.isfinite(loss) and math.isfinite(norm):
            self.in_a_row = 0
            return False
        if self.scaler is not None:  # fp16: the step is not applied either way; the scale backs off
            scale = self.scaler.get_scale()
            self.scaler.update()  # the gradients it unscaled held an inf or NaN: the scale is halved
            if math.isfinite(loss) and scale >= 1:
                self.log({"step": step, "scaler_skipped": f"grad norm {norm}", "loss_scale": scale, "lr": lr})
                if self.master_process:
                    print(
                        f"step {step:5d} | loss {loss:.6f} | norm {norm} | skipped by the fp16 loss scaler at "
                        f"scale {scale:g} (now {self.scaler.get_scale():g})"
                    )
                return True
        self.in_a_row += 1
        self.log({"step": step, "skipped": f"loss {loss}, grad norm {norm}", "lr": lr})
        if self.master_process:
            print(f"step {step:5d} | loss {loss} | norm {norm} | skipped ({self.in_a_row} in a row)")
        if self.in_a_row == MAX_BAD_STEPS:  # the weights and optimizer state are still those of the last good step
            path = self.checkpoint(step + 1) or os.path.join(self.out_dir, f"ckpt_{step + 1:06d}.pt")
            first = step + 1 - MAX_BAD_STEPS
            max_lr = self.max_lr or train_config_of(path).get("max_lr", math.nan)
            # the same weights failed on every batch: the weights (a learning rate too high), not the data
            raise same_on_every_rank(
                UserError(
                    f"{MAX_BAD_STEPS} steps in a row ({first} to {step}) had a non-finite loss or grad norm: "
                    f"stopped; {path} holds the weights they failed on (none of their updates was applied). "
                    f"If the data is at fault, --resume continues from it past these batches; else "
                    + diverged_advice(self.out_dir, max_lr)
                )
            )
        return True

"""The optional Weights & Biases mirror of the run log: checked before step 0, fed from a thread of
its own so that a step never waits on wandb or the network."""

import importlib.util
import os
import queue
import re
import threading

from support.cli import first_line


def wandb_problem(project):
    """Why --wandb-project cannot work, checked before step 0 (a failure after start is only a
    warning): the package missing (it is optional) or not importable, or a name wandb refuses.
    None if fine."""
    leave_out = "leave --wandb-project out (on --resume, which takes the run's: --wandb-project '')"
    if importlib.util.find_spec("wandb") is None:
        return f"--wandb-project needs the wandb package, which is not installed: pip install wandb, or {leave_out}"
    if len(project) > 128 or set(project) & set("/\\#?%:"):
        return f"--wandb-project {project!r}: wandb takes up to 128 characters and none of / \\ # ? % :"
    try:  # installed is not enough: a broken install (a missing or mismatched dependency) fails here, not after start
        importlib.import_module("wandb")
    except Exception as e:
        return (
            f"--wandb-project: the wandb package is installed but cannot be imported ({type(e).__name__}: "
            f"{first_line(e)}): reinstall it (pip install --force-reinstall wandb), or {leave_out}"
        )
    return None


class WandbMirror:
    """The run log's records mirrored to a Weights & Biases run: the header's config as the run's
    config, every other record as a history row under the same names, plotted against its `step`.
    The wandb run's id is the run's id, so a resumed run continues the same wandb run and a new
    run starts a new one. wandb lives in a thread of its own (import, start, logging, finish): a
    step only puts its record on a queue and never waits for wandb or the network. Any failure
    stops the mirror; `error` then says why, and the run goes on with log.jsonl alone."""

    def __init__(self, project, name, run_id, folder):
        self.records, self.error, self.exit_code = queue.SimpleQueue(), None, 0
        start = (project, name, re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[-64:], folder)
        self.thread = threading.Thread(target=self.work, args=start, name="wandb", daemon=True)
        self.thread.start()

    def __call__(self, record):
        self.records.put(record)

    def work(self, project, name, wandb_id, folder):
        run = None
        try:
            import wandb  # noqa: PLC0415  optional, 0.3 s to import: in this thread, so no step waits for it

            os.makedirs(folder, exist_ok=True)
            # the console stays ours (every record is mirrored); create_new: a run of its own even
            # where the process has another one open (a notebook, tests calling main())
            settings = wandb.Settings(console="off", reinit="create_new")
            run = wandb.init(project=project, name=name, id=wandb_id, resume="allow", dir=folder, settings=settings)
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
            while (record := self.records.get()) is not None:
                if isinstance(record, threading.Event):  # benchmarks/train.py's: the records before it are logged
                    record.set()
                elif record.get("event") == "header":  # a resumed run's may change --max-steps
                    header = {key: value for key, value in record.items() if key not in ("event", "config")}
                    run.config.update({**record["config"], "header": header}, allow_val_change=True)
                else:  # a history row: samples as a table of text, missing values (mfu on a CPU) left out
                    row = {key: value for key, value in record.items() if value is not None}
                    if "samples" in row:
                        row["samples"] = wandb.Table(columns=["sample"], data=[[text] for text in row["samples"]])
                    run.log(row)
            run.finish(exit_code=self.exit_code)
        except Exception as e:  # whatever wandb raises: training goes on without it
            self.error = f"{type(e).__name__}: {first_line(e)}"
            if run is not None:
                try:
                    run.finish(exit_code=1)  # what reached wandb is kept, the run marked failed
                except Exception:
                    pass

    def finish(self, exit_code, timeout):
        """Log what is queued and finish the wandb run; True if it did within timeout seconds."""
        self.exit_code = exit_code
        self.records.put(None)
        self.thread.join(timeout)
        return not self.thread.is_alive()

"""Stop signals: SIGTERM, SIGHUP, Ctrl-C and Ctrl-Break end a run at the next step boundary with a checkpoint."""

import contextlib
import os
import signal

import torch
import torch.distributed as dist

from support.run_folder import checkpoint_paths

# Under torchrun (it sets TORCHELASTIC_RUN_ID), its pid: each rank runs in a session of its own, so a
# `kill -9` of torchrun would leave the ranks training unseen; a rank whose parent changed stops as
# for SIGTERM. A plain run goes on when reparented (nohup, its shell gone).
TORCHRUN = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


class StopRequest:
    """SIGTERM (a spot instance reclaimed, a scheduler), SIGHUP (the terminal or ssh session that
    started the run went away; not on Windows), Ctrl-C or Ctrl-Break (SIGBREAK, Windows only): the
    run stops at the next step boundary with a checkpoint, an eval in progress is cut short; a
    second Ctrl-C stops at once, but for one while that checkpoint is written: it is said, and the
    write finishes; a third ends the run at once, the previous checkpoint still the newest. The
    signals this platform has are the ones handled. Under torchrun, torchrun gone (`kill -9`) is a
    SIGTERM too."""

    SIGNALS = tuple(
        getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT", "SIGBREAK") if hasattr(signal, name)
    )

    def __init__(self, out_dir, on_exit):
        self.signum, self.out_dir = 0, out_dir
        self.writing = None  # the checkpoint being written (during_write), and whether this process says so
        for s in self.SIGNALS:
            if s == getattr(signal, "SIGHUP", None) and signal.getsignal(s) == signal.SIG_IGN:
                continue  # started under nohup: hangups are to be ignored, and are
            # on_exit, the run's ExitStack, puts the handler from before the run back: a test or a notebook goes on
            on_exit.callback(signal.signal, s, signal.signal(s, self.on_signal))

    @contextlib.contextmanager
    def during_write(self, path, say):
        """A checkpoint written to path meanwhile (on every rank: the others wait for rank 0's write)."""
        self.writing = (path, say)
        try:
            yield
        finally:
            self.writing = None

    def on_signal(self, signum, frame):
        if self.signum and self.writing is not None:  # a stop is said once, and waits for the write
            (path, say), self.writing = self.writing, None
            newest = [p for p in checkpoint_paths(os.path.dirname(path)) if p != path][:1]
            kept = f"{newest[0]} stays the newest" if newest else "no checkpoint is kept: it starts again from step 0"
            if say:
                print(
                    f"caught {signal.Signals(signum).name}: {path} is being written, then the run stops; another "
                    f"stop signal ends the run now, without it ({kept})",
                    flush=True,
                )
            return
        if self.signum:  # the user does not want to wait: the run ends now, and run_cli prints what continues it
            found = checkpoint_paths(self.out_dir)
            if found:
                name = os.path.basename(found[0])
                raise KeyboardInterrupt(
                    f"interrupted: continue from its newest checkpoint, {name}, with --resume --out-dir {self.out_dir}"
                )
            raise KeyboardInterrupt(
                "interrupted before the run's first checkpoint: no checkpoint to continue from; the same command "
                "with a new --out-dir starts it again"
            )
        self.signum = signum
        print(f"caught {signal.Signals(signum).name}: stopping after this step with a checkpoint", flush=True)

    def __call__(self):  # this rank's request, for the evals and samples to poll
        self.check_torchrun()
        return self.signum != 0

    def check_torchrun(self):
        """Under torchrun, a parent that is not torchrun: it is gone (`kill -9`), a request as SIGTERM's."""
        if not self.signum and TORCHRUN not in (None, os.getppid()):
            self.signum = signal.SIGTERM
            if os.environ.get("LOCAL_RANK") == "0":
                print(
                    f"torchrun (pid {TORCHRUN}) is gone: stopping after this step with a checkpoint in {self.out_dir}",
                    flush=True,
                )

    def agreed(self, device, ddp):
        """The signal every rank stops for (0: none), the same on every rank."""
        self.check_torchrun()
        signum = torch.tensor(self.signum, device=device)
        if ddp:
            dist.all_reduce(signum, op=dist.ReduceOp.MAX)
        return signum.item()

"""Stop signals: SIGTERM, SIGHUP, Ctrl-C and Ctrl-Break end a run at the next step boundary with a checkpoint."""

import signal

import torch
import torch.distributed as dist


class StopRequest:
    """SIGTERM (a spot instance reclaimed, a scheduler), SIGHUP (the terminal or ssh session that
    started the run went away; not on Windows), Ctrl-C or Ctrl-Break (SIGBREAK, Windows only): the
    run stops at the next step boundary with a checkpoint, an eval in progress is cut short; a
    second Ctrl-C stops at once. The signals this platform has are the ones handled."""

    SIGNALS = tuple(
        getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT", "SIGBREAK") if hasattr(signal, name)
    )

    def __init__(self):
        self.signum = 0
        for s in self.SIGNALS:
            if s == getattr(signal, "SIGHUP", None) and signal.getsignal(s) == signal.SIG_IGN:
                continue  # started under nohup: hangups are to be ignored, and are
            signal.signal(s, self.on_signal)

    def on_signal(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt  # the user does not want to wait: run_cli prints one line
        self.signum = signum
        print(f"caught {signal.Signals(signum).name}: stopping after this step with a checkpoint", flush=True)

    def __call__(self):  # this rank's request, for the evals to poll
        return self.signum != 0

    def agreed(self, device, ddp):
        """The signal every rank stops for (0: none), the same on every rank."""
        signum = torch.tensor(self.signum, device=device)
        if ddp:
            dist.all_reduce(signum, op=dist.ReduceOp.MAX)
        return signum.item()

"""A run that diverges: the guard that skips a non-finite step and stops the run after several in
a row, the refusal to checkpoint weights that are not finite, which checkpoints hold weights that
trained without a NaN or inf, and what to do then (go on from one with a lower --max-lr)."""

import math

import torch

from support.cli import UserError, same_on_every_rank
from support.run_folder import checkpoint_path, known_good

MAX_BAD_STEPS = 3  # non-finite steps in a row: one is skipped as a bad batch, this many mean the run diverged


class NonFiniteGuard:
    """One NaN or inf (an overflow, a bad batch) in an update would spread to every weight: such a
    step is skipped. Every rank sees the same all-reduced loss and norm, so all skip it. Several
    in a row mean the run diverged: it stops with a checkpoint of the last good state.
    In fp16 (scaler: an enabled GradScaler) a finite loss whose gradients overflowed is the loss
    scale's doing, not divergence: the scaler skips the step and halves the scale, and the step is
    logged as {"scaler_skipped": ..., "loss_scale": the scale it overflowed at}, not counted as a bad
    step, unless the scale is already below 1 (then the gradients overflow unscaled: a bad step)."""

    def __init__(self, log, master_process, checkpoint, out_dir, max_lr, scaler=None):
        self.log, self.master_process, self.checkpoint, self.out_dir = log, master_process, checkpoint, out_dir
        self.in_a_row, self.max_lr = 0, max_lr
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
            path = self.checkpoint(step + 1) or checkpoint_path(self.out_dir, step + 1)  # rank 0 wrote it
            first = step + 1 - MAX_BAD_STEPS
            # the same weights failed on every batch: the weights (a learning rate too high), not the data
            raise same_on_every_rank(
                UserError(
                    f"{MAX_BAD_STEPS} steps in a row ({first} to {step}) had a non-finite loss or grad norm: "
                    f"stopped; {path} holds the weights they failed on (none of their updates was applied). "
                    f"If the data is at fault, --resume continues from it past these batches; else "
                    + diverged_advice(known_good(self.out_dir, self.log.trained), self.out_dir, self.max_lr)
                )
            )
        return True


def check_finite_state(ckpt, out_dir, trained, max_lr):
    """Weights or a val loss that are not finite are never saved as a checkpoint (ckpt: the dict
    about to be), and a run that has them is not done: it stops, saying which checkpoint in out_dir
    to go on from (trained: note_trained's) with an --max-lr below max_lr. The same on every rank
    (the weights are the same, the val loss all-reduced)."""
    bad = [name for name, tensor in ckpt["model"].items() if not torch.isfinite(tensor).all()]
    step, val_loss = ckpt["step"], ckpt.get("val_loss")
    if not bad and (val_loss is None or math.isfinite(val_loss)):
        return
    what = f"the weights after {step} steps are not finite ({bad[0]})" if bad else f"the val loss is {val_loss}"
    advice = diverged_advice(known_good(out_dir, trained), out_dir, max_lr)
    raise same_on_every_rank(UserError(f"{what}: the run diverged and stopped, writing no checkpoint of it; {advice}"))


def note_trained(trained, record):
    """trained, {step: trained without a NaN or inf}, with a log's next record: a step's last record
    decides (a resumed run redoes steps); a trained step, or one fp16's loss scaler skipped (its loss
    was finite, only the scaled gradients overflowed), is good, a skipped one (a NaN or inf) is not. A
    header starts a line of the run at the step it resumed from: the steps past it were another line's."""
    if record.get("event") == "header":
        for step in [step for step in trained if step > (record.get("resumed_from") or -1)]:
            del trained[step]
    elif any(k in record for k in ("train_loss", "scaler_skipped", "skipped")):
        trained[record.get("step")] = "skipped" not in record


def diverged_advice(good, out_dir, max_lr):
    """What to do after a divergence: go on from good[0] (run_folder.known_good's newest) with an --max-lr below
    max_lr, this run's (an allowed change on --resume); with none, start anew."""
    if good:
        return (
            f"continue from {good[0]}, the newest checkpoint whose weights trained without a NaN or inf, with "
            f"a lower learning rate: --resume {good[0]} --max-lr LR, LR below {max_lr:g}"
        )
    return (
        f"no checkpoint in {out_dir} holds weights that trained without a NaN or inf: start a new run with "
        f"a lower --max-lr (below {max_lr:g}) in a new --out-dir"
    )

"""support/divergence.py, through real runs of train_gpt2.py: a step whose loss or gradients are
not finite is not applied and is logged as skipped; several in a row stop the run with a checkpoint
of the weights they failed on; fp16's loss-scaler skips are not such steps; and the advice after a
divergence works when followed: --resume past bad batches, or from the last good checkpoint (which
--keep-ckpts keeps) with a --max-lr below the one that diverged; a run never ends "done" on NaN."""

import math
import os
import re

import numpy as np
import pytest
import torch

import train_gpt2
from helpers import (
    checkpoint_bytes,
    headers,
    random_shards,
    read_log,
    same_weights,
    strict_records,
    tiny_args,
    user_error,
)
from support import divergence, precision, run_folder
from support.checkpoints import load_checkpoint, load_training_checkpoint
from support.cli import UserError

# ----------------------------------------------------------------------------------------------
# A non-finite step is skipped; several in a row stop the run


def nonfinite_at(monkeypatch, factors, grad_accum_steps=2):
    """Scale the training loss of the given steps by nan / inf (its gradients follow), which is
    how a diverging step or a bad batch looks. The model's forward is wrapped from outside:
    training forwards are counted, grad_accum_steps of them per step (tiny_args has 2)."""
    forward, calls = train_gpt2.GPT.forward, [0]

    def scaled(self, idx, targets=None, **kwargs):
        logits, loss = forward(self, idx, targets, **kwargs)
        if self.training and targets is not None:
            step = calls[0] // grad_accum_steps
            calls[0] += 1
            loss = loss * factors.get(step, 1.0)
        return logits, loss

    monkeypatch.setattr(train_gpt2.GPT, "forward", scaled)


def test_nonfinite_steps_are_not_applied(data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    nonfinite_at(monkeypatch, {2: math.nan, 4: math.inf})
    args = tiny_args(data, out, "--max-steps", 6, "--ckpt-every", 1, "--keep-ckpts", 0, "--eval-every", 0)
    assert train_gpt2.main(args) == 0
    ckpt = {s: load_checkpoint(str(out / f"ckpt_{s:06d}.pt")) for s in range(1, 7)}
    for bad in (2, 4):  # the update after a bad step's checkpoint never happened ...
        assert same_weights(ckpt[bad]["model"], ckpt[bad + 1]["model"])
        assert ckpt[bad]["optimizer"]["state"][0]["step"] == ckpt[bad + 1]["optimizer"]["state"][0]["step"]
    for good in (1, 3, 5):  # ... while every good one changed the weights
        assert not torch.equal(ckpt[good]["model"]["lm_head.weight"], ckpt[good + 1]["model"]["lm_head.weight"])
    steps = read_log(out)[1]
    assert sorted(steps) == list(range(6))
    assert [s for s in steps if "skipped" in steps[s]] == [2, 4] and "train_loss" not in steps[2]
    assert all(np.isfinite(steps[s]["train_loss"]) for s in (0, 1, 3, 5))


def test_nonfinite_steps_in_a_row_stop_with_a_checkpoint_of_the_last_good_state_and_resume_goes_past(
    data, tmp_path, monkeypatch
):
    """Three batches whose loss is NaN or inf (bad data, injected into the loss): the guard's checkpoint
    holds the good weights, and --resume, as the message says, continues past them."""
    out = tmp_path / "out"
    nonfinite_at(monkeypatch, {2: math.nan, 3: math.inf, 4: math.nan})
    args = tiny_args(data, out, "--max-steps", 8, "--ckpt-every", 2, "--keep-ckpts", 0, "--eval-every", 0)
    msg = user_error(args)
    assert "3 steps in a row" in msg and "ckpt_000005.pt" in msg
    assert "If the data is at fault, --resume continues from it past these batches" in msg
    steps = read_log(out)[1]
    assert sorted(steps) == [0, 1, 2, 3, 4]  # stopped right away, no step after the third bad one
    last_good = load_checkpoint(str(out / "ckpt_000002.pt"))  # written before step 2, the first bad one
    stop = load_training_checkpoint(str(out / "ckpt_000005.pt"))
    assert stop["step"] == 5 and same_weights(stop["model"], last_good["model"])
    assert stop["optimizer"]["state"][0]["step"] == last_good["optimizer"]["state"][0]["step"] == 2
    monkeypatch.undo()
    assert train_gpt2.main(args + ["--resume"]) == 0
    steps = read_log(out)[1]
    assert sorted(steps) == list(range(8)) and all("train_loss" in steps[s] for s in (0, 1, 5, 6, 7))


def test_fp16_overflows_the_loss_scaler_skips_are_not_divergence(tmp_path, monkeypatch, capsys):
    """fp16 from a first loss scale of 2**22: this model's scaled gradients overflow fp16 at the
    first 4 steps (2**22 down to 2**19), more in a row than MAX_BAD_STEPS. Each is the scaler's
    skip, logged as such at its scale, not a bad step: the run trains on from 2**18 and finishes,
    the skipped steps leave the weights as they were, and their checkpoints count as good."""
    monkeypatch.setattr(precision, "INIT_SCALE", 2.0**22)
    data, out = random_shards(tmp_path / "data"), tmp_path / "out"
    args = tiny_args(data, out, "--dtype", "float16", "--max-steps", 5, "--ckpt-every", 1, "--keep-ckpts", 0)
    assert train_gpt2.main([*args, "--eval-every", 0]) == 0
    steps = read_log(out)[1]
    assert divergence.MAX_BAD_STEPS < 4
    assert [s for s in steps if "scaler_skipped" in steps[s]] == [0, 1, 2, 3]
    assert [steps[s]["loss_scale"] for s in range(5)] == [2.0**22, 2.0**21, 2.0**20, 2.0**19, 2.0**18]
    assert not any("skipped" in r or "train_loss" in r for r in list(steps.values())[:4])
    assert np.isfinite(steps[4]["train_loss"]) and np.isfinite(steps[4]["grad_norm"])
    assert "skipped by the fp16 loss scaler at scale 524288 (now 262144)" in capsys.readouterr().out
    ckpt = {s: load_checkpoint(str(out / f"ckpt_{s:06d}.pt")) for s in range(1, 6)}
    assert all(same_weights(ckpt[1]["model"], ckpt[s]["model"]) for s in (2, 3, 4))
    assert not same_weights(ckpt[4]["model"], ckpt[5]["model"])
    trained = {}
    for record in strict_records(out):
        divergence.note_trained(trained, record)
    # checkpoint N holds the weights step N trained from: 1-3 (scaler skips) and 4 good, 5 not trained from yet
    assert run_folder.known_good(str(out), trained) == [str(out / f"ckpt_{s:06d}.pt") for s in (4, 3, 2, 1)]


def test_weights_that_are_not_finite_are_never_saved(tmp_path, short_run):
    """A checkpoint of non-finite weights is refused before it is written (check_finite_state, which
    train_gpt2 calls where it checkpoints), in one line."""
    model = train_gpt2.load_model(str(short_run[1] / "ckpt_000002.pt"))
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = math.inf
    out = tmp_path / "out"
    out.mkdir()
    ckpt = {"model": model.state_dict(), "step": 3, "val_loss": None}
    with pytest.raises(
        UserError, match=r"the weights after 3 steps are not finite \(transformer.h.0.mlp.c_fc.weight\)"
    ):
        divergence.check_finite_state(ckpt, str(out), {}, 3e-3)
    assert os.listdir(out) == []


def test_fp16_a_nonfinite_loss_is_still_a_bad_step(tmp_path, monkeypatch):
    """In fp16 too a NaN or inf loss (from the forward, not the loss scale) counts toward MAX_BAD_STEPS."""
    nonfinite_at(monkeypatch, {0: math.nan, 1: math.inf, 2: math.nan})
    data, out = random_shards(tmp_path / "data"), tmp_path / "out"
    msg = user_error(tiny_args(data, out, "--dtype", "float16", "--max-steps", 20, "--eval-every", 0))
    assert "3 steps in a row (0 to 2)" in msg
    steps = read_log(out)[1]
    assert sorted(steps) == [0, 1, 2] and all("skipped" in steps[s] for s in steps)


# ----------------------------------------------------------------------------------------------
# After a divergence the advice works; a run never ends "done" on NaN


def test_divergence_names_the_last_good_checkpoint_and_resuming_it_with_a_lower_lr_finishes(
    data, run4_with_val_loss, capsys
):
    """--max-lr 1e30 from step 4: the val loss turns NaN and the run stops without "done" or a NaN
    checkpoint; the advice (--resume ckpt_4 --max-lr below) finishes with finite weights and loss."""
    args = tiny_args(
        data, run4_with_val_loss, "--max-steps", 8, "--warmup-steps", 2, "--ckpt-every", 2, "--eval-every", 2
    )
    msg = user_error(args + ["--resume", "--max-lr", 1e30])
    good = run4_with_val_loss / "ckpt_000004.pt"
    assert "the val loss is nan" in msg and f"--resume {good} --max-lr LR, LR below 1e+30" in msg
    assert "done" not in capsys.readouterr().out
    assert sorted(p.name for p in run4_with_val_loss.glob("ckpt_*.pt")) == ["ckpt_000002.pt", "ckpt_000004.pt"]
    val = [x["val_loss"] for x in strict_records(run4_with_val_loss) if "val_loss" in x]
    assert val[-1] == "NaN"  # strict JSON: a string any reader takes, which float() reads back
    assert train_gpt2.main(args + ["--resume", str(good), "--max-lr", 3e-3]) == 0
    assert "done: 8 steps, val loss" in capsys.readouterr().out
    final = load_checkpoint(str(run4_with_val_loss / "ckpt_000008.pt"))
    assert math.isfinite(final["val_loss"]) and all(torch.isfinite(t).all() for t in final["model"].values())


def test_divergence_at_the_start_says_start_anew_and_plain_resume_is_not_done(data, tmp_path, capsys):
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 8, "--ckpt-every", 1, "--eval-every", 0)
    msg = user_error(args + ["--max-lr", 1e30])
    assert "3 steps in a row (1 to 3)" in msg and f"{out / 'ckpt_000004.pt'} holds the weights they failed on" in msg
    assert "start a new run with a lower --max-lr (below 1e+30) in a new --out-dir" in msg
    # resuming the weights that failed, as they are, fails again: never "done"
    msg = user_error(args + ["--max-lr", 1e30, "--resume"])
    assert "3 steps in a row (4 to 6)" in msg and "done" not in capsys.readouterr().out
    # the advice: a new --out-dir, a lower --max-lr
    assert train_gpt2.main(tiny_args(data, tmp_path / "new", "--max-steps", 8, "--max-lr", 1e-3)) == 0
    assert all(math.isfinite(s["train_loss"]) for s in read_log(tmp_path / "new")[1].values())


def test_a_divergence_after_going_back_is_judged_by_its_own_line_and_its_advice_works(data, tmp_path, capsys):
    """A run trained to 9, then --resume ckpt_3 --max-lr 1e30: steps 4-6 fail, and the advice names 3, not the
    stop checkpoint 7 (the weights that failed, whose step the old line had trained). Followed, it trains to the
    end; a plain --resume then continues that line. Every checkpoint of the three lines is kept, unchanged."""
    out = tmp_path / "out"
    args = tiny_args(data, out, "--max-steps", 9, "--ckpt-every", 3, "--keep-ckpts", 3, "--eval-every", 0)
    assert train_gpt2.main(args) == 0
    msg = user_error([*args, "--resume", out / "ckpt_000003.pt", "--max-lr", 1e30])
    assert "3 steps in a row (4 to 6)" in msg and f"{out / 'ckpt_000007.pt'} holds the weights they failed on" in msg
    advised = re.search(r"--resume (\S+) --max-lr LR, LR below 1e\+30", msg)[1]
    assert advised == str(out / "ckpt_000003.pt")
    diverged = checkpoint_bytes(out)  # the first line's 3, 6, 9 and the diverged line's 6, 7
    assert len(diverged) == 5 and sorted(p.name for p in out.glob("ckpt_*.pt")) == [
        f"ckpt_00000{s}.pt" for s in (3, 6, 7)
    ]
    assert train_gpt2.main([*map(str, args), "--resume", advised, "--max-lr", "1e-3"]) == 0  # the advice, followed
    assert diverged.keys() <= checkpoint_bytes(out).keys()
    capsys.readouterr()
    assert train_gpt2.main(["--resume", "--out-dir", str(out), "--device", "cpu", "--max-steps", "12"]) == 0
    assert f"resuming from {out / 'ckpt_000009.pt'} at step 9" in capsys.readouterr().out
    assert [h["resumed_from"] for h in headers(out)] == [None, 3, 3, 9] and headers(out)[-1]["config"]["max_lr"] == 1e-3
    steps = read_log(out)[1]
    assert sorted(steps) == list(range(12)) and all(math.isfinite(steps[s]["train_loss"]) for s in steps)


def test_keep_ckpts_keeps_the_last_good_checkpoint_through_a_divergence(data, tmp_path):
    out = tmp_path / "out"
    args = tiny_args(data, out, "--ckpt-every", 1, "--keep-ckpts", 1, "--eval-every", 0)
    assert train_gpt2.main(args + ["--max-steps", 4]) == 0
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_000003.pt", "ckpt_000004.pt"]  # 4: not trained yet
    msg = user_error(args + ["--max-steps", 10, "--max-lr", 1e30, "--resume"])
    assert f"--resume {out / 'ckpt_000004.pt'} --max-lr LR" in msg
    assert (out / "ckpt_000004.pt").exists()
    assert train_gpt2.main(args + ["--max-steps", 10, "--max-lr", 1e-3, "--resume", out / "ckpt_000004.pt"]) == 0

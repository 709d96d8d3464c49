"""train_gpt2.main's steps, every part of the recipe active, against the same steps in plain torch (fp16:
torch's AMP recipe, overflows included): logged numbers, weights and AdamW's moments equal, bit for bit."""

import math
import random
from contextlib import nullcontext

import numpy as np
import pytest
import torch

import train_gpt2
from helpers import at_step, random_shards, read_log, tiny_args
from support import precision
from train_gpt2 import GPT, GPTConfig

# every setting away from its default, so that one lost on the way to the optimizer shows
SEED, STEPS, WARMUP = 7, 6, 2
MAX_LR, MIN_LR = 3e-3, 4e-4
WEIGHT_DECAY, BETAS, EPS = 0.3, (0.8, 0.99), 1e-6
GRAD_CLIP = 0.3  # the gradient norm of this model is above it at every step: the clip bites
B, T, TOTAL = 2, 16, 64  # 2 micro-steps of accumulation
CONFIG = dict(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
SHARDS = (300, 200)  # 9 and 6 chunks of B*T: step 4 reads the second shard, past the first's tail


def lr_at(step):
    """Linear warm-up over WARMUP steps, then a cosine from MAX_LR down to MIN_LR at STEPS."""
    if step < WARMUP:
        return MAX_LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * progress)) * (MAX_LR - MIN_LR)


def batches(data_dir):
    """(x, y) micro-batches: the train shards in name order, B*T tokens (+1) at a time, a short tail skipped."""
    for path in sorted(data_dir.glob("*_train_*.npy")):
        tokens = torch.from_numpy(np.load(path).astype(np.int64))
        for start in range(0, len(tokens) - B * T, B * T):
            buf = tokens[start : start + B * T + 1]
            yield buf[:-1].view(B, T), buf[1:].view(B, T)


def reference_steps(data_dir, fp16_init_scale=None):
    """The recipe's steps written plainly (AdamW fused, as the recipe's: the last bit differs otherwise), with
    fp16_init_scale in fp16 with a GradScaler; yields (loss, grad norm, lr, loss scale, model, optimizer)."""
    torch.manual_seed(SEED)  # what train_gpt2 seeds before it builds the model
    model = GPT(GPTConfig(**CONFIG))
    params = list(model.parameters())  # the tied wte / lm_head weight once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=MAX_LR, betas=BETAS, eps=EPS, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=fp16_init_scale) if fp16_init_scale else None
    data = batches(data_dir)
    accum = TOTAL // (B * T)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(accum):
            x, y = next(data)
            with torch.autocast("cpu", dtype=torch.float16) if scaler else nullcontext():
                _, loss = model(x, y)
            loss = loss / accum
            loss_sum += loss.detach()
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        scale = scaler.get_scale() if scaler else None
        if scaler:
            scaler.step(optimizer)  # skipped when the unscaled gradients hold an inf or NaN
            scaler.update()
        else:
            optimizer.step()
        yield loss_sum.item(), norm.item(), lr_at(step), scale, model, optimizer


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    """The same STEPS steps by train_gpt2.main, a checkpoint after each (all kept)."""
    tmp = tmp_path_factory.mktemp("recipe")
    data = random_shards(tmp / "data", train_lengths=SHARDS)
    assert train_gpt2.main(recipe_args(data, tmp / "out")) == 0
    return data, tmp / "out"


def recipe_args(data, out, *extra):
    schedule = f"--seed {SEED} --no-shuffle --max-steps {STEPS} --warmup-steps {WARMUP} --max-lr {MAX_LR}"
    optimizer = f"--min-lr {MIN_LR} --weight-decay {WEIGHT_DECAY} --beta1 {BETAS[0]} --beta2 {BETAS[1]}"
    optimizer += f" --adam-eps {EPS} --grad-clip {GRAD_CLIP}"
    rest = f"-B {B} -T {T} --total-batch-size {TOTAL} --ckpt-every 1 --keep-ckpts 0 --eval-every 0"
    config = [f"--{k.replace('_', '-')}={v}" for k, v in CONFIG.items()]
    return tiny_args(data, out, *f"{schedule} {optimizer} {rest}".split(), *config, *extra)


def checkpoint(out, step):
    return torch.load(out / f"ckpt_{step:06d}.pt", map_location="cpu", weights_only=True)


def folder_with_checkpoint(out, folder, step):
    """A new folder holding run `out`'s checkpoint of `step` alone."""
    folder.mkdir()
    (folder / f"ckpt_{step:06d}.pt").write_bytes((out / f"ckpt_{step:06d}.pt").read_bytes())
    return folder


def assert_same_state(ckpt, weights, moments, step):
    """ckpt holds the weights and AdamW's moments and step counts ({parameter index: state}), bit for bit."""
    for name, p in weights.items():
        assert torch.equal(ckpt["model"][name], p), (step, name, (ckpt["model"][name] - p).abs().max().item())
    for i, ref in moments.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ckpt["optimizer"]["state"][i][key], ref[key]), (step, i, key)


def assert_resumed_bitwise(out, run, steps, scaler=False):
    """run's checkpoints of steps hold out's weights, AdamW state (and GradScaler's), bit for bit."""
    for step in steps:
        a, b = checkpoint(out, step), checkpoint(run, step)
        assert not scaler or b["scaler"] == a["scaler"], step
        assert_same_state(b, a["model"], a["optimizer"]["state"], step)


def test_the_run_exercises_every_part_of_the_recipe(recipe_run):
    """The run visits what the tests below check: 2 micro-steps, warm-up and cosine, the clip, a second shard."""
    _, out = recipe_run
    records, steps = read_log(out)
    assert records[0]["config"]["grad_accum_steps"] == 2
    assert sorted(steps) == list(range(STEPS))
    assert all(steps[s]["grad_norm"] > 2 * GRAD_CLIP for s in steps), [steps[s]["grad_norm"] for s in steps]
    lrs = [lr_at(s) for s in range(STEPS)]
    assert lrs[0] < lrs[1] == MAX_LR == lrs[2] > lrs[3] > lrs[4] > lrs[5] > MIN_LR  # warm-up, top, cosine
    assert checkpoint(out, STEPS)["data"]["shard"] == 1


def test_every_step_equals_the_reference_bitwise(recipe_run):
    """After every step: the logged loss, norm and lr, the weights, AdamW's settings and moments, bit for bit."""
    data, out = recipe_run
    _, logged = read_log(out)
    for step, (loss, norm, lr, _, model, optimizer) in enumerate(reference_steps(data)):
        assert (logged[step]["train_loss"], logged[step]["grad_norm"], logged[step]["lr"]) == (loss, norm, lr), step
        ckpt = checkpoint(out, step + 1)
        assert ckpt["step"] == step + 1
        ref_state = optimizer.state_dict()  # parameter by parameter in the optimizer's order, decayed group first
        assert len(ckpt["optimizer"]["param_groups"]) == len(ref_state["param_groups"]) == 2
        for group, ref_group in zip(ckpt["optimizer"]["param_groups"], ref_state["param_groups"], strict=True):
            for key in ("lr", "betas", "eps", "weight_decay"):
                assert group[key] == ref_group[key], (step, key)
            assert group["params"] == ref_group["params"]
        n_params = len(list(model.parameters()))  # every parameter has moments, the tied one once
        assert sorted(ckpt["optimizer"]["state"]) == sorted(ref_state["state"]) == list(range(n_params))
        assert_same_state(ckpt, model.state_dict(), ref_state["state"], step)


def test_a_resume_with_every_flag_left_out_continues_the_recipe_bitwise(recipe_run, tmp_path, monkeypatch):
    """`--resume <folder>` of step 3's checkpoint alone takes the whole recipe from it: steps 3-5 as the run's,
    bit for bit; scrambling the global random generators after each step changes nothing."""
    _, out = recipe_run
    run = folder_with_checkpoint(out, tmp_path / "run", 3)
    scrambled = []

    def scramble():  # new seeds after each step: a draw from a global generator would show
        scrambled.append(1)
        for seed in (random.seed, np.random.seed, torch.manual_seed):
            seed(1000 + len(scrambled))

    at_step(monkeypatch, dict.fromkeys((3, 4, 5), scramble))
    assert train_gpt2.main(["--resume", str(run), "--device", "cpu"]) == 0
    assert len(scrambled) == 3
    assert sorted(read_log(run)[1]) == [3, 4, 5]
    assert_resumed_bitwise(out, run, (4, 5, 6))


# fp16 from a loss scale the first steps' gradients overflow at (from 2**19 here): the scaler skips, then steps
FP16_INIT_SCALE = 2.0**20


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    """The recipe's steps by `train_gpt2.main --dtype float16`, from the same first loss scale."""
    tmp = tmp_path_factory.mktemp("recipe_fp16")
    data = random_shards(tmp / "data", train_lengths=SHARDS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precision, "INIT_SCALE", FP16_INIT_SCALE)
        assert train_gpt2.main(recipe_args(data, tmp / "out", "--dtype", "float16")) == 0
    return data, tmp / "out"


def test_fp16_steps_equal_the_gradscaler_reference(fp16_run):
    """Overflowing steps are logged as skipped at the reference's scale, the others as the reference's."""
    data, out = fp16_run
    records, logged = read_log(out)
    assert records[0]["config"]["dtype"] == "float16" and records[0]["config"]["dtype_reason"] == "--dtype float16"
    assert sorted(logged) == list(range(STEPS))
    skipped = []
    for step, (loss, norm, _, scale, model, optimizer) in enumerate(reference_steps(data, FP16_INIT_SCALE)):
        record = logged[step]
        assert record["loss_scale"] == scale, step
        if math.isfinite(norm):
            assert (record["train_loss"], record["grad_norm"], record["lr"]) == (loss, norm, lr_at(step)), step
        else:
            assert "scaler_skipped" in record and "train_loss" not in record and "skipped" not in record, record
            skipped.append(step)
        ours = checkpoint(out, step + 1)
        assert ours.get("scaler", {}).get("scale") == (scale if math.isfinite(norm) else scale / 2), step
        # the reference's optimizer makes its (zero) state on a skipped first step too
        moments = {i: ref for i, ref in optimizer.state_dict()["state"].items() if ref["step"] > 0}
        assert_same_state(ours, model.state_dict(), moments, step)
    assert skipped == [0, 1]  # the run visits both paths: the first two overflow, the rest train


def test_an_fp16_resume_continues_the_loss_scale_bitwise(fp16_run, tmp_path):
    """From step 3's checkpoint (scale 2**18; a fresh one would overflow again) steps 3-5 are the run's, bitwise."""
    _, out = fp16_run
    run = folder_with_checkpoint(out, tmp_path / "run", 3)
    assert checkpoint(run, 3)["scaler"]["scale"] == FP16_INIT_SCALE / 4
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precision, "INIT_SCALE", FP16_INIT_SCALE)  # what a fresh scaler would start from
        # the dtype is the machine's, not the checkpoint's (auto is fp32 on a CPU): given again
        assert train_gpt2.main(["--resume", str(run), "--device", "cpu", "--dtype", "float16"]) == 0
    ref, resumed = read_log(out)[1], read_log(run)[1]
    assert sorted(resumed) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed[step].get("train_loss") == ref[step]["train_loss"], resumed[step]
        assert resumed[step]["loss_scale"] == ref[step]["loss_scale"], resumed[step]
    assert_resumed_bitwise(out, run, (4, 5, 6), scaler=True)

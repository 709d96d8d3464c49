"""support/checks.py, with the checks of support/device.py and support/shards.py that train_gpt2.py
makes before step 0: every refusal, and every number flag's type, has a case with the one line it
says (test_every_refusal_has_a_case, test_every_number_flag_has_a_checked_type); then real runs at
the edges: numbers the code cannot use, flags against one another, the data against the run. (The
checks under torchrun: test_ddp.py.)"""

import ast
import inspect
import os
import re
from unittest import mock

import numpy as np
import pytest

import train_gpt2
from helpers import random_shards, read_log, refused_before_step_0, tiny_args, user_error
from support import checks, device, shards
from support.checkpoints import load_checkpoint
from support.cli import UserError
from support.shards import check_batch_fits, check_batch_ids, check_same_data, find_shards

# the functions whose every refusal has a case (check_fineweb_finished's need fineweb.py's own
# manifests: tests/test_shards.py makes them)
CHECKED = ("check_args", "check_wandb", "check_model", "check_built_model", "check_data", "pick_device")
CHECKED += ("find_shards", "check_batch_fits", "check_same_data", "check_batch_ids")
CHECKED_IN = (checks, device, shards)  # the modules that hold them


def no_warmup(data, out, *extra):
    """tiny_args without --warmup-steps: the default (715) is in force."""
    args = tiny_args(data, out, *extra)
    i = args.index("--warmup-steps")
    return args[:i] + args[i + 2 :]


def train(*flags):
    """The refusal of train_gpt2.main(tiny flags + flags), made in-process: no data is read, the
    flags are checked before anything else."""
    return lambda tmp: train_gpt2.main(tiny_args(tmp / "data", tmp / "out", *flags))


def on_shards(*flags, **shards):
    """The refusal of train_gpt2.main(tiny flags + flags) on random shards (random_shards' keywords)."""
    return lambda tmp: train_gpt2.main(tiny_args(random_shards(tmp / "data", **shards), tmp / "out", *flags))


def on_a_cpu(device):
    """The refusal of train("--device", device) on a machine with neither CUDA nor MPS (is_available: bool())."""

    def case(tmp):
        with mock.patch("torch.cuda.is_available", bool), mock.patch("torch.backends.mps.is_available", bool):
            train_gpt2.main(tiny_args(tmp / "data", tmp / "out", "--device", device))

    return case


def folder(tmp, name, *files):
    """tmp/name holding empty files of these names; its path as a string."""
    (tmp / name).mkdir(parents=True)
    for file in files:
        (tmp / name / file).write_bytes(b"")
    return str(tmp / name)


def same_data(**now):
    """check_same_data of a run's one train shard (s_train_000001.npy, 100 bytes) against `now`."""
    saved = {"train": [["s_train_000001.npy", 100, "d1"]], "val": []}
    return lambda tmp: check_same_data(saved, {"train": now.get("train", []), "val": []}, "c.pt", "shards")


def not_the_data(what):
    return (
        f"--data-dir shards is not the data c.pt was trained on: {what}; resume on the run's own shards, or start "
        f"a new run from its weights with --init-from c.pt in a new --out-dir"
    )


def refused_type(flag, value, says, shown=None):
    """The case of a number flag whose type (support.checks.flag_type) refuses value at parse time:
    argparse's one line naming the flag (-B: --batch-size/-B) and what the type asks."""
    name = {"-B": "--batch-size/-B", "-T": "--seq-len/-T"}.get(flag, flag)
    shown = value if shown is None else shown
    return (train(flag, value), f"argument {name}: must be {says}, not {shown} (see python train_gpt2.py --help)")


FLOATS = ("--weight-decay", "--grad-clip", "--temperature")
FINITE = ("--ddp-timeout", "--max-lr", "--min-lr", "--weight-decay", "--beta1", "--beta2", "--adam-eps")
FINITE += ("--grad-clip", "--peak-flops", "--temperature")
POSITIVE = ("-B", "-T", "--total-batch-size", "--max-steps", "--n-layer", "--n-head", "--n-embd", "--block-size")
POSITIVE += ("--num-samples", "--max-new-tokens", "--hellaswag-limit")
COUNTS = ("--warmup-steps", "--weight-decay", "--grad-clip", "--eval-every", "--val-tokens", "--hellaswag-every")
COUNTS += ("--sample-every", "--ckpt-every", "--keep-ckpts", "--temperature", "--top-k")
DDP_SECONDS = (
    "a number of seconds from 1 (the ranks take about a second to join) to 1e+09 (about 31 years: torch counts it "
    "in nanoseconds)"
)

# refused by each flag's type as argparse parses it (test_every_number_flag_has_a_checked_type)
TYPE_CASES = {
    **{f"{flag} nan": refused_type(flag, "nan", "a finite number") for flag in FINITE},
    "--max-lr inf": refused_type("--max-lr", "inf", "a finite number"),
    **{f"{flag} 0": refused_type(flag, 0, "at least 1") for flag in POSITIVE},
    **{f"{flag} -1": refused_type(flag, -1, "0 or more", -1.0 if flag in FLOATS else -1) for flag in COUNTS},
    "--max-lr 0": refused_type("--max-lr", 0, "above 0", 0.0),
    "--max-lr -1": refused_type("--max-lr", -1, "above 0", -1.0),
    "--beta1 1": refused_type("--beta1", 1, "in [0, 1)", 1.0),
    "--beta2 -0.5": refused_type("--beta2", -0.5, "in [0, 1)"),
    "--adam-eps 0": refused_type("--adam-eps", 0, "above 0", 0.0),
    **{f"--ddp-timeout {t}": refused_type("--ddp-timeout", t, DDP_SECONDS, float(t)) for t in (0, 1e-9, 0.5, -5, 1e10)},
    "--peak-flops 0": refused_type("--peak-flops", 0, "above 0", 0.0),
    **{f"--seed {s}": refused_type("--seed", s, "between 0 and 4,294,967,295") for s in (-1, 2**32)},
}


def resume_with_an_init_from_preset(tmp):
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "ft.txt").write_text("# fine-tune GPT-2\n--init-from gpt2\n")
    return train_gpt2.main([f"@{tmp / 'ft.txt'}", *tiny_args(tmp / "data", tmp / "out", "--resume")])


CASES = {
    "--min-lr -1e-3": (train("--min-lr", -1e-3), "--min-lr -0.001 must be between 0 and --max-lr 0.003"),
    "--min-lr above --max-lr": (train("--min-lr", 1e-2), "--min-lr 0.01 must be between 0 and --max-lr 0.003"),
    "--n-embd 30 --n-head 4": (train("--n-embd", 30, "--n-head", 4), "--n-embd 30 is not a multiple of --n-head 4"),
    "--vocab-size 50000": (train("--vocab-size", 50000), "--vocab-size 50000 is smaller than GPT-2's 50257 tokens"),
    "--vocab-size 1e9": (
        train("--vocab-size", 10**9),
        "--vocab-size 1000000000 is more than the 65,536 token ids a shard can hold (uint16): pass at most 65536 "
        "(GPT-2 has 50,257 tokens; the default 50304 pads them to a multiple of 128)",
    ),
    **{
        f"{flag} {value:.0e}": (
            train(flag, value, *extra),
            re.compile(
                rf"the model flags make [\d,]+ parameters, [\d,]+ GiB to train \(weights, gradients and AdamW's two "
                rf"moments, 16 bytes each\), more than the [\d,]+ GiB of "
                rf"(this machine's memory|the GPU's memory \(.*\)): lower {named}"
            ),
        )
        for flag, value, extra, named in [
            ("--block-size", 10**12, [], "--block-size"),
            ("--n-layer", 10**8, [], "--n-layer or --n-embd"),
            ("--n-embd", 10**6, ["--n-head", 1], "--n-layer or --n-embd"),
        ]
    },
    "--init-from with --resume": (
        train("--init-from", "gpt2", "--resume"),
        "--init-from gpt2 starts a new run, --resume continues one: pass one of them",
    ),
    "--init-from from a preset with --resume": (
        resume_with_an_init_from_preset,
        lambda tmp: (
            f"--init-from gpt2 ({tmp / 'ft.txt'}, line 2) starts a new run, --resume continues one: pass one of them"
        ),
    ),
    "--max-steps inside the default warm-up": (
        lambda tmp: train_gpt2.main(no_warmup(tmp / "data", tmp / "out", "--max-steps", 20)),
        "--max-steps 20 ends inside the default 715-step warm-up (lr would never pass 8.4e-05): pass "
        "--warmup-steps below --max-steps (e.g. --warmup-steps 2)",
    ),
    "--total-batch-size 100": (
        train("--total-batch-size", 100),
        "--total-batch-size 100 is not a multiple of B*T*world_size = 2*16*1 = 32: change --batch-size, --seq-len "
        "or --total-batch-size",
    ),
    "--wandb-project me/gpt2": (
        train("--wandb-project", "me/gpt2"),
        "--wandb-project 'me/gpt2': wandb takes up to 128 characters and none of / \\ # ? % :",
    ),
    "--wandb-run-name alone": (
        train("--wandb-run-name", "x"),
        "--wandb-run-name x names a wandb run: pass --wandb-project too",
    ),
    "-T longer than --block-size": (
        train("-T", 128, "--total-batch-size", 256),
        "--seq-len 128 is longer than the model's block_size 64",
    ),
    "--device tpu": (on_a_cpu("tpu"), "unknown device 'tpu': use cuda, cuda:N, mps or cpu"),
    "--device cuda without CUDA": (
        on_a_cpu("cuda:1"),
        "--device cuda was asked for but CUDA is not available: use --device cpu",
    ),
    "--device mps without MPS": (
        on_a_cpu("mps"),
        "--device mps was asked for but MPS is not available: use --device cpu",
    ),
    # by hand: micro-batches of B*T = 2*16 = 32 tokens, (100 - 1) // 32 = 3 per shard: 96 usable
    "fewer train tokens than one step": (
        on_shards("--total-batch-size", 128, train_lengths=(100,)),
        lambda tmp: (
            f"the train shards in {tmp}/data hold 96 usable tokens, fewer than one step's --total-batch-size 128: "
            f"write more data or lower --total-batch-size"
        ),
    ),
    "--val-tokens below -T": (
        on_shards("--val-tokens", 8),
        "--val-tokens 8 is less than one sequence of -T 16 tokens: pass at least 16, or --val-tokens 0 to train "
        "without val loss",
    ),
    "no val shard with a sequence": (
        on_shards(val_length=16),
        lambda tmp: (
            f"no val shard (*_val_NNNNNN.npy or .bin) with 17 tokens in {tmp}/data: fineweb.py writes one (its shard "
            f"0), or pass --eval-every 0 to train without val loss"
        ),
    ),
    "--data-dir a file": (
        lambda tmp: find_shards(folder(tmp, "d", "notes.txt") + "/notes.txt", "train"),
        lambda tmp: (
            f"--data-dir {tmp}/d/notes.txt is a file, not a folder of shards: pass the folder that holds the "
            f"shards, or tokenize a text file with `python fineweb.py --input {tmp}/d/notes.txt --out-dir DIR` "
            f"and pass --data-dir DIR"
        ),
    ),
    "--data-dir a shard": (
        lambda tmp: find_shards(folder(tmp, "d", "x_train_000001.npy") + "/x_train_000001.npy", "train"),
        lambda tmp: (
            f"--data-dir {tmp}/d/x_train_000001.npy is a token shard, not the folder of shards: pass the folder "
            f"that holds it, --data-dir {tmp}/d"
        ),
    ),
    "--data-dir missing": (
        lambda tmp: find_shards(str(tmp / "none"), "train"),
        lambda tmp: f"data folder {tmp}/none does not exist: write shards with fineweb.py or pass --data-dir",
    ),
    "no train shards": (
        lambda tmp: find_shards(folder(tmp, "d", "a_val_000000.npy"), "train", required=True),
        lambda tmp: (
            f"no train shards (*_train_NNNNNN.npy or .bin) in {tmp}/d: write them with `python fineweb.py` "
            f"or pass --data-dir"
        ),
    ),
    "no shard holds a batch": (
        lambda tmp: check_batch_fits(0, [40, 60], 64, "shards", "train"),
        "the largest train shard in shards holds 60 tokens, fewer than the 65 that one batch (B*T*world_size + 1) "
        "needs: lower --batch-size or --seq-len, or write bigger shards (fineweb.py --shard-size)",
    ),
    "a shard of the run missing": (same_data(), not_the_data("s_train_000001.npy is missing")),
    "a shard the run did not have": (
        same_data(train=[["s_train_000001.npy", 100, "d1"], ["s_train_000002.npy", 100, "d2"]]),
        not_the_data("s_train_000002.npy is new"),
    ),
    "a shard of other bytes": (
        same_data(train=[["s_train_000001.npy", 100, "other"]]),
        not_the_data("s_train_000001.npy is rewritten (other bytes)"),
    ),
    "a batch's token id past the vocabulary": (
        lambda tmp: check_batch_ids(np.array([5, 50303, 50304, 60000], dtype=np.uint16), 50304, "s.npy", 1_234_565),
        "s.npy holds token id 50304 at position 1,234,567, past --vocab-size 50304: the shard is damaged or from "
        "another tokenizer; rerun fineweb.py into a new folder",
    ),
}


def refusal(case, tmp_path):
    """(the one-line message, the refusal's site in CHECKED_IN: (function, line))."""
    with pytest.raises(UserError) as e:
        case(tmp_path)
    site = None
    tb = e.value.__traceback__
    while tb is not None:  # the innermost frame of a checked function: where need() or raise was called
        code = tb.tb_frame.f_code
        if code.co_name in CHECKED and any(os.path.samefile(code.co_filename, m.__file__) for m in CHECKED_IN):
            site = (code.co_name, tb.tb_lineno)
        tb = tb.tb_next
    return str(e.value), site


@pytest.mark.parametrize("name", [*CASES, *TYPE_CASES])
def test_each_refusal_is_its_one_line(name, tmp_path):
    case, expected = {**CASES, **TYPE_CASES}[name]
    message, _ = refusal(case, tmp_path)
    expected = expected(tmp_path) if callable(expected) else expected
    assert expected.fullmatch(message) if isinstance(expected, re.Pattern) else message == expected, message
    assert not (tmp_path / "out").exists()  # refused before --out-dir is made


def refusal_sites():
    """{(function, first line, last line)} of every need(...) call and raise statement in the CHECKED functions."""
    sites = set()
    for fn in (n for m in CHECKED_IN for n in ast.parse(inspect.getsource(m)).body if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(fn) if fn.name in CHECKED else ():
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "need"
            if call or isinstance(node, ast.Raise):
                sites.add((fn.name, node.lineno, node.end_lineno))
    return sites


def test_every_refusal_has_a_case(tmp_path):
    """Each need(...) and raise in the checks is hit by a case above."""
    sites = refusal_sites()
    assert len(sites) >= 20  # the ast walk found the checks (check_args' alone: 4)
    hit = set()
    for name, (case, _) in CASES.items():
        _, (function, line) = refusal(case, tmp_path / name.replace("/", "_"))
        site = [s for s in sites if s[0] == function and s[1] <= line <= s[2]]
        assert site, f"{name}: refused at {function} line {line}, not at a need or raise"
        hit.add(site[0])
    assert sorted(sites - hit, key=str) == []


def test_every_number_flag_has_a_checked_type():
    """A new flag with a bare int or float (no support.checks type) fails this test, not a run hours in."""
    parser, _ = train_gpt2.command_line()
    numbers = {a.dest for a in parser._actions if getattr(a.type, "__name__", None) in ("int", "float")}
    bare = {a.dest for a in parser._actions if a.type in (int, float)}
    assert len(numbers) >= 30  # the flag types name themselves int and float, as argparse's words need
    assert bare == {"vocab_size"}  # check_args: GPT-2's vocabulary to a shard's uint16


# ----------------------------------------------------------------------------------------------
# Numbers the code cannot use


# one past each is refused: CASES' "--vocab-size 1e9", TYPE_CASES' "--seed 4294967296" and "--ddp-timeout 1e+10"
@pytest.mark.parametrize("flag, value", [("--vocab-size", 2**16), ("--seed", 2**32 - 1), ("--ddp-timeout", 1e9)])
def test_the_largest_value_of_a_bounded_flag_trains(data, tmp_path, flag, value):
    assert train_gpt2.main(tiny_args(data, tmp_path / "out", flag, value, "--max-steps", 1)) == 0


# ----------------------------------------------------------------------------------------------
# Flags checked in a real run before step 0, alone and against the others


def test_the_warm_up_a_short_run_is_refused_for_names_reaches_max_lr(data, tmp_path):
    """The refusal's words: CASES' "--max-steps inside the default warm-up"."""
    args = no_warmup(data, tmp_path / "out", "--max-steps", 20)
    msg = refused_before_step_0(args, tmp_path / "out", "--max-steps 20", "715", "--warmup-steps")
    fix = msg.split("(e.g. ")[1].rstrip(")").split()  # the warm-up it names: the run reaches --max-lr
    assert train_gpt2.main([*args, *fix, "--eval-every", 0]) == 0
    assert max(r["lr"] for r in read_log(tmp_path / "out")[1].values()) == pytest.approx(3e-3)


def warmup_notes(capsys):
    return [line for line in capsys.readouterr().out.splitlines() if "warm-up" in line]


def test_a_run_or_resume_inside_its_asked_for_warm_up_is_said_and_the_advised_warm_up_reaches_max_lr(
    data, tmp_path, capsys
):
    """Asked for, not refused: the first part of a longer run (test_resume.py's run4) is one; a --resume still
    inside it says it again, one past it nothing."""
    out, common = tmp_path / "out", ["--warmup-steps", 10, "--eval-every", 0]
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 3, *common)) == 0
    [note] = warmup_notes(capsys)
    assert note.startswith("note: --max-steps 3 ends inside the 10-step warm-up (--warmup-steps): the lr climbs to ")
    assert "9.0e-04, never to --max-lr 3.0e-03" in note and "--resume and a larger --max-steps" in note
    assert max(r["lr"] for r in read_log(out)[1].values()) == pytest.approx(3e-3 * 3 / 10)  # what it says
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 6, "--resume", *common)) == 0
    assert [n.split(":")[1] for n in warmup_notes(capsys)] == [
        " --max-steps 6 ends inside the 10-step warm-up (--warmup-steps)"
    ]
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 12, "--resume", *common)) == 0  # past it: the whole run
    assert warmup_notes(capsys) == []
    assert max(r["lr"] for r in read_log(out)[1].values()) == pytest.approx(3e-3)
    fix = note.split("else pass ")[1].split()  # the fix it names: the lr reaches --max-lr, and nothing is said
    assert train_gpt2.main(tiny_args(data, tmp_path / "fixed", "--max-steps", 3, *fix, "--eval-every", 0)) == 0
    assert warmup_notes(capsys) == []
    lrs = [r["lr"] for _, r in sorted(read_log(tmp_path / "fixed")[1].items())]
    assert lrs[int(fix[1])] == pytest.approx(3e-3)


@pytest.mark.parametrize("flag, value", [("--n-layer", 3), ("--n-embd", 64), ("--block-size", 128)])
def test_model_flags_with_init_from_are_said_not_dropped_silently(short_run, data, tmp_path, capsys, flag, value):
    out = tmp_path / "out"
    args = tiny_args(data, out, "--init-from", short_run[1], "--max-steps", 1, "--warmup-steps", 0, "--eval-every", 0)
    assert train_gpt2.main(args + [flag, value]) == 0
    note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    name = flag[2:].replace("-", "_")
    own = {"n_layer": 2, "n_embd": 32, "block_size": 64}[name]  # short_run's model
    assert note == [f"note: {flag} {value} is not used: --init-from {short_run[1]} brings its own shape ({name} {own})"]
    assert load_checkpoint(str(out / "ckpt_000001.pt"))["model_config"]["n_layer"] == 2  # the loaded model's shape


# ----------------------------------------------------------------------------------------------
# The data against the run's batch and budget


def test_without_a_val_shard_the_advised_eval_every_0_trains(tmp_path):
    """The refusal's words: CASES' "no val shard with a sequence"."""
    data = random_shards(tmp_path / "data")
    os.remove(data / "rand_val_000000.npy")
    assert "--eval-every 0" in user_error(tiny_args(data, tmp_path / "out"))
    assert train_gpt2.main(tiny_args(data, tmp_path / "out", "--max-steps", 1, "--eval-every", 0)) == 0


def test_warns_when_the_run_repeats_data(tmp_path, capsys):
    data = random_shards(tmp_path / "data", train_lengths=(100, 100))
    assert train_gpt2.main(tiny_args(data, tmp_path / "out", "--eval-every", 0)) == 0
    # by hand: micro-batches of 2*16 = 32 tokens; (100 - 1) // 32 = 3 per shard, 192 tokens an
    # epoch; 6 steps of 64 tokens = 384 tokens = 2 epochs
    err = capsys.readouterr().err
    assert "trains on 384 tokens but the train shards hold 192 usable ones" in err and "(2.00 epochs)" in err
    _, steps = read_log(tmp_path / "out")
    assert [steps[s]["epoch"] for s in range(6)] == [0, 0, 0, 1, 1, 1]

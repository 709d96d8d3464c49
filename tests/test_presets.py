"""support/presets.py and configs/: a preset's flags land as if typed, typed flags win, a preset run
resumes, and a wrong preset is one line naming the file, the line and the fix."""

import re

import pytest

import train_gpt2
from helpers import ROOT, headers, read_log, user_error

CONFIGS = ROOT / "configs"
TINY_RUN = f"@{ROOT / 'tests' / 'tiny_run.txt'}"  # the tests' tiny run (tiny_args)


def parsed(*argv):
    return vars(train_gpt2.parse_args([str(a) for a in argv])[0])


def test_the_laptop_preset_is_the_flags_it_lists_and_typed_flags_win_before_or_after_it():
    preset = f"@{CONFIGS / 'laptop.txt'}"
    args = parsed(preset)
    expected = dict(data_dir="shakespeare", out_dir="log_tiny", device="cpu", n_layer=4, n_head=4, n_embd=64)
    expected.update(block_size=256, batch_size=16, seq_len=64, total_batch_size=4096, max_steps=200)
    expected.update(warmup_steps=20, max_lr=3e-3, eval_every=50, val_tokens=32768, hellaswag_every=0)
    expected.update(sample_every=100, ckpt_every=100)
    assert {k: args[k] for k in expected} == expected
    assert {k: v for k, v in args.items() if k not in expected} == {
        k: v for k, v in parsed().items() if k not in expected
    }  # every other flag at its default
    for argv in ([preset, "--max-steps", 50, "-B", 8], ["--max-steps", 50, "-B", 8, preset]):
        args = parsed(*argv)
        assert (args["max_steps"], args["batch_size"], args["n_layer"]) == (50, 8, 4)


def test_a_preset_run_records_its_flags_resumes_and_a_contradiction_names_the_presets_file_and_line(data, tmp_path):
    out, preset = tmp_path / "run", tmp_path / "mine.txt"
    assert train_gpt2.main([TINY_RUN, "--data-dir", data, "--out-dir", out, "--ckpt-every", 3, "--max-steps", 3]) == 0
    config = headers(out)[0]["config"]
    assert (config["n_layer"], config["n_embd"], config["total_batch_size"], config["max_steps"]) == (2, 32, 64, 3)
    preset.write_text("# my run, 3 layers\n--n-layer 3\n")
    resume = [TINY_RUN, f"@{preset}", "--data-dir", data, "--out-dir", out, "--max-steps", 5, "--resume"]
    assert user_error(resume) == (
        f"--n-layer 3 ({preset}, line 2) contradicts the 2 that {out / 'ckpt_000003.pt'} was trained with: "
        f"drop that line to continue the run as it was, or start a new run in another --out-dir"
    )
    typed = user_error(["--n-layer", 3, *resume])  # typed, before the preset too: the command line's, not the preset's
    assert typed.startswith("--n-layer 3 contradicts the 2") and "leave --n-layer out" in typed
    preset.write_text("# my run, 3 layers\n")  # the advice, followed: the presets again with --resume, values given
    assert train_gpt2.main(resume) == 0
    assert train_gpt2.main(["--resume", str(out), "--max-steps", 6, "--device", "cpu"]) == 0  # a run's folder alone
    assert sorted(read_log(out)[1]) == list(range(6))
    assert [h["resumed_from"] for h in headers(out)] == [None, 3, 5]


def test_a_preset_is_found_where_typed_then_beside_train_gpt2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # another working directory: @configs/... is the repository's
    message = user_error(["@laptp.txt"])
    assert message.startswith("@laptp.txt: no such preset file")
    listed = re.findall(r"@configs/\w+\.txt", message)
    assert "@configs/laptop.txt" in listed and all(parsed(preset) for preset in listed)  # each works from here
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "laptop.txt").write_bytes("\ufeff--max-steps 7\n".encode())  # Notepad's: a BOM first
    assert parsed("@configs/laptop.txt")["max_steps"] == 7  # the user's own, where typed, first


def test_a_flags_value_is_never_a_preset(tmp_path):
    preset = tmp_path / "mine.txt"
    preset.write_text("--prompt '@alice said hi'\n")
    for argv in (["--prompt", "@alice said hi"], ["--prompt=@alice said hi"], [f"@{preset}"]):
        assert parsed(*argv)["prompt"] == "@alice said hi"
    assert parsed("--resume", f"@{preset}")["prompt"] == "@alice said hi"  # --resume's value is optional


@pytest.mark.parametrize(
    "line, words",
    [
        ("--n-layr 4", ["--n-layr is not a flag of train_gpt2.py", "did you mean --n-layer?"]),
        ("--max-steps many", ["argument --max-steps: invalid int value: 'many'"]),
        ("--prompt 'unclosed", ["No closing quotation", "close the quote"]),
        ("--n-layer 2 \\", ["ends in \\: one flag a line, no continuation"]),  # a shell's continuation
        ("--prompt café", ["byte 0xe9 is not UTF-8: save it as UTF-8"]),  # Latin-1
    ],
)
def test_a_wrong_line_names_the_file_the_line_and_the_fix(tmp_path, line, words):
    preset = tmp_path / "mine.txt"
    preset.write_bytes(f"# my run\n--n-layer 2\n\n{line}\n".encode("latin-1"))
    message = user_error([f"@{preset}"])
    assert message.startswith(f"{preset}, line 4: ") and "\n" not in message
    assert all(w in message for w in words), message

"""support/shards.py, mostly through real runs of train_gpt2.py: the GPT-2 tokenizer the shards
hold ids of, and its vocab.bpe missing or damaged in every script that tokenizes; a shard
passed as the data folder; shards that are truncated or have a wrong header, and shards
memory-mapped; every shard smaller than one batch; token ids past the model's vocabulary (each
shard's first ids at start), and in every batch and the val set as they are read
(an id past a shard's first 1,024 tokens); a folder fineweb.py has not finished, refused naming the
command that finishes it, or whose manifest lists shards missing; and a checkpoint continued only
on the shards its run started on (moved shards are the same data). Each refusal is one line before
step 0."""

import json
import os
import shlex
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import tiktoken

import fineweb
import support.shards
import train_gpt2
from helpers import (
    ROOT,
    UNICODE_TEXTS,
    as_typed,
    assert_one_line_error,
    cli,
    fineweb_killed_after,
    fineweb_stopped_after,
    headers,
    random_shards,
    read_log,
    snapshot,
    tiny_args,
    user_error,
    write_shard,
)
from support.cli import UserError
from support.shards import ShardFile, load_shard
from train_gpt2 import DataLoaderLite

# ----------------------------------------------------------------------------------------------
# The tokenizer


def test_tokenizer_is_tiktokens_gpt2(enc, assets):
    """The shipped vocab.bpe's tokenizer is tiktoken's gpt2: every token, texts both ways, and
    <|endoftext|> where special tokens are allowed."""
    reference = tiktoken.get_encoding("gpt2")  # from GPT-2's published files (conftest's tiktoken_cache)
    assert (enc.n_vocab, enc.eot_token, enc.max_token_value) == (reference.n_vocab, reference.eot_token, 50256)
    assert [enc.decode_single_token_bytes(i) for i in range(enc.n_vocab)] == [
        reference.decode_single_token_bytes(i) for i in range(reference.n_vocab)
    ]
    texts = [assets.shakespeare.read_text(), *UNICODE_TEXTS]
    texts += pq.read_table(assets.fineweb, columns=["text"]).column("text").to_pylist()
    assert len(texts) == 1 + len(UNICODE_TEXTS) + 100
    ours = enc.encode_ordinary_batch(texts)
    assert ours == reference.encode_ordinary_batch(texts)
    assert [enc.decode(ids) for ids in ours] == texts
    special = "a<|endoftext|>b <|endoftext|>"
    assert enc.encode(special, allowed_special="all") == reference.encode(special, allowed_special="all")
    assert enc.encode_ordinary(special) == reference.encode_ordinary(special)


SCRIPTS_THAT_TOKENIZE = {
    "sample.py": ["{ckpt}", "--num-samples", 1, "--max-new-tokens", 2],
    "export_hf.py": ["{ckpt}", "{tmp}/hf"],
    "hellaswag.py": ["-m", "{ckpt}", "--limit", 2, "--data", ROOT / "tests/assets/hellaswag_val_450.jsonl"],
    "fineweb.py": ["--input", ROOT / "data/tinyshakespeare.txt", "--out-dir", "{tmp}/shards"],
    "train_gpt2.py": [*tiny_args("{data}", "{tmp}/run"), "--sample-every", 3],
}


@pytest.mark.parametrize(
    "script, damage",
    [(script, "missing") for script in SCRIPTS_THAT_TOKENIZE]
    + [("sample.py", "cut mid-line"), ("sample.py", "cut at a line's end")],
)
def test_a_missing_or_damaged_vocab_bpe_is_one_line_naming_it_and_the_checkout(
    short_run, tmp_path, monkeypatch, script, damage
):
    """Every script that tokenizes, with support/gpt2_bpe/vocab.bpe deleted or cut short: one line naming
    the file and the git command that restores it, before anything is written."""
    text = (ROOT / "support" / "gpt2_bpe" / "vocab.bpe").read_text(encoding="utf-8")
    bpe = tmp_path / "gpt2_bpe" / "vocab.bpe"
    bpe.parent.mkdir()
    if damage != "missing":
        bpe.write_text(text[: len(text) // 2] if damage == "cut mid-line" else "".join(text.splitlines(True)[:40000]))
    monkeypatch.setattr(support.shards, "GPT2_BPE", str(bpe))
    support.shards.get_tokenizer.cache_clear()  # built again from the file below; a failure is not cached
    (tmp_path / "work").mkdir()
    fill = {"ckpt": short_run[1] / "ckpt_000002.pt", "tmp": tmp_path / "work", "data": short_run[0]}
    r = cli(*(str(a).format(**fill) for a in SCRIPTS_THAT_TOKENIZE[script]), script=script)
    assert_one_line_error(r, str(bpe), "is missing or damaged", f"cd {ROOT} && git checkout -- support/gpt2_bpe")
    assert "Traceback" not in r.stderr and os.listdir(tmp_path / "work") == []


# ----------------------------------------------------------------------------------------------
# Finding and reading the shards


def test_max_shards_1_says_there_is_no_train_shard_and_how_to_add_one(tmp_path, capsys, assets):
    data = fineweb_of(tmp_path, assets, 20000, 2000, "data", "--max-shards", "1")
    note = capsys.readouterr().err.strip().splitlines()[-1]
    assert note.startswith("note: there is no train shard: all 2,000 tokens are in the val shard edufineweb_val_000000")
    assert note.endswith("run it again with --max-shards 2 (it adds a train shard)")
    args = tiny_args(data, tmp_path / "out", "--max-steps", 1, "--eval-every", 0)
    assert user_error(args).startswith(f"no train shards (*_train_NNNNNN.npy or .bin) in {data}")
    fineweb_of(tmp_path, assets, 20000, 2000, "data", "--max-shards", "2")
    assert train_gpt2.main(args) == 0  # the note's advice


def test_a_shard_as_data_dir_names_its_folder_and_that_command_works(tmp_path):
    data = random_shards(tmp_path / "data")
    args = tiny_args(data / "rand_train_000001.npy", tmp_path / "out", "--max-steps", 1, "--eval-every", 0)
    msg = user_error(args)
    assert msg.startswith(f"--data-dir {data / 'rand_train_000001.npy'} is a token shard, not the folder")
    advice = msg.split("pass the folder that holds it, ")[1]
    assert advice == f"--data-dir {data}"
    fixed = args[: args.index("--data-dir")] + shlex.split(advice) + args[args.index("--data-dir") + 2 :]
    assert train_gpt2.main([str(a) for a in fixed]) == 0  # the advice, as given, runs


@pytest.mark.parametrize(
    "name, damage, said",
    [
        (
            "x_train_000001.bin",
            lambda raw: b"\x00" * 4 + raw[4:],
            "not an llm.c token shard (its header does not start",
        ),
        ("x_train_000001.bin", lambda raw: raw[: 1024 + 1800], "cannot read this token shard"),  # header: 1,000
        ("x_train_000001.npy", lambda raw: raw[:-100], "cannot read this token shard"),  # header: 1,000
    ],
    ids=["bad-header", "bin-cut-short", "npy-cut-short"],
)
def test_a_damaged_shard_is_one_line_naming_it(tmp_path, name, damage, said):
    write_shard(tmp_path / name, np.arange(1000))
    (tmp_path / name).write_bytes(damage((tmp_path / name).read_bytes()))
    with pytest.raises(UserError) as e:
        DataLoaderLite(str(tmp_path), "train", 2, 8)
    assert str(e.value).startswith(f"{tmp_path / name}: {said}") and "\n" not in str(e.value)


def test_shards_are_memory_mapped(tmp_path):
    write_shard(tmp_path / "s_train_000001.npy", np.arange(1000))
    write_shard(tmp_path / "s_train_000002.bin", np.arange(1000))
    for name in ("s_train_000001.npy", "s_train_000002.bin"):
        tokens = load_shard(str(tmp_path / name))
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
        assert np.array_equal(tokens, np.arange(1000))
        # the loader's: read from the file, a slice at a time
        shard = ShardFile(str(tmp_path / name))
        assert len(shard) == 1000 and np.array_equal(shard[990:1005], np.arange(990, 1000))


def test_a_shard_cut_short_while_the_run_reads_it_is_one_line_not_a_bus_error(tmp_path):
    write_shard(tmp_path / "s_train_000001.npy", np.arange(100_000) % 50257)
    loader = DataLoaderLite(str(tmp_path), "train", 4, 64, shuffle=False)
    loader.next_batch()
    os.truncate(loader.path, 4096)  # in place, under the run: a read through a memory map would SIGBUS
    with pytest.raises(UserError, match=r"s_train_000001.npy was cut short while this run read it \(100,000 tokens "):
        while True:
            loader.next_batch()


def test_shards_smaller_than_one_batch_name_the_largest_and_the_fix(tmp_path):
    # 150 tokens in all, but a batch (B 2 x T 32, + 1 for the targets: 65) is cut from one shard
    data = random_shards(tmp_path / "data", train_lengths=(40, 50, 60))
    msg = user_error(tiny_args(data, tmp_path / "out", "-T", 32))
    assert "the largest train shard" in msg and "holds 60 tokens, fewer than the 65" in msg
    assert "--shard-size" in msg and "--batch-size" in msg


# ----------------------------------------------------------------------------------------------
# Token ids below the model's vocabulary: a shard's first ones at start


def test_token_ids_outside_the_vocab(tmp_path):
    data = random_shards(tmp_path / "data")
    put_id(data / "rand_train_000002.npy", 50400, 123)  # fits in uint16, but the model's embedding has 50304 rows
    msg = user_error(tiny_args(data, tmp_path / "out"))
    assert "rand_train_000002.npy" in msg and "50400" in msg and "50304" in msg
    assert not (tmp_path / "out" / "log.jsonl").exists()


def fineweb_of(tmp_path, assets, chars, shard_size, name, *flags):
    """fineweb.py's shards of the first chars characters of tiny shakespeare, in tmp_path / name."""
    text = tmp_path / "input.txt"
    text.write_text(assets.shakespeare.read_text()[:chars])
    out = tmp_path / name
    fineweb.main(
        ["--input", str(text), "--out-dir", str(out), "--shard-size", str(shard_size), "--workers", "1", *flags]
    )
    return out


def manifest_shards(folder):
    return json.loads((folder / "edufineweb_manifest.json").read_text())["shards"]


# ----------------------------------------------------------------------------------------------
# Data is checked where it is read, not only where it is sampled: every batch's ids, and the val set's


@pytest.fixture
def big_shards(tmp_path, assets):
    """fineweb.py's shards of 40,000 tokens."""
    return fineweb_of(tmp_path, assets, 300_000, 40_000, "big")


def put_id(path, token_id, position=1500):
    """token_id at position of the shard at path (by default past its first 1,024 ids, which the start checks)."""
    tokens = np.load(path)
    tokens[position] = token_id
    np.save(path, tokens)
    return position


@pytest.mark.parametrize("token_id, refused", [(50303, False), (50304, True), (65535, True)])
def test_every_batch_is_checked_up_to_the_last_id_of_the_vocabulary(big_shards, token_id, refused):
    path = big_shards / manifest_shards(big_shards)[1]["file"]  # the first train shard, of 40,000 tokens
    at = put_id(path, token_id)
    loader = DataLoaderLite(str(big_shards), "train", 4, 64, shuffle=False, vocab_size=50304)  # the start passes
    batches = range(loader.batches_per_epoch)
    if not refused:
        assert max(int(loader.next_batch()[0].max()) for _ in batches) == 50303
        return
    with pytest.raises(UserError) as e:
        for _ in batches:
            loader.next_batch()
    assert str(e.value).startswith(f"{path} holds token id {token_id} at position {at:,}, past --vocab-size 50304")
    assert loader.pos <= at <= loader.pos + 256  # stopped at the batch that holds it (its targets too)


@pytest.mark.parametrize("position", [0, 1500, 4095])
def test_a_bad_id_in_the_val_set_is_refused_naming_its_position(big_shards, tmp_path, position):
    path = big_shards / "edufineweb_val_000000.npy"
    at = put_id(path, 60000, position)
    msg = user_error(tiny_args(big_shards, tmp_path / "out", "--val-tokens", 4096))
    assert msg.startswith(f"{path} holds token id 60000 at position {at:,}, past --vocab-size 50304")
    assert not (tmp_path / "out" / "log.jsonl").exists()


# ----------------------------------------------------------------------------------------------
# A manifest is believed only for the shards it lists that are on disk


@pytest.mark.parametrize("kept", [0, 1, 3])
def test_a_manifest_copied_into_a_half_written_folder_is_not_finished(tmp_path, assets, kept):
    fineweb_folder = fineweb_of(tmp_path, assets, 200_000, 20_000, "shards")
    listed = manifest_shards(fineweb_folder)
    assert len(listed) > 3
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(fineweb_folder / "edufineweb_manifest.json", half)
    for shard in listed[:kept]:
        shutil.copy(fineweb_folder / shard["file"], half)
    r = cli(*tiny_args(half, tmp_path / "out", "--max-steps", 2))
    missing = len(listed) - kept
    assert_one_line_error(
        r,
        f"--data-dir {half} is not whole",
        f"lists {listed[kept]['file']}, which is not there",
        f"({missing} of its {len(listed)} shards are missing): copy the folder again",
    )
    shutil.rmtree(half)
    shutil.copytree(fineweb_folder, half)  # the advice
    assert DataLoaderLite(str(half), "train", 2, 8, vocab_size=50304).batches_per_epoch > 0


# ----------------------------------------------------------------------------------------------
# Data is finished only if fineweb.py said so


@pytest.mark.parametrize("stop", [[], ["--max-tokens", "7000"], ["--max-shards", "3"]])
@pytest.mark.parametrize("how", ["Ctrl-C", "SIGKILL"])
def test_the_command_that_finishes_a_folder_stops_where_its_run_was_asked_to(tmp_path, assets, monkeypatch, stop, how):
    shards, out, tiny_text = tmp_path / "shards", tmp_path / "run", tmp_path / "tiny.txt"
    tiny_text.write_text(assets.shakespeare.read_text()[:40000])
    args = ["--input", str(tiny_text), "--out-dir", str(shards), "--shard-size", "2000", "--workers", "1", *stop]
    if how == "Ctrl-C":  # the manifest made whole as the run stops
        fineweb_stopped_after(monkeypatch, 2, args)  # after 2 of the shards it was asked for
    else:  # the manifest as the last finished shard left it
        fineweb_killed_after(2, args)
    before = snapshot(tmp_path)
    r = cli(*tiny_args(shards, out, "--max-steps", 2))
    line = assert_one_line_error(r, f"--data-dir {shards} is unfinished", "fineweb.py has not written all")
    assert snapshot(tmp_path) == before and not out.exists()
    command = line.split("`")[1]  # the run's own command, from the folder it ran in
    where = str(ROOT) if how == "SIGKILL" else os.getcwd()
    script = os.path.relpath(fineweb.__file__, where)
    assert command == f"cd {shlex.quote(where)} && " + shlex.join(["python", script, *args])
    done = as_typed(command)  # its `python` is the one running the tests, whatever is first on PATH
    assert done.returncode == 0, done.stderr
    asked = tmp_path / "asked"  # the run as it was asked, uninterrupted: the same files
    summary = fineweb.main([*args[:3], str(asked), *args[4:]])
    assert summary["complete"] == (not stop) and (not stop or summary["tokens"] in (6000, 7000))
    names = sorted(p.name for p in asked.iterdir())
    assert sorted(p.name for p in shards.iterdir()) == names
    manifest = lambda folder: {**json.loads((folder / "edufineweb_manifest.json").read_text()), "command": None}  # noqa: E731
    assert manifest(shards) == manifest(asked)  # its own command, with its own --out-dir, aside
    assert all((shards / n).read_bytes() == (asked / n).read_bytes() for n in names if n.endswith(".npy"))
    assert train_gpt2.main(tiny_args(shards, out, "--max-steps", 2, "--eval-every", 0)) == 0


# ----------------------------------------------------------------------------------------------
# A run's data is the data it started on


@pytest.fixture
def run_on(tmp_path):
    """(data folder, run folder) of 2 steps on its own random shards, checkpoints at 1 and 2."""
    data = random_shards(tmp_path / "data", train_lengths=(600, 600), val_length=600, seed=3)
    out = tmp_path / "run"
    assert train_gpt2.main(tiny_args(data, out, "--max-steps", 2, "--ckpt-every", 1, "--eval-every", 0)) == 0
    return data, out


def regenerate(data, lengths, val_length=600, seed=3):
    shutil.rmtree(data)
    random_shards(data, train_lengths=lengths, val_length=val_length, seed=seed)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: regenerate(d, (700, 500)), "rand_train_000001.npy is rewritten"),
        (lambda d: regenerate(d, (600, 600), seed=4), "rand_train_000001.npy is rewritten"),
        (lambda d: regenerate(d, (600, 600, 600)), "rand_train_000003.npy is new"),
        (lambda d: (d / "rand_train_000002.npy").unlink(), "rand_train_000002.npy is missing"),
        (lambda d: write_shard(d / "rand_val_000000.npy", range(900)), "rand_val_000000.npy is rewritten"),
    ],
    ids=["another-shard-size", "other-tokens", "a-shard-added", "a-shard-removed", "another-val-set"],
)
def test_resume_on_other_data_is_refused_naming_the_first_shard(run_on, change, words):
    data, out = run_on
    change(data)
    before = snapshot(out)
    line = user_error(tiny_args(data, out, "--max-steps", 4, "--resume"))
    assert f"--data-dir {data} is not the data " in line and words in line
    assert f"--init-from {out / 'ckpt_000002.pt'} in a new --out-dir" in line
    assert snapshot(out) == before
    # the way out it names: a new run from those weights, on the data as it is now
    fresh = out.parent / "fresh"
    assert train_gpt2.main(tiny_args(data, fresh, "--max-steps", 2, "--init-from", out / "ckpt_000002.pt")) == 0
    assert headers(fresh)[0]["config"]["init_from"] == str(out / "ckpt_000002.pt")


def test_the_same_shards_in_another_folder_are_the_same_data(run_on, tmp_path):
    data, out = run_on
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    shutil.rmtree(data)
    assert train_gpt2.main(tiny_args(moved, out, "--max-steps", 4, "--resume")) == 0
    assert sorted(read_log(out)[1]) == [0, 1, 2, 3]

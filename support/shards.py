"""Token shards on disk, torch-free (numpy and tiktoken): the GPT-2 tokenizer they hold ids of, their
format and names (fineweb.py writes them, train_gpt2.py reads them), and the checks a run
makes on them before step 0 (finished, ids below the vocabulary, the same data a checkpoint was
trained on), and on every batch's ids as it is read (check_batch_ids)."""

import functools
import hashlib
import itertools
import json
import os
import re
import shlex

import numpy as np
import tiktoken

from support.cli import UserError, first_line, same_on_every_rank
from support.files import write_atomic

EOT = 50256  # <|endoftext|>: every document starts with it
GPT2_VOCAB = 50257  # real GPT-2 vocabulary; ids >= this are padding and are never sampled

# --- the tokenizer: GPT-2's, built from OpenAI's vocab.bpe, shipped in support/gpt2_bpe/ -------------
GPT2_BPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_bpe", "vocab.bpe")
# GPT-2's split of text into the pieces BPE encodes apart (contractions, letters, digits, other
# symbols, each with one leading space; runs of spaces) as its encoder.py writes it, with possessive
# quantifiers (++), which give back nothing they matched, and a last \s for its \s+, which can only
# match one space there: the same pieces, found faster
GPT2_SPLIT = r"""'(?:s|t|re|ve|m|ll|d)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s+(?!\S)|\s"""


def byte_stand_ins():
    """GPT-2's printable stand-in for each byte, which vocab.bpe (and vocab.json) spell tokens with:
    the 188 bytes that print as a Latin-1 character keep it, the other 68 (controls, space, soft
    hyphen, ...) take chr(256), chr(257), ... in byte order."""
    others = itertools.count(256)
    return [chr(b) if chr(b).isprintable() and b != ord(" ") else chr(next(others)) for b in range(256)]


def read_gpt2_bpe():
    """GPT-2's byte-pair tokens from the shipped vocab.bpe: ({spelling: token bytes} in id order, the
    merges as (first, second) spellings), a spelling being the token's bytes in stand-in characters.
    Ids 0-255 are the bytes in their stand-ins' order (the printable ones first), and the i-th merge
    of the file makes token 256 + i, the two spellings joined."""
    chars = byte_stand_ins()
    tokens = {chars[b]: bytes([b]) for b in sorted(range(256), key=chars.__getitem__)}
    try:  # missing, cut short or edited: every script that tokenizes stops here, in one line
        with open(GPT2_BPE, encoding="utf-8") as f:
            words = f.read().split()  # "#version: 0.2", then a pair a line; no stand-in is a space
        merges = list(zip(words[2::2], words[3::2], strict=True))
        for first, second in merges:
            tokens[first + second] = tokens[first] + tokens[second]
        if len(tokens) != EOT:
            raise ValueError(f"{len(tokens)} tokens, not {EOT}")
    except (OSError, ValueError, KeyError) as e:
        why = e.strerror if isinstance(e, OSError) else first_line(e)
        root = shlex.quote(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        raise UserError(
            f"{GPT2_BPE} is missing or damaged ({why}): restore it with cd {root} && git checkout -- support/gpt2_bpe"
        ) from None
    return tokens, merges


@functools.cache
def get_tokenizer():
    """GPT-2's tokenizer (tiktoken's "gpt2", the same ids), built from the shipped vocab.bpe: no
    download, no cache folder, offline as online; <|endoftext|> is id 50256."""
    tokens, _ = read_gpt2_bpe()
    ranks = {token: rank for rank, token in enumerate(tokens.values())}
    return tiktoken.Encoding(
        "gpt2",
        pat_str=GPT2_SPLIT,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=EOT + 1,
    )


# --- the format ----------------------------------------------------------------------------------
# .npy: np.save of a 1-D uint16 array. .bin: llm.c / modded-nanogpt's format, a header of 256
# int32 (magic, version, token count, zeros) and then the uint16 tokens.
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
MAX_VOCAB_SIZE = 2**16  # token shards hold uint16 ids: a larger vocabulary has rows no token can reach


def write_shard(path, tokens, fmt="npy"):
    """tokens (uint16) as one shard file, written atomically."""
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    if fmt == "bin":
        write_atomic(path, lambda f: f.writelines([header.tobytes(), tokens.astype("<u2", copy=False).data]))
    else:
        write_atomic(path, lambda f: np.save(f, tokens))


def load_shard(path):
    """The tokens of one .npy or .bin shard as a read-only, memory-mapped uint16 array: pages are read
    from disk only where they are looked at, so the checks of every shard at start stay cheap."""
    try:
        if path.endswith(".bin"):
            header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)
            if len(header) < SHARD_HEADER_INTS or list(header[:2]) != [SHARD_MAGIC, SHARD_VERSION]:
                raise UserError(f"{path}: not an llm.c token shard (its header does not start {SHARD_MAGIC}, 1)")
            # a file shorter than its header says fails to map: one line below
            return np.memmap(path, dtype=np.uint16, mode="r", offset=SHARD_HEADER_INTS * 4, shape=(int(header[2]),))
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f"{path}: cannot read this token shard ({first_line(e)}): rewrite it with fineweb.py") from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise UserError(f"{path}: a token shard is a 1-D uint16 array, this one is {tokens.ndim}-D {tokens.dtype}")
    return tokens


class ShardFile:
    """A token shard the loader trains on, held open and read a slice at a time (shard[a:b] is a uint16
    array), not memory-mapped: it reads the file as it was opened, so a shard renamed over it (a
    fineweb.py rerun into the folder) is not read, and a file cut short under it is one line, where
    a read through a map would die of SIGBUS."""

    def __init__(self, path):
        tokens = load_shard(path)  # its checks; its length and where its tokens start
        self.path, self.offset, self.length = path, getattr(tokens, "offset", 0), len(tokens)
        self.file = open(path, "rb")  # closed with the object: the loader drops it at its next shard

    def __len__(self):
        return self.length

    def __getitem__(self, index):  # a slice, as the loader takes them
        start, stop, _ = index.indices(self.length)
        self.file.seek(self.offset + 2 * start)
        data = self.file.read(2 * max(0, stop - start))
        if len(data) < 2 * max(0, stop - start):  # truncated in place under the run
            raise UserError(
                f"{self.path} was cut short while this run read it ({self.length:,} tokens when opened): restore "
                f"it (rerun the fineweb.py that wrote it), then continue with --resume"
            )
        return np.frombuffer(data, dtype=np.uint16)


# --- the names: {prefix}_{split}_{index}.npy (or .bin), shard 0 the val split -------------------

SHARD_NAME = re.compile(r".+_(train|val)_\d+\.(npy|bin)")  # what find_shards reads


def shard_path(out_dir, prefix, index, fmt="npy"):
    """Where fineweb.py writes shard `index` of a folder."""
    split = "val" if index == 0 else "train"  # shard 0 is held out for validation
    return os.path.join(out_dir, f"{prefix}_{split}_{index:06d}.{fmt}")


def find_shards(data_dir, split, required=False):
    """The {prefix}_{split}_{index}.npy (or .bin) shards in data_dir, in name order."""
    if os.path.isfile(data_dir) and os.path.splitext(data_dir)[1] in (".npy", ".bin"):  # one shard
        raise UserError(
            f"--data-dir {data_dir} is a token shard, not the folder of shards: pass the folder that holds it, "
            f"--data-dir {shlex.quote(os.path.dirname(data_dir) or '.')}"
        )
    if os.path.isfile(data_dir):  # a text file where the folder of shards goes
        raise UserError(
            f"--data-dir {data_dir} is a file, not a folder of shards: pass the folder that holds the "
            f"shards, or tokenize a text file with `python fineweb.py --input {data_dir} --out-dir DIR` "
            f"and pass --data-dir DIR"
        )
    if not os.path.isdir(data_dir):
        raise UserError(f"data folder {data_dir} does not exist: write shards with fineweb.py or pass --data-dir")
    check_fineweb_finished(data_dir)
    names = sorted(n for n in os.listdir(data_dir) if (m := SHARD_NAME.fullmatch(n)) and m.group(1) == split)
    if required and not names:
        raise UserError(
            f"no {split} shards (*_{split}_NNNNNN.npy or .bin) in {data_dir}: write them with `python fineweb.py` "
            f"or pass --data-dir"
        )
    return [os.path.join(data_dir, n) for n in names]


def shard_fingerprint(path, blocks=16, block=4096):
    """[name, bytes, digest] of a token shard: its size and a blake2b of its first and last
    `block` bytes (the header and the first tokens) and of `blocks` blocks spread evenly between.
    About 70 KB read whatever the shard's size: cheap enough for every start to check them all."""
    size, digest = os.path.getsize(path), hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:  # seek and read: os.pread is POSIX only
        last = max(0, size - block)
        for i in range(blocks + 2):
            f.seek(last * i // (blocks + 1))
            digest.update(f.read(block))
    return [os.path.basename(path), size, digest.hexdigest()]


# --- the checks a run makes on them --------------------------------------------------------------


def check_fineweb_finished(data_dir):
    """A folder whose fineweb.py manifest says it is unfinished (fineweb.py still writing it, or
    stopped by a kill or an error) is refused, naming the command that finishes it: a run would
    train on what is there, and could not be resumed once fineweb.py adds the rest. A stop at
    --max-tokens / --max-shards is finished as asked. A manifest that lists a shard not there (a
    copy cut short) is refused too. Shards with no manifest (llm.c's, the user's own) are not
    fineweb.py's to judge, nor is a *_manifest.json that is not fineweb.py's."""
    for name in sorted(n for n in os.listdir(data_dir) if n.endswith("_manifest.json")):
        path = os.path.join(data_dir, name)
        try:
            with open(path, encoding="utf-8") as f:
                manifest = json.load(f)
            command, listed = manifest["command"], [os.path.join(data_dir, s["file"]) for s in manifest["shards"]]
        except (OSError, ValueError, KeyError, TypeError):  # another program's (fineweb.py's are written whole)
            continue
        if not (manifest.get("complete") or manifest.get("limit") is not None):
            raise UserError(
                f"--data-dir {data_dir} is unfinished: its {name} says fineweb.py has not written all of its "
                f"input (it is still writing, or it was stopped); finish it with `{command}` (or wait for the "
                f"fineweb.py writing it), then start the run"
            )
        missing = [shard for shard in listed if not os.path.isfile(shard)]
        if missing:
            raise UserError(
                f"--data-dir {data_dir} is not whole: its {name} lists {os.path.basename(missing[0])}, which is not "
                f"there ({len(missing)} of its {len(listed)} shards are missing): copy the folder again from "
                f"where fineweb.py wrote it"
            )


def check_batch_fits(batches_per_epoch, sizes, chunk, data_dir, split):
    """A batch is cut from one shard, never across two: at least one shard must hold one."""
    if batches_per_epoch == 0:
        raise UserError(
            f"the largest {split} shard in {data_dir} holds {max(sizes):,} tokens, fewer than the "
            f"{chunk + 1:,} that one batch (B*T*world_size + 1) needs: lower --batch-size or --seq-len, "
            f"or write bigger shards (fineweb.py --shard-size)"
        )


def data_identity(data_dir):
    """What a run's data is: {split: [fingerprint of each shard, in name order]} for train and val."""
    return {split: [shard_fingerprint(p) for p in find_shards(data_dir, split)] for split in ("train", "val")}


def check_same_data(saved, now, ckpt_path, data_dir):
    """A checkpoint continues only on the data its run started on (data_identity): shards written
    again (another --shard-size, other input), added or removed would put its data position in
    other tokens, and change the val set under it. Refused, naming the first shard that differs."""
    for split in ("train", "val"):
        was = {name: (size, digest) for name, size, digest in saved.get(split, [])}
        is_ = {name: (size, digest) for name, size, digest in now.get(split, [])}
        for name in sorted(n for n in set(was) | set(is_) if was.get(n) != is_.get(n)):  # raised at the first
            what = "missing" if name not in is_ else "new" if name not in was else "rewritten (other bytes)"
            raise same_on_every_rank(
                UserError(
                    f"--data-dir {data_dir} is not the data {ckpt_path} was trained on: {name} is {what}; resume on "
                    f"the run's own shards, or start a new run from its weights with --init-from {ckpt_path} in a "
                    f"new --out-dir"
                )
            )


def check_batch_ids(tokens, vocab_size, path, start):
    """The tokens a batch (or the val set) reads, from position `start` of the shard at path, returned
    as they are once no id in them is past the vocabulary: the start reads only each shard's first
    ids, and an id past it would crash the step (an IndexError, a device assert on CUDA, hours in).
    A max over B*T uint16 ids on the CPU: next to nothing (benchmarks/loader.py times it)."""
    if vocab_size is None or not len(tokens) or int(tokens.max()) < vocab_size:
        return tokens
    at = int(np.argmax(tokens >= vocab_size))
    raise UserError(
        f"{path} holds token id {int(tokens[at])} at position {start + at:,}, past --vocab-size {vocab_size}: "
        f"the shard is damaged or from another tokenizer; rerun fineweb.py into a new folder"
    )

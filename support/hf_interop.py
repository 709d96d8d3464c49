"""transformers' GPT-2: names it may fetch, folders an export may replace, its weight layout (state
dict in, state dict out, or its GPT2LMHeadModel built from a name, a folder or our checkpoint), and
GPT-2's tokenizer files written from the shipped vocab.bpe."""

import contextlib
import json
import os
import pickle
import re
import shutil

import torch

from support.cli import UserError, first_line
from support.files import UNFINISHED, existing_part, write_dir_atomic
from support.offline import hub_offline
from support.shards import GPT2_BPE, GPT2_VOCAB, get_tokenizer, read_gpt2_bpe

HF_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
EXPORT_MARK = "export_hf.py"  # config.json's "exported_by": a folder an export may replace


# everything an export writes: save_pretrained's files for a GPT2LMHeadModel (shards and their index
# for big models), GPT-2's vocab.json and merges.txt, and what a tokenizer's save_pretrained adds
# (transformers 4 writes special_tokens_map.json too)
EXPORT_FILES = re.compile(
    r"config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?"
    r"|vocab\.json|merges\.txt|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|\.unfinished_export"
)


HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


TIED = ("transformer.wte.weight", "lm_head.weight")  # one tensor; its padding rows are not exported


def hub_name_is_cached(name):
    """The local Hugging Face cache holds the config and the weights of Hub model `name`."""
    from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415  0.1 s to import: only Hub model names need it

    def cached(filename):
        return isinstance(try_to_load_from_cache(name, filename), str)  # else None or "known missing"

    return cached("config.json") and (cached("model.safetensors") or cached("pytorch_model.bin"))


def check_hub_reachable(name):
    """Refuse at once, in one line, to fetch `name` (not in the local cache) when offline use is
    set or the Hub does not answer: transformers would retry for half a minute, then not say why."""
    hub, reason = hub_offline(("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if reason:
        raise UserError(
            f"{name!r} is not in the local Hugging Face cache and the Hub ({hub}) cannot be asked ({reason}): pass a "
            f"local transformers GPT-2 directory instead (save_pretrained output, or export_hf.py's), or fill the "
            f"cache once online"
        )


class _Writable(Exception):
    """Raised where the export starts to write: write_dir_atomic removes what it made, as on any failure."""


def _stop_writing(tmp):
    raise _Writable


def check_export_target(out_dir):
    """The absolute folder an export may write: a new one, an empty one, or an earlier export (only
    save_pretrained's plain files, config.json marked EXPORT_MARK), which is replaced."""
    given = str(out_dir)
    if not given:  # not the current folder: a name left empty by mistake
        raise UserError("DIR '' names no folder: name the folder to write, e.g. python export_hf.py CKPT gpt2_ours")
    if os.path.islink(given) and not os.path.exists(given):
        raise UserError(f"export target {given} is a symbolic link to nothing: name a new folder")
    out_dir = os.path.realpath(given)  # a link to an earlier export: replace that folder, keep the link
    found = existing_part(out_dir)
    if not os.path.isdir(found):
        example = os.path.splitext(found)[0] + "_hf"
        raise UserError(f"export target {given}: {found} is a file, not a folder: name a new folder, e.g. {example}")
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    foreign = [
        n
        for n in names
        if not (EXPORT_FILES.fullmatch(n) and os.path.isfile(p := os.path.join(out_dir, n)) and not os.path.islink(p))
    ]
    if names and not foreign and UNFINISHED not in names:  # an earlier export says so in its config.json
        try:
            with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
                ours = json.load(f).get("exported_by") == EXPORT_MARK
        except (OSError, ValueError, AttributeError):  # unreadable, not JSON, or not a JSON object
            ours = False
        if not ours:
            foreign = ["a transformers model (its config.json has no exported_by mark)"]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise UserError(
            f"export target {given} is not empty and not an earlier export (it holds {foreign[0]}{more}): "
            f"name a new or empty folder; nothing was changed"
        )
    with contextlib.suppress(_Writable):  # tried, not guessed: its hidden folder made where the export writes
        write_dir_atomic(out_dir, _stop_writing, "the export")
    return out_dir


def check_state_dict(shapes, state_dict, source):
    """state_dict holds exactly the keys of shapes ({key: shape}), each with its shape: weights
    that do not fit a model are refused in one line naming the first key that differs."""
    missing, extra = sorted(set(shapes) - set(state_dict)), sorted(set(state_dict) - set(shapes))
    if missing or extra:
        what = f"key {missing[0]} is missing" if missing else f"unexpected key {extra[0]}"
        more = len(missing) + len(extra) - 1
        raise UserError(f"{source}: {what}" + (f" ({more} more keys differ)" if more else "") + ": not a GPT-2 of ours")
    for key, shape in shapes.items():
        if tuple(state_dict[key].shape) != tuple(shape):
            raise UserError(f"{source}: {key} has shape {tuple(state_dict[key].shape)}, expected {tuple(shape)}")


def state_dict_from_hf(sd_hf):
    """transformers' GPT-2 state dict in our layout: Conv1D weights transposed, the causal-mask
    buffers (not weights) dropped. Key names are the same in both."""
    skip = (".attn.bias", ".attn.masked_bias")
    return {k: v.t().contiguous() if k.endswith(HF_TRANSPOSED) else v for k, v in sd_hf.items() if not k.endswith(skip)}


def state_dict_to_hf(sd, vocab_size=GPT2_VOCAB):
    """Our state dict in transformers' layout, fp32 on the CPU: Conv1D weights transposed, the vocab
    cut to vocab_size rows (an export's GPT-2 50,257: the padding rows were never a token)."""
    out = {}
    for k, v in sd.items():
        v = v.detach().float().cpu()
        v = v.t().contiguous() if k.endswith(HF_TRANSPOSED) else v
        out[k] = v[:vocab_size] if k in TIED else v
    return out


def load_hf_model(name_or_dir):
    """transformers' GPT2LMHeadModel of OpenAI GPT-2 (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or of
    a local transformers GPT-2 directory (save_pretrained output), with SDPA attention (which takes
    the boolean masks of hellaswag.py's packed rows). A name not in the local cache is refused at
    once when offline; weights missing from the files are refused, not filled with random numbers."""
    is_dir = os.path.isdir(name_or_dir)  # else one of HF_NAMES (the scripts ask find_model first)
    local_only = not is_dir and hub_name_is_cached(name_or_dir)
    if not is_dir and not local_only:
        check_hub_reachable(name_or_dir)
    from transformers import GPT2LMHeadModel  # noqa: PLC0415  2 s to import: after the checks, which then answer at once

    try:
        hf, info = GPT2LMHeadModel.from_pretrained(
            name_or_dir, output_loading_info=True, local_files_only=local_only, attn_implementation="sdpa"
        )
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load transformers GPT-2 from {name_or_dir!r}: {first_line(e)}") from None
    except pickle.UnpicklingError:  # torch.load(weights_only=True) stopped at a pickled object: none ran
        raise UserError(
            f"{name_or_dir}: its pytorch_model.bin holds more than tensors, which loading would run as code: "
            f"refused, and nothing in it ran; use the model as safetensors (model.safetensors: tensors only)"
        ) from None
    if info["missing_keys"]:  # transformers fills them with random numbers and only warns
        missing = sorted(info["missing_keys"])
        more = f" ({len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{name_or_dir}: key {missing[0]} is missing{more}: not a whole GPT-2 model")
    return hf


def load_hf_gpt2(name_or_dir):
    """(config dict, state dict in our layout) of OpenAI GPT-2 (gpt2, gpt2-medium, gpt2-large,
    gpt2-xl) or a local transformers GPT-2 directory (save_pretrained output)."""
    hf = load_hf_model(name_or_dir)
    hc = hf.config
    if hc.activation_function not in ("gelu_new", "gelu_pytorch_tanh") or hc.layer_norm_epsilon != 1e-5:
        raise UserError(
            f"{name_or_dir}: activation {hc.activation_function!r} / layer_norm_epsilon "
            f"{hc.layer_norm_epsilon} differ from GPT-2's (gelu_new, 1e-5)"
        )
    config = dict(
        block_size=hc.n_positions, vocab_size=hc.vocab_size, n_layer=hc.n_layer, n_head=hc.n_head, n_embd=hc.n_embd
    )
    return config, state_dict_from_hf(hf.state_dict())


def hf_gpt2(config, sd, source, vocab_size=None, **extra):
    """Our model (config dict, our state dict) as transformers' GPT2LMHeadModel, in memory, every key
    and shape checked as our loader checks them (a UserError naming source); its vocabulary cut to
    vocab_size rows (None: as it is, the padding rows kept, so that its losses are our GPT's)."""
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415  2 s to import: only building one needs it

    # GPT-2's activation and LayerNorm epsilon, no dropout, tied embeddings
    hf_config = GPT2Config(
        vocab_size=vocab_size or config["vocab_size"],
        n_positions=config["block_size"],
        n_embd=config["n_embd"],
        n_layer=config["n_layer"],
        n_head=config["n_head"],
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **extra,
    )
    with torch.device("meta"):  # no random init to throw away: our tensors become the weights
        hf = GPT2LMHeadModel(hf_config)
    if any(True for _ in hf.buffers()):  # a transformers whose attention keeps buffers (a causal mask): real ones
        hf = GPT2LMHeadModel(hf_config)
    shapes = {k: v.shape[::-1] if k.endswith(HF_TRANSPOSED) else v.shape for k, v in hf.state_dict().items()}
    check_state_dict({**shapes, **dict.fromkeys(TIED, (config["vocab_size"], config["n_embd"]))}, sd, source)
    hf.load_state_dict(state_dict_to_hf(sd, vocab_size=hf_config.vocab_size), assign=True)
    hf.tie_weights()  # assigned one key at a time: tie them again
    return hf.eval()


# ----------------------------------------------------------------------------------------------
# GPT-2's tokenizer, beside the weights of an export


def save_gpt2_tokenizer(enc, folder, model_max_length):
    """GPT-2's tokenizer in folder, from the shipped vocab.bpe (no download): vocab.json and merges.txt
    (OpenAI's encoder.json and vocab.bpe, as transformers names them), and transformers'
    tokenizer.json and tokenizer_config.json (<|endoftext|> 50256 as end of text, bos and unk as in
    GPT-2's own; no pad token). It is checked against enc, our gpt2 encoding, on a probe string
    before it is written."""
    from transformers import GPT2TokenizerFast  # noqa: PLC0415  2 s to import: only the export needs it
    from transformers import __version__ as transformers_version  # noqa: PLC0415  as above

    tokens, merges = read_gpt2_bpe()
    vocab = {spelling: rank for rank, spelling in enumerate(tokens)}
    vocab["<|endoftext|>"] = enc.eot_token
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges, model_max_length=model_max_length)
    probe = "Hello world,\n\n  naïve 東京 🤖 3.14<|endoftext|>"
    if len(tok) != enc.n_vocab or tok.encode(probe) != enc.encode(probe, allowed_special="all"):
        raise UserError(
            f"transformers {transformers_version} did not build GPT-2's tokenizer from its vocabulary and "
            f"merges: pip install -U transformers, then export again"
        )
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    shutil.copyfile(GPT2_BPE, os.path.join(folder, "merges.txt"))
    tok.save_pretrained(folder)


def save_hf_gpt2(config, sd, out_dir, source="the model", **extra):
    """Write a model (config dict, our state dict) as a transformers GPT2LMHeadModel directory
    (vocab trimmed to 50257, tied embeddings) with GPT-2's tokenizer: every model this repo trains
    reads tiktoken's gpt2 ids (fineweb.py's shards), and the rows of a larger --vocab-size past
    50257 are padding. out_dir must be new, empty or an earlier export (check_export_target); source:
    what sd is, for the line that refuses weights that do not fit config (hf_gpt2); extra: more keys
    for its config.json (where the weights came from)."""
    out_dir = check_export_target(out_dir)  # refuse before the slow part
    enc = get_tokenizer()
    from transformers.utils import logging as hf_logging  # noqa: PLC0415  2 s to import: only the export needs it

    hf = hf_gpt2(config, sd, source, GPT2_VOCAB, exported_by=EXPORT_MARK, **extra)

    def write(folder):
        hf.save_pretrained(folder)
        save_gpt2_tokenizer(enc, folder, config["block_size"])

    hf_logging.disable_progress_bar()  # save_pretrained's bar on stderr would bury a one-line error
    write_dir_atomic(out_dir, write, "the export")

r"""
Reproduce GPT-2 (124M) pretraining on FineWeb-Edu, in one readable file.

Top to bottom, in the order of the recipe: the model, the tokenizer and device, the data
(memory-mapped token shards), the optimizer (GPT.configure_optimizers), the learning-rate
schedule, checkpoints, evaluation, and the training loop; the command line at the end.

Usage:
    python fineweb.py && torchrun --standalone --nproc_per_node=8 train_gpt2.py   # the full recipe
    python train_gpt2.py                                   # the same on one GPU (or CPU: slow)
    python train_gpt2.py --resume                          # continue from the newest log/ckpt_*.pt
    python train_gpt2.py --data-dir shards --n-layer 2 --n-head 4 --n-embd 64 -B 8 -T 64 \
        --total-batch-size 4096 --max-steps 200 --warmup-steps 20 --max-lr 1e-3 --eval-every 50 \
        --hellaswag-every 0 --sample-every 100 --val-tokens 16384         # a tiny run on a laptop
    python train_gpt2.py --sample-from gpt2                      # sample from OpenAI GPT-2
    python train_gpt2.py --sample-from log                       # from a run's newest checkpoint
    python train_gpt2.py --sample-from path/to/hf_dir --prompt "Hello, I'm a language model,"
    python train_gpt2.py --export-hf log/ckpt_019073.pt gpt2_ours  # our checkpoint -> transformers dir
"""

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, not a traceback from inside an import
    signal.signal(signal.SIGINT, lambda signum, frame: (print("interrupted", file=sys.stderr), os._exit(130)))

import argparse
import ctypes
import errno
import json
import math
import platform
import random
import re
import time
import zipfile
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hellaswag
from fineweb import (EOT, UserError, first_line, get_tokenizer, load_shard, offline_var, run_cli,  # noqa: F401
                     write_atomic, write_dir_atomic)

GPT2_VOCAB = 50257  # real GPT-2 vocabulary; ids >= this are padding and are never sampled
HF_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


# ----------------------------------------------------------------------------------------------
# The model


@dataclass
class GPTConfig:
    block_size: int = 1024  # max sequence length
    vocab_size: int = 50257  # 50,000 BPE merges + 256 byte tokens + <|endoftext|>
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class KVCache:
    """Keys and values of every layer, preallocated for max_len positions: one more token costs one
    position, not the whole prefix. pos is where the next positions go: a Python int (a prompt)
    that forward advances by T, or, for GPT.decode_step, a 1-element tensor the caller advances
    in place, so that every shape is static and the step can be compiled."""

    def __init__(self, n_layer, max_len):
        self.k = [None] * n_layer
        self.v = [None] * n_layer
        self.max_len = max_len
        self.pos = 0

    def update(self, layer, k, v):
        """Store k, v (B, nh, T, hs) at pos; -> (keys, values, attn_mask, is_causal) to attend over."""
        B, nh, T, hs = k.shape
        if self.k[layer] is None:  # allocated on first use: the dtype is whatever autocast produced
            # zeros, not empty: a decode step reads every slot (masked), and 0 * NaN would be NaN
            self.k[layer] = k.new_zeros(B, nh, self.max_len, hs)
            self.v[layer] = v.new_zeros(B, nh, self.max_len, hs)
        if torch.is_tensor(self.pos):  # one position at a tensor index; attend over the whole buffer
            self.k[layer].index_copy_(2, self.pos, k)
            self.v[layer].index_copy_(2, self.pos, v)
            mask = (torch.arange(self.max_len, device=k.device) <= self.pos).view(1, -1)  # slots written so far
            return self.k[layer], self.v[layer], mask, False
        pos = self.pos
        self.k[layer][:, :, pos : pos + T] = k
        self.v[layer][:, :, pos : pos + T] = v
        k, v = self.k[layer][:, :, : pos + T], self.v[layer][:, :, : pos + T]
        if pos == 0:
            return k, v, None, T > 1  # a plain causal prefix
        # query i sits at absolute position pos+i and sees keys 0 .. pos+i
        mask = None if T == 1 else torch.ones(T, pos + T, dtype=torch.bool, device=k.device).tril(pos)
        return k, v, mask, False


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x, cache=None, layer=0, mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if cache is None:  # flash attention on GPUs when causal; mask: see GPT.hidden_states
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        else:
            k, v, mask, is_causal = cache.update(layer, k, v)  # every position stored so far
            if T == 1 and mask is not None:  # a decode step: one query against the whole buffer
                # plain arithmetic, which torch.compile fuses: SDPA's masked kernel took 31 us a
                # layer for this on an H100 in fp32, a third of the step
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, 1, max_len)
                y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, layer=0, mask=None):
        # pre-LayerNorm: the residual stream itself is never normalised, only what branches off it
        x = x + self.attn(self.ln_1(x), cache, layer, mask)
        x = x + self.mlp(self.ln_2(x))
        return x


def _noise(B, temperature, generator, device):
    """What _next_token draws with: (B, 50257) Exp(1) samples, None when greedy (temperature 0)."""
    if temperature == 0:
        return None
    noise = torch.empty(B, GPT2_VOCAB, device=device).exponential_(generator=generator)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # never 0: p / 0 would win for any p


def _next_token(logits, temperature, top_k, noise):
    """One token per row from the last position's logits (B, vocab): greedy at temperature 0,
    else a draw from the top_k most likely; padding ids (>= 50257) are cut off first.
    The draw is the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability
    p_i (torch.multinomial does the same on CUDA). With the noise drawn beforehand this is plain
    arithmetic, so a compiled decode step samples inside its graph."""
    logits = logits[:, :GPT2_VOCAB].float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return (F.softmax(logits, dim=-1) / noise).argmax(dim=-1)  # (B,)


def _embedding(n, dim, fill):
    # fill=False leaves the weight empty: on the meta device, nn.Embedding's own N(0, 1) fill
    # imports torch._dynamo (1.4 s of a hellaswag.py or --sample-from start-up on a CPU)
    return nn.Embedding(n, dim) if fill else nn.Embedding(n, dim, _weight=torch.empty(n, dim))


class GPT(nn.Module):
    def __init__(self, config, init=True):
        """init=False: the tensors are left unfilled, for weights about to be loaded (the loaders
        build on the meta device: no random init to throw away, seconds at 124M)."""
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=_embedding(config.vocab_size, config.n_embd, init),
                wpe=_embedding(config.block_size, config.n_embd, init),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying: one Parameter, two uses
        if init:
            self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):
                # each block adds twice to the residual stream; keep its variance from growing
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, cache=None):
        x = self.hidden_states(idx, cache)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def hidden_states(self, idx, cache=None, pos=None, mask=None):
        """The final LayerNorm's output (B, T, n_embd): what lm_head reads. Callers that need the
        logits at a few positions only (sampling, HellaSwag) apply lm_head to just those.
        pos (B, T) and mask (B, 1, T, T), True where token t may see token s, lay out a row other
        than as one causal sequence (HellaSwag packs a context and its 4 endings in one row);
        default: positions 0 .. T-1 after the cache, causal."""
        B, T = idx.size()
        if cache is not None and torch.is_tensor(cache.pos):
            pos = cache.pos  # (1,): a decode step, one token per row; shapes stay static
        elif pos is None:
            pos0 = 0 if cache is None else cache.pos
            if pos0 + T > self.config.block_size:
                raise ValueError(f"sequence of length {pos0 + T} is longer than block_size {self.config.block_size}")
            pos = torch.arange(pos0, pos0 + T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, n_embd)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache, i, mask)
        if cache is not None and not torch.is_tensor(cache.pos):
            cache.pos += T
        return self.transformer.ln_f(x)

    def kv_cache(self, max_len):
        """An empty KVCache for up to max_len positions of this model."""
        return KVCache(self.config.n_layer, max_len)

    def decode_step(self, idx, cache, temperature, top_k, noise):
        """The token (B,) after idx (B, 1), which sits at position cache.pos (a 1-element tensor),
        drawn as _next_token does. Static shapes: torch.compile can capture it as one CUDA graph."""
        return _next_token(self.lm_head(self.hidden_states(idx, cache)[:, -1]), temperature, top_k, noise)

    def _compiled_decode(self, B, max_len, device):
        """A compiled decode_step and the KV cache it writes, both kept for the next call with the
        same shapes: CUDA graphs need their buffers at fixed addresses (and so does a fast
        second sample)."""
        key = (B, max_len, str(device), torch.is_autocast_enabled(torch.device(device).type))
        store = self.__dict__.setdefault("_decode_cache", {})
        if key not in store:
            mode = "reduce-overhead" if torch.device(device).type == "cuda" else None  # CUDA graphs
            store.clear()  # one cache at a time: a changed prompt or length replaces it
            store[key] = (torch.compile(self.decode_step, mode=mode, fullgraph=True), self.kv_cache(max_len))
        step, cache = store[key]
        cache.pos = 0
        return step, cache

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=50, generator=None, use_cache=True, compile=False):
        """Append up to max_new_tokens sampled tokens to idx (B, T); stops at block_size.
        temperature 0 is greedy. Padding ids (>= 50257) are never produced.

        use_cache: keep every position's keys and values (a KVCache sized for the whole output)
        and feed one token per step; False recomputes the whole prefix for every token (the
        plain way, kept as the reference). compile: torch.compile the one-token step (CUDA
        graphs on a GPU, where eager decoding waits on Python's kernel launches); the first call
        compiles, later calls with the same shapes reuse it."""
        B, T0 = idx.shape
        n_new = max(0, min(max_new_tokens, self.config.block_size - T0))
        out = idx.new_empty(B, T0 + n_new)  # preallocated: no torch.cat per token
        out[:, :T0] = idx
        if n_new == 0:
            return out
        if not use_cache:
            for t in range(T0, T0 + n_new):
                logits, _ = self(out[:, :t])
                out[:, t] = _next_token(logits[:, -1], temperature, top_k, _noise(B, temperature, generator, idx.device))
            return out
        if compile:
            step, cache = self._compiled_decode(B, T0 + n_new, idx.device)
        else:
            step, cache = self.decode_step, self.kv_cache(T0 + n_new)
        x = self.hidden_states(idx, cache)  # the prompt in one pass; its cache fills positions 0 .. T0-1
        out[:, T0] = _next_token(self.lm_head(x[:, -1]), temperature, top_k, _noise(B, temperature, generator, idx.device))
        if compile:
            for k, v in zip(cache.k, cache.v):  # tell the CUDA graph these buffers never move
                torch._dynamo.mark_static_address(k)
                torch._dynamo.mark_static_address(v)
        cache.pos = torch.tensor([T0], device=idx.device)
        for t in range(T0 + 1, T0 + n_new):
            out[:, t] = step(out[:, t - 1 : t], cache, temperature, top_k, _noise(B, temperature, generator, idx.device))
            cache.pos += 1
        return out

    def configure_optimizers(self, weight_decay, learning_rate, device_type, betas=(0.9, 0.95), eps=1e-8, verbose=True):
        """AdamW that decays only the tensors with dim >= 2 (embeddings and matmul weights):
        decaying biases and LayerNorm gains would only pull them towards 0 for no benefit."""
        params = [p for p in self.parameters() if p.requires_grad]  # the tied wte/lm_head weight once
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if verbose:
            print(f"decayed tensors: {len(decay)}, with {sum(p.numel() for p in decay):,} parameters")
            print(f"non-decayed tensors: {len(no_decay)}, with {sum(p.numel() for p in no_decay):,} parameters")
        # the fused kernel updates every tensor in one launch instead of a chain of small ones
        # (torch has it for cuda, mps and cpu, every device pick_device allows)
        fused = device_type in ("cuda", "mps", "cpu")
        if verbose:
            print(f"using fused AdamW: {fused}")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, fused=fused)

    # --- to and from the Hugging Face transformers format ------------------------------------

    # transformers' GPT-2 stores these as Conv1D weights, i.e. transposed relative to nn.Linear
    HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

    @classmethod
    def from_pretrained(cls, name_or_dir):
        """OpenAI GPT-2 (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a local transformers GPT-2
        directory (save_pretrained output). Every key and shape is checked."""
        is_dir = os.path.isdir(name_or_dir)
        if name_or_dir not in HF_NAMES and not is_dir:
            raise UserError(f"{name_or_dir!r} is neither one of {', '.join(HF_NAMES)} nor a directory")
        local_only = not is_dir and hub_name_is_cached(name_or_dir)
        if not is_dir and not local_only:
            check_hub_reachable(name_or_dir)
        from transformers import GPT2LMHeadModel  # after the checks, which then answer in a second

        try:
            hf, info = GPT2LMHeadModel.from_pretrained(name_or_dir, output_loading_info=True, local_files_only=local_only)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot load transformers GPT-2 from {name_or_dir!r}: {first_line(e)}") from None
        hc = hf.config
        if hc.activation_function not in ("gelu_new", "gelu_pytorch_tanh") or hc.layer_norm_epsilon != 1e-5:
            raise UserError(f"{name_or_dir}: activation {hc.activation_function!r} / layer_norm_epsilon "
                            f"{hc.layer_norm_epsilon} differ from GPT-2's (gelu_new, 1e-5)")  # fmt: skip
        with torch.device("meta"):  # every weight is copied below: no random init to throw away
            model = cls(GPTConfig(block_size=hc.n_positions, vocab_size=hc.vocab_size, n_layer=hc.n_layer,
                                  n_head=hc.n_head, n_embd=hc.n_embd), init=False)  # fmt: skip
        model.to_empty(device="cpu")
        model.transformer.wte.weight = model.lm_head.weight  # to_empty makes new Parameters: tie them again
        # transformers fills missing keys with random numbers and only warns: refuse them
        sd_hf = {k: v for k, v in hf.state_dict().items() if k not in info["missing_keys"]
                 and not k.endswith((".attn.bias", ".attn.masked_bias"))}  # fmt: skip
        sd = model.state_dict()
        missing, extra = sorted(set(sd) - set(sd_hf)), sorted(set(sd_hf) - set(sd))
        if missing or extra:
            what = f"key {missing[0]} is missing from" if missing else f"unexpected key {extra[0]} in"
            raise UserError(f"{name_or_dir}: {what} the transformers checkpoint")
        with torch.no_grad():
            for k in sd:
                w = sd_hf[k].t() if k.endswith(cls.HF_TRANSPOSED) else sd_hf[k]
                if w.shape != sd[k].shape:
                    raise UserError(f"{name_or_dir}: {k} has shape {tuple(w.shape)}, expected {tuple(sd[k].shape)}")
                sd[k].copy_(w)
        return model

    def export_hf(self, out_dir):
        """Write this model as a transformers GPT2LMHeadModel directory (vocab trimmed to 50257,
        tied embeddings). out_dir must be new, empty or an earlier export (check_export_target)."""
        c = self.config
        if c.vocab_size < GPT2_VOCAB:
            raise UserError(f"vocab_size {c.vocab_size} is smaller than GPT-2's {GPT2_VOCAB}: cannot export")
        given, out_dir = out_dir, check_export_target(out_dir)  # refuse before the slow part
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        hf = GPT2LMHeadModel(GPT2Config(
            vocab_size=GPT2_VOCAB, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
            activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, exported_by=EXPORT_MARK,
        ))  # fmt: skip
        sd_hf = hf.state_dict()
        with torch.no_grad():
            for k, w in self.state_dict().items():
                w = w.detach().float().cpu()
                w = w.t() if k.endswith(self.HF_TRANSPOSED) else w
                sd_hf[k].copy_(w[:GPT2_VOCAB] if k in ("transformer.wte.weight", "lm_head.weight") else w)  # no padding rows
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # its bar on stderr would bury a one-line error
        try:
            # checked again just before the swap: a file put there meanwhile is not ours to delete
            write_dir_atomic(out_dir, hf.save_pretrained, "the export", recheck=lambda: check_export_target(given))
        finally:
            if bar:
                hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------------------------
# Hub names and export folders: what from_pretrained may fetch and what export_hf may replace

EXPORT_MARK = "train_gpt2.py --export-hf"  # config.json's "exported_by": a folder export_hf may replace
# everything save_pretrained writes for a GPT2LMHeadModel (shards and their index for big models)
EXPORT_FILES = re.compile(r"config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")


def hub_name_is_cached(name):
    """The local Hugging Face cache holds the config and the weights of Hub model `name`."""
    from huggingface_hub import try_to_load_from_cache

    def cached(filename):
        return isinstance(try_to_load_from_cache(name, filename), str)  # else None or "known missing"

    return cached("config.json") and (cached("model.safetensors") or cached("pytorch_model.bin"))


def check_hub_reachable(name, timeout=3.0):
    """Refuse at once, in one line, to fetch `name` (not in the local cache) when offline use is
    set or the Hub does not answer: transformers would retry for half a minute, then not say why."""
    import urllib.error
    import urllib.request

    fix = "pass a local transformers GPT-2 directory instead (save_pretrained output, or --export-hf's)"
    var = offline_var(("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if var:
        raise UserError(f"{name!r} is not in the local Hugging Face cache and {var} is set: {fix}, or fill the cache once online")
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        urllib.request.urlopen(f"{endpoint}/api/models/{name}", timeout=timeout).close()  # a few KB of metadata
    except (OSError, ValueError) as e:  # no network, a timeout, a bad HF_ENDPOINT, a proxy's or captive portal's 404
        if isinstance(e, urllib.error.HTTPError) and e.code == 429:
            return  # the Hub is there but busy: transformers waits and retries
        reason = f"HTTP {e.code}" if isinstance(e, urllib.error.HTTPError) else getattr(e, "reason", e)
        raise UserError(f"cannot reach the Hugging Face Hub ({endpoint}: {first_line(reason)}) and {name!r} is not "
                        f"in the local cache: {fix}, or set HF_HUB_OFFLINE=1 with a cache that holds it") from None  # fmt: skip


def check_export_target(out_dir):
    """The absolute folder export_hf may write: a new one, an empty one, or an earlier export (only
    save_pretrained's plain files, config.json marked EXPORT_MARK), which is replaced."""
    given = str(out_dir)
    if os.path.islink(given) and not os.path.exists(given):
        raise UserError(f"--export-hf target {given} is a symbolic link to nothing: name a new folder")
    out_dir = os.path.realpath(given)  # a link to an earlier export: replace that folder, keep the link
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        example = os.path.splitext(given)[0] + "_hf"
        raise UserError(f"--export-hf target {given} is a file, not a folder: name a new folder, e.g. {example}")
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    foreign = [n for n in names if not (EXPORT_FILES.fullmatch(n) and os.path.isfile(p := os.path.join(out_dir, n))
                                        and not os.path.islink(p))]  # fmt: skip
    held = None
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        held = f"{foreign[0]}{more}"
    elif names:
        try:
            with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = None
        ours = isinstance(config, dict) and config.get("model_type") == "gpt2" and config.get("exported_by") == EXPORT_MARK
        held = None if ours else "a transformers model (its config.json has no exported_by mark)"
    if held:
        raise UserError(f"--export-hf target {given} is not empty and not an earlier export (it holds {held}): "
                        f"name a new or empty folder; nothing was changed")  # fmt: skip
    return out_dir


def flops_per_token(config, T):
    """Training FLOPs per token (forward + backward) at sequence length T, the nanoGPT / PaLM
    count: 6 per parameter in a matmul (2 forward, 4 backward) plus the attention scores and
    their weighted sum, 12 * n_layer * n_head * head_dim * T. Position embeddings are a lookup,
    not a matmul; the token embedding is counted because lm_head (tied to it) is a matmul.
    GPT-2 124M at T=1024: about 855 MFLOP per token."""
    C = config.n_embd
    n_params = config.vocab_size * C + config.block_size * C + config.n_layer * (12 * C * C + 13 * C) + 2 * C
    n_params -= config.block_size * C  # wpe
    return 6 * n_params + 12 * config.n_layer * config.n_head * (C // config.n_head) * T


# peak dense bf16 tensor-core FLOP/s from NVIDIA's datasheets, matched in this order against
# torch.cuda.get_device_name(); anything else needs --peak-flops for an MFU figure
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),
    ("A100", 312e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


def peak_flops(device_name):
    for name, flops in PEAK_FLOPS:
        if name in device_name:
            return flops
    return None


# ----------------------------------------------------------------------------------------------
# Tokenizer and device


def pick_device(requested=None):
    """cuda > mps > cpu unless requested; returns (device, device_type)."""
    if requested:
        device = requested
    elif torch.cuda.is_available():
        device = "cuda"
    elif hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        device = "mps"
    else:
        device = "cpu"
    device_type = device.split(":")[0]
    if device_type not in ("cuda", "mps", "cpu"):
        raise UserError(f"unknown device {device!r}: use cuda, cuda:N, mps or cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but CUDA is not available: use --device cpu")
    if device_type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise UserError("--device mps was asked for but MPS is not available: use --device cpu")
    return device, device_type


def keep_freed_memory():
    """Make glibc's malloc keep the memory a CPU run frees, for the next step to reuse.

    On a CPU the activations and the (B, T, vocab) logits live in the C heap. glibc gives every
    block of more than 32 MB its own mmap and unmaps it when freed (and trims the heap's top
    likewise), so each step the kernel maps and zeroes those pages afresh: in the README's tiny
    run that page faulting took as long as the compute (`sys` time = `user` time), half of every
    step. Kept, the memory is reused (bench.py: 1.8x the steps per second there). The cost: the
    heap holds its high-water mark, and the step's and the evals' layouts side by side (peak RSS
    2.4-2.6 GB instead of 1.3 GB for that run). A no-op where libc is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # macOS, musl: another allocator, nothing to set
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1


def set_deterministic(device_type):
    """Bitwise-reproducible training: the same seed, data and GPU count give the same losses and
    weights, run after run and across a --resume. On a CPU the kernels already are; on CUDA
    several default kernels add up partial sums in whatever order threads finish (atomics), so
    the last bits of the gradients change from run to run. Call before any CUDA work."""
    if device_type == "cuda":
        # cuBLAS reads this when it creates its handle (first matmul): a fixed workspace per
        # stream, without which its kernels may split a sum differently from call to call
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False  # benchmarking may pick another algorithm each run
        # SDPA: cuDNN attention's backward accumulates with atomics; flash and memory-efficient
        # attention switch to their deterministic backward under use_deterministic_algorithms
        torch.backends.cuda.enable_cudnn_sdp(False)
    # an op with no deterministic kernel now raises instead of running nondeterministically;
    # embedding backward and index_put take their sorted (deterministic) paths
    torch.use_deterministic_algorithms(True)
    # torch.compile: Inductor picks no kernel config by timing it where that changes the numerics
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True


def load_model(spec, device="cpu"):
    """A model from a name (gpt2, gpt2-medium, ...), a transformers directory, our checkpoint, or
    a training run's --out-dir (its newest checkpoint)."""
    if spec not in HF_NAMES and os.path.isdir(spec) and not os.path.exists(os.path.join(spec, "config.json")):
        found = checkpoint_paths(spec)
        if not found:
            raise UserError(f"{spec} holds neither a transformers model (config.json) nor our checkpoints (ckpt_*.pt)")
        print(f"{spec} is a training run's folder: using its newest checkpoint, {found[0]}")
        spec = found[0]
    if spec in HF_NAMES or os.path.isdir(spec):
        model = GPT.from_pretrained(spec)
    elif os.path.isfile(spec):
        model = model_from_checkpoint(load_checkpoint(spec), spec)
    else:  # most often a checkpoint's step mistyped: say which ones its folder holds
        folder = os.path.dirname(spec) or "."
        found = [os.path.basename(p) for p in checkpoint_paths(folder)]
        there = f"; {folder} holds {', '.join(found[:3])}" + (" ..." if len(found) > 3 else "") if found else ""
        raise UserError(f"{spec!r} does not exist, and is not a GPT-2 name ({', '.join(HF_NAMES)}){there}")
    return model.to(device)


def load_checkpoint(path):
    """Our checkpoint as a dict of tensors and plain values. weights_only=True: a checkpoint
    carrying pickled code is refused instead of run."""
    try:
        # torch.save writes a zip with a CRC per tensor, which torch.load never checks: without
        # this, a flipped bit on disk loads as silently wrong weights
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
        ckpt = torch.load(path, map_location="cpu", weights_only=True) if bad is None else None
    except FileNotFoundError:
        raise UserError(f"checkpoint {path} does not exist") from None
    except Exception as e:
        first = first_line(e)
        raise UserError(f"checkpoint {path} cannot be loaded safely (truncated, corrupt or not ours): {first}") from None
    if bad is not None:
        raise UserError(f"checkpoint {path} is corrupt: its {bad} fails the zip CRC check")
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"checkpoint {path} is not a train_gpt2.py checkpoint (no model / model_config)")
    return ckpt


def model_from_checkpoint(ckpt, path):
    """The GPT a checkpoint holds; weights that do not fit its own config are a UserError."""
    try:
        with torch.device("meta"):  # no random init that the weights then overwrite
            model = GPT(GPTConfig(**ckpt["model_config"]), init=False)
        model.load_state_dict(ckpt["model"], assign=True)  # the loaded tensors become the parameters
        model.transformer.wte.weight = model.lm_head.weight  # assigned one key at a time: tie them again
    except (TypeError, RuntimeError) as e:
        first = first_line(e)
        raise UserError(f"checkpoint {path}: its weights do not match its model_config ({first})") from None
    return model


def sample_text(model, enc, prompt, num_samples=4, max_new_tokens=32, temperature=1.0, top_k=50, seed=42, compile=False):
    """Decode num_samples continuations of prompt; the same seed gives the same text.
    compile: a compiled (on CUDA, graph-captured) decode step, kept on the model for the next call."""
    device = next(model.parameters()).device
    # a literal <|endoftext|> in the prompt is the token itself, as in the training data
    tokens = torch.tensor(enc.encode(prompt, allowed_special={"<|endoftext|>"}), dtype=torch.long, device=device)
    idx = tokens.unsqueeze(0).repeat(num_samples, 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator, compile=compile)
    return [enc.decode(row.tolist()) for row in out]


# ----------------------------------------------------------------------------------------------
# Data: token shards on disk, memory-mapped (fineweb.py writes them and owns their format)


def find_shards(data_dir, split):
    """The {prefix}_{split}_{index}.npy (or .bin) shards in data_dir, in name order."""
    if os.path.isfile(data_dir):  # a text file or one shard where the folder of shards goes
        raise UserError(f"--data-dir {data_dir} is a file, not a folder of shards: pass the folder that holds the "
                        f"shards, or tokenize a text file with `python fineweb.py --input {data_dir} --out-dir DIR` "
                        f"and pass --data-dir DIR")  # fmt: skip
    if not os.path.isdir(data_dir):
        raise UserError(f"data folder {data_dir} does not exist: write shards with fineweb.py or pass --data-dir")
    names = sorted(n for n in os.listdir(data_dir) if re.fullmatch(rf".+_{split}_\d+\.(npy|bin)", n))
    if len({os.path.splitext(n)[1] for n in names}) > 1:
        raise UserError(f"{data_dir} holds both .npy and .bin {split} shards: keep one format")
    return [os.path.join(data_dir, n) for n in names]


def check_token_ids(tokens, vocab_size, path):
    """An id the model has no embedding row for crashes the step whose batch holds it (a device
    assert on CUDA), possibly hours in: a shard of another tokenizer is refused up front."""
    if vocab_size is not None and len(tokens) and (top := int(tokens.max())) >= vocab_size:
        raise UserError(
            f"{path}: token id {top} is not below the model's vocab_size {vocab_size}: "
            f"written with another tokenizer? rewrite it with fineweb.py"
        )


class DataLoaderLite:
    """Batches (x, y) of B rows of T tokens, y being x shifted by one, from a folder of shards.

    Every micro-step takes the next chunk of B*T*world_size tokens (+1 for the last target) of
    the current shard, and rank r reads the r-th B*T slice of it: the ranks read disjoint data
    and, since the position is shared, they switch shards together. A shard's tail too short
    for a whole chunk is skipped. Each epoch visits the shards in a new order drawn from
    (seed, epoch), so a second epoch does not repeat the first one's sequence of data.
    The position (epoch, shard, pos) is all the state there is: state_dict() saves it."""

    def __init__(self, data_dir, split, B, T, rank=0, world_size=1, shuffle=True, seed=1337, vocab_size=None,
                 device="cpu"):  # fmt: skip
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.shuffle, self.seed, self.device = shuffle, seed, device
        self.chunk = B * T * world_size
        self.shards = find_shards(data_dir, split)
        if not self.shards:
            raise UserError(
                f"no {split} shards (*_{split}_NNNNNN.npy or .bin) in {data_dir}: write them with "
                f"`python fineweb.py` or pass --data-dir"
            )
        sizes = []
        for path in self.shards:  # checks every shard now, not hours later (~10 ms per 100M tokens)
            tokens = load_shard(path)
            check_token_ids(tokens, vocab_size, path)
            sizes.append(len(tokens))
        self.batches_per_epoch = sum(max(0, (n - 1) // self.chunk) for n in sizes)
        if self.batches_per_epoch == 0:
            raise UserError(  # a batch is cut from one shard, never across two
                f"the largest {split} shard in {data_dir} holds {max(sizes):,} tokens, fewer than the "
                f"{self.chunk + 1:,} that one batch (B*T*world_size + 1) needs: lower --batch-size or --seq-len, "
                f"or write bigger shards (fineweb.py --shard-size)"
            )
        self.tokens_per_epoch = self.batches_per_epoch * self.chunk
        self.set_position(0, 0, 0)

    def shard_order(self, epoch):
        if not self.shuffle:
            return list(range(len(self.shards)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards)).tolist()

    def set_position(self, epoch, shard, pos):
        self.epoch, self.shard, self.pos = epoch, shard, pos
        self.tokens = load_shard(self.shards[self.shard_order(epoch)[shard]])

    def next_batch(self):
        while self.pos + self.chunk + 1 > len(self.tokens):  # on to the next shard with a whole chunk
            if self.shard + 1 < len(self.shards):
                self.set_position(self.epoch, self.shard + 1, 0)
            else:
                self.set_position(self.epoch + 1, 0, 0)
        B, T = self.B, self.T
        start = self.pos + self.rank * B * T
        buf = torch.from_numpy(self.tokens[start : start + B * T + 1].astype(np.int64))  # copies B*T+1 only
        self.pos += self.chunk
        if torch.device(self.device).type == "cuda":  # pinned: the copy overlaps the GPU's work
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        elif self.device != "cpu":
            buf = buf.to(self.device)
        return buf[:-1].view(B, T), buf[1:].view(B, T)

    def state_dict(self):
        names = [os.path.basename(p) for p in self.shards]
        return {"epoch": self.epoch, "shard": self.shard, "pos": self.pos, "shards": names}

    def load_state_dict(self, state):
        names = [os.path.basename(p) for p in self.shards]
        if state["shards"] != names:
            raise UserError(
                f"the checkpoint's data position refers to {len(state['shards'])} shards "
                f"({state['shards'][0]}, ...), but the data folder holds {len(names)} others: resume "
                f"with the same shards, or start a new run from its weights with --init-from"
            )
        self.set_position(state["epoch"], state["shard"], state["pos"])


def load_val_tokens(data_dir, n_tokens, vocab_size=None):
    """The fixed validation set: the first n_tokens (+1 target) of the val shards, in name order.
    None when there is no val shard."""
    parts, have = [], 0
    for path in find_shards(data_dir, "val"):
        tokens = load_shard(path)[: n_tokens + 1 - have]
        check_token_ids(tokens, vocab_size, path)
        parts.append(tokens)
        have += len(tokens)
        if have == n_tokens + 1:
            break
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


# ----------------------------------------------------------------------------------------------
# Schedule


def get_lr(step, max_lr, min_lr, warmup_steps, max_steps):
    """Linear warmup to max_lr, then cosine decay to min_lr at max_steps, min_lr after.
    Step 0 already gets max_lr / warmup_steps: a step at lr 0 would be a wasted step."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    decay_ratio = (step - warmup_steps) / (max_steps - warmup_steps)  # 0 .. 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 .. 0
    return min_lr + coeff * (max_lr - min_lr)


# ----------------------------------------------------------------------------------------------
# Checkpoints, resume and the out-dir


def checkpoint_paths(out_dir):
    """The ckpt_NNNNNN.pt files in out_dir, newest (most steps) first."""
    if not os.path.isdir(out_dir):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(out_dir) if (m := re.fullmatch(r"ckpt_(\d+)\.pt", n))]
    return [os.path.join(out_dir, n) for _, n in sorted(found, reverse=True)]


def disk_error(e, what, then):
    """One line for a failed write; 'make room' only when the disk is really full."""
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    fix = "make room on the disk" if full else "make --out-dir writable"
    return UserError(f"cannot write {what} ({getattr(e, 'strerror', None) or e}): {fix}, then {then}")


def run_id_of(path):
    """The run a checkpoint belongs to; mmap reads only the small pickled part, not the tensors."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("run_id")
    except Exception:
        return None


def save_checkpoint(ckpt, out_dir, keep):
    """Write ckpt_<step>.pt atomically (a kill mid-write never leaves a half checkpoint under the
    real name), then delete this run's checkpoints beyond the newest `keep`: another run's
    files are never touched."""
    path = os.path.join(out_dir, f"ckpt_{ckpt['step']:06d}.pt")
    try:
        write_atomic(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as e:
        cause = e if isinstance(e, OSError) else e.__context__  # torch.save wraps a failed write
        if not isinstance(cause, OSError):
            raise  # not the disk: a bug, keep its traceback
        then = "continue with --resume (the checkpoints before it are intact)"
        raise disk_error(cause, f"checkpoint {path}", then) from None
    if keep > 0:
        for old in checkpoint_paths(out_dir)[keep:]:
            if run_id_of(old) == ckpt["run_id"]:
                os.remove(old)
    return path


def load_training_checkpoint(path):
    """A checkpoint that holds a run's training state, not just weights."""
    ckpt = load_checkpoint(path)
    missing = [k for k in ("optimizer", "step", "data", "rng") if k not in ckpt]
    if missing:
        raise UserError(
            f"checkpoint {path} has no training state ({', '.join(missing)}): "
            f"start a new run from its weights with --init-from {path}"
        )
    return ckpt


def find_resume_checkpoint(resume, out_dir):
    """(path, checkpoint) for --resume: the given file, or for 'latest' the newest checkpoint in
    out_dir that loads; one that does not (cut short, corrupt) is reported and the previous one
    tried. (None, None) when out_dir has no checkpoint at all: the run starts from step 0."""
    if resume != "latest":
        return resume, load_training_checkpoint(resume)
    paths = checkpoint_paths(out_dir)
    for path in paths:
        try:
            return path, load_training_checkpoint(path)
        except UserError as e:
            print(f"warning: skipping {path}: {e}", file=sys.stderr)
    if paths:
        raise UserError(f"none of the {len(paths)} checkpoints in {out_dir} can be loaded: see the warnings above")
    print(f"no checkpoint in {out_dir} to resume from: starting a new run")
    return None, None


def missing_folders(path):
    """The folders of path that do not exist yet, deepest first: those os.makedirs would create."""
    path, missing = os.path.abspath(path), []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def claim_out_dir(out_dir, resume):
    """An out-dir belongs to one run: a new run next to another run's checkpoints would have them
    pruned instead of its own and its log drawn as one curve with theirs, so it is refused."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create --out-dir {out_dir}: {e.strerror}") from None
    names = os.listdir(out_dir)
    theirs = sorted(n for n in names if re.fullmatch(r"ckpt_\d+\.pt|log\.jsonl", n))
    if theirs and not resume:
        raise UserError(
            f"--out-dir {out_dir} holds another run ({', '.join(theirs[:3])}): continue it with --resume, "
            f"or pass a new --out-dir"
        )
    for name in names:  # a checkpoint write of this run cut short by a kill: never complete
        if re.fullmatch(r"\.ckpt_\d+\.pt\.tmp", name):
            print(f"removing the unfinished {name}")
            os.remove(os.path.join(out_dir, name))


# The recipe a checkpoint was trained with. On --resume a flag left out takes the checkpoint's
# value, so `--resume` alone continues the run as it was; a flag given with another value is a
# contradiction, refused, except for the changes below, which are allowed and reported.
RECIPE_FLAGS = ("total_batch_size", "seq_len", "max_lr", "min_lr", "warmup_steps", "max_steps", "weight_decay",
                "beta1", "beta2", "adam_eps", "grad_clip", "seed", "no_shuffle", "n_layer", "n_head", "n_embd",
                "vocab_size", "block_size", "batch_size")  # fmt: skip
ALLOWED_CHANGES = {
    "max_steps": "the cosine schedule is re-stretched from here to the new last step",
    "batch_size": "the same batch in other micro-batches: equal up to float rounding, not bitwise",
}
# The run's other settings: left out on --resume they are the checkpoint's too (`--resume log_tiny`
# reads the same data and evaluates as before, rather than the defaults' edu_fineweb10B and
# HellaSwag every 250 steps); given, they change from here on. The device, dtype, compile,
# --peak-flops and --ddp-timeout are the machine's: a run may continue on another one.
RUN_SETTINGS = ("data_dir", "eval_every", "val_tokens", "hellaswag_every", "hellaswag_limit", "hellaswag_data",
                "sample_every", "ckpt_every", "keep_ckpts", "prompt", "num_samples", "max_new_tokens", "temperature",
                "top_k", "deterministic")  # fmt: skip


def reconcile_resume(args, explicit, ckpt, ckpt_path):
    """Fill args from the checkpoint's recipe and settings; refuse contradictions. Returns the
    allowed changes as {flag: [checkpoint's value, new value]} and the settings taken from the
    checkpoint as {flag: value}."""
    old, changes = ckpt.get("train_config", {}), {}
    taken = {n: old[n] for n in RUN_SETTINGS if n in old and n not in explicit and old[n] != getattr(args, n)}
    for name, value in taken.items():
        setattr(args, name, value)
    for name in RECIPE_FLAGS:
        if name not in old or old[name] == getattr(args, name):
            continue
        flag = "--" + name.replace("_", "-")
        if name not in explicit:
            setattr(args, name, old[name])
        elif name not in ALLOWED_CHANGES:
            raise UserError(
                f"{flag} {getattr(args, name)} contradicts the {old[name]} that {ckpt_path} was trained with: "
                f"leave {flag} out to continue the run as it was, or start a new run in another --out-dir"
            )
        else:
            changes[name] = [old[name], getattr(args, name)]
    if args.max_steps < ckpt["step"]:
        raise UserError(f"--max-steps {args.max_steps} is below the {ckpt['step']} steps {ckpt_path} has done")
    return changes, taken


def get_rng_state(device_type):
    """Every random generator's state, as tensors and plain values (weights_only-loadable)."""
    # numpy's state holds a numpy array, which weights_only loading refuses: keep it as a tensor
    _, key, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos)}
    numpy_state.update(has_gauss=int(has_gauss), gauss=float(gauss))
    return {
        "python": random.getstate(),
        "numpy": numpy_state,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None,
    }


def set_rng_state(state, device_type):
    random.setstate(state["python"])
    s = state["numpy"]
    np.random.set_state(("MT19937", s["key"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["gauss"]))
    torch.set_rng_state(state["torch"])
    if device_type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------------------------
# Evaluation


def autocast(device_type, dtype):
    """bf16 autocast when dtype is set, a no-op otherwise."""
    return torch.autocast(device_type=device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


@torch.no_grad()
def evaluate_val_loss(model, val_tokens, B, T, device, autocast_dtype=None, rank=0, world_size=1, should_stop=None,
                      progress=False):
    """Mean next-token loss over the val set cut into sequences of T tokens. Rank r scores
    sequences r, r + world_size, ... in batches of B and the sums are reduced, so the result is
    the same number whatever the GPU count or B. None when should_stop() interrupted it."""
    n_seq = (len(val_tokens) - 1) // T
    mine = list(range(rank, n_seq, world_size))
    device_type = torch.device(device).type
    model.eval()
    totals = torch.zeros(2, device=device)  # loss sum, ranks interrupted
    t0 = t_print = time.time()
    for i in range(0, len(mine), B):
        if should_stop is not None and should_stop():
            totals[1] = 1
            break
        if progress and time.time() - t_print > 10:  # a long eval says where it is, as HellaSwag's does
            t_print = time.time()
            print(f"val loss: batch {i // B + 1}/{-(-len(mine) // B)}, {t_print - t0:.0f} s", file=sys.stderr, flush=True)
        rows = np.stack([val_tokens[j * T : j * T + T + 1] for j in mine[i : i + B]]).astype(np.int64)
        buf = torch.from_numpy(rows).to(device)
        with autocast(device_type, autocast_dtype):
            _, loss = model(buf[:, :-1], buf[:, 1:])
        totals[0] += loss.float() * buf[:, 1:].numel()
    model.train()
    if world_size > 1:  # every rank reaches this, interrupted or not: no rank waits for another
        dist.all_reduce(totals)
    loss_sum, interrupted = totals.tolist()
    return None if interrupted else loss_sum / (n_seq * T)


@torch.no_grad()
def evaluate_hellaswag(model, prepared, device, autocast_dtype, dist_info, should_stop):
    """acc_norm, acc and n over every rank, or None when a rank was interrupted."""
    counts = hellaswag.evaluate(
        model, prepared, device, dist_info.rank, dist_info.world_size, autocast_dtype=autocast_dtype,
        should_stop=should_stop, progress=dist_info.master_process,
    )  # fmt: skip
    model.train()
    c = counts or {"n": 0, "correct": 0, "correct_norm": 0}
    totals = torch.tensor([c["n"], c["correct"], c["correct_norm"], counts is None], device=device)
    if dist_info.world_size > 1:
        dist.all_reduce(totals)
    n, correct, correct_norm, interrupted = totals.tolist()
    return None if interrupted else {"hellaswag": correct_norm / n, "hellaswag_acc": correct / n, "hellaswag_n": n}


def load_hellaswag(args, enc, master_process, ddp):
    """The HellaSwag examples, tokenized once for every eval of the run, or None after one
    warning when the data cannot be had: a run never dies for want of its side evaluation."""
    if args.hellaswag_every <= 0:
        return None

    def load():
        try:
            examples = hellaswag.load_examples(args.hellaswag_data, limit=args.hellaswag_limit)
            return hellaswag.prepare(examples, enc), None
        except Exception as e:  # no network, a bad cache, a datasets error: all mean "no data"
            return None, first_line(e)

    # rank 0 first: it may download and cache the data, which the others then just read
    prepared, problem = load() if master_process else (None, None)
    if ddp:
        dist.barrier()
        if not master_process:
            prepared, problem = load()
        # every rank must agree, or the ones with data would wait forever for the others
        ok = torch.tensor(int(problem is None), device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item() and problem is None:
            problem = "another rank could not load the HellaSwag data"
    if problem is not None:
        if master_process:
            print(f"warning: HellaSwag evaluation is off for this run: {problem}", file=sys.stderr)
        return None
    return prepared


def encode_prompt(enc, prompt, block_size):
    """The prompt's tokens; an empty prompt starts from <|endoftext|>, as a new document would."""
    tokens = enc.encode(prompt, allowed_special={"<|endoftext|>"}) if prompt else [EOT]
    if len(tokens) >= block_size:
        raise UserError(f"--prompt is {len(tokens)} tokens, the model reads at most {block_size - 1} before a new one")
    return tokens


def note_if_samples_stop_early(n_prompt, max_new_tokens, block_size):
    """generate stops at the model's window: say so when the prompt and --max-new-tokens overrun it."""
    room = block_size - n_prompt
    if max_new_tokens > room:
        print(f"note: samples stop at the model's {block_size}-token window: {room} new tokens after the "
              f"{n_prompt}-token prompt, not --max-new-tokens {max_new_tokens}")  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The training run: its processes, its log, stop requests and the non-finite guard


@dataclass
class DistInfo:
    ddp: bool
    rank: int
    local_rank: int
    world_size: int

    @property
    def master_process(self):  # the one process that prints, logs and writes checkpoints
        return self.rank == 0


def setup_distributed(args, explicit):
    """(DistInfo, device, device_type); torchrun sets RANK, LOCAL_RANK and WORLD_SIZE."""
    d = DistInfo("RANK" in os.environ, int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
                 int(os.environ.get("WORLD_SIZE", 1)))  # fmt: skip
    device, device_type = pick_device(args.device)
    if d.ddp and device_type == "cuda":
        device = f"cuda:{d.local_rank}"
        torch.cuda.set_device(device)
    check_args(args, d.world_size, explicit)  # before any process starts waiting on another
    if d.ddp:  # a rank that freezes (not dies: torchrun sees that) fails the others' collectives after this
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=args.ddp_timeout))
    return d, device, device_type


class StopRequest:
    """SIGTERM (a spot instance reclaimed, a scheduler), SIGHUP (the terminal or ssh session that
    started the run went away) or Ctrl-C: the run stops at the next step boundary with a
    checkpoint, an eval in progress is cut short; a second Ctrl-C stops at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __init__(self):
        self.signum = 0
        for s in self.SIGNALS:
            if s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN:
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


def versions():
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "numpy": np.__version__}  # fmt: skip


class RunLog:
    """log.jsonl: one JSON record per line, appended, never wiped, so a resumed run continues
    the same file (play.ipynb keeps the last record of each step)."""

    def __init__(self, out_dir, enabled):
        self.path, self.file = os.path.join(out_dir, "log.jsonl"), None
        if not enabled:
            return
        try:
            self.file = open(self.path, "a")
            if self.file.tell() > 0:
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":  # a line cut short by a kill: start ours on a fresh line
                        self.file.write("\n")
        except OSError as e:
            raise disk_error(e, self.path, "start again") from None

    def __call__(self, record):
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: stop now, the checkpoints written so far are intact
            raise disk_error(e, self.path, "continue with --resume") from None


MAX_BAD_STEPS = 3  # non-finite steps in a row: one is skipped as a bad batch, this many mean the run diverged


class NonFiniteGuard:
    """One NaN or inf (an overflow, a bad batch) in an update would spread to every weight: such a
    step is skipped. Every rank sees the same all-reduced loss and norm, so all skip it. Several
    in a row mean the run diverged: it stops with a checkpoint of the last good state."""

    def __init__(self, log, master_process, checkpoint, out_dir):
        self.log, self.master_process, self.checkpoint, self.out_dir = log, master_process, checkpoint, out_dir
        self.in_a_row = 0

    def skip(self, step, loss, norm, lr):
        if math.isfinite(loss) and math.isfinite(norm):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.log({"step": step, "skipped": f"loss {loss}, grad norm {norm}", "lr": lr})
        if self.master_process:
            print(f"step {step:5d} | loss {loss} | norm {norm} | skipped ({self.in_a_row} in a row)")
        if self.in_a_row == MAX_BAD_STEPS:  # the weights and optimizer state are still those of the last good step
            self.checkpoint(step + 1)
            raise UserError(
                f"{MAX_BAD_STEPS} steps in a row (to {step}) had a non-finite loss or grad norm: stopped; "
                f"ckpt_{step + 1:06d}.pt in {self.out_dir} holds the last good weights: lower --max-lr or "
                f"check the data, then continue with --resume"
            )
        return True


def save_training_state(step, run, args, ckpt_extra, dist_info, device_type):
    """Every rank's RNG state is gathered; rank 0 writes the checkpoint of `step` steps done."""
    rng = [get_rng_state(device_type)]
    if dist_info.ddp:
        rng = [None] * dist_info.world_size
        dist.all_gather_object(rng, get_rng_state(device_type))
    if dist_info.master_process:
        ckpt = {"model": run.model.state_dict(), "model_config": asdict(run.model.config),
                "optimizer": run.optimizer.state_dict(), "step": step, "train_config": vars(args),
                "data": run.loader.state_dict(), "rng": rng, "world_size": dist_info.world_size,
                **ckpt_extra}  # fmt: skip
        print(f"wrote {save_checkpoint(ckpt, args.out_dir, args.keep_ckpts)}")


def run_evals(step, run, args, dist_info, stop, log):
    """Val loss, HellaSwag and samples when their cadence (or the last step) says so."""
    last, d = step == args.max_steps, dist_info
    due = lambda every: every > 0 and (step % every == 0 or last)  # noqa: E731
    if run.val_tokens is not None and due(args.eval_every):
        val_loss = evaluate_val_loss(run.model, run.val_tokens, B=args.batch_size, T=args.seq_len, device=run.device,
                                     autocast_dtype=run.autocast_dtype, rank=d.rank, world_size=d.world_size,
                                     should_stop=stop, progress=d.master_process)  # fmt: skip
        if val_loss is not None:
            run.val_loss = val_loss
            log({"step": step, "val_loss": val_loss})
            if d.master_process:
                print(f"step {step:5d} | val loss {val_loss:.6f}")
    if run.hellaswag is not None and due(args.hellaswag_every) and not stop():
        result = evaluate_hellaswag(run.model, run.hellaswag, run.device, run.autocast_dtype, d, stop)
        if result is not None:
            log({"step": step, **result})
            if d.master_process:
                print(f"step {step:5d} | hellaswag acc_norm {result['hellaswag']:.4f} of {result['hellaswag_n']}")
    if d.master_process and due(args.sample_every) and step > 0 and not stop():
        texts = run.sample(args.max_new_tokens)
        log({"step": step, "samples": texts})
        for i, text in enumerate(texts):
            print(f"step {step:5d} | sample {i}: {text!r}")


@dataclass
class Run:
    """What the evaluations and checkpoints of a run share."""

    model: nn.Module  # the raw module: evaluation, sampling and checkpoints never go through compile or DDP
    optimizer: torch.optim.Optimizer
    loader: DataLoaderLite
    device: str
    autocast_dtype: torch.dtype = None
    val_tokens: np.ndarray = None
    hellaswag: object = None  # hellaswag.prepare()'s tokenized examples
    val_loss: float = None
    sample: object = None  # sample(max_new_tokens) -> texts with the run's prompt and settings


def resume_checkpoint(args, explicit, d):
    """(path, checkpoint, allowed changes, settings taken from it) for --resume, else (None, None,
    {}, {}). Rank 0 picks the checkpoint, so that every rank loads the same one (multi-node: the
    out-dir must be shared)."""
    if not args.resume:
        return None, None, {}, {}
    picked = [find_resume_checkpoint(args.resume, args.out_dir)[0] if d.master_process else None]
    if d.ddp:
        dist.broadcast_object_list(picked, src=0)
    if picked[0] is None:
        return None, None, {}, {}
    ckpt = load_training_checkpoint(picked[0])
    return picked[0], ckpt, *reconcile_resume(args, explicit, ckpt, picked[0])


def set_precision_and_seeds(args, device_type):
    """(dtype name, autocast dtype or None, compile?): bf16 autocast and compile by default on CUDA."""
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device_type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the matmuls autocast leaves in fp32
    if args.deterministic:
        set_deterministic(device_type)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)  # the same init on every rank (DDP also broadcasts rank 0's)
    use_compile = args.compile if args.compile is not None else device_type == "cuda"
    return dtype, (torch.bfloat16 if dtype == "bfloat16" else None), use_compile


def build_model(args, ckpt, ckpt_path, device, master):
    """The checkpoint's model on --resume, else a new one from the model flags or --init-from."""
    if ckpt is not None:
        model = model_from_checkpoint(ckpt, ckpt_path)
    elif args.init_from == "scratch":
        model = GPT(GPTConfig(block_size=args.block_size, vocab_size=args.vocab_size, n_layer=args.n_layer,
                              n_head=args.n_head, n_embd=args.n_embd))  # fmt: skip
    else:
        model = load_model(args.init_from)
    if args.seq_len > model.config.block_size:
        raise UserError(f"--seq-len {args.seq_len} is longer than the model's block_size {model.config.block_size}")
    if master:
        print(f"model: {asdict(model.config)}, {sum(p.numel() for p in model.parameters()):,} parameters")
    return model.to(device)


def restore_training_state(run, ckpt, ckpt_path, d, device_type):
    """(start step, run id): the optimizer, data position and RNG of a checkpoint, or a new run's id."""
    if ckpt is None:
        return 0, f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(4).hex()}"  # unique, seeds untouched
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.loader.load_state_dict(ckpt["data"])
    if d.rank < len(ckpt["rng"]):
        set_rng_state(ckpt["rng"][d.rank], device_type)
    run.val_loss = ckpt.get("val_loss")
    if d.master_process:
        print(f"resuming from {ckpt_path} at step {ckpt['step']}")
    return ckpt["step"], ckpt.get("run_id", ckpt_path)


def prepare_side_evals(run, args, config, master, ddp):
    """Tokenize HellaSwag and the prompt, and draw one sample token, now: a bad prompt or
    sampling setting fails at start, not at the first sample step hours in."""
    enc = get_tokenizer() if args.hellaswag_every > 0 or args.sample_every > 0 else None
    run.hellaswag = load_hellaswag(args, enc, master, ddp)
    if args.sample_every <= 0:
        return
    tokens = encode_prompt(enc, args.prompt, config.block_size)
    prompt = enc.decode(tokens)
    if master:
        note_if_samples_stop_early(len(tokens), args.max_new_tokens, config.block_size)
    device_type = torch.device(run.device).type

    def sample(max_new_tokens):  # a fixed seed: the same noise every time, so samples show what was learned
        with autocast(device_type, run.autocast_dtype):
            return sample_text(run.model, enc, prompt, num_samples=args.num_samples, max_new_tokens=max_new_tokens,
                               temperature=args.temperature, top_k=args.top_k or None)  # top-k 0: no filtering

    run.sample = sample
    if master:
        sample(1)


def train(args, explicit=frozenset()):
    # --- config: processes, device, precision, batch arithmetic --------------------------------
    d, device, device_type = setup_distributed(args, explicit)
    if device_type == "cpu":
        keep_freed_memory()  # 1.2-1.8x faster steps for small models: see its docstring
    master = d.master_process
    if master:
        claim_out_dir(args.out_dir, args.resume)
    ckpt_path, ckpt, changes, taken = resume_checkpoint(args, explicit, d)
    check_args(args, d.world_size, explicit)  # again: the checkpoint's recipe with this run's changes
    B, T = args.batch_size, args.seq_len
    grad_accum_steps = args.total_batch_size // (B * T * d.world_size)
    dtype, autocast_dtype, use_compile = set_precision_and_seeds(args, device_type)
    if master:
        print(f"device {device} x {d.world_size} | dtype {dtype} | compile {use_compile}")
        print(f"total batch {args.total_batch_size:,} tokens = B {B} x T {T} x {d.world_size} ranks "
              f"x {grad_accum_steps} accumulation steps")  # fmt: skip
        for name, (old, new) in changes.items():
            print(f"note: --{name.replace('_', '-')} {old} -> {new} on resume: {ALLOWED_CHANGES[name]}")
        if taken:
            flags = ", ".join(f"--{name.replace('_', '-')} {value!r}" for name, value in taken.items())
            print(f"note: continuing with the run's {flags} (flags left out on --resume are the checkpoint's)")

    # --- model -------------------------------------------------------------------------------
    raw_model = build_model(args, ckpt, ckpt_path, device, master)  # evals, samples and checkpoints use this
    config = raw_model.config

    # --- data --------------------------------------------------------------------------------
    train_loader = DataLoaderLite(args.data_dir, "train", B, T, rank=d.rank, world_size=d.world_size,
                                  shuffle=not args.no_shuffle, seed=args.seed, vocab_size=config.vocab_size,
                                  device=device)  # fmt: skip
    val_tokens = check_data(args, train_loader, config, master)

    # --- optimizer and schedule ------------------------------------------------------------------
    optimizer = raw_model.configure_optimizers(args.weight_decay, args.max_lr, device_type, (args.beta1, args.beta2),
                                               args.adam_eps, verbose=master)  # fmt: skip
    min_lr = args.min_lr if args.min_lr is not None else 0.1 * args.max_lr
    run = Run(model=raw_model, optimizer=optimizer, loader=train_loader, device=device, autocast_dtype=autocast_dtype,
              val_tokens=val_tokens)
    start_step, run_id = restore_training_state(run, ckpt, ckpt_path, d, device_type)
    del ckpt  # the weights and optimizer state now live in the model and optimizer
    model = torch.compile(raw_model) if use_compile else raw_model
    if d.ddp:
        model = DDP(model, device_ids=[d.local_rank] if device_type == "cuda" else None)

    # --- what runs mid-training is exercised now, not first at hour three -----------------------
    prepare_side_evals(run, args, config, master, d.ddp)
    log = RunLog(args.out_dir, master)
    flops = flops_per_token(config, T)
    device_name = torch.cuda.get_device_name(device) if device_type == "cuda" else platform.processor() or device_type
    peak = args.peak_flops or (peak_flops(device_name) if device_type == "cuda" else None)
    log({"event": "header", "run_id": run_id, "device": device_name, "resumed_from": start_step if ckpt_path else None,
         "changed_on_resume": changes or None, "versions": versions(),
         "config": {**vars(args), "grad_accum_steps": grad_accum_steps, "world_size": d.world_size, "dtype": dtype,
                    "compile": use_compile, "model_config": asdict(config), "min_lr": min_lr, "flops_per_token": flops}})

    def checkpoint(step):
        save_training_state(step, run, args, {"run_id": run_id, "val_loss": run.val_loss}, d, device_type)

    stop, guard = StopRequest(), NonFiniteGuard(log, master, checkpoint, args.out_dir)

    # --- the loop ------------------------------------------------------------------------------
    # Iteration `step` first evaluates the model after `step` updates (not timed), checkpoints,
    # then makes update number step+1. The last iteration only evaluates and checkpoints.
    for step in range(start_step, args.max_steps + 1):
        last_step = step == args.max_steps
        if step > start_step or start_step == 0:  # a resumed step's evals are in its checkpoint already
            run_evals(step, run, args, d, stop, log)
        signum = stop.agreed(device, d.ddp)  # all ranks stop at the same step, whichever got the signal
        if signum or (step > start_step and ((args.ckpt_every > 0 and step % args.ckpt_every == 0) or last_step)):
            checkpoint(step)
        if signum:
            return 128 + signum  # the shell's code for "ended by this signal"
        if last_step:
            break

        # --- TRAINING STEP BEGIN -----------------------------------------------------------------
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_accum = torch.zeros((), device=device)
        for micro_step in range(grad_accum_steps):
            x, y = train_loader.next_batch()
            # DDP all-reduces gradients in backward; only the last micro-step needs it, and DDP
            # decides in forward whether to, so no_sync() covers forward and backward
            last_micro = micro_step == grad_accum_steps - 1
            with model.no_sync() if d.ddp and not last_micro else nullcontext():
                with autocast(device_type, autocast_dtype):
                    _, loss = model(x, y)
                # each micro-batch's loss is a mean over B*T tokens; the batch's is the mean of those
                loss = loss / grad_accum_steps
                loss_accum += loss.detach()
                loss.backward()
        if d.ddp:  # the logged loss is the whole batch's, over every rank (gloo has no AVG)
            dist.all_reduce(loss_accum)
            loss_accum /= d.world_size
        # clip_grad_norm_ returns the norm before clipping; with inf it only measures it
        norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or math.inf)
        lr = get_lr(step, args.max_lr, min_lr, args.warmup_steps, args.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, norm = loss_accum.item(), norm.item()
        if guard.skip(step, loss, norm, lr):  # a NaN / inf step is not applied
            continue
        optimizer.step()
        if device_type == "cuda":
            torch.cuda.synchronize()  # the GPU runs behind the CPU: wait for it before reading the clock
        dt = time.perf_counter() - t0
        # --- TRAINING STEP END -------------------------------------------------------------------

        tok_per_sec = args.total_batch_size / dt
        mfu = flops * tok_per_sec / d.world_size / peak if peak else None  # of one GPU's peak, per GPU
        log({"step": step, "train_loss": loss, "lr": lr, "grad_norm": norm, "dt_ms": dt * 1000, "tok_per_sec": tok_per_sec,
             "mfu": mfu, "tokens": (step + 1) * args.total_batch_size, "epoch": train_loader.epoch})  # fmt: skip
        if master:
            print(f"step {step:5d}/{args.max_steps} | loss {loss:.6f} | lr {lr:.4e} | norm {norm:.4f} | dt {dt * 1000:.2f}ms"
                  f" | tok/s {tok_per_sec:,.0f} | mfu {f'{100 * mfu:.1f}%' if mfu else 'n/a'} | epoch {train_loader.epoch}",
                  flush=True)  # fmt: skip
    if master and run.val_loss is not None:
        print(f"done: {args.max_steps} steps, val loss {run.val_loss:.6f}")
    return 0


# ----------------------------------------------------------------------------------------------
# Command line: every flag is checked here, alone and against the others, before step 0


def check_args(args, world_size, explicit=frozenset()):
    """Bad numbers as one-line errors, before any process starts waiting on another."""
    def need(ok, message):
        if not ok:
            raise UserError(message)

    for name, value in vars(args).items():  # nan passes every comparison below: refuse it first
        need(not isinstance(value, float) or math.isfinite(value), f"--{name.replace('_', '-')} must be a finite number, not {value}")
    positive = ("batch_size", "seq_len", "total_batch_size", "max_steps", "n_layer", "n_head", "n_embd", "block_size",
                "val_tokens", "num_samples", "max_new_tokens")  # fmt: skip
    for name in positive:
        need(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    for name in ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "hellaswag_every", "sample_every",
                 "ckpt_every", "keep_ckpts", "temperature", "top_k"):  # fmt: skip
        need(getattr(args, name) >= 0, f"--{name.replace('_', '-')} must be 0 or more, not {getattr(args, name)}")
    need(args.max_lr > 0, f"--max-lr must be above 0, not {args.max_lr}")
    need(args.min_lr is None or 0 <= args.min_lr <= args.max_lr, f"--min-lr {args.min_lr} must be between 0 and --max-lr {args.max_lr}")
    for name in ("beta1", "beta2"):
        need(0 <= getattr(args, name) < 1, f"--{name} must be in [0, 1), not {getattr(args, name)}")
    need(args.adam_eps > 0, f"--adam-eps must be above 0, not {args.adam_eps}")
    need(args.ddp_timeout > 0, f"--ddp-timeout must be a positive number of seconds, not {args.ddp_timeout}")
    need(args.peak_flops is None or args.peak_flops > 0, f"--peak-flops must be above 0, not {args.peak_flops}")
    need(args.hellaswag_limit is None or args.hellaswag_limit >= 1,
         f"--hellaswag-limit {args.hellaswag_limit}: give a positive number of examples")
    need(args.n_embd % args.n_head == 0, f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    need(args.vocab_size >= GPT2_VOCAB, f"--vocab-size {args.vocab_size} is smaller than GPT-2's {GPT2_VOCAB} tokens")
    need(not (args.resume and args.init_from != "scratch"),
         f"--init-from {args.init_from} starts a new run, --resume continues one: pass one of them")
    if not args.resume and "warmup_steps" not in explicit:  # on resume the checkpoint's value counts
        need(args.warmup_steps < args.max_steps,
             f"--max-steps {args.max_steps} ends inside the default {args.warmup_steps}-step warm-up (lr would "
             f"never pass {get_lr(args.max_steps - 1, args.max_lr, 0, args.warmup_steps, args.max_steps):.1e}): "
             f"pass --warmup-steps below --max-steps")
    micro = args.batch_size * args.seq_len * world_size
    need(args.total_batch_size % micro == 0,
         f"--total-batch-size {args.total_batch_size:,} is not a multiple of B*T*world_size = "
         f"{args.batch_size}*{args.seq_len}*{world_size} = {micro:,}: change --batch-size, --seq-len or --total-batch-size")


def check_data(args, train_loader, config, master):
    """The val tokens (None without --eval-every); too little data is refused before step 0."""
    T = args.seq_len
    if train_loader.tokens_per_epoch < args.total_batch_size:  # one step would see the same tokens twice
        raise UserError(
            f"the train shards in {args.data_dir} hold {train_loader.tokens_per_epoch:,} usable tokens, fewer than "
            f"one step's --total-batch-size {args.total_batch_size:,}: write more data or lower --total-batch-size"
        )
    val_tokens = None
    if args.eval_every > 0:
        val_tokens = load_val_tokens(args.data_dir, args.val_tokens, config.vocab_size)
        if val_tokens is None or len(val_tokens) < T + 1:
            raise UserError(
                f"no val shard (*_val_NNNNNN.npy or .bin) with {T + 1} tokens in {args.data_dir}: fineweb.py "
                f"writes one (its shard 0), or pass --eval-every 0 to train without val loss"
            )
        if master and len(val_tokens) < args.val_tokens + 1:
            print(f"note: the val shards hold only {len(val_tokens) - 1:,} of the --val-tokens {args.val_tokens:,}")
    run_tokens = args.max_steps * args.total_batch_size
    if master and run_tokens > train_loader.tokens_per_epoch:
        print(f"warning: this run trains on {run_tokens:,} tokens but the train shards hold "
              f"{train_loader.tokens_per_epoch:,} usable ones: the data repeats "
              f"({run_tokens / train_loader.tokens_per_epoch:.2f} epochs)", file=sys.stderr)  # fmt: skip
    return val_tokens


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The usage examples as written, and every flag's default in --help."""


def parse_args(argv=None):
    """(args, the flags given explicitly): on --resume, the flags left out take the checkpoint's values."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("--device", default=None, help="cuda, cuda:N, mps or cpu (default: the best available)")
    p.add_argument("--seed", type=int, default=1337, help="model init, shard order")
    p.add_argument("--ddp-timeout", type=float, default=1800, help="seconds a rank waits for the others before failing")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic CUDA kernels: reruns and resumes bitwise equal on GPUs too, at some speed")
    g = p.add_argument_group("data and output (--data-dir with --resume: the checkpoint's unless given)")
    g.add_argument("--data-dir", default="edu_fineweb10B", help="folder of *_train_*/*_val_* .npy or .bin shards")
    g.add_argument("--no-shuffle", action="store_true", help="read the shards in name order every epoch")
    g.add_argument("--out-dir", default="log", help="log.jsonl and checkpoints of one run go here")
    g = p.add_argument_group("model (taken from the checkpoint with --resume)")
    g.add_argument("--init-from", default="scratch",
                   help="scratch, gpt2*, a transformers dir, our checkpoint or a run's folder (its newest)")
    g.add_argument("--n-layer", type=int, default=12)
    g.add_argument("--n-head", type=int, default=12)
    g.add_argument("--n-embd", type=int, default=768)
    g.add_argument("--vocab-size", type=int, default=50304, help="50257 padded to a multiple of 128: faster matmuls")
    g.add_argument("--block-size", type=int, default=1024, help="the model's context length")
    g = p.add_argument_group("batch, optimizer and schedule (taken from the checkpoint with --resume)")
    g.add_argument("--batch-size", "-B", type=int, default=64, help="micro-batch rows per GPU (B)")
    g.add_argument("--seq-len", "-T", type=int, default=1024, help="tokens per row (T)")
    g.add_argument("--total-batch-size", type=int, default=524288, help="tokens per optimizer step (2**19)")
    g.add_argument("--max-steps", type=int, default=19073, help="10B tokens / 524,288")
    g.add_argument("--warmup-steps", type=int, default=715, help="linear warm-up steps")
    g.add_argument("--max-lr", type=float, default=6e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=None, help="the lr the cosine ends at (None: 0.1 * max-lr)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, on matrices and embeddings only")
    g.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1")
    g.add_argument("--beta2", type=float, default=0.95, help="AdamW beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm; 0 turns clipping off")
    g = p.add_argument_group("precision and speed")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="auto: bfloat16 on CUDA")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, help="torch.compile (None: on for CUDA)")
    g.add_argument("--peak-flops", type=float, help="the device's peak FLOP/s, for MFU (None: a table of GPUs)")
    g = p.add_argument_group("evaluation, sampling, checkpoints (with --resume: the checkpoint's unless given)")
    g.add_argument("--eval-every", type=int, default=250, help="val loss every N steps (0: never)")
    g.add_argument("--val-tokens", type=int, default=10_485_760, help="val loss over this many tokens (any GPU count)")
    g.add_argument("--hellaswag-every", type=int, default=250, help="HellaSwag every N steps (0: never)")
    g.add_argument("--hellaswag-limit", type=int, default=None, help="only the first N HellaSwag examples")
    g.add_argument("--hellaswag-data", help="a local HellaSwag jsonl (None: hellaswag.py's cache or download)")
    g.add_argument("--sample-every", type=int, default=250, help="print samples every N steps (0: never)")
    g.add_argument("--ckpt-every", type=int, default=1000, help="checkpoint every N steps, and at the end")
    g.add_argument("--keep-ckpts", type=int, default=3, help="keep this run's newest N checkpoints (0: all)")
    g.add_argument("--resume", nargs="?", const="latest", metavar="CKPT",
                   help="continue: the newest in --out-dir, or CKPT, or a run's folder (its newest, writing "
                        "there); flags left out are the run's, except the machine's: device, dtype, compile, "
                        "peak-flops, ddp-timeout")  # fmt: skip
    g = p.add_argument_group("sampling (in training, and with --sample-from) and export")
    g.add_argument("--sample-from", metavar="MODEL",
                   help="gpt2*, a transformers dir, our checkpoint or a run's folder (its newest): sample and exit")
    g.add_argument("--prompt", default="Hello, I'm a language model,", help="'' starts from <|endoftext|>")
    g.add_argument("--num-samples", type=int, default=4)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--export-hf", nargs=2, metavar=("CKPT", "DIR"), help="write our checkpoint as a transformers dir")
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = p.parse_args(argv)
    given = {a.dest for a in p._actions for s in a.option_strings for tok in argv
             if tok == s or tok.startswith(s + "=") or (len(s) == 2 and tok.startswith(s) and not tok.startswith("--"))}  # fmt: skip
    if args.resume not in (None, "latest") and os.path.isdir(args.resume):  # --resume <a run's folder>
        if "out_dir" in given and os.path.realpath(args.out_dir) != os.path.realpath(args.resume):
            raise UserError(f"--resume {args.resume} is a run's folder, --out-dir {args.out_dir} another: continue that "
                            f"run with --resume --out-dir {args.resume}, or name the checkpoint to start from")  # fmt: skip
        args.out_dir, args.resume = args.resume, "latest"  # continue it where it is
        given.add("out_dir")
    return args, frozenset(given)


def main(argv=None):
    args, explicit = parse_args(argv)
    if args.sample_from and args.export_hf:
        raise UserError("--sample-from and --export-hf are two different jobs: pass one")
    if args.sample_from or args.export_hf:
        check_args(args, 1, explicit | {"warmup_steps"})  # the sampling settings; training's do not matter here
    if args.sample_from:
        device, _ = pick_device(args.device)
        model = load_model(args.sample_from, device)
        enc = get_tokenizer()
        tokens = encode_prompt(enc, args.prompt, model.config.block_size)
        note_if_samples_stop_early(len(tokens), args.max_new_tokens, model.config.block_size)
        prompt = enc.decode(tokens)
        texts = sample_text(model, enc, prompt, num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_k=args.top_k or None, seed=args.seed)  # top-k 0: all
        for i, text in enumerate(texts):
            print(f"sample {i}: {text}")
        return 0
    if args.export_hf:
        ckpt_path, out_dir = args.export_hf
        load_model(ckpt_path).export_hf(out_dir)
        print(f"wrote a transformers GPT-2 directory to {out_dir}")
        return 0
    previous = {s: signal.getsignal(s) for s in StopRequest.SIGNALS}  # train() replaces them
    made = missing_folders(args.out_dir) if int(os.environ.get("RANK", "0")) == 0 else []  # rank 0 makes it
    try:
        return train(args, explicit)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for folder in made:  # a run refused at start leaves no empty --out-dir behind
            try:
                os.rmdir(folder)  # only ever an empty folder: one the run wrote to stays
            except OSError:
                break
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main, interrupted="interrupted (a training run continues from its newest checkpoint with --resume)")

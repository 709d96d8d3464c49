"""
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
    python train_gpt2.py --sample-from path/to/hf_dir --prompt "Hello, I'm a language model,"
    python train_gpt2.py --export-hf log/ckpt_019073.pt gpt2_ours  # our checkpoint -> transformers dir
"""

import argparse
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import sys
import tempfile
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
from fineweb import EOT, UserError, first_line, get_tokenizer, load_shard, run_cli, write_atomic  # noqa: F401

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
    """Keys and values of every layer for the positions seen so far, preallocated up to
    max_len, so that sampling one more token costs one position, not the whole prefix."""

    def __init__(self, n_layer, max_len):
        self.k = [None] * n_layer
        self.v = [None] * n_layer
        self.max_len = max_len
        self.pos = 0  # number of positions already stored

    def update(self, layer, k, v):
        # k, v: (B, nh, T, hs) for positions pos .. pos+T-1; returns all positions 0 .. pos+T-1
        B, nh, T, hs = k.shape
        if self.k[layer] is None:  # allocate lazily: the dtype is whatever autocast produced
            self.k[layer] = k.new_empty(B, nh, self.max_len, hs)
            self.v[layer] = v.new_empty(B, nh, self.max_len, hs)
        self.k[layer][:, :, self.pos : self.pos + T] = k
        self.v[layer][:, :, self.pos : self.pos + T] = v
        return self.k[layer][:, :, : self.pos + T], self.v[layer][:, :, : self.pos + T]


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x, cache=None, layer=0):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention on GPUs
        else:
            pos = cache.pos
            k, v = cache.update(layer, k, v)  # (B, nh, pos+T, hs)
            # query i sits at absolute position pos+i and sees keys 0 .. pos+i
            mask = None if T == 1 else torch.ones(T, pos + T, dtype=torch.bool, device=x.device).tril(pos)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
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

    def forward(self, x, cache=None, layer=0):
        # pre-LayerNorm: the residual stream itself is never normalised, only what branches off it
        x = x + self.attn(self.ln_1(x), cache, layer)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying: one Parameter, two uses
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
        B, T = idx.size()
        pos0 = 0 if cache is None else cache.pos
        if pos0 + T > self.config.block_size:
            raise ValueError(f"sequence of length {pos0 + T} is longer than block_size {self.config.block_size}")
        pos = torch.arange(pos0, pos0 + T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, n_embd)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache, i)
        if cache is not None:
            cache.pos += T
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=50, generator=None, use_cache=True):
        """Append up to max_new_tokens sampled tokens to idx (B, T); stops at block_size.
        temperature 0 is greedy. Padding ids (>= 50257) are never produced."""
        cache = KVCache(self.config.n_layer, self.config.block_size) if use_cache else None
        for _ in range(max_new_tokens):
            if idx.size(1) >= self.config.block_size:
                break
            if cache is None:
                x = idx  # recompute the whole prefix
            else:
                x = idx[:, cache.pos :]  # only the positions the cache has not seen yet
            logits, _ = self(x, cache=cache)
            logits = logits[:, -1, :].float()  # (B, vocab_size)
            logits[:, GPT2_VOCAB:] = float("-inf")
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, GPT2_VOCAB), dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

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
        # the fused kernel updates every tensor in one launch instead of a chain of small ones; AdamW
        # raises if asked for it on a device without one, so ask torch which devices have it
        try:
            from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

            fused = device_type in _get_fused_kernels_supported_devices()
        except ImportError:  # a private helper: if it ever moves, CUDA is the safe bet
            fused = device_type == "cuda"
        if verbose:
            print(f"using fused AdamW: {fused}")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, fused=fused)

    # --- to and from the Hugging Face transformers format ------------------------------------

    # transformers' GPT-2 stores these as Conv1D weights, i.e. transposed relative to nn.Linear
    HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

    @classmethod
    def from_pretrained(cls, name_or_dir):
        """OpenAI GPT-2 (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a local transformers
        GPT-2 directory (save_pretrained output). Every key and shape is checked."""
        from transformers import GPT2LMHeadModel

        if name_or_dir not in HF_NAMES and not os.path.isdir(name_or_dir):
            raise UserError(f"{name_or_dir!r} is neither one of {', '.join(HF_NAMES)} nor a directory")
        try:
            hf, info = GPT2LMHeadModel.from_pretrained(name_or_dir, output_loading_info=True)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot load transformers GPT-2 from {name_or_dir!r}: {first_line(e)}") from None
        if info["missing_keys"]:  # transformers fills these with random numbers and only warns
            missing = sorted(info["missing_keys"])
            raise UserError(
                f"{name_or_dir}: key {missing[0]} is missing from the transformers checkpoint ({len(missing)} missing)"
            )
        hc = hf.config
        if hc.activation_function not in ("gelu_new", "gelu_pytorch_tanh") or hc.layer_norm_epsilon != 1e-5:
            raise UserError(
                f"{name_or_dir}: activation {hc.activation_function!r} / layer_norm_epsilon "
                f"{hc.layer_norm_epsilon} differ from GPT-2's (gelu_new, 1e-5)"
            )
        config = GPTConfig(
            block_size=hc.n_positions, vocab_size=hc.vocab_size, n_layer=hc.n_layer, n_head=hc.n_head, n_embd=hc.n_embd
        )
        model = cls(config)
        sd_hf = {k: v for k, v in hf.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
        sd = model.state_dict()
        for k in sd:
            if k not in sd_hf:
                raise UserError(f"{name_or_dir}: key {k} is missing from the transformers checkpoint")
            w = sd_hf[k].t() if k.endswith(cls.HF_TRANSPOSED) else sd_hf[k]
            if w.shape != sd[k].shape:
                raise UserError(f"{name_or_dir}: {k} has shape {tuple(w.shape)}, expected {tuple(sd[k].shape)}")
            with torch.no_grad():
                sd[k].copy_(w)
        extra = sorted(set(sd_hf) - set(sd))
        if extra:
            raise UserError(f"{name_or_dir}: unexpected key {extra[0]} in the transformers checkpoint")
        return model

    def export_hf(self, out_dir):
        """Write this model as a transformers GPT2LMHeadModel directory (vocab trimmed to 50257,
        tied embeddings), atomically: a temporary directory renamed into place."""
        from transformers import GPT2Config, GPT2LMHeadModel

        c = self.config
        if c.vocab_size < GPT2_VOCAB:
            raise UserError(f"vocab_size {c.vocab_size} is smaller than GPT-2's {GPT2_VOCAB}: cannot export")
        hc = GPT2Config(
            vocab_size=GPT2_VOCAB, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
            activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        hf = GPT2LMHeadModel(hc)
        sd_hf = hf.state_dict()
        with torch.no_grad():
            for k, w in self.state_dict().items():
                w = w.detach().float().cpu()
                if k.endswith(self.HF_TRANSPOSED):
                    w = w.t()
                if k in ("transformer.wte.weight", "lm_head.weight"):
                    w = w[:GPT2_VOCAB]  # drop the padding rows
                sd_hf[k].copy_(w)
        out_dir = os.path.abspath(out_dir)
        parent = os.path.dirname(out_dir)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".export_", dir=parent)
        hf.save_pretrained(tmp)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)


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
    return device, device_type


def load_model(spec, device="cpu"):
    """A model from a name (gpt2, gpt2-medium, ...), a transformers directory or our checkpoint."""
    if spec in HF_NAMES or os.path.isdir(spec):
        model = GPT.from_pretrained(spec)
    elif os.path.isfile(spec):
        model = model_from_checkpoint(load_checkpoint(spec), spec)
    else:
        raise UserError(f"{spec!r} is not a GPT-2 name ({', '.join(HF_NAMES)}), a directory or a checkpoint file")
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
        model = GPT(GPTConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
    except (TypeError, RuntimeError) as e:
        first = first_line(e)
        raise UserError(f"checkpoint {path}: its weights do not match its model_config ({first})") from None
    return model


def sample_text(model, enc, prompt, num_samples=4, max_new_tokens=32, temperature=1.0, top_k=50, seed=42):
    """Decode num_samples continuations of prompt; the same seed gives the same text."""
    device = next(model.parameters()).device
    tokens = torch.tensor(enc.encode(prompt), dtype=torch.long, device=device)
    idx = tokens.unsqueeze(0).repeat(num_samples, 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return [enc.decode(row.tolist()) for row in out]


# ----------------------------------------------------------------------------------------------
# Data: token shards on disk, memory-mapped

def find_shards(data_dir, split):
    """The {prefix}_{split}_{index}.npy (or .bin) shards in data_dir, in name order."""
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

    def __init__(self, data_dir, split, B, T, rank=0, world_size=1, shuffle=True, seed=1337, vocab_size=None):
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.shuffle, self.seed = shuffle, seed
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
            raise UserError(
                f"the {split} shards in {data_dir} hold {sum(sizes):,} tokens, none of them the "
                f"{self.chunk + 1:,} that one batch of B*T*world_size needs: lower --batch-size or --seq-len"
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
# Checkpoints


def checkpoint_paths(out_dir):
    """The ckpt_NNNNNN.pt files in out_dir, newest (most steps) first."""
    if not os.path.isdir(out_dir):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(out_dir) if (m := re.fullmatch(r"ckpt_(\d+)\.pt", n))]
    return [os.path.join(out_dir, n) for _, n in sorted(found, reverse=True)]


def save_checkpoint(ckpt, out_dir, keep):
    """Write ckpt_<step>.pt under a temporary name, then rename: a crash mid-write never leaves
    a half checkpoint under the real name. Then delete all but the newest `keep`."""
    path = os.path.join(out_dir, f"ckpt_{ckpt['step']:06d}.pt")
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it count
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        cause = e if isinstance(e, OSError) else e.__context__  # torch.save wraps a failed write
        if not isinstance(cause, OSError):
            raise  # not the disk: a bug, keep its traceback
        if os.path.exists(tmp):
            os.remove(tmp)  # a full disk: give back the space the partial file holds
        raise UserError(
            f"cannot write checkpoint {path} ({cause.strerror or cause}): the checkpoints before it are intact; "
            f"make room or fix --out-dir, then continue with --resume"
        ) from None
    if keep > 0:
        for old in checkpoint_paths(out_dir)[keep:]:
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
def evaluate_val_loss(model, val_tokens, B, T, device, autocast_dtype=None, rank=0, world_size=1):
    """Mean next-token loss over the val set cut into sequences of T tokens. Rank r scores
    sequences r, r + world_size, ... in batches of B and the sums are reduced, so the result is
    the same number whatever the GPU count or B."""
    n_seq = (len(val_tokens) - 1) // T
    mine = list(range(rank, n_seq, world_size))
    device_type = torch.device(device).type
    model.eval()
    loss_sum = torch.zeros((), device=device)
    for i in range(0, len(mine), B):
        rows = np.stack([val_tokens[j * T : j * T + T + 1] for j in mine[i : i + B]]).astype(np.int64)
        buf = torch.from_numpy(rows).to(device)
        with autocast(device_type, autocast_dtype):
            _, loss = model(buf[:, :-1], buf[:, 1:])
        loss_sum += loss.float() * buf[:, 1:].numel()
    model.train()
    if world_size > 1:
        dist.all_reduce(loss_sum)
    return loss_sum.item() / (n_seq * T)


def load_hellaswag(args, master_process, ddp):
    """hellaswag.py and its examples, or (None, None) after one warning when either is missing:
    a training run must never die for want of its side evaluation."""
    if args.hellaswag_every <= 0:
        return None, None
    examples, problem = None, None
    try:
        import hellaswag
    except ImportError as e:
        problem = f"cannot import hellaswag.py ({e})"
    if problem is None:

        def load():
            try:
                return hellaswag.load_examples(args.hellaswag_data, limit=args.hellaswag_limit), None
            except Exception as e:  # no network, a bad cache, a datasets error: all mean "no data"
                return None, first_line(e)

        # rank 0 first: it may download and cache the data, which the others then just read
        if master_process:
            examples, problem = load()
        if ddp:
            dist.barrier()
        if not master_process:
            examples, problem = load()
    if ddp:  # every rank must agree, or the ones with data would wait forever for the others
        ok = torch.tensor(int(problem is None), device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item() and problem is None:
            problem = "another rank could not load the HellaSwag data"
    if problem is not None:
        if master_process:
            print(f"warning: HellaSwag evaluation is off for this run: {problem}", file=sys.stderr)
        return None, None
    return hellaswag, examples


# ----------------------------------------------------------------------------------------------
# The training run


def accumulate_gradients(model, train_loader, grad_accum_steps, device, autocast_dtype=None):
    """Forward and backward over grad_accum_steps micro-batches: leaves the gradient of one
    batch's mean loss in .grad and returns that loss (this rank's, detached)."""
    device_type = torch.device(device).type
    loss_accum = torch.zeros((), device=device)
    for micro_step in range(grad_accum_steps):
        x, y = train_loader.next_batch()
        if device_type == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        else:
            x, y = x.to(device), y.to(device)
        # DDP all-reduces gradients during backward; only the last micro-step needs that, and
        # DDP decides in forward whether to, so no_sync() must cover the forward pass too
        last = micro_step == grad_accum_steps - 1
        with (model.no_sync() if isinstance(model, DDP) and not last else nullcontext()):
            with autocast(device_type, autocast_dtype):
                _, loss = model(x, y)
            # each micro-batch's loss is a mean over B*T tokens; the batch's is the mean of those
            loss = loss / grad_accum_steps
            loss_accum += loss.detach()
            loss.backward()
    return loss_accum


MAX_BAD_STEPS = 3  # non-finite steps in a row: one is skipped as a bad batch, this many mean the run diverged


def train(args):
    # --- config: processes, device, precision, batch arithmetic --------------------------------
    ddp = "RANK" in os.environ  # launched by torchrun
    ddp_rank = int(os.environ.get("RANK", 0))
    ddp_local_rank = int(os.environ.get("LOCAL_RANK", 0))
    ddp_world_size = int(os.environ.get("WORLD_SIZE", 1))
    master_process = ddp_rank == 0  # the one process that prints, logs and writes checkpoints
    device, device_type = pick_device(args.device)
    if ddp and device_type == "cuda":
        device = f"cuda:{ddp_local_rank}"
        torch.cuda.set_device(device)
    B, T = args.batch_size, args.seq_len
    check_args(args, ddp_world_size)
    grad_accum_steps = args.total_batch_size // (B * T * ddp_world_size)
    if ddp:
        # a rank that freezes (not dies: torchrun sees that) holds the others in a collective for this long
        timeout = timedelta(seconds=args.ddp_timeout)
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", timeout=timeout)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device_type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    autocast_dtype = torch.bfloat16 if dtype == "bfloat16" else None
    use_compile = args.compile if args.compile is not None else device_type == "cuda"
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the matmuls autocast leaves in fp32
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)  # the same init on every rank (DDP also broadcasts rank 0's)
    if master_process:
        print(f"device {device} x {ddp_world_size} | dtype {dtype} | compile {use_compile}")
        print(
            f"total batch {args.total_batch_size:,} tokens = B {B} x T {T} x {ddp_world_size} ranks "
            f"x {grad_accum_steps} accumulation steps"
        )
        try:
            os.makedirs(args.out_dir, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create --out-dir {args.out_dir}: {e.strerror}") from None
        for name in os.listdir(args.out_dir):
            if re.fullmatch(r"ckpt_\d+\.pt\.tmp", name):  # a write cut short by a kill: never complete
                print(f"removing the unfinished {name}")
                os.remove(os.path.join(args.out_dir, name))

    # --- resume: rank 0 picks the checkpoint, so that every rank loads the same one -------------
    ckpt_path, ckpt = None, None
    if args.resume:
        if master_process:
            ckpt_path, ckpt = find_resume_checkpoint(args.resume, args.out_dir)
        if ddp:
            picked = [ckpt_path]
            dist.broadcast_object_list(picked, src=0)
            ckpt_path = picked[0]
            if not master_process and ckpt_path is not None:
                ckpt = load_training_checkpoint(ckpt_path)  # multi-node: out-dir must be shared

    # --- model -------------------------------------------------------------------------------
    config = GPTConfig(
        block_size=args.block_size, vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
        n_embd=args.n_embd,
    )  # fmt: skip
    if ckpt is not None:
        if args.init_from == "scratch" and ckpt["model_config"] != asdict(config):
            raise UserError(
                f"checkpoint {ckpt_path} is of another model ({ckpt['model_config']}) than this run's "
                f"({asdict(config)}): pass the model flags it was trained with"
            )
        model = model_from_checkpoint(ckpt, ckpt_path)
    elif args.init_from == "scratch":
        model = GPT(config)
    else:
        model = load_model(args.init_from)
    model.to(device)
    config = model.config
    if T > config.block_size:
        raise UserError(f"--seq-len {T} is longer than the model's block_size {config.block_size}")
    raw_model = model  # evaluation, sampling and checkpoints use this uncompiled module
    if master_process:
        print(f"model: {asdict(config)}, {sum(p.numel() for p in raw_model.parameters()):,} parameters")

    # --- data --------------------------------------------------------------------------------
    train_loader = DataLoaderLite(
        args.data_dir, "train", B, T, ddp_rank, ddp_world_size, not args.no_shuffle, args.seed, config.vocab_size
    )
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
        if master_process and len(val_tokens) < args.val_tokens + 1:
            print(f"note: the val shards hold only {len(val_tokens) - 1:,} of the --val-tokens {args.val_tokens:,}")
    run_tokens = args.max_steps * args.total_batch_size
    if master_process and run_tokens > train_loader.tokens_per_epoch:
        print(
            f"warning: this run trains on {run_tokens:,} tokens but the train shards hold "
            f"{train_loader.tokens_per_epoch:,} usable ones: the data repeats "
            f"({run_tokens / train_loader.tokens_per_epoch:.2f} epochs)",
            file=sys.stderr,
        )

    # --- optimizer and schedule ------------------------------------------------------------------
    optimizer = raw_model.configure_optimizers(
        args.weight_decay, args.max_lr, device_type, (args.beta1, args.beta2), args.adam_eps, verbose=master_process
    )
    min_lr = args.min_lr if args.min_lr is not None else 0.1 * args.max_lr

    start_step, val_loss = 0, None
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        train_loader.load_state_dict(ckpt["data"])
        if ddp_rank < len(ckpt["rng"]):
            set_rng_state(ckpt["rng"][ddp_rank], device_type)
        start_step, val_loss = ckpt["step"], ckpt.get("val_loss")
        if master_process:
            print(f"resuming from {ckpt_path} at step {start_step}")
        del ckpt  # the weights and optimizer state now live in the model and optimizer

    model = raw_model
    if use_compile:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)
    hellaswag, hellaswag_examples = load_hellaswag(args, master_process, ddp)
    enc = get_tokenizer() if hellaswag is not None or args.sample_every > 0 else None

    # --- log: appended, never wiped, so a resumed run continues the same file ------------------
    log_file = None
    if master_process:
        log_path = os.path.join(args.out_dir, "log.jsonl")
        try:
            log_file = open(log_path, "a")
        except OSError as e:
            raise UserError(f"cannot write {log_path}: {e.strerror}") from None
        if log_file.tell() > 0:
            with open(log_path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a line cut short by a kill: start ours on a fresh line
                    log_file.write("\n")
    flops = flops_per_token(config, T)
    device_name = torch.cuda.get_device_name(device) if device_type == "cuda" else platform.processor() or device_type
    peak = args.peak_flops or (peak_flops(device_name) if device_type == "cuda" else None)

    def log(record):
        if log_file is not None:
            try:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
            except OSError as e:  # a full disk: stop now, the checkpoints written so far are intact
                msg = f"cannot write {log_path} ({e.strerror}): make room, then continue with --resume"
                raise UserError(msg) from None

    log({
        "event": "header",
        "config": {**vars(args), "grad_accum_steps": grad_accum_steps, "world_size": ddp_world_size, "dtype": dtype,
                   "compile": use_compile, "model_config": asdict(config), "min_lr": min_lr, "flops_per_token": flops},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                     "numpy": np.__version__},
        "device": device_name,
        "resumed_from": start_step if ckpt_path else None,
    })  # fmt: skip

    def checkpoint(step):
        rng = [get_rng_state(device_type)]
        if ddp:
            rng = [None] * ddp_world_size
            dist.all_gather_object(rng, get_rng_state(device_type))
        if master_process:
            ckpt = {
                "model": raw_model.state_dict(),
                "model_config": asdict(config),
                "optimizer": optimizer.state_dict(),
                "step": step,  # steps done: the run continues with this step
                "train_config": vars(args),
                "data": train_loader.state_dict(),
                "rng": rng,
                "val_loss": val_loss,
                "world_size": ddp_world_size,
            }
            path = save_checkpoint(ckpt, args.out_dir, args.keep_ckpts)
            print(f"wrote {path}")

    # SIGTERM (spot instance reclaimed, scheduler) or Ctrl-C: finish the step, checkpoint, exit
    stop = {"signum": 0}

    def on_signal(signum, frame):
        if stop["signum"]:  # a second Ctrl-C: the user does not want to wait
            raise KeyboardInterrupt
        stop["signum"] = signum
        print(f"caught {signal.Signals(signum).name}: stopping after this step with a checkpoint", flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # --- the loop ------------------------------------------------------------------------------
    # Iteration `step` first evaluates the model after `step` updates (not timed), checkpoints,
    # then makes update number step+1. The last iteration only evaluates and checkpoints.
    bad_steps = 0  # non-finite steps in a row
    inject = dict(args.inject_nonfinite)  # the test hook in parse_args: {step: factor}
    for step in range(start_step, args.max_steps + 1):
        last_step = step == args.max_steps
        signum = torch.tensor(stop["signum"], device=device)
        if ddp:  # every rank stops at the same step, whichever received the signal
            dist.all_reduce(signum, op=dist.ReduceOp.MAX)
        if signum.item():
            checkpoint(step)
            return 128 + signum.item()  # the shell's code for "ended by this signal"
        resumed_here = step == start_step and start_step > 0  # the checkpoint already has these

        if val_tokens is not None and (step % args.eval_every == 0 or last_step) and not resumed_here:
            val_loss = evaluate_val_loss(raw_model, val_tokens, B, T, device, autocast_dtype, ddp_rank, ddp_world_size)
            if master_process:
                print(f"step {step:5d} | val loss {val_loss:.6f}")
            log({"step": step, "val_loss": val_loss})
        if hellaswag is not None and (step % args.hellaswag_every == 0 or last_step) and not resumed_here:
            raw_model.eval()
            counts = hellaswag.evaluate(
                raw_model, enc, hellaswag_examples, device, ddp_rank, ddp_world_size, autocast_dtype=autocast_dtype
            )
            raw_model.train()
            totals = torch.tensor([counts["n"], counts["correct"], counts["correct_norm"]], device=device)
            if ddp:
                dist.all_reduce(totals)
            n, correct, correct_norm = totals.tolist()
            if master_process:
                print(f"step {step:5d} | hellaswag acc_norm {correct_norm}/{n} = {correct_norm / n:.4f}")
            log({"step": step, "hellaswag": correct_norm / n, "hellaswag_acc": correct / n, "hellaswag_n": n})
        sample_now = args.sample_every > 0 and ((step > 0 and step % args.sample_every == 0) or last_step)
        if sample_now and master_process and not resumed_here:
            raw_model.eval()
            with autocast(device_type, autocast_dtype):
                texts = sample_text(
                    raw_model, enc, args.prompt, args.num_samples, args.max_new_tokens, args.temperature, args.top_k
                )  # a fixed seed: the same noise at every step, so the samples show what the model learned
            raw_model.train()
            for i, text in enumerate(texts):
                print(f"step {step:5d} | sample {i}: {text!r}")
            log({"step": step, "samples": texts})
        if step > start_step and ((args.ckpt_every > 0 and step % args.ckpt_every == 0) or last_step):
            checkpoint(step)
        if last_step:
            break

        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, train_loader, grad_accum_steps, device, autocast_dtype)
        if step in inject:
            loss *= inject[step]
            for p in raw_model.parameters():
                p.grad *= inject[step]
        if ddp:  # the logged loss is the whole batch's, over every rank (gloo has no AVG)
            dist.all_reduce(loss)
            loss /= ddp_world_size
        # clip_grad_norm_ returns the norm before clipping; with inf it only measures it
        norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or math.inf)
        lr = get_lr(step, args.max_lr, min_lr, args.warmup_steps, args.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # one NaN or inf (an overflow, a bad batch) in an update would spread to every weight: skip
        # such a step; every rank sees the same all-reduced loss and gradients, so all skip it
        loss, norm = loss.item(), norm.item()
        if not (math.isfinite(loss) and math.isfinite(norm)):
            bad_steps += 1
            log({"step": step, "skipped": f"loss {loss}, grad norm {norm}", "lr": lr})
            if master_process:
                print(f"step {step:5d}/{args.max_steps} | loss {loss} | norm {norm} | skipped ({bad_steps} in a row)")
            if bad_steps == MAX_BAD_STEPS:
                checkpoint(step + 1)  # the weights and optimizer state of the last good step
                raise UserError(
                    f"{bad_steps} steps in a row ({step - bad_steps + 1}-{step}) had a non-finite loss or grad norm: "
                    f"stopped; ckpt_{step + 1:06d}.pt in {args.out_dir} holds the last good weights: lower --max-lr "
                    f"or check the data, then continue with --resume"
                )
            continue
        bad_steps = 0
        optimizer.step()
        if device_type == "cuda":
            torch.cuda.synchronize()  # the GPU runs behind the CPU: wait for it before reading the clock
        dt = time.perf_counter() - t0
        tok_per_sec = args.total_batch_size / dt
        mfu = flops * tok_per_sec / ddp_world_size / peak if peak else None
        record = {"step": step, "train_loss": loss, "lr": lr, "grad_norm": norm, "dt_ms": dt * 1000,
                  "tok_per_sec": tok_per_sec, "mfu": mfu, "tokens": (step + 1) * args.total_batch_size,
                  "epoch": train_loader.epoch}  # fmt: skip
        log(record)
        if master_process:
            mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
            print(
                f"step {step:5d}/{args.max_steps} | loss {loss:.6f} | lr {lr:.4e} | norm {norm:.4f} | "
                f"dt {dt * 1000:.2f}ms | tok/s {tok_per_sec:,.0f} | mfu {mfu_text} | epoch {train_loader.epoch}",
                flush=True,
            )
    if master_process and val_loss is not None:
        print(f"done: {args.max_steps} steps, val loss {val_loss:.6f}")
    return 0


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda, cuda:N, mps or cpu (default: the best available)")
    p.add_argument("--seed", type=int, default=1337, help="model init, shard order")
    p.add_argument("--ddp-timeout", type=float, default=1800, help="seconds a rank waits for the others before failing")
    g = p.add_argument_group("data and output")
    g.add_argument("--data-dir", default="edu_fineweb10B", help="folder of *_train_*/*_val_* .npy or .bin shards")
    g.add_argument("--no-shuffle", action="store_true", help="read the shards in name order every epoch")
    g.add_argument("--out-dir", default="log", help="log.jsonl and checkpoints go here")
    g = p.add_argument_group("model (ignored with --init-from other than scratch, or --resume)")
    g.add_argument("--init-from", default="scratch", help="scratch, gpt2*, a transformers dir or our checkpoint")
    g.add_argument("--n-layer", type=int, default=12)
    g.add_argument("--n-head", type=int, default=12)
    g.add_argument("--n-embd", type=int, default=768)
    g.add_argument("--vocab-size", type=int, default=50304, help="50257 padded to a multiple of 128: faster matmuls")
    g.add_argument("--block-size", type=int, default=1024, help="the model's context length")
    g = p.add_argument_group("batch, optimizer and schedule")
    g.add_argument("--batch-size", "-B", type=int, default=64, help="micro-batch rows per GPU (B)")
    g.add_argument("--seq-len", "-T", type=int, default=1024, help="tokens per row (T)")
    g.add_argument("--total-batch-size", type=int, default=524288, help="tokens per optimizer step (2**19)")
    g.add_argument("--max-steps", type=int, default=19073, help="10B tokens / 524,288")
    g.add_argument("--warmup-steps", type=int, default=715)
    g.add_argument("--max-lr", type=float, default=6e-4)
    g.add_argument("--min-lr", type=float, default=None, help="default: 0.1 * max-lr")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm; 0 turns clipping off")
    g = p.add_argument_group("precision and speed")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="auto: bfloat16 on CUDA")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, help="torch.compile (default: on for CUDA)")
    g.add_argument("--peak-flops", type=float, help="the device's peak FLOP/s, for MFU (default: a table of GPUs)")
    g = p.add_argument_group("evaluation, sampling, checkpoints")
    g.add_argument("--eval-every", type=int, default=250, help="val loss every N steps (0: never)")
    g.add_argument("--val-tokens", type=int, default=10_485_760, help="val loss over this many tokens (any GPU count)")
    g.add_argument("--hellaswag-every", type=int, default=250, help="HellaSwag every N steps (0: never)")
    g.add_argument("--hellaswag-limit", type=int, default=None, help="only the first N HellaSwag examples")
    g.add_argument("--hellaswag-data", help="a local HellaSwag jsonl (default: hellaswag.py's cache or download)")
    g.add_argument("--sample-every", type=int, default=250, help="print samples every N steps (0: never)")
    g.add_argument("--ckpt-every", type=int, default=1000, help="checkpoint every N steps, and at the end")
    g.add_argument("--keep-ckpts", type=int, default=3, help="keep the newest N checkpoints (0: all)")
    g.add_argument("--resume", nargs="?", const="latest", metavar="CKPT", help="continue: newest in --out-dir, or CKPT")
    g = p.add_argument_group("sampling and export (instead of training)")
    g.add_argument("--sample-from", metavar="MODEL", help="gpt2*, a transformers dir or our checkpoint: sample and exit")
    g.add_argument("--prompt", default="Hello, I'm a language model,")
    g.add_argument("--num-samples", type=int, default=4)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--export-hf", nargs=2, metavar=("CKPT", "DIR"), help="write our checkpoint as a transformers dir")
    # a test hook for tests/test_faults.py, hidden from --help: STEP=FACTOR multiplies that step's
    # loss and gradients by FACTOR (nan, inf), which is how a diverging step looks
    step_factor = lambda s: (int(s.split("=")[0]), float(s.split("=")[1]))  # noqa: E731
    p.add_argument("--inject-nonfinite", nargs="+", default=[], type=step_factor, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def check_args(args, world_size):
    """Bad numbers as one-line errors, before any process starts waiting on another."""
    positive = ("batch_size", "seq_len", "total_batch_size", "max_steps", "n_layer", "n_head", "n_embd", "block_size")
    for name in (*positive, "val_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if args.warmup_steps < 0 or args.max_lr <= 0:
        raise UserError("--warmup-steps must be >= 0 and --max-lr > 0")
    if args.hellaswag_limit is not None and args.hellaswag_limit < 1:
        raise UserError(f"--hellaswag-limit {args.hellaswag_limit}: give a positive number of examples")
    if args.n_embd % args.n_head != 0:
        raise UserError(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if args.vocab_size < GPT2_VOCAB:
        raise UserError(f"--vocab-size {args.vocab_size} is smaller than GPT-2's {GPT2_VOCAB} tokens")
    micro = args.batch_size * args.seq_len * world_size
    if args.total_batch_size % micro != 0:
        raise UserError(
            f"--total-batch-size {args.total_batch_size:,} is not a multiple of B*T*world_size = "
            f"{args.batch_size}*{args.seq_len}*{world_size} = {micro:,}: change --batch-size, --seq-len or "
            f"--total-batch-size"
        )


def main(argv=None):
    args = parse_args(argv)
    if args.sample_from:
        device, _ = pick_device(args.device)
        model = load_model(args.sample_from, device)
        enc = get_tokenizer()
        texts = sample_text(
            model, enc, args.prompt, args.num_samples, args.max_new_tokens, args.temperature, args.top_k, args.seed
        )
        for i, text in enumerate(texts):
            print(f"sample {i}: {text}")
        return 0
    if args.export_hf:
        ckpt_path, out_dir = args.export_hf
        load_model(ckpt_path).export_hf(out_dir)
        print(f"wrote a transformers GPT-2 directory to {out_dir}")
        return 0
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}  # train() replaces them
    try:
        return train(args)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)

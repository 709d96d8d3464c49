"""
Reproduce GPT-2 (124M) pretraining on FineWeb-Edu, in one readable file.

The model sits at the top (nanoGPT style), then the tokenizer, the device choice and the
ways in and out of the Hugging Face format.

Usage:
    python train_gpt2.py --sample-from gpt2                      # sample from OpenAI GPT-2
    python train_gpt2.py --sample-from path/to/hf_dir --prompt "Hello, I'm a language model,"
    python train_gpt2.py --export-hf log/ckpt_019073.pt gpt2_ours  # our checkpoint -> transformers dir
"""

import argparse
import math
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

GPT2_VOCAB = 50257  # real GPT-2 vocabulary; ids >= this are padding and are never sampled
EOT = 50256  # <|endoftext|>
HF_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


class UserError(Exception):
    """A mistake in the user's input: reported as one line, exit code 1, no traceback."""


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
            hf = GPT2LMHeadModel.from_pretrained(name_or_dir)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot load transformers GPT-2 from {name_or_dir!r}: {first}") from None
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


# ----------------------------------------------------------------------------------------------
# Tokenizer and device


def get_tokenizer():
    """tiktoken's gpt2 encoding. Offline machines point TIKTOKEN_CACHE_DIR at a cache of it."""
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # network errors, hash mismatches: all mean the same thing to the user
        raise UserError(
            f"cannot load tiktoken's gpt2 encoding ({type(e).__name__}); offline, set TIKTOKEN_CACHE_DIR "
            f"to a folder holding its cached vocab.bpe and encoder.json"
        ) from None


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
        ckpt = load_checkpoint(spec)
        model = GPT(GPTConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
    else:
        raise UserError(f"{spec!r} is not a GPT-2 name ({', '.join(HF_NAMES)}), a directory or a checkpoint file")
    return model.to(device)


def load_checkpoint(path):
    """Our checkpoint as a dict of tensors and plain values. weights_only=True: a checkpoint
    carrying pickled code is refused instead of run."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint {path} does not exist") from None
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"checkpoint {path} cannot be loaded safely (truncated, corrupt or not ours): {first}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"checkpoint {path} is not a train_gpt2.py checkpoint (no model / model_config)")
    return ckpt


def sample_text(model, enc, prompt, num_samples=4, max_new_tokens=32, temperature=1.0, top_k=50, seed=42):
    """Decode num_samples continuations of prompt; the same seed gives the same text."""
    device = next(model.parameters()).device
    tokens = torch.tensor(enc.encode(prompt), dtype=torch.long, device=device)
    idx = tokens.unsqueeze(0).repeat(num_samples, 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return [enc.decode(row.tolist()) for row in out]


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda, cuda:N, mps or cpu (default: the best available)")
    p.add_argument("--seed", type=int, default=1337)
    g = p.add_argument_group("sampling and export (instead of training)")
    g.add_argument("--sample-from", metavar="MODEL", help="gpt2*, a transformers dir or our checkpoint: sample and exit")
    g.add_argument("--prompt", default="Hello, I'm a language model,")
    g.add_argument("--num-samples", type=int, default=4)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--export-hf", nargs=2, metavar=("CKPT", "DIR"), help="write our checkpoint as a transformers dir")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device, _ = pick_device(args.device)
    if args.sample_from:
        model = load_model(args.sample_from, device)
        enc = get_tokenizer()
        texts = sample_text(
            model, enc, args.prompt, args.num_samples, args.max_new_tokens, args.temperature, args.top_k, args.seed
        )
        for i, text in enumerate(texts):
            print(f"sample {i}: {text}")
        return
    if args.export_hf:
        ckpt_path, out_dir = args.export_hf
        load_model(ckpt_path).export_hf(out_dir)
        print(f"wrote a transformers GPT-2 directory to {out_dir}")
        return


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)

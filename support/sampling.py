"""Generating text from a model: the KV cache a sample decodes with, the draw of each token, the
(compiled) one-token decode step, generate, and the prompt, flags and samples that training
(checked at its start, logged mid-run) and sample.py share. The model is passed in: any GPT whose
hidden_states takes a cache (see KVCache) and whose lm_head gives the logits."""

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from support.cli import Number, UserError, flag
from support.out_of_memory import oom_phase
from support.precision import autocast
from support.shards import GPT2_VOCAB

# --- The KV cache: what the model's attention asks when it is given one ------------------------


class KVCache:
    """Keys and values of every layer, preallocated for max_len positions: one more token costs one
    position, not the whole prefix. pos, where the next positions go, is 0 for the prompt (one pass)
    or, in a decode step, a 1-element tensor the decode loop advances in place: static shapes, so the
    step compiles. The model asks it positions(T) for its next T tokens and calls attend(layer, q, k, v)
    in every layer in place of its own attention."""

    def __init__(self, n_layer, max_len):
        self.k = [None] * n_layer
        self.v = [None] * n_layer
        self.max_len = max_len
        self.pos = 0

    def positions(self, T, device):
        """The positions of the next T tokens: (1,) in a decode step, else the prompt's 0 .. T-1."""
        return self.pos if torch.is_tensor(self.pos) else torch.arange(T, dtype=torch.long, device=device)

    def attend(self, layer, q, k, v):
        """Store k, v (B, nh, T, hs) at pos; -> each query's attention (B, nh, T, hs) over every
        position stored so far, itself and the earlier ones of its own T included."""
        B, nh, T, hs = k.shape
        if self.k[layer] is None:  # allocated on first use: the dtype is whatever autocast produced
            # zeros, not empty: a decode step reads every slot (masked), and 0 * NaN would be NaN
            self.k[layer] = k.new_zeros(B, nh, self.max_len, hs)
            self.v[layer] = v.new_zeros(B, nh, self.max_len, hs)
        if torch.is_tensor(self.pos):  # a decode step: one query against the whole buffer
            self.k[layer].index_copy_(2, self.pos, k)
            self.v[layer].index_copy_(2, self.pos, v)
            mask = torch.arange(self.max_len, device=k.device) <= self.pos  # the slots written so far
            # plain arithmetic, which torch.compile fuses: SDPA's masked kernel is slow for one
            # query (docs/performance.md has the profile)
            att = (q @ self.k[layer].transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, 1, max_len)
            return att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ self.v[layer]
        self.k[layer][:, :, :T] = k  # the prompt, in one pass from position 0: causal over itself
        self.v[layer][:, :, :T] = v
        return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)


# --- Drawing a token ---------------------------------------------------------------------------


def draw_noise(B, temperature, generator, device):
    """What next_token draws with: (B, 50257) Exp(1) samples, None when greedy (temperature 0)."""
    if temperature == 0:
        return None
    noise = torch.empty(B, GPT2_VOCAB, device=device).exponential_(generator=generator)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # never 0: p / 0 would win for any p


def next_token(logits, temperature, top_k, noise):
    """One token per row from the last position's logits (B, vocab): greedy at temperature 0,
    else a draw from the top_k most likely (0 or None: all); padding ids (>= 50257) are cut off first.
    The draw is the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability
    p_i (torch.multinomial does the same on CUDA). With the noise drawn beforehand this is plain
    arithmetic, so a compiled decode step samples inside its graph."""
    logits = logits[:, :GPT2_VOCAB].float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    # shifted so the largest is 0: a temperature so low that the scaled logits overflow gives -inf
    # to all but the largest (greedy), never inf - inf = NaN; below 1e-30 float32 has no divisor
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, 1e-30)
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return (F.softmax(logits, dim=-1) / noise).argmax(dim=-1)  # (B,)


# --- Decoding ----------------------------------------------------------------------------------


def decode_step(model, idx, cache, temperature, top_k, noise):
    """The token (B,) after idx (B, 1), which sits at position cache.pos (a 1-element tensor),
    drawn as next_token does. Static shapes: torch.compile can capture it as one CUDA graph."""
    return next_token(model.lm_head(model.hidden_states(idx, cache)[:, -1]), temperature, top_k, noise)


def compiled_decode(model, B, max_len, device):
    """A compiled decode_step and the KV cache it writes, kept on the model for the next call with
    the same shapes: CUDA graphs need their buffers at fixed addresses (and so does a fast second sample)."""
    key = (B, max_len, str(device), torch.is_autocast_enabled(torch.device(device).type))
    store = model.__dict__.setdefault("_decode_cache", {})  # goes with the model
    if key not in store:
        mode = "reduce-overhead" if torch.device(device).type == "cuda" else None  # CUDA graphs
        store.clear()  # one cache at a time: a changed prompt or length replaces it
        step = torch.compile(decode_step, mode=mode, fullgraph=True)
        store[key] = (step, KVCache(model.config.n_layer, max_len))
    step, cache = store[key]
    cache.pos = 0
    return step, cache


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=50, generator=None, compile=False, stop=None):
    """idx (B, T) with up to max_new_tokens sampled tokens appended, stopping at the model's
    block_size (T below it, max_new_tokens at least 1: encode_prompt and the flags check them);
    temperature 0 is greedy, padding ids (>= 50257) never come out. The prompt fills a KVCache in
    one pass, then each token is one step. compile: a compiled one-token step (CUDA graphs
    on a GPU, where eager decoding waits on kernel launches). stop: polled before every token (a stop
    signal mid-sample); when it says True, None is returned."""
    B, T0 = idx.shape
    n_new = min(max_new_tokens, model.config.block_size - T0)
    out = idx.new_empty(B, T0 + n_new)  # preallocated: no torch.cat per token
    out[:, :T0] = idx
    draw = lambda: draw_noise(B, temperature, generator, idx.device)  # noqa: E731
    if compile:
        step, cache = compiled_decode(model, B, T0 + n_new, idx.device)
    else:
        step, cache = decode_step, KVCache(model.config.n_layer, T0 + n_new)
    x = model.hidden_states(idx, cache)  # the prompt in one pass; its cache fills positions 0 .. T0-1
    out[:, T0] = next_token(model.lm_head(x[:, -1]), temperature, top_k, draw())
    if compile:
        for k, v in zip(cache.k, cache.v, strict=True):  # tell the CUDA graph these buffers never move
            torch._dynamo.mark_static_address(k)
            torch._dynamo.mark_static_address(v)
    cache.pos = torch.tensor([T0], device=idx.device)
    for t in range(T0 + 1, T0 + n_new):
        if stop is not None and stop():
            return None
        out[:, t] = step(model, out[:, t - 1 : t], cache, temperature, top_k, draw())
        cache.pos += 1
    return out


# --- Text in, text out: the flags, the prompt, and the samples a run logs (sample.py prints them) -


def encode_prompt(enc, prompt, block_size, max_new_tokens, say=True):
    """The prompt's tokens, a literal <|endoftext|> the token itself (as in the training data); an empty
    prompt starts from <|endoftext|>, as a new document would. generate stops at the model's window:
    say, a note when the prompt and max_new_tokens overrun it."""
    tokens = enc.encode(prompt, allowed_special={"<|endoftext|>"}) if prompt else [enc.eot_token]
    if len(tokens) >= block_size:
        raise UserError(f"--prompt is {len(tokens)} tokens, the model reads at most {block_size - 1} before a new one")
    if say and len(tokens) + max_new_tokens > block_size:
        print(
            f"note: samples stop at the model's {block_size}-token window: {block_size - len(tokens)} new tokens "
            f"after the {len(tokens)}-token prompt, not --max-new-tokens {max_new_tokens}"
        )
    return tokens


def sample_text(model, enc, prompt, num_samples=4, max_new_tokens=32, temperature=1.0, top_k=50, seed=42, stop=None):
    """Decode num_samples continuations of prompt (encode_prompt's tokens); the same seed gives the
    same text. stop: polled before every token (a training run's stop signal): None when it cut the
    samples short."""
    device = next(model.parameters()).device
    tokens = encode_prompt(enc, prompt, model.config.block_size, max_new_tokens, say=False)
    idx = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(0).repeat(num_samples, 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = generate(model, idx, max_new_tokens, temperature, top_k, generator, stop=stop)
    return None if out is None else [enc.decode(row.tolist()) for row in out]


@dataclass(frozen=True)
class Sampling:
    """Sampling flags, train_gpt2.py's (mid-run) and sample.py's; check_sampling tries a run's on its model."""

    prompt: str = flag("Hello, I'm a language model,", "'' starts from <|endoftext|>")
    num_samples: int = flag(4, "samples drawn at once", Number.POSITIVE)
    max_new_tokens: int = flag(32, "tokens each sample adds to the prompt", Number.POSITIVE)
    temperature: float = flag(1.0, "0: greedy", Number.AMOUNT)
    top_k: int = flag(50, "sample among the k likeliest tokens (0: all)", Number.COUNT)

    def draw(self, model, enc, max_new_tokens, stop=None):
        return sample_text(
            model, enc, self.prompt, self.num_samples, max_new_tokens, self.temperature, self.top_k, stop=stop
        )


def check_sampling(model, enc, sampling, autocast_dtype, master_process):
    """A training run's samples, checked at start: the prompt tokenized and fitted to the model's
    window (rank 0 says when the samples stop early), and one token drawn with the run's settings:
    a bad prompt or setting fails now, not at the first sample step hours in. sample_text's fixed
    seed gives the same noise at every sample step, so the samples show what was learned."""
    encode_prompt(enc, sampling.prompt, model.config.block_size, sampling.max_new_tokens, say=master_process)
    oom_phase("sampling check", num_samples=sampling.num_samples)
    with autocast(next(model.parameters()).device.type, autocast_dtype):  # every rank samples, here and mid-run
        sampling.draw(model, enc, max_new_tokens=1)


def log_samples(step, model, enc, sampling, autocast_dtype, log, should_stop):
    """Samples of the prompt after `step` updates (every rank samples, rank 0 logs them), unless a
    stop signal cut them short; sampling: the one check_sampling checked."""
    oom_phase("sampling", step=step, num_samples=sampling.num_samples, max_new_tokens=sampling.max_new_tokens)
    with autocast(next(model.parameters()).device.type, autocast_dtype):
        samples = sampling.draw(model, enc, sampling.max_new_tokens, stop=should_stop)
    if samples is not None:
        log({"step": step, "samples": samples})

"""Text samples from a model: the prompt's tokens, seeded decoding, and the note when the model's
window cuts a sample short."""

import torch

from support.common import UserError


def encode_prompt(enc, prompt, block_size):
    """The prompt's tokens; an empty prompt starts from <|endoftext|>, as a new document would."""
    tokens = enc.encode(prompt, allowed_special={"<|endoftext|>"}) if prompt else [enc.eot_token]
    if len(tokens) >= block_size:
        raise UserError(f"--prompt is {len(tokens)} tokens, the model reads at most {block_size - 1} before a new one")
    return tokens


def sample_text(
    model, enc, prompt, num_samples=4, max_new_tokens=32, temperature=1.0, top_k=50, seed=42, compile=False, stop=None
):
    """Decode num_samples continuations of prompt; the same seed gives the same text.
    compile: a compiled (on CUDA, graph-captured) decode step, kept on the model for the next call.
    stop: polled before every token (a training run's stop signal): None when it cut the samples short."""
    device = next(model.parameters()).device
    # a literal <|endoftext|> in the prompt is the token itself, as in the training data
    tokens = torch.tensor(enc.encode(prompt, allowed_special={"<|endoftext|>"}), dtype=torch.long, device=device)
    idx = tokens.unsqueeze(0).repeat(num_samples, 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature, top_k, generator, compile=compile, stop=stop)
    return None if out is None else [enc.decode(row.tolist()) for row in out]


def print_samples(model, enc, args):
    """--sample-from: samples of --prompt with the sampling flags, printed one per line."""
    block_size = model.config.block_size
    tokens = encode_prompt(enc, args.prompt, block_size)
    note_if_samples_stop_early(len(tokens), args.max_new_tokens, block_size)
    top_k = args.top_k or None  # 0: all
    texts = sample_text(
        model, enc, enc.decode(tokens), args.num_samples, args.max_new_tokens, args.temperature, top_k, args.seed
    )
    for i, text in enumerate(texts):
        print(f"sample {i}: {text}")


def note_if_samples_stop_early(n_prompt, max_new_tokens, block_size):
    """generate stops at the model's window: say so when the prompt and --max-new-tokens overrun it."""
    room = block_size - n_prompt
    if max_new_tokens > room:
        print(
            f"note: samples stop at the model's {block_size}-token window: {room} new tokens after the "
            f"{n_prompt}-token prompt, not --max-new-tokens {max_new_tokens}"
        )

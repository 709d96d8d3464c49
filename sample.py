"""
Sample from a GPT-2 (train_gpt2.py's GPT): OpenAI's, a transformers folder, our checkpoint or a run's folder.

Usage:
    python sample.py gpt2                                  # OpenAI GPT-2 124M: from the Hub once, then its cache
    python sample.py log_tiny --prompt "ROMEO:"            # a run's newest checkpoint
    python sample.py log/ckpt_019073.pt --temperature 0    # greedy: the likeliest token every step
"""

import argparse
import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, not a traceback from inside an import
    signal.signal(signal.SIGINT, lambda signum, frame: (print("interrupted", file=sys.stderr), os._exit(130)))

from support.cli import ArgumentParser, Number, add_flags, run_cli
from support.device import pick_device
from support.gpu import device_memory
from support.model_files import block_size_of
from support.out_of_memory import oom_phase, sample_out_of_memory
from support.sampling import Sampling, encode_prompt, sample_text
from support.shards import get_tokenizer
from train_gpt2 import load_model


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The usage examples as written, and every flag's default in --help."""


def main(argv=None):
    p = ArgumentParser(prog="sample.py", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", metavar="MODEL", help="gpt2*, a transformers folder, our checkpoint or a run's folder")
    defaults = add_flags(p, Sampling)  # --prompt, --num-samples, --max-new-tokens, --temperature, --top-k
    p.add_argument("--seed", type=Number.TORCH_SEED, default=1337, help="the same seed and flags: the same samples")
    p.add_argument("--device", default=None, help="cuda, cuda:N, mps or cpu (None: the best available)")
    p.add_argument("--dry-run", action="store_true", help="check the model, the prompt and the flags; load no weights")
    args = p.parse_args(argv, argparse.Namespace(**defaults))  # the sampling flags left out: their defaults
    device, _ = pick_device(args.device)
    enc = get_tokenizer()
    if args.dry_run:  # the model found, its window read from its files (no weights loaded), the prompt fitted to it
        encode_prompt(enc, args.prompt, block_size_of(args.model), args.max_new_tokens)
        print(f"dry run: {args.model}, the prompt and the sampling flags are fine; nothing was sampled")
        return 0
    model = load_model(args.model, device)
    encode_prompt(enc, args.prompt, model.config.block_size, args.max_new_tokens)  # refused, or the window said
    c = model.config  # a sample holds 5 fp32 rows of logits (next_token's) and a KV cache: half the memory for them
    fit = (device_memory(device)[0] or 0) // 2 // (4 * (5 * c.vocab_size + 2 * c.n_layer * c.block_size * c.n_embd))
    oom_phase("drawing samples", num_samples=args.num_samples, max_new_tokens=args.max_new_tokens, fit=fit)
    texts = sample_text(
        model, enc, args.prompt, args.num_samples, args.max_new_tokens, args.temperature, args.top_k, args.seed
    )
    for i, text in enumerate(texts):
        print(f"sample {i}: {text}")
    return 0


if __name__ == "__main__":
    run_cli(main, out_of_memory=sample_out_of_memory)

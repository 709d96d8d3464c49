r"""
Reproduce GPT-2 (124M) pretraining on FineWeb-Edu, in one readable file.

Top to bottom, in the order of the recipe: the model, the device and its precision, the data
(memory-mapped token shards), the learning-rate schedule, the val loss, the processes (DDP),
and the training loop; the command line at the end. What keeps a run safe without changing
what it computes (flag checks, checkpoint files, resume, signals, the log) is in support/, one
module per concern.

Usage:
    python fineweb.py && torchrun --standalone --nproc_per_node=8 train_gpt2.py   # the full recipe
    python train_gpt2.py                                   # the same on one GPU (or CPU: slow)
    python train_gpt2.py --resume                          # continue from the newest log/ckpt_*.pt
    python train_gpt2.py @configs/laptop.txt               # a tiny run on a laptop: a preset's flags
    python train_gpt2.py @configs/laptop.txt --dtype bfloat16 \
        --max-steps 400 --out-dir log_tiny400              # flags typed after (or before) a preset win
    python train_gpt2.py --sample-from gpt2                      # sample from OpenAI GPT-2
    python train_gpt2.py --sample-from log --prompt "Hello,"     # from a run's newest checkpoint
    python train_gpt2.py --export-hf log/ckpt_019073.pt gpt2_ours  # our checkpoint -> transformers dir
The recipe's flags are the defaults; configs/gpu8.txt and configs/gpu1.txt write them out.
"""

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, not a traceback from inside an import
    signal.signal(signal.SIGINT, lambda signum, frame: (print("interrupted", file=sys.stderr), os._exit(130)))

import argparse
import math
import platform
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hellaswag
from support.checkpoints import load_checkpoint, save_training_state
from support.checks import check_args, check_data, check_init_shape, check_model_fits, warmup_note
from support.common import (
    GPT2_VOCAB,
    ArgumentParser,
    UserError,
    first_line,
    run_cli,
    said_on_interrupt,
    same_on_every_rank,
)
from support.ddp import join_process_group
from support.divergence import NonFiniteGuard
from support.dry_run import dry_run_job
from support.hf_interop import check_state_dict, load_hf_gpt2, save_hf_gpt2
from support.machine import choose_compile, keep_freed_memory, peak_flops, pick_device, set_deterministic
from support.model_files import find_model
from support.out_dir import check_not_data_folder, claim_out_dir, missing_folders, release_out_dir, remove_made_folders
from support.out_of_memory import oom_phase, training_out_of_memory
from support.precision import AUTOCAST_DTYPES, grad_scaler, loss_scale, pick_dtype
from support.presets import expand_presets
from support.resume import report_resume, restore_training_state, resume_checkpoint
from support.run_log import RunLog
from support.sampling import encode_prompt, note_if_samples_stop_early, print_samples, sample_text
from support.shards import (
    ShardFile,
    check_batch_fits,
    check_batch_ids,
    check_same_shards,
    check_token_ids,
    find_shards,
    get_tokenizer,
    load_shard,
    recorded_max_ids,
)
from support.signals import StopRequest

# --- The model ------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    block_size: int = 1024  # max sequence length
    vocab_size: int = 50257  # 50,000 BPE merges + 256 byte tokens + <|endoftext|>
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


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
        else:  # sampling: the cache stores k, v and attends over every position so far
            y = cache.attend(layer, q, k, v)
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


def _embedding(n, dim, fill):
    # fill=False leaves the weight empty: on the meta device, nn.Embedding's own N(0, 1) fill
    # imports torch._dynamo, seconds of a hellaswag.py or --sample-from start-up on a CPU
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
        default: positions 0 .. T-1, causal. cache (support/sampling.py's KVCache): the tokens continue
        what it holds, and attend to that too."""
        B, T = idx.size()
        if cache is not None:  # sampling (support/sampling.py): the cache says where its next tokens go
            pos = cache.positions(T, idx.device)
        elif pos is None:
            if T > self.config.block_size:
                raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
            pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, n_embd)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache, i, mask)
        if cache is not None:
            cache.advance(T)
        return self.transformer.ln_f(x)

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

    # --- loading weights, and the Hugging Face transformers format ----------------------------

    @classmethod
    def from_state_dict(cls, config, state_dict, source):
        """A GPT of `config` whose parameters are the tensors of `state_dict` (our layout); every
        key and shape is checked. Built on the meta device: no random init to throw away."""
        with torch.device("meta"):
            model = cls(config, init=False)
        check_state_dict({k: v.shape for k, v in model.state_dict().items()}, state_dict, source)
        model.load_state_dict(state_dict, assign=True)  # the loaded tensors become the parameters
        model.transformer.wte.weight = model.lm_head.weight  # assigned one key at a time: tie them again
        return model

    @classmethod
    def from_pretrained(cls, name_or_dir):
        """OpenAI GPT-2 (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a local transformers GPT-2
        directory (save_pretrained output)."""
        config, state_dict = load_hf_gpt2(name_or_dir)  # transformers' layout turned into ours
        return cls.from_state_dict(GPTConfig(**config), state_dict, name_or_dir)

    def export_hf(self, out_dir):
        """Write this model as a transformers GPT2LMHeadModel directory (vocab trimmed to 50257,
        tied embeddings) with GPT-2's tokenizer; out_dir must be new, empty or an earlier export."""
        save_hf_gpt2(asdict(self.config), self.state_dict(), out_dir)


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


def load_model(spec, device="cpu"):
    """A model from a name (gpt2, gpt2-medium, ...), a transformers directory, our checkpoint, or
    a training run's --out-dir (its newest checkpoint)."""
    kind, spec = find_model(spec)
    model = GPT.from_pretrained(spec) if kind == "transformers" else model_from_checkpoint(load_checkpoint(spec), spec)
    return model.to(device)


def model_from_checkpoint(ckpt, path):
    """The GPT a checkpoint holds; weights that do not fit its own config are a UserError."""
    try:
        config = GPTConfig(**ckpt["model_config"])
    except TypeError as e:
        raise UserError(f"checkpoint {path}: its model_config is not a GPT config ({first_line(e)})") from None
    return GPT.from_state_dict(config, ckpt["model"], f"checkpoint {path}")


# --- Device and precision: TF32 and bf16 autocast on CUDA, torch.compile --------------------------


def autocast(device_type, dtype):
    """Autocast to dtype (bf16 or fp16) when it is set, a no-op otherwise."""
    return torch.autocast(device_type=device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def set_precision_and_seeds(args, device_type):
    """({"dtype", "dtype_reason"}, autocast dtype or None, compile?): bf16 (fp16) autocast, compile on CUDA."""
    dtype, why = pick_dtype(args.dtype, device_type)
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the matmuls autocast leaves in fp32
    if args.deterministic:
        set_deterministic(device_type)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)  # the same init on every rank (DDP also broadcasts rank 0's)
    use_compile = choose_compile(args.compile, device_type, verbose=os.environ.get("RANK", "0") == "0")
    return {"dtype": dtype, "dtype_reason": why}, AUTOCAST_DTYPES[dtype], use_compile


# --- Data: token shards on disk, memory-mapped (their format: support/shards.py) ------------------


class DataLoaderLite:
    """Batches (x, y) of B rows of T tokens, y being x shifted by one, from a folder of shards.

    Every micro-step takes the next chunk of B*T*world_size tokens (+1 for the last target) of the
    current shard, and rank r reads its r-th B*T slice: disjoint data, and the ranks switch shards
    together. A shard's tail too short for a chunk is skipped. Each epoch visits the shards in a new
    order drawn from (seed, epoch). The position (epoch, shard, pos) is all the state there is."""

    def __init__(
        self, data_dir, split, B, T, rank=0, world_size=1, shuffle=True, seed=1337, vocab_size=None, device="cpu"
    ):
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.shuffle, self.seed, self.device, self.vocab_size = shuffle, seed, device, vocab_size
        self.chunk = B * T * world_size
        self.shards = find_shards(data_dir, split, required=True)
        sizes, recorded = [], recorded_max_ids(data_dir)  # the ids fineweb.py saw: no need to read those shards
        for path in self.shards:  # checks every shard now, not hours later
            tokens = load_shard(path)
            check_token_ids(tokens, vocab_size, path, recorded.get(path))
            sizes.append(len(tokens))
        self.batches_per_epoch = sum(max(0, (n - 1) // self.chunk) for n in sizes)  # a batch never spans two shards
        check_batch_fits(self.batches_per_epoch, sizes, self.chunk, data_dir, split)
        self.tokens_per_epoch = self.batches_per_epoch * self.chunk
        self.set_position(0, 0, 0)

    def shard_order(self, epoch):
        if not self.shuffle:
            return list(range(len(self.shards)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards)).tolist()

    def set_position(self, epoch, shard, pos):
        self.epoch, self.shard, self.pos = epoch, shard, pos
        self.path = self.shards[self.shard_order(epoch)[shard]]
        self.tokens = ShardFile(self.path)  # read, not mapped: a shard cut short mid-run is one line, no SIGBUS

    def next_batch(self):
        while self.pos + self.chunk + 1 > len(self.tokens):  # on to the next shard with a whole chunk
            if self.shard + 1 < len(self.shards):
                self.set_position(self.epoch, self.shard + 1, 0)
            else:
                self.set_position(self.epoch + 1, 0, 0)
        B, T = self.B, self.T
        start = self.pos + self.rank * B * T
        tokens = check_batch_ids(self.tokens[start : start + B * T + 1], self.vocab_size, self.path, start)
        buf = torch.from_numpy(tokens.astype(np.int64))  # copies B*T+1 only
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
        check_same_shards(state["shards"], [os.path.basename(p) for p in self.shards])
        self.set_position(state["epoch"], state["shard"], state["pos"])


def load_val_tokens(data_dir, n_tokens, vocab_size=None):
    """The fixed validation set: the first n_tokens (+1 target) of the val shards, in name order.
    None when there is no val shard, or n_tokens is 0 (no val loss)."""
    parts, have = [], 0
    for path in find_shards(data_dir, "val") if n_tokens > 0 else []:
        tokens = ShardFile(path)[: n_tokens + 1 - have]  # read into memory, not mapped
        parts.append(check_batch_ids(tokens, vocab_size, path, 0))
        have += len(tokens)
        if have == n_tokens + 1:
            break
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


# --- Schedule -------------------------------------------------------------------------------------


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


# --- Evaluation: the val loss (HellaSwag is hellaswag.py's) ---------------------------------------


@torch.no_grad()
def evaluate_val_loss(
    model, val_tokens, B, T, device, autocast_dtype=None, rank=0, world_size=1, should_stop=None, progress=False
):
    """Mean next-token loss over the val set cut into sequences of T tokens. Rank r scores
    sequences r, r + world_size, ... in batches of B and the sums are reduced, so the result is
    the same number whatever the GPU count or B. None when should_stop() interrupted it."""
    n_seq = (len(val_tokens) - 1) // T
    mine = list(range(rank, n_seq, world_size))
    n_batches = -(-len(mine) // B)
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
            print(f"val loss: batch {i // B + 1}/{n_batches}, {t_print - t0:.0f} s", file=sys.stderr, flush=True)
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


# --- Processes: one per GPU under torchrun (DDP), each with its rank ------------------------------


@dataclass
class DistInfo:
    """Who this process is in the job; torchrun sets RANK, LOCAL_RANK and WORLD_SIZE."""

    ddp: bool
    ddp_rank: int
    ddp_local_rank: int
    ddp_world_size: int

    @property
    def master_process(self):  # the one process that prints, logs and writes checkpoints
        return self.ddp_rank == 0


def setup_distributed(args, given):
    """(DistInfo, device, device_type): the flags checked, then the process group joined."""
    env = os.environ
    dist_info = DistInfo(
        "RANK" in env, int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))
    )
    device, device_type = pick_device(args.device)
    if dist_info.ddp and device_type == "cuda":
        device = f"cuda:{dist_info.ddp_local_rank}"
        torch.cuda.set_device(device)
    check_args(args, dist_info.ddp_world_size, given)  # before any process starts waiting on another
    if dist_info.ddp:  # a rank that freezes (not dies: torchrun sees that) fails the others' collectives after this
        backend = "nccl" if device_type == "cuda" else "gloo"
        join_process_group(backend, args.ddp_timeout)
    return dist_info, device, device_type


# --- The training run: the model, the data, the side evaluations, and the loop --------------------


@dataclass
class Run:
    """A training run's parts, as the loop, the evaluations, the checkpoints and the out-of-memory
    advice (support/out_of_memory.py) share them."""

    args: argparse.Namespace
    dist_info: DistInfo
    device: str
    autocast_dtype: torch.dtype
    grad_accum_steps: int
    use_compile: bool
    scaler: torch.amp.GradScaler = None  # fp16's loss scaling; disabled (a no-op) for bf16 and fp32
    model: nn.Module = None  # the raw module: evaluation, sampling and checkpoints never go through compile or DDP
    optimizer: torch.optim.Optimizer = None
    loader: DataLoaderLite = None
    run_id: str = None
    val_tokens: np.ndarray = None
    val_loss: float = None
    hellaswag_examples: hellaswag.Prepared = None  # tokenized once; None: no HellaSwag eval
    sampling: dict = None  # sample_text's tokenizer, prompt (checked) and sampling flags; None: no samples


def build_model(args, ckpt, ckpt_path, device, master_process):
    """The checkpoint's model on --resume, else a new one from the model flags or --init-from."""
    if ckpt is not None:
        model = model_from_checkpoint(ckpt, ckpt_path)
    elif args.init_from == "scratch":
        shape = {name: getattr(args, name) for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")}
        check_model_fits(shape, device)  # before building it: a model too big would take minutes to fail
        model = GPT(GPTConfig(**shape))
    else:
        model = load_model(args.init_from)
    if args.seq_len > model.config.block_size:
        raise UserError(f"--seq-len {args.seq_len} is longer than the model's block_size {model.config.block_size}")
    if master_process:
        print(f"model: {asdict(model.config)}, {sum(p.numel() for p in model.parameters()):,} parameters")
    return model.to(device)


def prepare_side_evals(run, enc):
    """Tokenize HellaSwag and the prompt, and draw one sample token, now: a bad prompt or
    sampling setting fails at start, not at the first sample step hours in."""
    args, dist_info, block_size = run.args, run.dist_info, run.model.config.block_size
    if args.hellaswag_every > 0:  # None after a warning: a run never dies for want of its side evaluation
        run.hellaswag_examples = hellaswag.load_for_run(
            args.hellaswag_data, args.hellaswag_limit, enc, dist_info.master_process, dist_info.ddp
        )
    if args.sample_every > 0:
        tokens = encode_prompt(enc, args.prompt, block_size)
        if dist_info.master_process:
            note_if_samples_stop_early(len(tokens), args.max_new_tokens, block_size)
        # sample_text's fixed seed: the same noise at every sample step, so samples show what was learned
        settings = dict(num_samples=args.num_samples, temperature=args.temperature, top_k=args.top_k or None)
        run.sampling = dict(enc=enc, prompt=enc.decode(tokens), **settings)  # top_k None (--top-k 0): all tokens
        # every rank samples, here and in run_evals: none waits alone in a collective meanwhile
        with oom_phase("sampling check", run=run), autocast(torch.device(run.device).type, run.autocast_dtype):
            sample_text(run.model, max_new_tokens=1, **run.sampling)


def run_evals(step, run, stop, log):
    """Val loss, HellaSwag and samples when their cadence (or the last step) says so. Each polls
    stop: a stop signal cuts it short, and nothing of it is logged."""
    args, dist_info = run.args, run.dist_info
    due = lambda every: every > 0 and (step % every == 0 or step == args.max_steps)  # noqa: E731
    # both evals: on the run's device and precision, each rank its share (the sums reduced), polling stop
    shared = dict(device=run.device, autocast_dtype=run.autocast_dtype, should_stop=stop)
    shared.update(rank=dist_info.ddp_rank, world_size=dist_info.ddp_world_size)
    if run.val_tokens is not None and due(args.eval_every):
        with oom_phase("val loss", run=run, step=step):
            B, T, progress = args.batch_size, args.seq_len, dist_info.master_process
            val_loss = evaluate_val_loss(run.model, run.val_tokens, B=B, T=T, progress=progress, **shared)
        if val_loss is not None:
            run.val_loss = val_loss
            log({"step": step, "val_loss": val_loss})
    if run.hellaswag_examples is not None and due(args.hellaswag_every) and not stop():
        with oom_phase("HellaSwag eval", run=run, step=step):
            result = hellaswag.evaluate_all_ranks(run.model, run.hellaswag_examples, **shared)
        if result is not None:
            log({"step": step, **result})
    if due(args.sample_every) and step > 0 and not stop():  # every rank samples, rank 0 logs them
        with oom_phase("sampling", run=run, step=step), autocast(torch.device(run.device).type, run.autocast_dtype):
            samples = sample_text(run.model, max_new_tokens=args.max_new_tokens, stop=stop, **run.sampling)
        if samples is not None:
            log({"step": step, "samples": samples})


def start_run(args, given):
    """The processes, device and precision, and on --resume the checkpoint with what it decides;
    -> (Run, the checkpoint's path and contents or None, the allowed changes, the dtype and why)."""
    dist_info, device, device_type = setup_distributed(args, given)
    if device_type == "cpu":
        keep_freed_memory()  # faster steps for small models: see its docstring
    claim = lambda: claim_out_dir(args.out_dir, args.resume)  # noqa: E731  (rank 0's, in resume_checkpoint)
    with oom_phase("loading the checkpoint"):
        ckpt_path, ckpt, changes, taken = resume_checkpoint(args, given, dist_info.ddp, dist_info.master_process, claim)
    check_args(args, dist_info.ddp_world_size, given)  # again: the checkpoint's recipe with this run's changes
    B, T, ddp_world_size = args.batch_size, args.seq_len, dist_info.ddp_world_size
    grad_accum_steps = args.total_batch_size // (B * T * ddp_world_size)
    precision, autocast_dtype, use_compile = set_precision_and_seeds(args, device_type)
    if dist_info.master_process:
        dtype = f"{precision['dtype']} ({precision['dtype_reason']})"
        print(f"device {device} x {ddp_world_size} | dtype {dtype} | compile {use_compile}")
        print(f"total batch {args.total_batch_size:,} tokens = B {B} x T {T} x {ddp_world_size} ranks", end="")
        print(f" x {grad_accum_steps} accumulation steps")
        report_resume(changes, taken)
        if (note := warmup_note(args)) is not None:
            print(note)
    run = Run(args, dist_info, device, autocast_dtype, grad_accum_steps, use_compile)
    run.scaler = grad_scaler(precision["dtype"], device_type)
    return run, ckpt_path, ckpt, changes, precision


def train(args, given=frozenset()):
    # --- config: processes, device, precision, batch arithmetic --------------------------------
    run, ckpt_path, ckpt, changes, precision = start_run(args, given)
    dist_info, device, device_type = run.dist_info, run.device, torch.device(run.device).type
    ddp, ddp_rank, ddp_world_size = dist_info.ddp, dist_info.ddp_rank, dist_info.ddp_world_size
    master_process, autocast_dtype = dist_info.master_process, run.autocast_dtype
    grad_accum_steps = run.grad_accum_steps
    B, T = args.batch_size, args.seq_len

    # --- model -------------------------------------------------------------------------------
    with oom_phase("building the model", run=run):
        run.model = raw_model = build_model(args, ckpt, ckpt_path, device, master_process)
    config = raw_model.config
    check_init_shape(args, given, asdict(config), master_process)  # model flags with --init-from: a note

    # --- data --------------------------------------------------------------------------------
    vocab_size = config.vocab_size
    try:  # the ranks of a node read the same folder: a mistake in it is said once a node
        with oom_phase("reading the data", run=run):
            # this rank's slices of every batch, the shards in an order drawn from the seed each epoch
            order = dict(rank=ddp_rank, world_size=ddp_world_size, shuffle=not args.no_shuffle, seed=args.seed)
            run.loader = train_loader = DataLoaderLite(
                args.data_dir, "train", B, T, **order, vocab_size=vocab_size, device=device
            )
            run.val_tokens = (
                load_val_tokens(args.data_dir, args.val_tokens, vocab_size) if args.eval_every > 0 else None
            )
        check_data(args, train_loader.tokens_per_epoch, run.val_tokens, master_process)
    except UserError as e:
        raise e if e.every_rank else same_on_every_rank(e, node=True) from None

    # --- optimizer and schedule ------------------------------------------------------------------
    betas, min_lr = (args.beta1, args.beta2), args.min_lr if args.min_lr is not None else 0.1 * args.max_lr
    run.optimizer = optimizer = raw_model.configure_optimizers(
        args.weight_decay, args.max_lr, device_type, betas, args.adam_eps, verbose=master_process
    )
    with oom_phase("loading the checkpoint"):
        start_step, run.run_id, run.val_loss = restore_training_state(
            ckpt, ckpt_path, optimizer, train_loader, ddp_rank, device_type, run.scaler
        )
    del ckpt  # the weights and optimizer state now live in the model and optimizer
    with oom_phase("start", run=run):
        model = torch.compile(raw_model) if run.use_compile else raw_model
        if ddp:
            model = DDP(model, device_ids=[dist_info.ddp_local_rank] if device_type == "cuda" else None)

    # --- what runs mid-training is exercised now, not first at hour three -----------------------
    prepare_side_evals(run, get_tokenizer() if args.hellaswag_every > 0 or args.sample_every > 0 else None)
    if args.dry_run:  # every start-up check passed; nothing is trained or written
        return print("dry run: the flags, the data, --out-dir and the sampling check are fine") or 0
    flops = flops_per_token(config, T)
    device_name = torch.cuda.get_device_name(device) if device_type == "cuda" else platform.processor() or device_type
    peak = args.peak_flops or (peak_flops(device_name) if device_type == "cuda" else None)
    log = RunLog(args.out_dir, master_process, args.max_steps)
    header = {**vars(args), "grad_accum_steps": grad_accum_steps, "world_size": ddp_world_size, **precision}
    header.update(compile=run.use_compile, model_config=asdict(config), min_lr=min_lr, flops_per_token=flops)
    log.header(run.run_id, device_name, start_step if ckpt_path else None, changes, header)

    def checkpoint(step):
        with oom_phase("writing the checkpoint", run=run, step=step):
            save_training_state(step, run)

    stop, guard = StopRequest(args.out_dir), NonFiniteGuard(log, master_process, checkpoint, args.out_dir, run.scaler)

    # --- the loop ------------------------------------------------------------------------------
    # Iteration `step` first evaluates the model after `step` updates (not timed), checkpoints,
    # then makes update number step+1. The last iteration only evaluates and checkpoints.
    for step in range(start_step, args.max_steps + 1):
        last_step = step == args.max_steps
        if step > start_step or start_step == 0:  # a resumed step's evals are in its checkpoint already
            run_evals(step, run, stop, log)
        signum = stop.agreed(device, ddp)  # all ranks stop at the same step, whichever got the signal
        if signum or (step > start_step and ((args.ckpt_every > 0 and step % args.ckpt_every == 0) or last_step)):
            checkpoint(step)
        if signum:
            return 128 + signum  # the shell's code for "ended by this signal"
        if last_step:
            break

        # --- TRAINING STEP BEGIN -----------------------------------------------------------------
        t0 = time.perf_counter()
        with oom_phase("training step", run=run, step=step, first=step == start_step):
            optimizer.zero_grad(set_to_none=True)
            loss_accum = torch.zeros((), device=device)
            for micro_step in range(grad_accum_steps):
                x, y = train_loader.next_batch()
                # DDP all-reduces gradients in backward; only the last micro-step needs it, and DDP
                # decides in forward whether to, so no_sync() covers forward and backward
                last_micro = micro_step == grad_accum_steps - 1
                with model.no_sync() if ddp and not last_micro else nullcontext():
                    with autocast(device_type, autocast_dtype):
                        _, loss = model(x, y)
                    # each micro-batch's loss is a mean over B*T tokens; the batch's is the mean of those
                    loss = loss / grad_accum_steps
                    loss_accum += loss.detach()
                    run.scaler.scale(loss).backward()  # fp16: times the loss scale (else unchanged)
            if ddp:  # the logged loss is the whole batch's, over every rank (gloo has no AVG)
                dist.all_reduce(loss_accum)
                loss_accum /= ddp_world_size
            run.scaler.unscale_(optimizer)  # fp16: the true gradients, for the clip and the logged norm
            # clip_grad_norm_ returns the norm before clipping; with inf it only measures it
            norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or math.inf)
            lr = get_lr(step, args.max_lr, min_lr, args.warmup_steps, args.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, norm, scale = loss_accum.item(), norm.item(), loss_scale(run.scaler)  # fp16: the scale used
            if guard.skip(step, loss, norm, lr):  # a NaN / inf step is not applied
                continue
            run.scaler.step(optimizer)  # optimizer.step(): its gradients are finite (the guard saw to it)
            run.scaler.update()
            if device_type == "cuda":
                torch.cuda.synchronize()  # the GPU runs behind the CPU: wait for it before reading the clock
        dt = time.perf_counter() - t0
        # --- TRAINING STEP END -------------------------------------------------------------------

        tok_per_sec = args.total_batch_size / dt
        mfu = flops * tok_per_sec / ddp_world_size / peak if peak else None  # of one GPU's peak, per GPU
        record = {"step": step, "train_loss": loss, "lr": lr, "grad_norm": norm, "dt_ms": dt * 1000, **scale}
        record.update(
            tok_per_sec=tok_per_sec, mfu=mfu, tokens=(step + 1) * args.total_batch_size, epoch=train_loader.epoch
        )
        log(record)
    if master_process and run.val_loss is not None:
        print(f"done: {args.max_steps} steps, val loss {run.val_loss:.6f}")
    return 0


# --- Command line: every flag is checked before step 0 (support/checks.py) ---------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The usage examples as written, and every flag's default in --help."""


def parse_args(argv=None):
    """(args, the flags given): on --resume, the flags left out take the checkpoint's values."""
    p = ArgumentParser(prog="train_gpt2.py", description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("--device", default=None, help="cuda, cuda:N, mps or cpu (default: the best available)")
    p.add_argument("--seed", type=int, default=1337, help="model init, shard order")
    p.add_argument("--ddp-timeout", type=float, default=1800, help="seconds a rank waits for the others before failing")
    p.add_argument("--deterministic", action="store_true", help="CUDA kernels that rerun and resume bitwise equal")
    p.add_argument("--dry-run", action="store_true", help="run a job's start-up checks, then exit: nothing is written")
    g = p.add_argument_group("data and output (--data-dir with --resume: the checkpoint's unless given)")
    g.add_argument("--data-dir", default="edu_fineweb10B", help="folder of *_train_*/*_val_* .npy or .bin shards")
    g.add_argument("--no-shuffle", action="store_true", help="read the shards in name order every epoch")
    g.add_argument("--out-dir", default="log", help="log.jsonl and checkpoints of one run go here")
    g = p.add_argument_group("model (taken from the checkpoint with --resume)")
    g.add_argument(
        "--init-from", default="scratch", help="scratch, gpt2*, a transformers dir, a checkpoint, a run's folder"
    )
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
    g.add_argument("--dtype", default="auto", choices=("auto", *AUTOCAST_DTYPES), help="auto: see the README")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, help="torch.compile (None: on for CUDA)")
    g.add_argument("--peak-flops", type=float, help="the device's peak FLOP/s, for MFU (None: a table of GPUs)")
    # on --resume, flags left out are the run's; the machine's (device, dtype, compile, peak-flops, ddp-timeout) are not
    g = p.add_argument_group("evaluation, sampling, checkpoints (with --resume: the run's unless given)")
    g.add_argument("--eval-every", type=int, default=250, help="val loss every N steps (0: never)")
    g.add_argument("--val-tokens", type=int, default=10_485_760, help="val loss over this many tokens (any GPU count)")
    g.add_argument("--hellaswag-every", type=int, default=250, help="HellaSwag every N steps (0: never)")
    g.add_argument("--hellaswag-limit", type=int, default=None, help="only the first N HellaSwag examples")
    g.add_argument("--hellaswag-data", help="a local HellaSwag jsonl (None: hellaswag.py's cache or download)")
    g.add_argument("--sample-every", type=int, default=250, help="print samples every N steps (0: never)")
    g.add_argument("--ckpt-every", type=int, default=1000, help="checkpoint every N steps, and at the end")
    g.add_argument("--keep-ckpts", type=int, default=3, help="keep this run's newest N checkpoints (0: all)")
    g.add_argument(
        "--resume", nargs="?", const="latest", metavar="CKPT", help="the newest in --out-dir, CKPT, a run's folder"
    )
    g.add_argument("--wandb-project", metavar="NAME", help="log to this wandb project too (pip install wandb)")
    g.add_argument("--wandb-run-name", metavar="NAME", help="the wandb run's name (None: the --out-dir folder's)")
    g = p.add_argument_group("sampling (in training, and with --sample-from) and export")
    g.add_argument("--sample-from", metavar="MODEL", help="gpt2*, a transformers dir, a checkpoint, a run's folder")
    g.add_argument("--prompt", default="Hello, I'm a language model,", help="'' starts from <|endoftext|>")
    g.add_argument("--num-samples", type=int, default=4)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--export-hf", nargs=2, metavar=("CKPT", "DIR"), help="write our checkpoint as a transformers dir")
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    try:  # every rank of a torchrun job reads the same command line: a mistake in it is said once
        argv = expand_presets(argv, p)  # @configs/laptop.txt: its flags, then the typed ones (which win)
        args = p.parse_args(argv)
    except UserError as e:
        raise same_on_every_rank(e) from None
    # parsed again onto a namespace that already holds every name: argparse fills in no defaults
    # there, so the names whose value changed are the flags the command line gave
    unset = object()
    again = p.parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(args), unset)))
    given = {name for name, value in vars(again).items() if value is not unset}
    if args.resume not in (None, "latest") and os.path.isdir(args.resume):  # --resume <a run's folder>
        check_not_data_folder(args.resume, f"--resume {args.resume}")
        if "out_dir" in given and os.path.realpath(args.out_dir) != os.path.realpath(args.resume):
            raise UserError(
                f"--resume {args.resume} is a run's folder, --out-dir {args.out_dir} another: continue that "
                f"run with --resume --out-dir {args.resume}, or name the checkpoint to start from"
            )
        args.out_dir, args.resume = args.resume, "latest"  # continue it where it is
        given.add("out_dir")
    return args, frozenset(given)


def main(argv=None):
    args, given = parse_args(argv)
    if args.sample_from and args.export_hf:
        raise UserError("--sample-from and --export-hf are two different jobs: pass one")
    if args.sample_from or args.export_hf:
        check_args(args, 1, given | {"warmup_steps"})  # the sampling settings; training's do not matter here
        if args.dry_run:  # the device, the model, the prompt, the export's folder; nothing loaded or written
            pick_device(args.device)
            return dry_run_job(args, get_tokenizer())  # an export writes the tokenizer too
    if args.sample_from:
        device, _ = pick_device(args.device)
        model = load_model(args.sample_from, device)
        with oom_phase("sample-from", args=args):
            print_samples(model, get_tokenizer(), args)
        return 0
    if args.export_hf:
        ckpt_path, out_dir = args.export_hf
        with said_on_interrupt(f"interrupted: nothing was exported ({out_dir} is as it was); run the command again"):
            model = load_model(ckpt_path)
            model.export_hf(out_dir)
        padding = model.config.vocab_size - GPT2_VOCAB
        rows = f"; its {padding} padding rows of the vocabulary left out" if padding else ""
        print(f"wrote a transformers GPT-2 directory to {out_dir}: the model and GPT-2's tokenizer{rows}")
        return 0
    previous = {s: signal.getsignal(s) for s in StopRequest.SIGNALS}  # train() replaces them
    made = missing_folders(args.out_dir) if int(os.environ.get("RANK", "0")) == 0 else []  # rank 0 makes it
    try:
        return train(args, given)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        release_out_dir()  # the lock; a start that failed leaves the folder as it found it
        remove_made_folders(made)  # a run refused at start leaves no empty --out-dir behind
        if dist.is_initialized():
            dist.destroy_process_group()
        RunLog.finish_wandb()  # last (the ranks leave together): what is queued is logged, the wandb run finished


if __name__ == "__main__":
    run_cli(
        main,
        interrupted="interrupted (a training run continues from its newest checkpoint with --resume)",
        out_of_memory=training_out_of_memory,  # reads the oom_phase the allocation failed in
    )

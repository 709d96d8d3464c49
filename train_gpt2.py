r"""
Reproduce GPT-2 (124M) pretraining on FineWeb-Edu, in one readable file.

Top to bottom, in the order of the recipe: the model and the settings (each field a flag), the device
and its precision, the data (token shards), the learning-rate schedule, the val loss, and the training
loop (a process per GPU under torchrun: DDP); the command line at the end. What keeps a run safe without
changing what it computes (flag checks, checkpoints, resume, signals, the log) is in support/, one module per concern.

Usage:
    python fineweb.py && torchrun --standalone --nproc_per_node=8 train_gpt2.py   # the full recipe
    python train_gpt2.py                                   # the same on one GPU (or CPU: slow)
    python train_gpt2.py --resume                          # continue from the newest log/ckpt_*.pt
    python train_gpt2.py @configs/laptop.txt --max-steps 400   # a laptop's tiny run: a preset, typed flags win
A run's samples: python sample.py log; as a transformers folder: python export_hf.py log gpt2_ours
"""

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, not a traceback from inside an import
    signal.signal(signal.SIGINT, lambda signum, frame: (print("interrupted", file=sys.stderr), os._exit(130)))

import argparse
import math
import platform
import time
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hellaswag
from support.checks import check_args, check_built_model, check_data, check_model, check_wandb
from support.cli import ArgumentParser, Number, UserError, add_flags, flag, run_cli, same_on_every_rank
from support.ddp import fence, setup_distributed
from support.device import choose_compile, keep_freed_memory, set_deterministic
from support.divergence import NonFiniteGuard, check_finite_state
from support.gpu import peak_flops
from support.hf_interop import check_state_dict, load_hf_gpt2
from support.model_files import find_model
from support.out_of_memory import forget_phases, oom_phase, oom_run, training_out_of_memory
from support.precision import AUTOCAST_DTYPES, autocast, grad_scaler, loss_scale, pick_dtype
from support.presets import parse_with_presets
from support.resume import RECIPE, RUN_SETTING, restore_training_state, resume_checkpoint, resume_folder
from support.run_folder import checkpoint_path, save_checkpoint
from support.run_log import RunLog
from support.sampling import Sampling, check_sampling, log_samples
from support.shards import (
    ShardFile,
    check_batch_fits,
    check_batch_ids,
    data_identity,
    find_shards,
    get_tokenizer,
    load_shard,
)
from support.signals import StopRequest

# --- The model ------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    """model (the recipe: with --resume, the checkpoint's; another value is refused)"""

    block_size: int = flag(1024, "the model's context length", Number.POSITIVE)  # max sequence length
    vocab_size: int = flag(50257, "50257 padded to a multiple of 128: faster matmuls", int, flag_default=50304)
    n_layer: int = flag(12, "transformer blocks", Number.POSITIVE)
    n_head: int = flag(12, "attention heads per block", Number.POSITIVE)
    n_embd: int = flag(768, "the residual stream's width", Number.POSITIVE)


@dataclass
class Recipe:
    """batch, optimizer, schedule (the recipe too; on --resume -B, --max-steps and the lr may change)"""

    batch_size: int = flag(64, "micro-batch rows per GPU (B)", Number.POSITIVE, short="-B")
    seq_len: int = flag(1024, "tokens per row (T)", Number.POSITIVE, short="-T")
    total_batch_size: int = flag(524288, "tokens per optimizer step (2**19)", Number.POSITIVE)
    max_steps: int = flag(19073, "10B tokens / 524,288", Number.POSITIVE)
    warmup_steps: int = flag(715, "linear warm-up steps", Number.COUNT)
    max_lr: float = flag(6e-4, "peak learning rate", Number.ABOVE_ZERO)
    min_lr: float | None = flag(None, "the lr the cosine ends at (None: 0.1 * max-lr)", Number.FINITE)
    weight_decay: float = flag(0.1, "AdamW's, on matrices and embeddings only", Number.AMOUNT)
    beta1: float = flag(0.9, "AdamW beta1", Number.FRACTION)
    beta2: float = flag(0.95, "AdamW beta2", Number.FRACTION)
    adam_eps: float = flag(1e-8, "AdamW epsilon", Number.ABOVE_ZERO)
    grad_clip: float = flag(1.0, "max global grad norm; 0 turns clipping off", Number.AMOUNT)
    seed: int = flag(1337, "model init, shard order", Number.SEED)
    no_shuffle: bool = flag(False, "read the shards in name order every epoch")


@dataclass
class RunSettings:
    """data, evaluation, sampling, checkpoints (with --resume: the run's unless given)"""

    data_dir: str = flag("edu_fineweb10B", "folder of *_train_*/*_val_* .npy or .bin shards")
    eval_every: int = flag(250, "val loss every N steps (0: never)", Number.COUNT)
    val_tokens: int = flag(10_485_760, "val loss over this many tokens (any GPU count)", Number.COUNT)
    hellaswag_every: int = flag(250, "HellaSwag every N steps (0: never)", Number.COUNT)
    hellaswag_limit: int | None = flag(None, "only the first N HellaSwag examples", Number.POSITIVE)
    hellaswag_data: str | None = flag(None, "a local HellaSwag jsonl (None: hellaswag.py's cache or download)")
    ckpt_every: int = flag(1000, "checkpoint every N steps, and at the end", Number.COUNT)
    keep_ckpts: int = flag(3, "keep this run's newest N checkpoints (0: all)", Number.COUNT)
    deterministic: bool = flag(False, "CUDA kernels that rerun and resume bitwise equal")
    wandb_project: str | None = flag(None, "log to this wandb project too (pip install wandb)", metavar="NAME")
    wandb_run_name: str | None = flag(None, "the wandb run's name (None: the --out-dir folder's)", metavar="NAME")
    sample_every: int = flag(250, "print samples every N steps (0: never)", Number.COUNT)


@dataclass
class Job:
    """the job and the machine (never taken from a checkpoint)"""

    out_dir: str = flag("log", "log.jsonl and checkpoints of one run go here")
    resume: str | None = flag(None, "the newest in --out-dir, CKPT, a run's folder", const="latest", metavar="CKPT")
    init_from: str = flag("scratch", "scratch, gpt2*, a transformers dir, a checkpoint, a run's folder")
    dry_run: bool = flag(False, "run the start-up checks, then exit: nothing is trained or written")
    device: str | None = flag(None, "cuda, cuda:N, mps or cpu (None: the best available)")
    dtype: str = flag("auto", "auto: see the README", choices=("auto", *AUTOCAST_DTYPES))
    compile: bool | None = flag(None, "torch.compile (None: on for CUDA)", action=argparse.BooleanOptionalAction)
    peak_flops: float | None = flag(
        None, "the device's peak FLOP/s, for MFU (None: a table of GPUs)", Number.ABOVE_ZERO
    )
    ddp_timeout: float = flag(1800, "seconds a rank waits for the others", Number.DDP_SECONDS)


# Each dataclass of flags: their role on --resume (support/resume.py); its docstring: their group's title in --help
FLAGS = {Job: None, GPTConfig: RECIPE, Recipe: RECIPE, RunSettings: RUN_SETTING, Sampling: RUN_SETTING}
ROLES = {f.name: role for cls, role in FLAGS.items() for f in fields(cls)}


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
    # imports torch._dynamo, seconds of a hellaswag.py or sample.py start-up on a CPU
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

    def forward(self, idx, targets=None):
        x = self.hidden_states(idx)
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
        return self.transformer.ln_f(x)

    def configure_optimizers(self, weight_decay, learning_rate, device_type, betas=(0.9, 0.95), eps=1e-8, verbose=True):
        """AdamW that decays only the tensors with dim >= 2 (embeddings and matmul weights):
        decaying biases and LayerNorm gains would only pull them towards 0 for no benefit."""
        params = [p for p in self.parameters() if p.requires_grad]  # the tied wte/lm_head weight once
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # the fused kernel updates every tensor in one launch instead of a chain of small ones
        # (torch has it for cuda, mps and cpu, every device pick_device allows)
        fused = device_type in ("cuda", "mps", "cpu")
        if verbose:
            print(f"decayed tensors: {len(decay)}, with {sum(p.numel() for p in decay):,} parameters")
            print(f"non-decayed tensors: {len(no_decay)}, with {sum(p.numel() for p in no_decay):,} parameters")
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


def flops_per_token(config, T):
    """Training FLOPs per token (forward + backward) at sequence length T, the nanoGPT / PaLM
    count: 6 per parameter in a matmul (2 forward, 4 backward) plus the attention scores and
    their weighted sum, 12 * n_layer * n_head * head_dim * T. Position embeddings are a lookup,
    not a matmul; the token embedding is counted because lm_head (tied to it) is a matmul.
    GPT-2 124M at T=1024: about 855 MFLOP per token."""
    C = config.n_embd
    n_params = config.vocab_size * C + config.n_layer * (12 * C * C + 13 * C) + 2 * C  # without wpe
    return 6 * n_params + 12 * config.n_layer * config.n_head * (C // config.n_head) * T


def load_model(spec, device="cpu"):
    """A model from a name (gpt2, gpt2-medium, ...), a transformers directory, our checkpoint, or
    a training run's --out-dir (its newest checkpoint)."""
    kind, spec, ckpt = find_model(spec)
    model = GPT.from_pretrained(spec) if kind == "transformers" else model_from_checkpoint(ckpt, spec)
    return model.to(device)


def model_from_checkpoint(ckpt, path):
    """The GPT a checkpoint (load_checkpoint's) holds; weights that do not fit its config are a UserError."""
    return GPT.from_state_dict(GPTConfig(**ckpt["model_config"]), ckpt["model"], f"checkpoint {path}")


# --- Device and precision: TF32 and bf16 autocast on CUDA, torch.compile --------------------------


def set_precision_and_seeds(args, device, world_size, grad_accum_steps, master_process):
    """bf16 (fp16) autocast, TF32 and compile on CUDA, the seed, --deterministic; rank 0 says how the
    run computes. -> (the dtype's name, why that one, whether to compile)."""
    device_type = torch.device(device).type
    if device_type == "cpu":
        keep_freed_memory()  # faster steps for small models: see its docstring
    dtype, why = pick_dtype(args.dtype, device_type)
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the matmuls autocast leaves in fp32
    if args.deterministic:
        set_deterministic(device_type)
    torch.manual_seed(args.seed)  # the same init on every rank (DDP also broadcasts rank 0's)
    use_compile = choose_compile(args.compile, device_type, verbose=master_process)
    B, T, total = args.batch_size, args.seq_len, args.total_batch_size
    if master_process:
        print(f"device {device} x {world_size} | dtype {dtype} ({why}) | compile {use_compile}")
        print(f"total batch {total:,} tokens = B {B} x T {T} x {world_size} ranks x {grad_accum_steps} micro-steps")
    return dtype, why, use_compile


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
        sizes = []
        for path in self.shards:  # checks every shard now, not hours later
            tokens = load_shard(path)
            check_batch_ids(tokens[:1024], vocab_size, path, 0)  # another tokenizer's, by its first ids
            sizes.append(len(tokens))
        self.batches_per_epoch = sum(max(0, (n - 1) // self.chunk) for n in sizes)  # a batch never spans two shards
        check_batch_fits(self.batches_per_epoch, sizes, self.chunk, data_dir, split)
        self.tokens_per_epoch = self.batches_per_epoch * self.chunk
        self.identity = data_identity(data_dir)  # the folder's shards: a checkpoint records them, --resume checks
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


def load_data(args, config, ddp_rank, ddp_world_size, device, master_process):
    """(the train loader of this rank's slices, the val set or None), checked against the run now."""
    oom_phase("reading the data", val_tokens=args.val_tokens)
    order = dict(rank=ddp_rank, world_size=ddp_world_size, shuffle=not args.no_shuffle, seed=args.seed)
    B, T, data_dir, vocab_size = args.batch_size, args.seq_len, args.data_dir, config.vocab_size
    try:  # every rank reads the folder (a node's may be its own): a mistake in it is said once a node
        train_loader = DataLoaderLite(data_dir, "train", B, T, **order, vocab_size=vocab_size, device=device)
        n_val = args.val_tokens if args.eval_every > 0 else 0  # --eval-every 0: no val loss, as --val-tokens 0
        val_tokens = load_val_tokens(data_dir, n_val, vocab_size)
        check_data(data_dir, train_loader, val_tokens, n_val, args.total_batch_size, args.max_steps, master_process)
    except UserError as e:
        raise same_on_every_rank(e) from None
    return train_loader, val_tokens


# --- Schedule -------------------------------------------------------------------------------------


def warmup_lr(step, max_lr, warmup_steps):
    """The lr of warm-up step `step`: linear up to max_lr. Step 0 already gets max_lr / warmup_steps:
    a step at lr 0 would be a wasted step."""
    return max_lr * (step + 1) / warmup_steps


def get_lr(step, max_lr, min_lr, warmup_steps, max_steps):
    """Linear warmup to max_lr, then cosine decay to min_lr at max_steps, min_lr after."""
    if step < warmup_steps:
        return warmup_lr(step, max_lr, warmup_steps)
    if step >= max_steps:
        return min_lr
    decay_ratio = (step - warmup_steps) / (max_steps - warmup_steps)  # 0 .. 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 .. 0
    return min_lr + coeff * (max_lr - min_lr)


# --- Evaluation: the val loss (HellaSwag is hellaswag.py's) ---------------------------------------


@torch.no_grad()
def evaluate_val_loss(model, val_tokens, B, T, device, autocast_dtype=None, rank=0, world_size=1, should_stop=None):
    """Mean next-token loss over the val set cut into sequences of T tokens. Rank r scores
    sequences r, r + world_size, ... in batches of B and the sums are reduced, so the result is
    the same number whatever the GPU count or B. None when should_stop() interrupted it. Rank 0
    says where a long one is."""
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
        if rank == 0 and time.time() - t_print > 10:  # a long eval says where it is, as HellaSwag's does
            t_print = time.time()
            print(f"val loss: batch {i // B + 1}/{n_batches}, {t_print - t0:.0f} s", file=sys.stderr, flush=True)
        rows = np.stack([val_tokens[j * T : j * T + T + 1] for j in mine[i : i + B]]).astype(np.int64)
        buf = torch.from_numpy(rows).to(device)
        with autocast(device_type, autocast_dtype):
            loss = model(buf[:, :-1], buf[:, 1:])[1]
        totals[0] += loss.float() * buf[:, 1:].numel()
    model.train()
    if world_size > 1:  # every rank reaches this, interrupted or not: no rank waits for another
        dist.all_reduce(totals)
    loss_sum, interrupted = totals.tolist()
    return None if interrupted else loss_sum / (n_seq * T)


# --- The training run: the model, the side evaluations, and the loop -----------------------------


def build_model(args, given, ckpt, ckpt_path, device, master_process):
    """The checkpoint's model on --resume, else a new one from the model flags or --init-from."""
    oom_phase("building the model", init_from=args.init_from, resume=bool(args.resume))
    flags = GPTConfig(**{f.name: getattr(args, f.name) for f in fields(GPTConfig)})  # the model flags
    if ckpt is not None:
        model = model_from_checkpoint(ckpt, ckpt_path)
    elif args.init_from == "scratch":
        check_model(flags, device)  # before building it: a model too big would take minutes to fail
        model = GPT(flags)
    else:
        model = load_model(args.init_from)
    check_built_model(model.config, flags, args.seq_len, args.init_from, given, master_process)
    if master_process:
        print(f"model: {asdict(model.config)}, {sum(p.numel() for p in model.parameters()):,} parameters")
    return model.to(device)


def train(args, given, on_exit):
    # --- processes and device; on --resume the checkpoint and its recipe; then every flag is checked --
    ddp, ddp_rank, ddp_local_rank, ddp_world_size, device = setup_distributed(args.device, args.ddp_timeout)
    if ddp:
        on_exit.callback(dist.destroy_process_group)
    device_type, master_process = torch.device(device).type, ddp_rank == 0  # rank 0 prints, logs, checkpoints
    ckpt_path, ckpt, run_id, args, changes, records, moved = resume_checkpoint(
        args.out_dir, args.resume, args.dry_run, args, given, ROLES, ddp, master_process, on_exit
    )
    recipe = Recipe(**{f.name: getattr(args, f.name) for f in fields(Recipe)})  # as the checkpoint and flags make it
    check_args(recipe, ddp_world_size, args.resume, args.init_from, given, warmup_lr)
    check_wandb(args.wandb_project, args.wandb_run_name, args.resume)
    B, T = args.batch_size, args.seq_len
    grad_accum_steps = args.total_batch_size // (B * T * ddp_world_size)
    dtype, why, use_compile = set_precision_and_seeds(args, device, ddp_world_size, grad_accum_steps, master_process)
    autocast_dtype = AUTOCAST_DTYPES[dtype]  # None: fp32

    # --- model and data; evaluation, sampling and checkpoints use raw_model, not compile's or DDP's ---
    raw_model = build_model(args, given, ckpt, ckpt_path, device, master_process)
    flops = flops_per_token(raw_model.config, T)  # a token's forward and backward, for MFU
    oom_run(raw_model.config, device, autocast_dtype, B, T, args.total_batch_size, args.out_dir)  # for its advice
    train_loader, val_tokens = load_data(args, raw_model.config, ddp_rank, ddp_world_size, device, master_process)

    # --- optimizer and schedule ---------------------------------------------------------------------
    min_lr = args.min_lr if args.min_lr is not None else 0.1 * args.max_lr
    betas, eps = (args.beta1, args.beta2), args.adam_eps
    optimizer = raw_model.configure_optimizers(args.weight_decay, args.max_lr, device_type, betas, eps, master_process)
    scaler = grad_scaler(dtype, device_type)  # fp16's loss scaling; a no-op for bf16 and fp32
    start_step, val_loss = restore_training_state(ckpt, ckpt_path, optimizer, train_loader, scaler, args.max_steps)
    del ckpt  # the weights and optimizer state now live in the model and optimizer
    oom_phase("start")
    model = torch.compile(raw_model) if use_compile else raw_model
    if ddp:
        model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)

    # --- what runs mid-training is exercised now, not first at hour three; then the log -------------
    enc = get_tokenizer() if args.hellaswag_every > 0 or args.sample_every > 0 else None
    examples, hs_off, sampling = None, None, None  # HellaSwag's examples or why not, the samples' Sampling
    if args.hellaswag_every > 0:  # None after a warning: a run never dies for want of its side evaluation
        examples, hs_off = hellaswag.load_for_run(args.hellaswag_data, args.hellaswag_limit, enc, master_process, ddp)
    if args.sample_every > 0:
        sampling = Sampling(args.prompt, args.num_samples, args.max_new_tokens, args.temperature, args.top_k)
        check_sampling(raw_model, enc, sampling, autocast_dtype, master_process)
    if args.dry_run:  # every start-up check passed; nothing is trained or written
        print("dry run: the flags, the data, --out-dir and the sampling check are fine")
        return 0
    name = torch.cuda.get_device_name(device) if device_type == "cuda" else platform.processor() or device
    derived = dict(grad_accum_steps=grad_accum_steps, world_size=ddp_world_size, dtype=dtype, dtype_reason=why)
    derived.update(compile=use_compile, model_config=asdict(raw_model.config), flops_per_token=flops)
    derived.update(hellaswag_off=hs_off)  # said in the log too, where play.ipynb shows it
    config = {**vars(args), "data_dir": os.path.abspath(args.data_dir)}  # the run's flags: --resume from anywhere
    every = dict(val_loss=args.eval_every, hellaswag=args.hellaswag_every, samples=args.sample_every)  # for the ETA
    log = RunLog(args.out_dir, master_process, args.max_steps, every, records)  # the log as read at start
    log.mirror(args.wandb_project, args.wandb_run_name, run_id, on_exit)  # to wandb too, when asked for
    log.header(run_id, name, start_step or None, changes, {**config, **derived}, moved)
    peak = args.peak_flops or (peak_flops(name) if device_type == "cuda" else None)  # MFU: of one GPU's peak

    def checkpoint(step):  # every rank: rank 0 writes, the others wait for it
        ckpt = dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(), data=train_loader.state_dict())
        ckpt.update(scaler=scaler.state_dict() if scaler.is_enabled() else None, model_config=asdict(raw_model.config))
        ckpt.update(run_id=run_id, step=step, val_loss=val_loss)
        ckpt.update(world_size=ddp_world_size, data_identity=train_loader.identity)  # the shards it started on
        ckpt.update(train_config=config)
        oom_phase("writing the checkpoint", step=step)
        check_finite_state(ckpt, args.out_dir, log.trained, args.max_lr)  # never a checkpoint of non-finite weights
        with stop.during_write(checkpoint_path(args.out_dir, step), say=master_process):  # ranks 1..: wait in the fence
            path = save_checkpoint(ckpt, args.out_dir, args.keep_ckpts, log.trained) if master_process else None
            fence(ddp)  # not a collective that times out during a long write
        return path

    stop = StopRequest(args.out_dir, on_exit)  # the signal handlers from before the run, back as it ends
    guard = NonFiniteGuard(log, master_process, checkpoint, args.out_dir, args.max_lr, scaler)
    for step in range(start_step, args.max_steps + 1):  # evaluate the model after `step` updates, then update
        last_step = step == args.max_steps
        fresh = step > start_step or step == 0  # not the step a run resumes at: evaluated before its checkpoint
        # once in a while evaluate the val loss (every rank, even one with a stop request: it all-reduces)
        if val_tokens is not None and fresh and (step % args.eval_every == 0 or last_step):
            oom_phase("val loss", step=step)
            val = evaluate_val_loss(raw_model, val_tokens, B, T, device, autocast_dtype, ddp_rank, ddp_world_size, stop)
            if val is not None:  # None: a stop request cut it short
                val_loss = val
                log({"step": step, "val_loss": val_loss})
        # once in a while evaluate HellaSwag (every rank its share)
        if examples is not None and fresh and (step % args.hellaswag_every == 0 or last_step) and not stop():
            oom_phase("HellaSwag eval", step=step)
            result = hellaswag.evaluate_all_ranks(
                raw_model, examples, device, autocast_dtype, ddp_rank, ddp_world_size, stop
            )
            if result is not None:
                log({"step": step, **result})
        # once in a while generate some samples
        if sampling is not None and fresh and (step % args.sample_every == 0 or last_step) and step > 0 and not stop():
            log_samples(step, raw_model, enc, sampling, autocast_dtype, log, stop)
        # once in a while, and when a stop signal came (every rank at the same step), save a checkpoint
        signum = stop.agreed(device, ddp)
        if signum or (step > start_step and (last_step or args.ckpt_every and step % args.ckpt_every == 0)):
            checkpoint(step)
        if signum or last_step:
            break

        # the optimization step: the batch's gradients over grad_accum_steps micro-batches, then the update
        t0 = time.perf_counter()
        oom_phase("training step", step=step, first=step == start_step)
        optimizer.zero_grad(set_to_none=True)
        loss_accum = torch.zeros((), device=device)
        for micro_step in range(grad_accum_steps):
            x, y = train_loader.next_batch()
            # DDP all-reduces gradients in backward; only the last micro-step needs it, and DDP
            # decides in forward whether to, so no_sync() covers forward and backward
            with model.no_sync() if ddp and micro_step < grad_accum_steps - 1 else nullcontext():
                with autocast(device_type, autocast_dtype):
                    loss = model(x, y)[1]  # logits not kept: held, they would sit beside the next batch's
                # each micro-batch's loss is a mean over B*T tokens; the batch's is the mean of those
                loss = loss / grad_accum_steps
                loss_accum += loss.detach()
                scaler.scale(loss).backward()  # fp16: times the loss scale (else unchanged)
        if ddp:  # the logged loss is the whole batch's, over every rank (gloo has no AVG)
            dist.all_reduce(loss_accum)
            loss_accum /= ddp_world_size
        scaler.unscale_(optimizer)  # fp16: the true gradients, for the clip and the logged norm
        # clip_grad_norm_ returns the norm before clipping; with inf it only measures it
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf)
        loss, norm, scale = loss_accum.item(), norm.item(), loss_scale(scaler)  # the scale these gradients had
        lr = get_lr(step, args.max_lr, min_lr, args.warmup_steps, args.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if guard.skip(step, loss, norm, lr):  # a NaN / inf step is not applied
            continue
        scaler.step(optimizer)  # optimizer.step(): its gradients are finite (the guard saw to it)
        scaler.update()
        if device_type == "cuda":
            torch.cuda.synchronize()  # the GPU runs behind the CPU: wait for it before reading the clock
        dt = time.perf_counter() - t0
        tok_per_sec, tokens = args.total_batch_size / dt, (step + 1) * args.total_batch_size
        mfu = flops * tok_per_sec / ddp_world_size / peak if peak else None  # of one GPU's peak, per GPU
        record = dict(step=step, train_loss=loss, lr=lr, grad_norm=norm, **scale, epoch=train_loader.epoch)
        log({**record, "dt_ms": dt * 1000, "tok_per_sec": tok_per_sec, "mfu": mfu, "tokens": tokens})
    if signum:
        return 128 + signum  # the shell's code for "ended by this signal"
    if master_process and val_loss is not None:
        print(f"done: {args.max_steps} steps, val loss {val_loss:.6f}")
    return 0


# --- Command line: made from the flags' dataclasses (FLAGS) -------------------------------------


def command_line():
    """(the parser of FLAGS' flags, {flag: its default}); parsed, its namespace holds the flags given (add_flags)."""
    p = ArgumentParser(prog="train_gpt2.py", description=__doc__, allow_abbrev=False)  # add_flags says the defaults
    defaults = {}
    for cls in FLAGS:
        if cls is not Sampling:  # Sampling's flags (sample.py's too) join RunSettings' group
            group = p.add_argument_group(cls.__doc__)
        defaults.update(add_flags(group, cls))
    return p, defaults


def parse_args(argv=None):
    """(args: the defaults, the flags given over them; {flag given: "" typed, or "FILE, line N" of its preset})."""
    p, defaults = command_line()
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    try:  # every rank of a torchrun job parses the same command line (@presets too): said once
        typed, given = parse_with_presets(argv, p)
    except UserError as e:
        raise same_on_every_rank(e) from None
    moved = resume_folder(typed.get("resume"), typed.get("out_dir"))  # --resume <a run's folder>: its --out-dir
    return argparse.Namespace(**{**defaults, **typed, **moved}), {**given, **dict.fromkeys(moved, "")}


def main(argv=None):
    args, given = parse_args(argv)
    forget_phases()  # a start of its own: no phase of an earlier main() in this process is in progress
    with ExitStack() as on_exit:  # what the run takes, given back in reverse order however it ends
        return train(args, given, on_exit)


if __name__ == "__main__":
    run_cli(
        main,
        interrupted="interrupted (a training run continues from its newest checkpoint with --resume)",
        out_of_memory=training_out_of_memory,  # words the phase marked last (oom_phase)
    )

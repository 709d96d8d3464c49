"""What a GPU gives a run's numbers: its datasheet peak FLOP/s (MFU's denominator), its memory (or the
machine's, for a model elsewhere) and the micro-batch -B it fits (which the out-of-memory advice names)."""

import os

import torch

# --- GPU memory: the micro-batch B that fits ---------------------------------------------------

TRAIN_BYTES_PER_PARAMETER = 16  # fp32 weights, their gradients and AdamW's two moments
GiB = 2**30
RECIPE_PARAMS = 124_475_904  # GPT-2 124M with the vocabulary padded to 50,304
# measured (docs/performance.md): the recipe's peak on an H100 at B 64, T 1024, bf16 autocast, compile
MEASURED_PEAK, MEASURED_TOKENS = 41.2 * GiB, 64 * 1024
FIXED_BYTES = TRAIN_BYTES_PER_PARAMETER * RECIPE_PARAMS  # whatever B is
BYTES_PER_TOKEN = (MEASURED_PEAK - FIXED_BYTES) / MEASURED_TOKENS  # the rest, spread over the micro-batch
USABLE = 0.9  # of the GPU's memory: the rest for the CUDA context, the allocator's slack, eager's extra


def training_memory(B, T):
    """Estimated peak bytes of the 124M recipe's training step at micro-batch B x T (bf16/fp16
    autocast): the fixed part plus the measured peak's remainder, linear in the tokens."""
    return FIXED_BYTES + B * T * BYTES_PER_TOKEN


def fitting_B(B, T, gpu_memory):
    """The largest divisor of B (so the total batch stays a whole number of micro-batches) whose
    training_memory fits in USABLE of gpu_memory bytes, or None if not even 1 does."""
    fits = [d for d in range(1, B + 1) if B % d == 0 and training_memory(d, T) <= USABLE * gpu_memory]
    return max(fits, default=None)


def device_memory(device):
    """(bytes, what they are) of the memory a model on device lives in: a CUDA GPU's own, else the
    machine's RAM (a CPU's, and MPS's, which shares it); (None, None) where it cannot be read."""
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the GPU's memory ({props.name})"
    names = getattr(os, "sysconf_names", {})
    if "SC_PHYS_PAGES" in names and "SC_PAGE_SIZE" in names:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's memory"
    return None, None


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
    return next((flops for name, flops in PEAK_FLOPS if name in device_name), None)  # the first match

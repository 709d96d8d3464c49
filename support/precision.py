"""Mixed precision: the autocast dtype a run computes in and why (--dtype auto), autocast to it,
and fp16's loss scaling (torch.amp.GradScaler), with what the step record shows of it."""

import torch

# the autocast dtype of each --dtype (None: no autocast, fp32 throughout)
AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": None}

# GradScaler's default first scale (2**16). fp16 overflows above 65504, so the first steps often
# overflow at it and are skipped while the scale halves down to one that fits the gradients
INIT_SCALE = 2.0**16


def autocast(device_type, dtype):
    """Autocast to dtype (bf16 or fp16) when it is set, a no-op otherwise."""
    return torch.autocast(device_type=device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def pick_dtype(requested, device_type):
    """(dtype name, why) for --dtype. An explicit dtype is used as given. auto: bf16 where the current
    CUDA GPU computes it natively (compute capability 8.0 and up: A100, RTX 30xx, H100, ...); fp16 with
    loss scaling on older CUDA GPUs (T4, V100, GTX 10xx, RTX 20xx), where torch.cuda.is_bf16_supported()
    is true by emulation, without tensor cores; fp32 on a CPU or a Mac."""
    if requested != "auto":
        return requested, f"--dtype {requested}"
    if device_type != "cuda":
        return "float32", f"auto: fp32 on {device_type}, not a CUDA GPU"
    capability = torch.cuda.get_device_capability()
    cc = f"compute capability {capability[0]}.{capability[1]}"
    if tuple(capability) >= (8, 0):
        return "bfloat16", f"auto: {cc} has native bf16"
    return "float16", f"auto: {cc}, below 8.0, has no native bf16: fp16 with loss scaling"


def grad_scaler(dtype, device_type):
    """fp16's loss scaler: the loss is multiplied by the scale before backward, so that small
    gradients do not flush to zero in fp16, and the gradients are divided by it again before the
    clip and the update; a step whose scaled gradients overflowed is skipped and the scale halved
    (and doubled after 2000 steps without one). Disabled for bf16 and fp32: every call a no-op."""
    return torch.amp.GradScaler(device_type, init_scale=INIT_SCALE, enabled=dtype == "float16")


def loss_scale(scaler):
    """{"loss_scale": the scale this step's gradients were computed at} for the step record; {} without fp16."""
    return {"loss_scale": scaler.get_scale()} if scaler is not None and scaler.is_enabled() else {}

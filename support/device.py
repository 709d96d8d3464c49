"""The device a run trains on and how torch runs there: the device picked (or checked), whether
torch.compile works on it, deterministic kernels, and glibc's allocator keeping a CPU run's freed
memory."""

import ctypes
import functools
import os

import torch

from support.cli import UserError, first_line, same_on_every_rank

# --- the device: the best this machine has, or the one asked for ------------------------------


def pick_device(requested=None):
    """cuda > mps > cpu, or --device (requested) where this machine has it; returns (device, device_type)."""
    has = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    device = requested or next(kind for kind in has if has[kind])
    device_type = device.split(":")[0]
    if device_type not in has:
        raise UserError(f"unknown device {device!r}: use cuda, cuda:N, mps or cpu")
    if not has[device_type]:
        raise UserError(
            f"--device {device_type} was asked for but {device_type.upper()} is not available: use --device cpu"
        )
    return device, device_type


# --- torch.compile: on by default where it pays, and only where it works ----------------------

COMPILE_BY_DEFAULT = ("cuda",)  # device types that compile unless --no-compile; elsewhere --compile asks for it


@functools.cache  # one check per device in a process (the model's compile itself is cached likewise)
def compile_problem(device):
    """Why torch.compile cannot work on device, or None. A tiny elementwise function, compiled
    with the default backend (Inductor) and run once, needs what the model's compile needs: a
    C++ compiler on a CPU (the CXX variable or g++), Triton on a GPU (Windows has none by default)."""
    try:
        torch.compile(lambda t: t * 2 + 1, dynamic=False)(torch.ones(8, device=device))
    except Exception as e:  # Inductor's errors have no common type: any failure here says it cannot work
        return first_line(e)
    return None


def choose_compile(requested, device_type, verbose=True, problem=compile_problem):
    """Whether the run compiles: --compile (True), --no-compile (False) or the default (None: on
    for COMPILE_BY_DEFAULT). A compile that cannot work (problem(device_type) says why) is one
    error line when asked for, and by default a note (when verbose) and an eager run."""
    if requested is False or (requested is None and device_type not in COMPILE_BY_DEFAULT):
        return False
    why = problem(device_type)
    if why is None:
        return True
    if requested:
        raise same_on_every_rank(
            UserError(f"--compile: torch.compile does not work on this {device_type} ({why}); run with --no-compile")
        )
    if verbose:
        print(f"note: torch.compile does not work on this {device_type} ({why}): training without it (slower)")
    return False


def keep_freed_memory():
    """Make glibc's malloc keep the memory a CPU run frees, for the next step to reuse.

    On a CPU the activations and the (B, T, vocab) logits live in the C heap. glibc gives every
    block above its mmap threshold its own mmap and unmaps it when freed (and trims the heap's
    top likewise), so each step the kernel maps and zeroes those pages afresh: for small models
    that page faulting costs as much as the compute. Kept, the memory is reused (bench.py
    measures the gain). The cost: the heap holds its high-water mark, the step's and the evals'
    layouts side by side (about twice the peak RSS). A no-op where libc is not glibc."""
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
    import torch._inductor.config as inductor_config  # noqa: PLC0415  a second to import: only --deterministic needs it

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
    inductor_config.deterministic = True

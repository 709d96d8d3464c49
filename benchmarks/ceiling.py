"""The matmul ceiling: the GFLOP/s a large square torch.mm reaches on this device, fp32 and bf16."""

import torch

from benchmarks.report import comparison
from benchmarks.timing import interleave, rates, stats


def matmul_fn(n, dtype, device):
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return lambda: torch.mm(a, b)


def onednn_fp32_fn(n):
    """The same fp32 product through oneDNN's matmul, which torch.mm and nn.Linear do not use for
    fp32 on x86 (they call MKL, whose sgemm on AMD CPUs runs at about AVX2 speed), or None where
    torch lacks the op."""
    linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if linear is None:
        return None
    a, b = torch.randn(n, n), torch.randn(n, n)
    return lambda: linear(a, b, None, "none", [], "")  # a @ b.T: the same 2 n^3 FLOPs


def bench_ceiling(s, device, device_type):
    n = s["mm_n"]
    contenders = {"fp32": matmul_fn(n, torch.float32, device), "bf16": matmul_fn(n, torch.bfloat16, device)}
    if device_type == "cpu" and onednn_fp32_fn(8) is not None:
        contenders["fp32 oneDNN"] = onednn_fp32_fn(n)
    times, _ = interleave(contenders, *s["mm_rounds"], device_type, f"ceiling {n}x{n} matmul")
    gflops = {k: rates(2 * n**3 / 1e9, v) for k, v in times.items()}
    result = {"n": n, "gflops": {k: stats(v) for k, v in gflops.items()}}
    rows = [
        comparison(
            f"matmul ceiling fp32 ({n}x{n} torch.mm{', TF32 as training sets it' if device_type == 'cuda' else ''})",
            gflops["fp32"],
            None,
            "GFLOP/s",
        ),
        comparison(f"matmul ceiling bf16 ({n}x{n} torch.mm)", gflops["bf16"], None, "GFLOP/s"),
    ]
    if "fp32 oneDNN" in gflops:
        rows.append(
            comparison(
                f"matmul fp32 through oneDNN ({n}x{n})",
                gflops["fp32 oneDNN"],
                gflops["fp32"],
                "GFLOP/s",
                note="for reference: nn.Linear and torch.mm call MKL for fp32",
            )
        )
    return result, rows

"""--dtype auto's choice (support/precision.py pick_dtype): bf16 only where the GPU computes it
natively, fp16 on older CUDA GPUs, fp32 off CUDA; an explicit --dtype as given."""

import pytest

from support.precision import pick_dtype


@pytest.mark.parametrize(
    "requested, device_type, capability, dtype, why",
    [
        ("auto", "cuda", (6, 1), "float16", "compute capability 6.1"),  # GTX 10xx
        ("auto", "cuda", (7, 0), "float16", "compute capability 7.0"),  # V100
        ("auto", "cuda", (7, 5), "float16", "compute capability 7.5"),  # T4
        ("auto", "cuda", (8, 0), "bfloat16", "compute capability 8.0"),  # A100
        ("auto", "cuda", (9, 0), "bfloat16", "compute capability 9.0"),  # H100
        ("auto", "cpu", None, "float32", "fp32 on cpu"),
        ("auto", "mps", None, "float32", "fp32 on mps"),
        *[(dtype, "cuda", (7, 0), dtype, f"--dtype {dtype}") for dtype in ("float32", "bfloat16", "float16")],
    ],
)
def test_the_dtype_a_run_computes_in_and_the_reason_said(requested, device_type, capability, dtype, why):
    picked, said = pick_dtype(requested, device_type, capability)
    assert picked == dtype and why in said, said

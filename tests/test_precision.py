"""--dtype auto's choice (support/precision.py pick_dtype): bf16 only where the GPU computes it
natively, fp16 on older CUDA GPUs, fp32 off CUDA; an explicit --dtype as given."""

import pytest

from support.precision import pick_dtype


@pytest.mark.parametrize(
    "capability, dtype",
    [((7, 0), "float16"), ((7, 5), "float16"), ((6, 1), "float16"), ((8, 0), "bfloat16"), ((9, 0), "bfloat16")],
)
def test_auto_on_cuda_is_bf16_from_compute_capability_8(capability, dtype):
    """V100 (7.0), T4 (7.5), GTX 10xx (6.1): fp16; A100 (8.0), H100 (9.0): bf16. The reason names the capability."""
    picked, why = pick_dtype("auto", "cuda", capability)
    assert picked == dtype
    assert f"compute capability {capability[0]}.{capability[1]}" in why


@pytest.mark.parametrize("device_type", ["cpu", "mps"])
def test_auto_without_cuda_is_fp32(device_type):
    assert pick_dtype("auto", device_type)[0] == "float32"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_used_as_given(dtype):
    assert pick_dtype(dtype, "cuda", (7, 0)) == (dtype, f"--dtype {dtype}")

"""support/gpu.py: the -B a GPU's memory fits, from the recipe's peak measured on an H100 (41.2 GiB at
B 64, T 1024), against numbers worked by hand."""

import pytest

from helpers import GiB
from support.gpu import fitting_B

# Worked by hand: the fixed part is 16 bytes (fp32 weight, gradient, AdamW's two moments) x
# 124,475,904 parameters = 1.855 GiB; the rest of 41.2 GiB over B 64 is (41.2 - 1.855) / 64 =
# 0.6148 GiB a row of 1,024 tokens. So B 8 needs 6.77 GiB, B 16 11.69, B 32 21.53, B 64 41.2,
# each held against 90% of the card.


@pytest.mark.parametrize(
    "B, T, memory_gib, expected",
    [
        (64, 1024, 80, 64),  # 72 GiB usable: B 64 fits
        (64, 1024, 40, 32),  # 36 usable < 41.2
        (64, 1024, 24, 32),  # 21.6 usable >= 21.53
        (64, 1024, 23.65, 16),  # 21.29 usable < 21.53: a 24 GB card as CUDA reports it
        (64, 1024, 16, 16),  # 14.4 usable
        (64, 1024, 8, 8),  # 7.2 usable >= 6.77
        (48, 1024, 24, 24),  # 32 does not divide 48 (the total batch would not stay whole); 24 needs 16.61
        (64, 2048, 24, 16),  # a row of 2,048 tokens is two of 1,024: B 16 needs 21.53
        (64, 1024, 2, None),  # 1.8 usable: not even the fixed 1.855
    ],
)
def test_memory_estimate_picks_the_largest_divisor_of_B_that_fits(B, T, memory_gib, expected):
    assert fitting_B(B, T, memory_gib * GiB) == expected

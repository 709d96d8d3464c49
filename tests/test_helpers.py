"""helpers.cli(): it reports a script's end as python does, ends one past its timeout whatever the
script catches, and leaves nothing of the script's behind."""

import random

import numpy as np
import pytest
import torch

from helpers import Overran, cli

SEEDS = (random.seed, np.random.seed, torch.manual_seed)


def draws():
    return random.random(), np.random.random(), torch.rand(1).item()


def test_a_sys_exit_message_is_printed_with_exit_1_and_the_random_generators_are_put_back(tmp_path):
    script = tmp_path / "script.py"
    seeded = "random.seed(0)\nnumpy.random.seed(0)\ntorch.manual_seed(0)\n"
    script.write_text(f"import random, sys, numpy, torch\n{seeded}sys.exit('error: its words')\n")
    for seed in SEEDS:
        seed(1)
    expected = draws()
    for seed in SEEDS:
        seed(1)
    r = cli(script=script)
    assert (r.returncode, r.stderr) == (1, "error: its words\n")
    assert draws() == expected  # not seed 0's


def test_a_script_past_its_timeout_ends_even_if_it_catches_exceptions(tmp_path):
    """A hang in a write that the script turns into a one-line error (an OSError's) is a hang, not that error."""
    script = tmp_path / "hangs.py"
    script.write_text(
        "import sys, time\ntry:\n    time.sleep(60)\nexcept Exception as e:\n    sys.exit(f'error: {e}')\n"
    )
    with pytest.raises(Overran):
        cli(script=script, timeout=1)

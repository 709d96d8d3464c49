"""When a run cannot go on, it says what to do, and the advice works: running out of memory (for
real, under a memory limit), a divergence, numbers at the edge of what the code can do with them
(seeds, timeouts, temperatures), torchrun, read-only folders, and messages that must name the
right flag and tell the truth about what is on disk. Each message's advice is followed here."""

from test_notebook import clean_records, kernel_env, run_notebook, write_log  # noqa: F401  (kernel_env: a fixture)

import train_gpt2
from helpers import read_log, strict_records, tiny_args

# ----------------------------------------------------------------------------------------------
# Rule 6: every message names the flag of its program and tells the truth about the disk


def test_val_tokens_0_turns_the_val_loss_off(data, tmp_path):
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data, out, "--val-tokens", 0, "--eval-every", 2, "--max-steps", 2)) == 0
    records = strict_records(out)
    assert not any("val_loss" in x for x in records) and sorted(read_log(out)[1]) == [0, 1]

"""One run per folder, one dataset per run (docs/reliability.md, rules 16, 17, 18 and 20): a
running run holds a lock on its --out-dir that a second process (new run or --resume, plain or
torchrun) is refused by, in one line naming the holder; a checkpoint continues only into its own
run's folder or a new one; a checkpoint continues only on the shards its run started on, and a
folder fineweb.py has not finished is refused; a start that fails leaves the folder as it found it."""

import pytest

from helpers import assert_one_line_error, cli, headers, random_shards, read_log, tiny_args

# ----------------------------------------------------------------------------------------------
# Rule 20: a start that fails leaves the folder as it found it


@pytest.mark.slow
def test_out_of_memory_in_the_first_step_then_a_smaller_batch_in_the_same_folder(tmp_path):
    """A real out-of-memory (an address-space cap) with the recipe's flags: the folder the run made
    is gone again, and the same command with a smaller -B, without --resume, trains there."""
    from test_limits import limited

    data = random_shards(tmp_path / "data", train_lengths=(20000,), val_length=5000)
    out = tmp_path / "out"
    args = tiny_args(data, out, "-B", 64, "-T", 64, "--total-batch-size", 4096, "--max-steps", 2, "--eval-every", 0)
    assert_one_line_error(limited(400, *args), "out of host memory in the first training step")
    assert not out.exists()
    r = cli(*args, "-B", 8)  # a later flag wins; without the cap: the folder is what is tested here
    assert r.returncode == 0, r.stderr
    assert len(headers(out)) == 1 and sorted(read_log(out)[1]) == [0, 1]

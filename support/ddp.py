"""The processes of a torchrun job joining one another: within --ddp-timeout, and a join that fails
said in one line by each rank, not as c10d's traceback."""

import os
import re
from datetime import timedelta

import torch.distributed as dist

from support.common import UserError, first_line


def join_process_group(backend, ddp_timeout):
    """dist.init_process_group with --ddp-timeout (seconds). Every rank waits here for the others:
    one that does not arrive in time (started late, a node not started, an unreachable address)
    fails the join on every rank that did, and each says so in one line."""
    try:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=ddp_timeout))
    except (RuntimeError, OSError) as e:  # c10d's DistError is a RuntimeError, gloo raises RuntimeError
        reason = first_line(e)
        if re.search(r"time ?out|timed out", reason, re.IGNORECASE):
            fix = (
                f"start every rank within --ddp-timeout {ddp_timeout:g} s of the first, or pass a longer "
                f"--ddp-timeout (e.g. 60)"
            )
        else:
            fix = "check that every node can reach the rendezvous address (torchrun's --rdzv-endpoint or --master-addr)"
        rank = os.environ.get("RANK", "?")
        raise UserError(f"rank {rank} could not join the job's other ranks ({reason}): {fix}") from None

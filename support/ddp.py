"""The processes of a torchrun job: each one's rank and GPU, joining the others within
--ddp-timeout (a join that fails said in one line by each rank, not as c10d's traceback), and the
fence where the others wait while rank 0 works alone."""

import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist

from support.cli import UserError, first_line
from support.device import pick_device

FENCE_TIMEOUT = 3600  # seconds the other ranks wait for what rank 0 does alone (a checkpoint write)


def setup_distributed(device, ddp_timeout):
    """(ddp, ddp_rank, ddp_local_rank, ddp_world_size, device): torchrun sets RANK, LOCAL_RANK and
    WORLD_SIZE; each process takes GPU LOCAL_RANK of its node and joins the others (within
    ddp_timeout seconds); ddp is then the gloo group of the job's fence (see fence). Without
    torchrun, one process: rank 0 of 1, ddp False."""
    ddp = "RANK" in os.environ
    ddp_rank, ddp_local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    ddp_world_size = int(os.environ.get("WORLD_SIZE", 1))
    device, device_type = pick_device(device)
    if ddp and device_type == "cuda":
        device = f"cuda:{ddp_local_rank}"
        torch.cuda.set_device(device)
    if ddp:  # every rank waits here for the others, --ddp-timeout seconds at most: one that does not come
        # in time (started late, a node not started, an unreachable address) fails the join of every rank that
        # did, and each says so in one line
        try:
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timedelta(seconds=ddp_timeout))
        except (RuntimeError, OSError) as e:  # c10d's DistError is a RuntimeError, gloo raises RuntimeError
            reason = first_line(e)
            fix = "check that every node can reach the rendezvous address (torchrun's --rdzv-endpoint or --master-addr)"
            if re.search(r"time ?out|timed out", reason, re.IGNORECASE):
                fix = (
                    f"start every rank within --ddp-timeout {ddp_timeout:g} s of the first, or pass a longer "
                    f"--ddp-timeout (e.g. 60)"
                )
            raise UserError(f"rank {ddp_rank} could not join the job's other ranks ({reason}): {fix}") from None
        # after the join a rank that freezes (not dies: torchrun sees that) fails the others' collectives
        ddp = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(FENCE_TIMEOUT, ddp_timeout)))
    return ddp, ddp_rank, ddp_local_rank, ddp_world_size, device


def fence(ddp):
    """Under torchrun, every rank waits here until all arrive, for up to FENCE_TIMEOUT seconds (or
    --ddp-timeout if longer): after work that rank 0 does alone, so that the other ranks do not
    wait for it in a collective that --ddp-timeout ends. ddp: setup_distributed's, the gloo group
    the fence waits in (False: one process, no wait). Returns it."""
    if ddp:
        dist.barrier(group=ddp)
    return ddp

"""Timing contenders side by side: interleaved rounds, medians and min-max, throughput per round."""

import statistics
import sys
import time

import torch


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def timed(fn, device_type):
    """Seconds one call of fn takes; on a GPU the queued work is waited for on both sides."""
    sync = {"cuda": torch.cuda.synchronize, "mps": lambda: torch.mps.synchronize()}.get(device_type, lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def interleave(contenders, warmup, rounds, device_type, label):
    """Call every contender once per round, in the same order each round (A B A B ...), so that
    a slow spell of the machine hits them all alike. Returns ({name: seconds per measured
    round}, {name: seconds of its very first call}); the first `warmup` rounds are dropped."""
    times = {name: [] for name in contenders}
    first = {}
    for r in range(warmup + rounds):
        this_round = {}
        for name, fn in contenders.items():
            this_round[name] = timed(fn, device_type)
            first.setdefault(name, this_round[name])
            if r >= warmup:
                times[name].append(this_round[name])
        done = "warm-up" if r < warmup else "measured"
        log(
            f"  {label}: round {r + 1}/{warmup + rounds} ({done}): "
            + ", ".join(f"{n} {t:.3f}s" for n, t in this_round.items())
        )
    return times, first


def stats(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def rates(work, seconds):
    """Throughput per round: work (tokens, examples, ...) over each round's seconds."""
    return [work / s for s in seconds]

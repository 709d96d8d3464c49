"""The data loader across shard boundaries, and the data checks every start makes (token ids, identity)."""

import gc
import os
import shutil
import statistics
import time

import numpy as np
import psutil

from benchmarks.report import comparison
from benchmarks.settings import TRAIN_CONFIGS, VOCAB
from benchmarks.timing import log, stats, timed
from support.shards import data_identity, find_shards, load_shard, shard_fingerprint, shard_path, write_shard
from train_gpt2 import DataLoaderLite


def rss_mib():
    """(anonymous, file-backed) resident MiB of this process. Anonymous memory is what the process
    allocated; the file-backed pages of a memory-mapped shard are the kernel's page cache, shared
    and dropped under memory pressure, and leave with the mapping."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["RssAnon"].split()[0]) / 1024, int(fields["RssFile"].split()[0]) / 1024
    except (OSError, KeyError):  # not Linux
        return psutil.Process().memory_info().rss / 2**20, 0.0


def bench_loader(s, device_type, tmp):
    c = TRAIN_CONFIGS["gpt2"]
    B, T = c.get(f"B_{device_type}", c["B"]), c["T"]
    data_dir = os.path.join(tmp, "loader_data")
    os.makedirs(data_dir)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for i in range(1, s["shards"] + 1):
        write_shard(shard_path(data_dir, "bench", i), rng.integers(0, 50257, s["shard_tokens"], dtype=np.uint16))
    log(f"  loader: wrote {s['shards']} shards of {s['shard_tokens']:,} tokens in {time.perf_counter() - t0:.1f}s")
    gc.collect()
    anon0, file0 = rss_mib()
    # on the CPU: the loader's own cost, with the check of every batch's ids that training makes
    loader = DataLoaderLite(data_dir, "train", B, T, shuffle=False, vocab_size=VOCAB)
    calls = loader.batches_per_epoch + 2  # through every shard and on into the next epoch
    times, switch_times = np.empty(calls), []
    anon_peak, file_peak = anon0, file0
    for i in range(calls):
        where = (loader.epoch, loader.shard)
        t0 = time.perf_counter()
        loader.next_batch()
        times[i] = time.perf_counter() - t0
        if (loader.epoch, loader.shard) != where:
            switch_times.append(times[i])
        if (loader.epoch, loader.shard) != where or i % 4096 == 0 or i == calls - 1:
            anon, file = rss_mib()
            anon_peak, file_peak = max(anon_peak, anon), max(file_peak, file)
    anon1, file1 = rss_mib()
    del loader
    result = {
        "B": B,
        "T": T,
        "shards": s["shards"],
        "shard_tokens": s["shard_tokens"],
        "batches": calls,
        "switches": len(switch_times),
        "us_per_batch_mean": 1e6 * times.mean(),
        "us_per_batch": stats((1e6 * times).tolist()),
        "us_at_switch": stats([1e6 * t for t in switch_times]),
        "rss_anon_growth_mib": anon_peak - anon0,
        "rss_anon_end_growth_mib": anon1 - anon0,
        "rss_file_peak_growth_mib": file_peak - file0,
    }
    note = f"B {B} T {T}, {len(switch_times)} switches between {s['shards']} shards of {s['shard_tokens']:,} tokens"
    ms, switch_ms = (times * 1e3).tolist(), [t * 1e3 for t in switch_times]
    below_1ms = dict(target="loader_switch_ms", higher_is_better=False, judge="mean")
    rows = [
        comparison("loader: ms per next_batch, all batches", ms, None, "ms", note=note, **below_1ms),
        comparison("loader: ms per next_batch at a shard switch", switch_ms, None, "ms", **below_1ms),
        comparison(
            "loader: RSS added (anonymous, peak)",
            [anon_peak - anon0],
            None,
            "MiB",
            "loader_rss_mb",
            higher_is_better=False,
            note=f"and up to {file_peak - file0:,.0f} MiB of page cache: the mapped shard",
        ),
    ]
    result["data_identity"], more = bench_data_identity(data_dir, tmp)
    return result, rows + more


def bench_data_identity(data_dir, tmp, n_shards=100, shard_tokens=100_000_000, rounds=5):
    """support.shards.data_identity, the check of the data every start and --resume makes: on a
    folder of 100 shards of 100M tokens (20 GB, as FineWeb-Edu 10B's: sparse files, a real .npy
    header and then holes, so they take no disk and read from the page cache), and per shard on
    the loader's real shards with their pages dropped from the page cache first (posix_fadvise
    DONTNEED): a read from the disk, as on a machine's first start."""
    folder = os.path.join(tmp, "identity_data")
    os.makedirs(folder)
    for i in range(n_shards):
        path = shard_path(folder, "bench", i)
        np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(shard_tokens,))
    data_identity(folder)  # warm-up: the first start after writing them
    times = [timed(lambda: data_identity(folder), "cpu") for _ in range(rounds)]
    start, read_all = whole_start(folder, rounds)
    cold = []
    for path in find_shards(data_dir, "train") if hasattr(os, "posix_fadvise") else []:  # not macOS
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        cold.append(timed(lambda p=path: shard_fingerprint(p), "cpu"))
    shutil.rmtree(folder)
    cold_ms = [1e3 * t for t in cold]
    result = {"shards": n_shards, "shard_tokens": shard_tokens, "seconds": stats(times), "cold_ms_per_shard": cold_ms}
    result.update(start_seconds=stats(start), start_reading_every_shard_seconds=stats(read_all))
    cold_note = (
        f"; {statistics.median(cold_ms):.2f} ms a shard read cold from disk ({len(cold)} real shards)" if cold else ""
    )
    rows = [
        comparison(
            f"data identity check: {n_shards} shards of {shard_tokens:,} tokens",
            times,
            None,
            "s",
            "data_identity_s",
            higher_is_better=False,
            note=f"sparse shards, page cache{cold_note}",
        ),
        comparison(
            f"a start's data checks: {n_shards} shards of {shard_tokens:,} tokens (token ids, identity)",
            start,
            read_all,
            "s",
            "data_start_s",
            higher_is_better=False,
            note="each shard's first ids vs reading every shard; sparse shards, page cache",
        ),
    ]
    return result, rows


def whole_start(folder, rounds):
    """The data checks of a training start on folder (the train loader's check of each shard's first
    token ids, and the data identity), timed; and once a check that reads every shard in full, the
    cost a start's look at each shard's first ids (every batch is checked as it is read) leaves out."""

    def start():
        DataLoaderLite(folder, "train", 64, 1024, vocab_size=50304)
        data_identity(folder)

    start()  # warm-up
    sampled = [timed(start, "cpu") for _ in range(rounds)]
    read_all = [timed(lambda: [int(load_shard(p).max()) for p in find_shards(folder, "train")], "cpu")]  # 20 GB
    return sampled, read_all

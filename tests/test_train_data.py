"""DataLoaderLite: every token once per epoch across ranks, shuffling, a resumable position,
and the val loss's fixed budget."""

import math

import numpy as np
import torch

from helpers import write_known_shards
from train_gpt2 import GPT, DataLoaderLite, GPTConfig, evaluate_val_loss


def test_every_token_once_per_epoch_across_ranks(tmp_path):
    B, T, world = 2, 8, 2
    chunk = B * T * world
    shards = write_known_shards(tmp_path, [1000, 777, 1500, 20])  # the last one is shorter than a chunk
    loaders = [DataLoaderLite(str(tmp_path), "train", B, T, rank=r, world_size=world, seed=5) for r in range(world)]
    # by hand: a shard of n tokens gives (n - 1) // chunk chunks; its last n - chunks*chunk tokens are never inputs
    expected = np.concatenate([s[: (len(s) - 1) // chunk * chunk] for s in shards])
    steps = sum((len(s) - 1) // chunk for s in shards)
    assert loaders[0].batches_per_epoch == steps
    seen = []
    for _ in range(steps):
        batches = [loader.next_batch() for loader in loaders]
        assert len({(loader.epoch, loader.shard) for loader in loaders}) == 1  # the ranks move together
        for x, y in batches:
            assert x.shape == (B, T) and x.dtype == torch.long
            assert torch.equal(y, x + 1)  # targets are the next tokens
            seen.append(x.flatten().numpy())
        # within one micro-step the ranks read consecutive, disjoint slices of the chunk
        assert batches[1][0][0, 0].item() == batches[0][0][-1, -1].item() + 1
    seen = np.concatenate(seen)
    assert len(seen) == len(expected) == len(np.unique(seen))
    assert np.array_equal(np.sort(seen), np.sort(expected))
    assert loaders[0].epoch == 0
    loaders[0].next_batch()
    assert loaders[0].epoch == 1


def _shard_visits(folder, seed, shuffle, epochs):
    """The order in which the loader visits the shards, read from the tokens it returns."""
    loader = DataLoaderLite(str(folder), "train", 1, 9, seed=seed, shuffle=shuffle)
    per_epoch = []
    for _ in range(epochs):
        order = []
        for _ in range(loader.batches_per_epoch):
            x, _ = loader.next_batch()
            shard = x[0, 0].item() // 100
            if not order or order[-1] != shard:
                order.append(shard)
        per_epoch.append(order)
    return per_epoch


def test_shard_order_shuffled_per_epoch_and_seed(tmp_path):
    write_known_shards(tmp_path, [100] * 8)
    a = _shard_visits(tmp_path, seed=1, shuffle=True, epochs=3)
    b = _shard_visits(tmp_path, seed=2, shuffle=True, epochs=1)
    for order in a + b:
        assert sorted(order) == list(range(8))  # each epoch visits every shard once
    assert a[0] != a[1] and a[1] != a[2] and a[0] != b[0]
    assert a == _shard_visits(tmp_path, seed=1, shuffle=True, epochs=3)  # seeded: reproducible
    assert _shard_visits(tmp_path, seed=1, shuffle=False, epochs=2) == [list(range(8))] * 2


def test_position_survives_state_dict(tmp_path):
    write_known_shards(tmp_path, [300, 400, 500])
    a = DataLoaderLite(str(tmp_path), "train", 2, 8, seed=9)
    for _ in range(30):  # into the second epoch
        a.next_batch()
    b = DataLoaderLite(str(tmp_path), "train", 2, 8, seed=9)
    b.load_state_dict(a.state_dict())
    for _ in range(40):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])


def test_val_loss_is_the_mean_over_the_budget_whatever_B(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50304, n_layer=1, n_head=2, n_embd=16))
    T, n_seq = 8, 7
    val = np.random.default_rng(1).integers(0, 50257, n_seq * T + 1).astype(np.uint16)
    # by hand: every sequence's summed token losses over all tokens
    with torch.no_grad():
        total = 0.0
        for j in range(n_seq):
            seq = torch.from_numpy(val[j * T : j * T + T + 1].astype(np.int64))
            logits, _ = model(seq[None, :-1])
            total += torch.nn.functional.cross_entropy(logits[0], seq[1:], reduction="sum").item()
    expected = total / (n_seq * T)
    for B in (1, 3, 7, 10):
        assert math.isclose(evaluate_val_loss(model, val, B, T, "cpu"), expected, rel_tol=1e-6)

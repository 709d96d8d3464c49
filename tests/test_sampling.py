"""Sampling with the preallocated KV cache: the one-token decode step against recomputing the
whole prefix (greedy and seeded top-k), no growing tensors, no padding ids, and the compiled
decode step giving the same tokens as the eager one."""

import pytest
import torch

from support.common import GPT2_VOCAB
from support.sampling import KVCache, decode_step, generate, next_token
from train_gpt2 import GPT


@pytest.fixture
def model(tiny_config):
    torch.manual_seed(5)
    model = GPT(tiny_config).eval()  # block size 64
    with torch.no_grad():  # move LayerNorms and biases off 1 / 0 so every weight matters
        for name, p in model.named_parameters():
            if ("ln" in name or name.endswith("bias")) and "ln_f" not in name:  # ln_f's bias would pick one token
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_greedy_kv_cache_equals_recompute_up_to_block_size(model):
    idx = torch.randint(0, GPT2_VOCAB, (3, 7))
    cached = generate(model, idx, 100, temperature=0, use_cache=True)  # runs into the 64-position window
    full = generate(model, idx, 100, temperature=0, use_cache=False)
    assert cached.shape == (3, 64) and torch.equal(cached[:, :7], idx)
    assert torch.equal(cached, full)


def test_seeded_top_k_is_reproducible_and_equal_to_recompute(model):
    idx = torch.randint(0, GPT2_VOCAB, (2, 4))
    a = generate(model, idx, 30, top_k=20, generator=torch.Generator().manual_seed(7))
    b = generate(model, idx, 30, top_k=20, generator=torch.Generator().manual_seed(7))
    c = generate(model, idx, 30, top_k=20, generator=torch.Generator().manual_seed(7), use_cache=False)
    d = generate(model, idx, 30, top_k=20, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and torch.equal(a, c) and not torch.equal(a, d)
    assert len(set(a[:, 4:].flatten().tolist())) > 20  # the draws vary: the comparison is not empty
    # top_k=1 is greedy
    assert torch.equal(generate(model, idx, 30, top_k=1), generate(model, idx, 30, temperature=0))


def test_a_prompt_fed_to_the_cache_in_pieces_equals_one_pass(model):
    """The cache continues from a Python-int position with several tokens at once (each sees the
    cached prefix and its own earlier tokens): the same hidden states as the whole row at once."""
    tokens = torch.randint(0, GPT2_VOCAB, (2, 12))
    with torch.no_grad():
        whole = model.hidden_states(tokens)
        cache = KVCache(model.config.n_layer, 12)
        pieces = [model.hidden_states(tokens[:, a:b], cache) for a, b in ((0, 5), (5, 6), (6, 12))]
    assert cache.pos == 12
    assert torch.allclose(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-4)


def test_decode_step_logits_equal_the_full_forward(model):
    """The static-shape step (position as a tensor, attention over the whole buffer with a mask)
    gives the logits the plain forward gives at that position."""
    tokens = torch.randint(0, GPT2_VOCAB, (2, 12))
    full, _ = model(tokens)
    cache = KVCache(model.config.n_layer, 20)  # longer than used: the unused slots must stay masked
    with torch.no_grad():
        model.hidden_states(tokens[:, :5], cache)
        assert cache.pos == 5
        cache.pos = torch.tensor([5])
        for t in range(5, 12):
            logits = model.lm_head(model.hidden_states(tokens[:, t : t + 1], cache)[:, -1])  # decode_step's logits
            assert torch.allclose(logits, full[:, t], atol=1e-5, rtol=1e-4)
            # the same position again (a tensor pos is advanced by the caller), through decode_step
            greedy = decode_step(model, tokens[:, t : t + 1], cache, temperature=0, top_k=None, noise=None)
            assert torch.equal(greedy, full[:, t, :GPT2_VOCAB].argmax(-1))
            cache.pos += 1
    assert cache.k[0].shape == (2, model.config.n_head, 20, model.config.n_embd // model.config.n_head)


def test_no_tensor_grows_per_token(model, monkeypatch):
    def no_cat(*args, **kwargs):
        raise AssertionError("torch.cat while sampling")

    idx = torch.randint(0, GPT2_VOCAB, (2, 3))
    expected = generate(model, idx, 20, temperature=0)
    monkeypatch.setattr(torch, "cat", no_cat)
    assert torch.equal(generate(model, idx, 20, temperature=0), expected)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padding_ids_are_never_produced(model, temperature):
    with torch.no_grad():  # make the padding ids overwhelmingly likely: they must still never come out
        model.lm_head.weight[GPT2_VOCAB:] = 5.0
        model.transformer.ln_f.bias.fill_(1.0)
    idx = torch.zeros(2, 1, dtype=torch.long)
    out = generate(model, idx, 40, temperature=temperature, top_k=None, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 41) and out.max().item() < GPT2_VOCAB


def test_nothing_to_generate_returns_the_prompt(model):
    idx = torch.randint(0, GPT2_VOCAB, (1, 64))
    assert torch.equal(generate(model, idx, 10), idx)
    assert torch.equal(generate(model, idx[:, :5], 0), idx[:, :5])


@pytest.mark.slow
def test_compiled_decode_step_gives_the_same_tokens(model):
    """compile=True: torch.compile'd decode step (CUDA graphs on a GPU); here inductor on the CPU.
    The second call reuses the compiled step and its cache."""
    idx = torch.randint(0, GPT2_VOCAB, (2, 5))
    eager = generate(model, idx, 20, temperature=0)
    assert torch.equal(generate(model, idx, 20, temperature=0, compile=True), eager)
    sampled = generate(model, idx, 20, top_k=50, generator=torch.Generator().manual_seed(3))
    again = generate(model, idx, 20, top_k=50, generator=torch.Generator().manual_seed(3), compile=True)
    assert torch.equal(again, sampled)
    assert len(model._decode_cache) == 1


def test_the_exponential_race_draws_from_the_softmax():
    """next_token's draw, argmax(p / E) with E ~ Exp(1), against the probabilities computed by
    hand: frequencies over 40,000 rows within 4 standard errors, the top-k cut-off respected."""
    n = 40_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(n, 5)  # a 5-token vocabulary, one row per draw
    g = torch.Generator().manual_seed(0)
    for top_k, temperature in ((None, 1.0), (3, 1.0), (None, 0.7)):
        p = torch.softmax(logits[0, : top_k or 5].double() / temperature, 0)
        noise = torch.empty(n, 5).exponential_(generator=g)
        counts = torch.bincount(next_token(logits, temperature, top_k, noise), minlength=5).double()
        assert counts[len(p) :].sum() == 0
        se = (p * (1 - p) / n).sqrt()
        assert ((counts[: len(p)] / n - p).abs() < 4 * se).all(), (counts / n, p)

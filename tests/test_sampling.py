"""support/sampling.py: sampling with the preallocated KV cache, the one-token decode step against
recomputing the whole prefix (greedy and seeded top-k), no growing tensors, no padding ids, the
compiled decode step giving the same tokens as the eager one, a temperature so low that the logits
overflow sampling greedily, and a stop request polled before every token; then, through real runs of
train_gpt2.py, each sampling setting having its effect in training, the model's window said where
samples stop at it, and sampling exercised before step 0 (sample.py's own: test_sample.py)."""

import pytest
import torch

import train_gpt2
from helpers import read_log, refused_before_step_0, tiny_args
from support import sampling
from support.cli import UserError
from support.sampling import generate, next_token
from support.shards import GPT2_VOCAB
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


@torch.no_grad()
def recompute(model, idx, n, temperature=1.0, top_k=50, generator=None):
    """The plain reference: the whole prefix recomputed for every token, drawn as generate draws."""
    for _ in range(min(n, model.config.block_size - idx.size(1))):
        logits, _ = model(idx)
        noise = sampling.draw_noise(len(idx), temperature, generator, idx.device)
        idx = torch.cat([idx, next_token(logits[:, -1], temperature, top_k, noise)[:, None]], dim=1)
    return idx


def test_greedy_kv_cache_equals_recompute_up_to_block_size_and_no_tensor_grows(model, monkeypatch):
    def no_cat(*args, **kwargs):
        raise AssertionError("torch.cat while sampling")

    idx = torch.randint(0, GPT2_VOCAB, (3, 7))
    full = recompute(model, idx, 100, temperature=0)
    monkeypatch.setattr(torch, "cat", no_cat)  # preallocated: no tensor grows per token
    cached = generate(model, idx, 100, temperature=0)  # runs into the 64-position window
    assert cached.shape == (3, 64) and torch.equal(cached[:, :7], idx)
    assert torch.equal(cached, full)


def test_seeded_top_k_is_reproducible_and_equal_to_recompute(model):
    idx = torch.randint(0, GPT2_VOCAB, (2, 4))
    a = generate(model, idx, 30, top_k=20, generator=torch.Generator().manual_seed(7))
    b = generate(model, idx, 30, top_k=20, generator=torch.Generator().manual_seed(7))
    c = recompute(model, idx, 30, top_k=20, generator=torch.Generator().manual_seed(7))
    d = generate(model, idx, 30, top_k=20, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and torch.equal(a, c) and not torch.equal(a, d)
    assert len(set(a[:, 4:].flatten().tolist())) > 20  # the draws vary: the comparison is not empty
    # top_k=1 is greedy
    assert torch.equal(generate(model, idx, 30, top_k=1), generate(model, idx, 30, temperature=0))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padding_ids_are_never_produced(model, temperature):
    with torch.no_grad():  # make the padding ids overwhelmingly likely: they must still never come out
        model.lm_head.weight[GPT2_VOCAB:] = 5.0
        model.transformer.ln_f.bias.fill_(1.0)
    idx = torch.zeros(2, 1, dtype=torch.long)
    out = generate(model, idx, 40, temperature=temperature, top_k=None, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 41) and out.max().item() < GPT2_VOCAB


@pytest.mark.slow
def test_compiled_decode_step_gives_the_same_tokens(model):
    """compile=True (inductor here, CUDA graphs on a GPU); the second call reuses the compiled step."""
    idx = torch.randint(0, GPT2_VOCAB, (2, 5))
    eager = generate(model, idx, 20, temperature=0)
    assert torch.equal(generate(model, idx, 20, temperature=0, compile=True), eager)
    sampled = generate(model, idx, 20, top_k=50, generator=torch.Generator().manual_seed(3))
    again = generate(model, idx, 20, top_k=50, generator=torch.Generator().manual_seed(3), compile=True)
    assert torch.equal(again, sampled)
    assert len(model._decode_cache) == 1


def test_the_exponential_race_draws_from_the_softmax():
    """argmax(p / E), E ~ Exp(1): frequencies within 4 standard errors of softmax, top-k respected."""
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


# ----------------------------------------------------------------------------------------------
# The draw: a temperature too low for the logits is greedy; a stop request


@pytest.mark.parametrize("temperature", [1e-40, 1e-50, 1e-320])
def test_a_temperature_so_low_that_logits_overflow_samples_greedily(temperature):
    logits = torch.randn(4, 50304) * 30
    noise = torch.empty(4, 50257).exponential_(generator=torch.Generator().manual_seed(0))
    token = sampling.next_token(logits, temperature, None, noise)
    assert torch.equal(token, logits[:, :50257].argmax(-1))
    assert torch.equal(sampling.next_token(logits, temperature, 5, noise), token)


def test_generation_polls_the_stop_request_before_every_token(model, monkeypatch):
    forwards = []
    real = model.hidden_states
    monkeypatch.setattr(model, "hidden_states", lambda *a, **k: forwards.append(1) or real(*a, **k))
    idx = torch.randint(0, GPT2_VOCAB, (2, 3))
    polls = []

    def stop():  # says stop from its 5th poll on: before the 5th token
        polls.append(1)
        return len(polls) >= 5

    assert generate(model, idx, 50, stop=stop) is None
    assert len(polls) == 5 and len(forwards) == 5  # the prompt's pass and 4 one-token steps
    # never asked to stop: the whole sample, the same tokens as without a stop request
    torch.manual_seed(1)
    a = generate(model, idx, 20, stop=lambda: False)
    torch.manual_seed(1)
    assert torch.equal(a, generate(model, idx, 20))


# ----------------------------------------------------------------------------------------------
# Sampling in a run: each setting has its effect, the window is said,
# and what runs mid-training is exercised before step 0


HELLO = "Hello, I'm a language model,"  # the default --prompt


@pytest.mark.parametrize(
    "flags, prompt, n_new",
    [
        (["--temperature", 0], HELLO, 4),  # greedy: 4 new tokens (--max-new-tokens 4)
        (["--prompt", "", "--temperature", 0], "", 4),  # unconditional: starts from <|endoftext|>
        (["--prompt", "<|endoftext|>Once upon a time", "--temperature", 0], "Once upon a time", 4),  # typed literally
        (["--max-new-tokens", 500, "--temperature", 0], HELLO, 64 - 8),  # beyond the 64-token window: stops there
        (["--top-k", 0], HELLO, 4),  # no top-k filtering
    ],
)
def test_legitimate_sampling_settings_work(data, tmp_path, enc, flags, prompt, n_new, capsys):
    """Each setting has its effect: the logged samples of steps 1 and 2 are the ones computed here
    from that step's checkpoint (greedy: recomputed without a cache; <|endoftext|> is token 50256)."""
    out = tmp_path / "out"
    run = "--max-steps 2 --sample-every 1 --num-samples 2 --max-new-tokens 4 --eval-every 0 --ckpt-every 1"
    args = tiny_args(data, out, *run.split(), *flags)
    assert train_gpt2.main(args) == 0
    stops_early = "note: samples stop at the model's 64-token window" in capsys.readouterr().out
    assert stops_early == (500 in flags)
    samples = {r["step"]: r["samples"] for r in read_log(out)[0] if "samples" in r}
    assert sorted(samples) == [1, 2]
    tokens = ([] if prompt == HELLO else [50256]) + enc.encode_ordinary(prompt)
    for step, texts in samples.items():
        model = train_gpt2.load_model(str(out / f"ckpt_{step:06d}.pt")).eval()
        if "--temperature" in flags:
            assert texts == [enc.decode(recompute(model, torch.tensor([tokens]), n_new, temperature=0)[0].tolist())] * 2
        else:  # drawn among all 50257 tokens, with the run's fixed sampling seed (42)
            draw = lambda top_k, model=model: generate(  # noqa: E731  (this step's model)
                model, torch.tensor([tokens] * 2), n_new, top_k=top_k, generator=torch.Generator().manual_seed(42)
            )
            assert texts == [enc.decode(row.tolist()) for row in draw(None)], step
            assert texts != [enc.decode(row.tolist()) for row in draw(50)]  # the setting changes the draw


def test_a_prompt_longer_than_the_window_is_refused_at_start(data, tmp_path):
    out = tmp_path / "out"
    args = tiny_args(data, out, "--sample-every", 100, "--prompt", "word " * 200)
    refused_before_step_0(args, out, "--prompt", "tokens")


def test_sampling_is_exercised_before_step_0(data, tmp_path, monkeypatch):
    """A sampling failure (here: the sampler raising) happens before the first step, not at step N."""

    def broken(*args, **kwargs):
        raise UserError("sampling failed")

    monkeypatch.setattr(sampling, "sample_text", broken)
    out = tmp_path / "out"
    refused_before_step_0(tiny_args(data, out, "--sample-every", 1000, "--max-steps", 3000), out, "sampling failed")

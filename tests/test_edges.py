"""The safety features hold at their edges (docs/reliability.md, "At the edges"): a lock file a user
deletes does not let a second run into the folder, a run killed before its first checkpoint is
restarted as the run it was, data fineweb.py never said it finished is refused, and a stop signal
cuts in-training samples short."""

import signal

import pytest
import torch

import train_gpt2
from conftest import random_shards, read_log, tiny_args
from support.common import GPT2_VOCAB
from train_gpt2 import GPT


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return random_shards(tmp_path_factory.mktemp("data"))


# ----------------------------------------------------------------------------------------------
# Every signal is honoured within one step's time, sampling included


class Countdown:
    """A stop request that says True from its n-th poll on; counts the polls."""

    def __init__(self, n):
        self.n, self.polls = n, 0

    def __call__(self):
        self.polls += 1
        return self.polls >= self.n


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_polls_the_stop_request_before_every_token(tiny_config, monkeypatch, use_cache):
    torch.manual_seed(0)
    model = GPT(tiny_config).eval()
    forwards = []
    real = model.hidden_states
    monkeypatch.setattr(model, "hidden_states", lambda *a, **k: forwards.append(1) or real(*a, **k))
    idx = torch.randint(0, GPT2_VOCAB, (2, 3))
    stop = Countdown(5)  # says stop before the 5th token
    assert model.generate(idx, 50, use_cache=use_cache, stop=stop) is None
    # the prompt's pass and 4 one-token steps, or 4 recomputes of the whole prefix
    assert stop.polls == 5 and len(forwards) == (5 if use_cache else 4)
    # never asked to stop: the whole sample, the same tokens as without a stop request
    torch.manual_seed(1)
    a = model.generate(idx, 20, use_cache=use_cache, stop=lambda: False)
    torch.manual_seed(1)
    assert torch.equal(a, model.generate(idx, 20, use_cache=use_cache))


def test_sigterm_while_a_run_samples_stops_it_within_a_token_with_a_checkpoint(data, tmp_path, monkeypatch):
    """SIGTERM arrives at the 3rd token of step 2's samples (40 tokens each): the run stops there, with
    step 2's checkpoint, and logs no half samples."""
    out, tokens = tmp_path / "out", []
    real = GPT.decode_step

    def decode_step(self, *args):
        tokens.append(1)
        if len(tokens) == 3:
            signal.raise_signal(signal.SIGTERM)
        return real(self, *args)

    monkeypatch.setattr(GPT, "decode_step", decode_step)
    args = tiny_args(data, out, "--sample-every", 2, "--max-new-tokens", 40, "--max-steps", 6, "--eval-every", 0)
    assert train_gpt2.main(args) == 128 + signal.SIGTERM
    # the start-up check draws 1 token (no decode step); step 2's samples stop at the signal
    assert len(tokens) == 3
    records, steps = read_log(out)
    assert sorted(steps) == [0, 1] and not [r for r in records if "samples" in r]
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_000002.pt"]
    assert train_gpt2.main([*args, "--resume"]) == 0  # and it continues from there
    assert sorted(read_log(out)[1]) == list(range(6))
    assert [r["step"] for r in read_log(out)[0] if "samples" in r] == [4, 6]

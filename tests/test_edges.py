"""The safety features hold at their edges (docs/reliability.md, "At the edges"): a lock file a user
deletes does not let a second run into the folder, a run killed before its first checkpoint is
restarted as the run it was, data fineweb.py never said it finished is refused, and a stop signal
cuts in-training samples short."""

import os
import signal

import pytest
import torch
from test_ownership import headers

import train_gpt2
from conftest import assert_one_line_error, cli, random_shards, read_log, tiny_args
from support.common import GPT2_VOCAB, UserError
from support.out_dir import LOCK_FILE, lock_out_dir
from train_gpt2 import GPT


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return random_shards(tmp_path_factory.mktemp("data"))


# ----------------------------------------------------------------------------------------------
# A folder's owner is decided by something a user cannot delete by accident


def at_step(monkeypatch, actions):
    """Run actions[step]() as training step `step` computes its learning rate (after its checkpoint,
    before its log record)."""
    real = train_gpt2.get_lr

    def get_lr(step, *args):
        if step in actions:
            actions[step]()
        return real(step, *args)

    monkeypatch.setattr(train_gpt2, "get_lr", get_lr)


@pytest.mark.parametrize("how", ["deleted", "replaced by an empty file"])
def test_a_deleted_lock_file_is_locked_again_and_a_resume_into_the_folder_is_refused(
    data, tmp_path, monkeypatch, capsys, how
):
    out = tmp_path / "out"
    lock, refused = out / LOCK_FILE, []

    def delete():  # "a stale lock": it is not
        lock.unlink()
        if how != "deleted":
            lock.write_text("")  # rm; touch: a file no one holds

    def resume():  # while this run trains: `--resume` as a user runs it, or (cheaper) its lock alone
        if how == "deleted":
            r = cli(*tiny_args(data, out, "--max-steps", 100, "--resume"))
            refused.append(assert_one_line_error(r))
        else:
            with pytest.raises(UserError) as e:
                lock_out_dir(str(out), "start again")
            refused.append(str(e.value))

    at_step(monkeypatch, {2: delete, 4: resume})
    assert train_gpt2.main(tiny_args(data, out, "--ckpt-every", 2)) == 0
    assert f"--out-dir {out} is in use by another run (pid {os.getpid()} on " in refused[0]
    assert f"warning: {lock} was deleted while this run trained: locked again" in capsys.readouterr().err
    assert len(headers(out)) == 1 and sorted(read_log(out)[1]) == list(range(6)) and not lock.exists()


def test_a_run_whose_lock_another_run_took_stops_and_leaves_that_runs_lock(data, tmp_path, monkeypatch):
    """The lock file deleted and another run started into the folder before this run's next write:
    this run stops at that write, in one line naming the other run, writes nothing more, and as it
    exits leaves the other run's lock file in place."""
    out = tmp_path / "out"
    lock, other = out / LOCK_FILE, []

    def another_run_starts():
        lock.unlink()
        other.append(lock_out_dir(str(out), "start again"))  # a new file, locked by another open file

    at_step(monkeypatch, {2: another_run_starts})
    try:
        with pytest.raises(UserError) as e:
            train_gpt2.main(tiny_args(data, out, "--ckpt-every", 1))
        assert f"{lock} was deleted or replaced while this run trained, and another run holds it now (pid " in str(
            e.value
        )
        assert "this run stops here and writes nothing more" in str(e.value)
        assert sorted(read_log(out)[1]) == [0, 1]  # step 2 trained, not logged
        assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_000001.pt", "ckpt_000002.pt"]
        assert os.path.samestat(os.fstat(other[0]), os.stat(lock))  # the other run's lock, untouched
    finally:
        if other:
            os.close(other[0])


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

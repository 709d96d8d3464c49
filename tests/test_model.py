"""The model is exactly GPT-2: parameter count, init, a checkpoint loaded, transformers parity both ways."""

import math
import re
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from transformers import GPT2LMHeadModel

from helpers import ROOT, save_tiny_hf_gpt2
from support.checkpoints import load_checkpoint
from support.hf_interop import save_hf_gpt2
from support.shards import GPT2_VOCAB
from train_gpt2 import GPT, GPTConfig, model_from_checkpoint


def test_parameter_count_and_tying():
    with torch.device("meta"):  # shapes only: no memory, no init time
        m = GPT(GPTConfig())
        padded = GPT(GPTConfig(vocab_size=50304))
    assert sum(p.numel() for p in m.parameters()) == 124_439_808
    assert sum(p.numel() for p in padded.parameters()) == 124_475_904
    assert m.lm_head.weight is m.transformer.wte.weight


def test_a_loaded_checkpoint_keeps_the_tie_and_trains_it_as_one_parameter(tmp_path, tiny_config):
    """Built on the meta device and assigned: the tied wte / lm_head is one Parameter, stepped once."""
    torch.manual_seed(0)
    model = GPT(tiny_config)
    torch.save({"model": model.state_dict(), "model_config": asdict(tiny_config)}, tmp_path / "ckpt.pt")
    loaded = model_from_checkpoint(load_checkpoint(tmp_path / "ckpt.pt"), "ckpt.pt")
    assert loaded.transformer.wte.weight is loaded.lm_head.weight
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in model.named_parameters()]
    for m in (model, loaded):  # one identical AdamW step on each: the same weights after it
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        _, loss = m(torch.arange(8).view(1, 8), torch.arange(1, 9).view(1, 8))
        loss.backward()
        opt.step()
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_loading_a_checkpoint_does_not_import_torch_dynamo(tmp_path, tiny_config):
    """In a fresh interpreter: a fill on the meta device (nn.Embedding's own) would import torch._dynamo."""
    torch.save({"model": GPT(tiny_config).state_dict(), "model_config": asdict(tiny_config)}, tmp_path / "ckpt.pt")
    code = "import sys, train_gpt2; train_gpt2.load_model(sys.argv[1]); print('torch._dynamo' in sys.modules)"
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ckpt.pt")], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def gpt2_init(name, n_layer):
    """(mean, std) of GPT-2's init of a parameter, by name (the GPT-2 paper, 2.3); std 0: a constant."""
    if name in ("transformer.wte.weight", "transformer.wpe.weight"):
        return 0.0, 0.02  # token and position embeddings
    if re.fullmatch(r"transformer\.(h\.\d+\.ln_[12]|ln_f)\.weight", name):
        return 1.0, 0.0  # LayerNorm gain
    if name.endswith(".bias"):  # LayerNorms' and the linear layers'
        return 0.0, 0.0
    if re.fullmatch(r"transformer\.h\.\d+\.(attn|mlp)\.c_proj\.weight", name):
        return 0.0, 0.02 / math.sqrt(2 * n_layer)  # the residual projections: two per layer add to the stream
    if re.fullmatch(r"transformer\.h\.\d+\.(attn\.c_attn|mlp\.c_fc)\.weight", name):
        return 0.0, 0.02
    raise AssertionError(f"{name}: not a GPT-2 parameter")


def test_every_parameter_starts_at_gpt2s_mean_and_std():
    """Per tensor: mean, std and the share within one sigma (68.27%) each within 6 standard errors of gpt2_init's."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=256, vocab_size=50304, n_layer=4, n_head=4, n_embd=128)
    m = GPT(config)
    params = dict(m.named_parameters())  # the tied lm_head.weight is wte's, listed once
    assert m.lm_head.weight is params["transformer.wte.weight"]
    assert len(params) == 4 + 12 * config.n_layer
    for name, p in params.items():
        mean, sigma = gpt2_init(name, config.n_layer)
        x = p.detach().double().flatten()
        n = x.numel()
        if sigma == 0:
            assert torch.all(x == mean), name
            continue
        assert n >= 16384, name  # enough elements for the tolerances to be tight (6 / sqrt(2n) < 4%)
        assert abs(x.mean().item() - mean) < 6 * sigma / math.sqrt(n), (name, x.mean().item())
        assert abs(x.std().item() - sigma) < 6 * sigma / math.sqrt(2 * n), (name, x.std().item(), sigma)
        within = ((x - mean).abs() < sigma).double().mean().item()
        assert abs(within - 0.6827) < 6 * math.sqrt(0.6827 * 0.3173 / n), (name, within)


def test_sequence_longer_than_block_size_is_an_error(tiny_config):
    m = GPT(tiny_config)
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, tiny_config.block_size + 1, dtype=torch.long))


def test_export_of_a_model_of_gpt2s_own_vocab_roundtrips(tmp_path):
    """The padded vocabulary of a trained run's export: test_export_hf.py's logits_match."""
    torch.manual_seed(3)
    config = GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config)
    save_hf_gpt2(asdict(config), model.state_dict(), tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.vocab_size == GPT2_VOCAB
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    torch.manual_seed(2)
    idx = torch.randint(0, GPT2_VOCAB, (2, 30))
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(idx).logits
    assert (ours - theirs).abs().max().item() < 1e-5


# parity at a trained model's scale (at init's, tanh and exact GELU agree to ~1e-7); float noise ~2e-6
TRAINED_SCALE_TOL = 2e-5


@pytest.fixture(scope="module")
def hf_trained_scale_dir(tmp_path_factory):
    """A small transformers GPT-2 at a trained model's scale: embeddings and biases std 0.1, gains 1 +- 0.2,
    matrices std 1/sqrt(fan_in)."""

    def trained_scale(name, p):
        if name.endswith(("wte.weight", "wpe.weight")):
            p.normal_(0, 0.1)
        elif ".ln_" in name and name.endswith("weight"):
            p.copy_(1 + 0.2 * torch.randn_like(p))
        elif name.endswith("bias"):
            p.normal_(0, 0.1)
        else:  # transformers' Conv1D weight is (fan_in, fan_out)
            p.normal_(0, p.shape[0] ** -0.5)

    return save_tiny_hf_gpt2(tmp_path_factory.mktemp("hf_trained_scale"), init=trained_scale)


def _trained_scale_logits(hf_dir, **config_changes):
    """transformers' logits (2, 64, 50257) for fixed random tokens; config_changes alter its numerics."""
    hf = GPT2LMHeadModel.from_pretrained(hf_dir, **config_changes).eval()
    idx = torch.randint(0, GPT2_VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return idx, hf(idx).logits


def test_trained_scale_logits_match_transformers(hf_trained_scale_dir):
    """tanh GELU, 1/sqrt(head_dim) attention and LayerNorm eps 1e-5 as GPT-2's, the nonlinearities away from 0."""
    idx, ref = _trained_scale_logits(hf_trained_scale_dir)
    ours = GPT.from_pretrained(str(hf_trained_scale_dir)).eval()
    # built on the meta device and filled: on the CPU, tied, and trainable as GPT(config) is
    assert ours.transformer.wte.weight is ours.lm_head.weight
    assert all(p.device.type == "cpu" and p.requires_grad for p in ours.parameters())
    fc_inputs = []
    hook = ours.transformer.h[1].mlp.gelu.register_forward_hook(lambda m, inputs, out: fc_inputs.append(inputs[0]))
    with torch.no_grad():
        logits, _ = ours(idx)
    hook.remove()
    assert fc_inputs[0].std().item() > 0.5  # GELU's inputs at trained scale, not init's ~0.1
    assert ref.std().item() > 0.5
    assert (logits - ref).abs().max().item() < TRAINED_SCALE_TOL


@pytest.mark.parametrize(
    "error",
    [
        {"activation_function": "gelu"},  # exact GELU instead of GPT-2's tanh approximation
        {"scale_attn_by_inverse_layer_idx": True},  # the second layer's attention scores at half scale
        {"layer_norm_epsilon": 1e-6},  # LayerNorm eps 1e-6 instead of 1e-5
    ],
)
def test_trained_scale_tolerance_tells_numerics_errors_from_float_noise(hf_trained_scale_dir, error):
    _, right = _trained_scale_logits(hf_trained_scale_dir)
    _, wrong = _trained_scale_logits(hf_trained_scale_dir, **error)
    assert (wrong - right).abs().max().item() > 10 * TRAINED_SCALE_TOL

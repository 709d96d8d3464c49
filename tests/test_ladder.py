"""bench.py's speed-up ladder: the rungs' losses agree within their precision and a rung that computes
something else is caught; rung 8's chunked loss is F.cross_entropy's without the full logits. No speed."""

import json
import os
import statistics

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import ladder
from benchmarks.chunked_loss import chunked_cross_entropy
from benchmarks.ladder import (
    LADDER_LOSS_TOL,
    MaskedSoftmaxAttention,
    ladder_base_state,
    ladder_ddp,
    ladder_half,
    ladder_precision,
    ladder_step,
    loss_check,
)
from helpers import cli, headers, read_log
from support.shards import shard_path, write_shard
from train_gpt2 import GPT, DataLoaderLite, GPTConfig

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64, "T": 32, "B": 2}


@pytest.fixture
def shard_dir(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 50257, 20_000, dtype=np.uint16)
    write_shard(shard_path(str(tmp_path), "bench", 1), tokens)
    return str(tmp_path)


def run_rungs(rungs, shard_dir, steps=4, accum=1):
    """{rung: losses of `steps` steps of `accum` micro-batches of B (bigger_B: one of B * accum)}."""
    base = ladder_base_state(TINY)
    losses = {}
    for rung, changes in rungs.items():
        B, n = (TINY["B"] * accum, 1) if "bigger_B" in changes else (TINY["B"], accum)
        step, losses[rung] = ladder_step(changes, base, TINY, B, shard_dir, "cpu", "cpu", n)
        for _ in range(steps):
            step()
    return losses


def test_masked_softmax_attention_is_causal_attention():
    """Rungs 1-4's attention, on the block's own weights, is SDPA's and a loop's by hand."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=4, n_embd=32)
    attn = GPT(config).transformer.h[0].attn
    masked = MaskedSoftmaxAttention(attn, 16)
    assert masked.c_attn.weight is attn.c_attn.weight and masked.c_proj.weight is attn.c_proj.weight
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        out = masked(x)
        # by hand: head h at t weighs the values of 0..t by softmax(q_t . k_s / sqrt(8))
        q, k, v = attn.c_attn(x).split(32, dim=2)
        y = torch.zeros(2, 16, 32)
        for h in range(4):
            hs = slice(8 * h, 8 * h + 8)
            for t in range(16):
                w = torch.softmax(torch.einsum("bd,bsd->bs", q[:, t, hs], k[:, : t + 1, hs]) / 8**0.5, dim=-1)
                y[:, t, hs] = torch.einsum("bs,bsd->bd", w, v[:, : t + 1, hs])
        torch.testing.assert_close(out, attn.c_proj(y), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, attn(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(masked(x[:, :5]), out[:, :5], rtol=1e-5, atol=1e-6)  # a shorter T: the mask's corner


def test_rung_one_computes_the_models_own_loss(shard_dir):
    """Step 0 of rung 1 (masked softmax, vocab 50,257) is the plain model's loss on the first batch."""
    losses = run_rungs({1: set()}, shard_dir, steps=1)
    config = GPTConfig(block_size=32, vocab_size=50257, n_layer=2, n_head=2, n_embd=64)
    model = GPT(config)
    model.load_state_dict(ladder_base_state(TINY))
    x, y = DataLoaderLite(shard_dir, "train", 2, 32, shuffle=False).next_batch()
    with torch.no_grad():
        _, loss = model(x, y)
    assert losses[1][0] == pytest.approx(loss.item(), abs=1e-5)
    assert losses[1][0] == pytest.approx(np.log(50257), abs=0.2)  # random init: about uniform


def test_the_loss_check_catches_a_rung_that_computes_something_else(shard_dir, monkeypatch):
    """Attention without its causal mask: in fp32 its losses leave the tolerance at once."""
    good = run_rungs({1: set()}, shard_dir)
    init = MaskedSoftmaxAttention.__init__

    def no_mask(self, attn, block_size):
        init(self, attn, block_size)
        self.causal.fill_(True)

    monkeypatch.setattr(MaskedSoftmaxAttention, "__init__", no_mask)
    bad = run_rungs({"broken": set()}, shard_dir)
    diff, tol, agree = loss_check({1: good[1], "broken": bad["broken"]}, {1: set(), "broken": set()})["broken"]
    assert not agree and diff > 10 * tol


@pytest.mark.slow
def test_compiled_rung_matches_eager(shard_dir):
    """torch.compile (rung 4's change, static shapes) trains to the same fp32 losses as eager."""
    torch._dynamo.reset()
    try:
        losses = run_rungs({1: {"sdpa"}, 4: {"sdpa", "compile"}}, shard_dir, steps=3)
    finally:
        torch._dynamo.reset()
    assert losses[4] == pytest.approx(losses[1], abs=LADDER_LOSS_TOL["fp32"])


def test_the_rungs_a_run_cannot_have_are_skipped_by_what_their_rows_need(monkeypatch):
    """Without compile rung 4 is skipped, and on CUDA rungs 11 and 12 with it; a CPU skips 10-12."""
    monkeypatch.setattr(ladder, "tf32_has_effect", lambda *args: True)
    monkeypatch.setattr(ladder, "compile_unavailable", lambda s, device: "no compiler")
    monkeypatch.setattr(ladder, "cudnn_attention_unavailable", lambda device: None)
    no_compile = "a compile setting, and this run has no compile (rung 4: no compiler)"
    assert ladder.skipped_rungs({}, None, None, None, "cuda", "cuda") == {
        4: "no compiler",
        11: no_compile,
        12: no_compile,
    }
    assert ladder.skipped_rungs({}, None, None, None, "cpu", "cpu") == {
        4: "no compiler",
        10: "CUDA only (cuDNN's attention backend)",
        11: "CUDA only (autotunes the GPU's GEMM and Triton kernels)",
        12: "CUDA only (CUDA graphs)",
    }


@pytest.mark.slow
def test_tiny_ladder_prints_the_table_and_writes_json_and_png(tmp_path):
    out = tmp_path / "bench.json"
    r = cli("--tiny", "--only", "ladder", "--out", out, script="bench.py", cwd=tmp_path, timeout=600)  # 14 rows, 7 run
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["sections"]) == ["ladder"] and report["rows"] == []
    ladder = report["sections"]["ladder"]
    assert ladder["table"] in r.stdout
    assert "tiny config: 2 layers, 2 heads, 64 wide, B 2, T 32" in r.stdout
    assert sorted(os.listdir(tmp_path)) == ["bench.json", "ladder.png"]
    png = (tmp_path / "ladder.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    rungs = {row["rung"]: row for row in ladder["rungs"]}
    assert list(rungs) == [1, 2, 3, 4, 5, 6, 7, "7+", 8, 9, 10, 11, 12, "DDP"]
    assert len(ladder["table"].splitlines()) == 2 + len(rungs)
    # the reference's A100 figures, tok/s and ms per step
    reference = [
        (16_300, 1000),
        (49_000, 333),
        (54_700, 300),
        (126_000, 129.5),
        (170_000, 97),
        (176_000, 93),
        (182_000, 90),
    ]
    assert [(rungs[k]["reference_tok_per_sec"], rungs[k]["reference_ms"]) for k in range(1, 8)] == reference
    assert rungs["DDP"]["reference_tok_per_sec"] == 1_500_000
    assert all(rungs[k]["reference_tok_per_sec"] is None for k in range(8, 13))  # past the reference

    # what does not run here says why: TF32 where it changes no fp32 matmul, compile off, DDP and 10-12 CUDA only
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    plain = a @ b
    torch.set_float32_matmul_precision("high")
    try:
        tf32_changes_mm = not torch.equal(a @ b, plain)
    finally:
        torch.set_float32_matmul_precision("highest")
    if not tf32_changes_mm:
        assert not rungs[2]["measured"] and "no effect" in rungs[2]["note"]
    assert not rungs[4]["measured"] and "compile is off" in rungs[4]["note"]
    assert not rungs["7+"]["measured"] and not rungs["DDP"]["measured"] and "no GPUs" in rungs["DDP"]["note"]
    for k in (10, 11, 12):
        assert not rungs[k]["measured"] and rungs[k]["note"].startswith("CUDA only (")
    for k, row in rungs.items():
        if not row["measured"]:
            assert f"| {k} | {row['change']} | not measured: {row['note']} |" in ladder["table"]

    measured = [k for k in range(1, 13) if rungs[k]["measured"]]
    assert {1, 3, 5, 6, 7, 8, 9} <= set(measured)
    median1 = rungs[1]["tok_per_sec"]["median"]
    for prev, k in zip([None] + measured, measured, strict=False):  # each rung and the one before
        row = rungs[k]
        # 1 warm-up + 3 measured steps of 2 micro-batches of B 2 x T 32 (rung 9: one of B 4) = 128 tokens
        assert (row["B"], row["grad_accum_steps"]) == ((4, 1) if k == 9 else (2, 2))
        assert row["step_ms"]["n"] == row["tok_per_sec"]["n"] == 3 and len(row["losses"]) == 4
        assert row["tok_per_sec"]["max"] == pytest.approx(128 / (row["step_ms"]["min"] / 1000))
        assert row["tok_per_sec"]["median"] == pytest.approx(128 / (row["step_ms"]["median"] / 1000))  # 3 rounds: odd
        assert row["vs_rung1"] == pytest.approx(row["tok_per_sec"]["median"] / median1)
        assert row["previous"] == prev
        if prev is not None:
            ratio = row["tok_per_sec"]["median"] / rungs[prev]["tok_per_sec"]["median"]
            assert row["vs_previous"] == pytest.approx(ratio)
            assert f"{row['vs_previous']:.2f}x" in ladder["table"]
        assert row["losses_agree"] and row["loss_max_abs_diff"] <= row["loss_tol"]
        assert statistics.fmean(row["losses"]) == pytest.approx(np.log(50257), abs=0.2)
    assert rungs[3]["loss_precision"] == "bf16" and rungs[1]["loss_max_abs_diff"] == 0
    assert ladder["losses_agree"]
    # this project's rungs are checked against rung 7 too, at bf16's tolerance (both padded)
    for k in (8, 9):
        assert rungs[k]["loss_vs_rung7_max_abs_diff"] <= rungs[k]["loss_vs_rung7_tol"] == LADDER_LOSS_TOL["bf16"]
        assert rungs[k]["loss_vs_rung7_max_abs_diff"] == max(
            abs(a - b) for a, b in zip(rungs[k]["losses"], rungs[7]["losses"], strict=True)
        )
    assert "loss_vs_rung7_max_abs_diff" not in rungs[7]
    # the headline: the last rung measured over rung 7, said to be a CPU number
    head = ladder["headline"]
    assert head["final_rung"] == 9 and head["device_type"] == "cpu"
    assert head["over_rung7"] == pytest.approx(rungs[9]["tok_per_sec"]["median"] / rungs[7]["tok_per_sec"]["median"])
    assert head["text"] in r.stdout and "CPU: not a GPU measurement" in head["text"]


@pytest.mark.slow
def test_ddp_rung_runs_train_gpt2_under_torchrun(tmp_path, shard_dir):
    """The DDP rung's command, on 2 CPU processes (gloo): the job's tok/s is its batch over each step's time."""
    r8 = ladder_ddp(2, TINY, 2, 6, shard_dir, str(tmp_path / "ddp"), "cpu")
    assert r8["processes"] == 2 and r8["steps"] == 6 and r8["steps_dropped"] == 2
    (header,) = headers(tmp_path / "ddp")
    assert header["config"]["world_size"] == 2 and header["config"]["grad_accum_steps"] == 1
    steps = list(read_log(tmp_path / "ddp")[1].values())
    tok = [2 * 2 * 32 / (rec["dt_ms"] / 1000) for rec in steps[2:]]  # 2 processes x B 2 x T 32 per step
    assert r8["tok_per_sec"]["median"] == pytest.approx(statistics.median(tok), rel=1e-6)
    assert r8["tok_per_sec_per_process"]["median"] == pytest.approx(statistics.median(tok) / 2, rel=1e-6)
    assert all(abs(loss - np.log(50257)) < 0.5 for loss in r8["losses"])


@pytest.mark.parametrize(
    "device, capability, half",
    [("cuda", (7, 5), torch.float16), ("cuda", (8, 0), torch.bfloat16), ("cpu", None, torch.bfloat16)],
)
def test_rung_3_is_fp16_on_a_gpu_without_native_bf16(monkeypatch, device, capability, half):
    """A T4 (7.5) emulates bf16: rung 3 runs fp16 there and its loss check says so; bf16 from 8.0 and on a CPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert ladder_half(device) == half
    assert ladder_precision({"tf32", "bf16"}, ladder_half(device)) == ("fp16" if half == torch.float16 else "bf16")


class LargestOutputs(TorchDispatchMode):
    """Records the shape of every tensor any aten op returns (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def chunked_and_full(chunk_rows, half=None, grad_scale=1.0):
    """(loss, grad h, grad W, the (rows, vocab) shapes its ops returned, forward and backward) of
    chunked_cross_entropy and of F.cross_entropy on the full logits, same inputs: 37 rows, 16 wide, vocab 101."""
    N, C, V = 37, 16, 101
    torch.manual_seed(0)
    h0, w0, y = torch.randn(N, C), 0.1 * torch.randn(V, C), torch.randint(0, V, (N,))
    out = []
    for fn in (
        lambda h, w: chunked_cross_entropy(h, w, y, chunk_rows),
        lambda h, w: F.cross_entropy(F.linear(h, w).float(), y),
    ):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with LargestOutputs() as watch:
            with torch.autocast("cpu", dtype=half or torch.bfloat16, enabled=half is not None):
                loss = fn(h, w)
            (grad_scale * loss).backward()
        logits = [s for s in watch.shapes if len(s) == 2 and s[1] == V]
        out.append((loss.detach(), h.grad, w.grad, logits))
    return out


@pytest.mark.parametrize("chunk_rows", [8, 37, 1000])  # 8 does not divide the 37 rows; 1000 is one chunk
def test_chunked_loss_is_cross_entropy_in_fp32(chunk_rows):
    """Rung 8's loss and gradients (scaled by 3, as fp16's are) are F.cross_entropy's, to fp32 rounding."""
    (loss, gh, gw, _), (ref, rh, rw, _) = chunked_and_full(chunk_rows, grad_scale=3.0)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-7)
    assert gh.dtype == gw.dtype == torch.float32


def test_chunked_loss_is_cross_entropy_under_bf16_autocast():
    """Under bf16 autocast (bf16 matmuls, fp32 softmax): the loss to fp32 rounding of the same bf16 logits, the
    gradients to a few bf16 roundings (2**-8 relative each; W's is summed over 5 chunks here)."""
    (loss, gh, gw, _), (ref, rh, rw, _) = chunked_and_full(8, half=torch.bfloat16)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-5)
    for got, want in ((gh, rh), (gw, rw)):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=4 * 2**-8 * want.abs().max().item())
    # and bf16 is what ran: the fp32 loss on the same inputs differs by more than fp32 rounding
    (fp32_loss, *_), _ = chunked_and_full(8)
    assert abs(fp32_loss - loss) > 1e-5


@pytest.mark.parametrize("half", [None, torch.bfloat16])
def test_chunked_loss_never_makes_the_full_logits(half):
    """No op of the chunked loss returns over chunk_rows rows of logits; the full loss, watched too, does."""
    (*_, chunked), (*_, full) = chunked_and_full(24, half=half)  # chunks of 24 and 13 rows; W's transpose has 16
    assert (37, 101) in full  # the watch sees the full logits where they are made
    assert max(rows for rows, _ in chunked) == 24


def test_rungs_compute_the_same_loss_within_their_precision(shard_dir):
    """Each rung trains to rung 1's and rung 7's losses within its precision (the tiny ladder's losses_agree);
    rung 9 (one micro-batch of 2B) is checked at the same total batch (the same 4 rows), not against one
    micro-batch of B."""
    r7 = {"sdpa", "padded_vocab", "fused_adamw"}
    rungs = {
        1: set(),
        3: {"bf16"},
        7: r7 | {"bf16"},
        8: r7 | {"bf16", "chunked_loss"},
        9: r7 | {"bf16", "chunked_loss", "bigger_B"},
        "5 fp32": {"sdpa"},
        "7 fp32": r7,
        "8 fp32": r7 | {"chunked_loss"},
        "9 fp32": r7 | {"chunked_loss", "bigger_B"},
    }
    losses = run_rungs(rungs, shard_dir, steps=3, accum=2)
    for against in (1, 7):
        checks = loss_check(losses, rungs, against)
        assert all(agree for _, _, agree in checks.values()), (against, checks)
    diff = lambda a, b: max(abs(x - y) for x, y in zip(losses[a], losses[b], strict=True))  # noqa: E731
    # how close: flash attention, the chunked loss and one bigger micro-batch are the same fp32 arithmetic
    # in another order
    assert diff("5 fp32", 1) < 1e-5 and diff("8 fp32", "7 fp32") < 1e-5 and diff("9 fp32", "8 fp32") < 1e-5
    # the 47 padded rows start at zero, logits near 0 at init: the loss rises by log(1 + 47 / 50257) a step
    shift = [a - b for a, b in zip(losses["7 fp32"], losses["5 fp32"], strict=True)]
    assert shift == pytest.approx([np.log1p(47 / 50257)] * 3, abs=1e-4), shift
    # bf16 moves the loss more than fp32's reordering, and within its tolerance
    assert 1e-6 < diff(3, 1) < LADDER_LOSS_TOL["bf16"]
    assert len(set(losses[9])) == 3  # the steps learn
    one = run_rungs({8: rungs["8 fp32"]}, shard_dir, steps=2, accum=1)
    assert abs(one[8][1] - losses["9 fp32"][1]) > 1e-4  # a different batch: another loss

"""`train.fused_ce`: cross-entropy's passes over the logits as Triton kernels (train/loss_kernels.py) give
the rows the compiled chunk function gives: the loss, q(label), argmax correctness and the gradient, with
the plain head and with the FP8 head (docs/fp8.md).

On the CPU Triton's interpreter runs the kernels (TRITON_INTERPRET=1, which must be set before Triton is
imported: the checks run in a child process); on a GPU the `gpu` test runs them for real against the
compiled function."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashdraft.config import load_config
from flashdraft.errors import FlashdraftError
from flashdraft.train import loss_kernels

needs_triton = pytest.mark.skipif(not loss_kernels.available(), reason="Triton is not importable")
ROOT = Path(__file__).resolve().parents[2]


def _case(rows: int, hidden: int, vocab: int, device: str = "cpu", dtype=torch.float32, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    head = torch.randn(vocab, hidden, generator=g, device=device) * 0.5
    rows_ = torch.randn(rows, hidden, generator=g, device=device)
    labels = torch.randint(0, vocab, (rows,), generator=g, device=device)
    return rows_.to(dtype), head.to(dtype), labels


def check_rows(fused, reference, grad_rtol: float) -> None:
    torch.testing.assert_close(fused.loss, reference.loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused.label_prob, reference.label_prob, rtol=1e-4, atol=1e-5)
    assert torch.equal(fused.correct, reference.correct)
    error = float((fused.grad.float() - reference.grad.float()).norm() / reference.grad.float().norm())
    assert error < grad_rtol, error


def interpreted_checks() -> None:
    """Run by the test below in a child process with TRITON_INTERPRET=1."""
    # the row statistics against torch, with a tie for the largest logit (the first index wins) and a
    # vocabulary that is no multiple of the kernels' blocks
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, 5003, generator=g) * 3).to(torch.bfloat16)
    logits[1, 17] = logits[1, 4001] = logits[1].max() + 1
    labels = torch.randint(0, 5003, (5,), generator=g)
    lse, label_logit, argmax = loss_kernels.row_stats(logits, labels, 0.5)
    z = logits.float() * 0.5
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), rtol=1e-5, atol=1e-5)
    assert torch.equal(label_logit, z.gather(1, labels[:, None])[:, 0])
    assert torch.equal(argmax, z.argmax(-1)) and argmax[1] == 17
    # the gradient, fp32 at a scale and bf16 at scale 1 (an e5m2 output is checked on the GPU: the
    # interpreter's float8 conversion drops the carry when rounding up crosses a power of two, 7.74 -> 4)
    want = (torch.softmax(z, -1) - torch.nn.functional.one_hot(labels, 5003)) * 0.5
    scale = torch.tensor([57344.0 / 0.5])
    scaled = loss_kernels.softmax_grad(logits, labels, lse, 0.5, scale, torch.float32)
    torch.testing.assert_close(scaled, want * scale, rtol=1e-5, atol=1e-3)
    plain = loss_kernels.softmax_grad(logits, labels, lse, 0.5, torch.ones(1), torch.bfloat16)
    torch.testing.assert_close(plain.float(), want, rtol=2**-7, atol=1e-6)

    # the loss's rows with the plain head (fp32 on the CPU): fused against the compiled function's eager
    # twin, across chunks and a short last one
    from flashdraft.train.loss import WeightedHeadLoss

    hidden, head, labels = _case(rows=70, hidden=32, vocab=3001)
    reference = WeightedHeadLoss(chunk=32, multiplier=0.7).rows(hidden, head, labels)
    fused = WeightedHeadLoss(chunk=32, multiplier=0.7, fused=True).rows(hidden, head, labels)
    check_rows(fused, reference, 1e-5)
    print("interpreted checks passed")


def test_the_fused_rows_through_the_fp8_head_are_the_compiled_functions(monkeypatch):
    """The FP8 head's side of the fused path (the e5m2 gradient at the scale from q(label), its GEMM) with
    the two kernels' math in torch (the kernels themselves: above, and on the GPU): the rows equal the
    chunk function's, the gradient to e5m2 rounding."""
    from flashdraft.distributed.float8 import Float8Head
    from flashdraft.train.loss import WeightedHeadLoss

    def row_stats(logits, labels, multiplier):
        z = logits.float() * multiplier
        return torch.logsumexp(z, -1), z.gather(1, labels[:, None])[:, 0], z.argmax(-1)

    def softmax_grad(logits, labels, lse, multiplier, scale, dtype):
        q = torch.exp(logits.float() * multiplier - lse[:, None])
        grad = (q - torch.nn.functional.one_hot(labels, q.shape[1])) * (multiplier * scale)
        largest = torch.finfo(dtype).max
        return grad.clamp(-largest, largest).to(dtype)

    monkeypatch.setattr(loss_kernels, "row_stats", row_stats)
    monkeypatch.setattr(loss_kernels, "softmax_grad", softmax_grad)
    hidden, head, labels = _case(rows=70, hidden=32, vocab=3008)
    gemm = Float8Head(emulate=True)
    reference = WeightedHeadLoss(chunk=32, multiplier=0.7, head=gemm).rows(hidden, head, labels)
    fused = WeightedHeadLoss(chunk=32, multiplier=0.7, head=gemm, fused=True).rows(hidden, head, labels)
    check_rows(fused, reference, 1e-3)


@needs_triton
def test_the_kernels_give_the_compiled_functions_rows_under_tritons_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", "import tests.train.test_loss_kernels as t; t.interpreted_checks()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "interpreted checks passed" in done.stdout, done.stdout + done.stderr


def test_fused_ce_is_refused_for_other_losses_and_off_a_gpu():
    from flashdraft.train.loss import WeightedHeadLoss
    from flashdraft.train.trainer import fused_ce_allowed

    with pytest.raises(FlashdraftError, match=r"train\.fused_ce computes cross-entropy only"):
        load_config(None, ["train.fused_ce=true", "train.loss=kl"])
    with pytest.raises(ValueError, match="fused kernels compute cross-entropy only"):
        WeightedHeadLoss(loss="lk", fused=True)
    with pytest.raises(
        FlashdraftError, match=r"train\.fused_ce runs Triton kernels on a CUDA GPU; this run is on cpu"
    ):
        fused_ce_allowed(True, torch.device("cpu"))
    assert not fused_ce_allowed(False, torch.device("cpu"))
    loss = WeightedHeadLoss(fused=True)
    loss.top_k = 4  # a DFlash2 selector's candidates
    hidden, head, labels = _case(rows=4, hidden=8, vocab=32)
    with pytest.raises(ValueError, match="no top-k"):
        loss.rows(hidden, head, labels)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_head", [False, True])
def test_on_a_gpu_the_kernels_give_the_compiled_chunk_functions_rows(fp8_head):
    """The real kernels against the trainer's compiled chunk function, bf16 head of a realistic width."""
    from flashdraft.distributed.float8 import Float8Head
    from flashdraft.train.loss import WeightedHeadLoss

    hidden, head, labels = _case(rows=1500, hidden=512, vocab=32003, device="cuda", dtype=torch.bfloat16)
    head = head[:32000].contiguous()  # the FP8 GEMM wants multiples of 16
    labels = labels % 32000
    gemm = Float8Head() if fp8_head else None
    reference = WeightedHeadLoss(chunk=1024, head=gemm, compile=True).rows(hidden, head, labels)
    fused = WeightedHeadLoss(chunk=1024, head=gemm, fused=True).rows(hidden, head, labels)
    check_rows(fused, reference, 0.03 if fp8_head else 0.01)

"""train.loss (ce | kl | lk) and train.position_weight (decay | dpace): the batched, chunked objective equals
a brute-force per-block reference that shares none of its code (docs/drafters.md §1)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashdraft.train.loss import WeightedHeadLoss, ce_grad_amax, dpace_weights, selector_weight
from flashdraft.train.objective import Objective

from .helpers import MASK_ID, tiny_pair, token_batch

GAMMA = 3.0
ALPHA = 0.3
ETA = 3.0


def per_position_loss(kind: str, logits, teacher_logits, label):
    """One block position's loss from full-vocabulary logits, by plain autograd."""
    if kind == "ce":
        return F.cross_entropy(logits[None], label[None])
    log_q = torch.log_softmax(logits, -1)
    log_p = torch.log_softmax(teacher_logits, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum()
    if kind == "kl":
        return kl
    acceptance = torch.minimum(log_p.exp(), log_q.exp()).sum()
    lam = math.exp(-ETA * acceptance.item())
    return lam * kl + (1 - lam) * (1 - acceptance)


def reference(drafter, target, batch, anchors_per_row, block_size, kind, weighting):
    """One block at a time: its own context slice, no mask (full-attention layers), the target's logits from
    the Hugging Face forward, D-PACE weights by explicit loops."""
    head = target.lm_head_weight
    num, den = 0.0, 0.0
    for row, anchors in enumerate(anchors_per_row):
        n = int(batch.lengths[row])
        ids = batch.input_ids[row, :n]
        feats = target.features(ids[None])[..., : 2 * target.hidden_size]
        with torch.no_grad():
            target_logits = target.model(ids[None]).logits[0].float()
        for a in anchors:
            block = torch.tensor([[int(ids[a])] + [MASK_ID] * (block_size - 1)])
            hidden = drafter(
                target.embed(block),
                feats[:, :a],
                torch.arange(a)[None],
                torch.arange(a, a + block_size)[None],
                None,
            )
            logits = hidden[0] @ head.T
            supervised = [k for k in range(1, block_size) if a + k < n and batch.loss_mask[row, a + k]]
            if weighting == "decay":
                weights = {k: math.exp(-(k - 1) / GAMMA) for k in supervised}
            else:
                smooth = {}
                for k in supervised:
                    q_label = torch.softmax(logits[k].detach(), -1)[ids[a + k]].item()
                    smooth[k] = (1 - ALPHA) * q_label + ALPHA
                weights = {}
                for k in supervised:
                    total = 0.0
                    for j in supervised:
                        if j >= k:
                            total += math.prod(smooth[i] for i in supervised if i <= j)
                    weights[k] = total
            for k in supervised:
                p = a + k
                num = num + weights[k] * per_position_loss(kind, logits[k], target_logits[p - 1], ids[p])
                # D-PACE keeps its credit mass: normalised by the count of supervised positions.
                den += weights[k] if weighting == "decay" else 1
    return num / den


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "kind,weighting", [("ce", "dpace"), ("kl", "decay"), ("lk", "decay"), ("kl", "dpace"), ("lk", "dpace")]
)
def test_objective_equals_per_block_reference(qwen3_target, kind, weighting):
    drafter, target = tiny_pair(qwen3_target, block_size=4)
    batch = token_batch([23, 15], prompt_lengths=[5, 9], seq_len=26)
    objective = Objective(
        drafter,
        target,
        num_anchors=6,
        gamma=GAMMA,
        loss=WeightedHeadLoss(chunk=7, loss=kind, lk_eta=ETA),
        position_weight=weighting,
        dpace_alpha=ALPHA,
    )
    blocks = objective.blocks(batch)
    out = objective(batch, blocks)
    loss = out.loss_sum / out.weight_sum
    loss.backward()
    g_batched = grads(drafter)
    drafter.zero_grad()

    anchors = [blocks.anchors[r][blocks.keep[r]].tolist() for r in range(2)]
    assert len(anchors[0]) == 6 and 0 < len(anchors[1]) < 6  # row 1 has padding blocks
    ref = reference(drafter, target, batch, anchors, 4, kind, weighting)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    for name, g in grads(drafter).items():
        assert torch.allclose(g_batched[name], g, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("kind", ["kl", "lk"])
@pytest.mark.parametrize("multiplier", [1.0, 0.7])
def test_chunked_loss_and_gradient_equal_autograd(kind, multiplier):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    teacher = torch.randn(37, 16, generator=g)
    head = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    w = torch.rand(37, generator=g)
    loss = WeightedHeadLoss(chunk=8, multiplier=multiplier, loss=kind, lk_eta=ETA)
    total, correct = loss(hidden, head, labels, w, teacher)
    total.backward()
    g_fused = hidden.grad.clone()
    hidden.grad = None
    logits = (hidden @ head.T) * multiplier
    teacher_logits = teacher @ head.T
    ref = sum(w[r] * per_position_loss(kind, logits[r], teacher_logits[r], labels[r]) for r in range(37))
    ref.backward()
    assert torch.allclose(total, ref, atol=1e-5)
    assert torch.allclose(g_fused, hidden.grad, atol=1e-5)
    assert torch.equal(correct, logits.argmax(-1) == labels)


@pytest.mark.parametrize("multiplier", [1.0, 0.7, -2.0])
def test_the_cross_entropy_gradients_amax_is_one_less_the_smallest_label_probability(multiplier):
    """ce_grad_amax (1 - q_label's largest) against the amax of the whole (q - onehot) * multiplier: random
    rows, rows whose argmax is the label with q_label near 1, rows that tie everywhere, and rows where one
    other token takes nearly all the mass (its q_j within rounding of 1 - q_label)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=g) * 3
    labels = torch.randint(0, 40, (64,), generator=g)
    logits[:16].scatter_(1, labels[:16, None], 20.0)  # argmax is the label, q_label near 1
    logits[16:24] = 0.0  # every logit ties: argmax is token 0
    labels[16:20] = 0  # ... which is the label in half of them
    logits[24:32, 5] = 15.0  # one other token takes nearly all the mass
    labels[24:32] = 6
    for rows in (slice(None), slice(0, 16), slice(16, 24), slice(24, 32)):
        z, y = logits[rows] * multiplier, labels[rows]
        log_q = torch.log_softmax(z, dim=-1)
        grad = (log_q.exp() - F.one_hot(y, 40).float()) * multiplier
        label_log_q = log_q.gather(-1, y[:, None])[:, 0]
        got = ce_grad_amax(label_log_q, multiplier)
        torch.testing.assert_close(got, grad.abs().amax(), rtol=1e-6, atol=0)


def test_kl_and_lk_need_the_target_distribution():
    with pytest.raises(ValueError, match="final hidden rows"):
        WeightedHeadLoss(loss="kl").rows(
            torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long)
        )


def test_dpace_weights_by_hand():
    confidence = torch.tensor([[0.0, 0.5, 0.2, 0.9], [0.0, 0.4, 0.7, 0.1]])
    valid = torch.tensor([[False, True, True, True], [False, True, False, True]])
    w = dpace_weights(confidence, valid, 0.5)
    s = [0.75, 0.6, 0.95]  # row 0: (1 - a) q + a at positions 1..3
    expected0 = [
        0.0,
        s[0] + s[0] * s[1] + s[0] * s[1] * s[2],
        s[0] * s[1] + s[0] * s[1] * s[2],
        s[0] * s[1] * s[2],
    ]
    t = [0.7, 0.55]  # row 1: position 2 is unsupervised: a no-op in the products, nothing in the sums
    expected1 = [0.0, t[0] + t[0] * t[1], 0.0, t[0] * t[1]]
    assert torch.allclose(w, torch.tensor([expected0, expected1]))


def test_selector_weight_schedule():
    assert [selector_weight(s, 0.5, 2, 4) for s in range(7)] == [0, 0, 0.125, 0.25, 0.375, 0.5, 0.5]
    assert selector_weight(0, 0.5, 0, 0) == 0.5
    assert selector_weight(10, 0.0, 0, 0) == 0.0


@pytest.mark.parametrize(
    "override,field",
    [
        ("train.loss=mse", "train.loss"),
        ("train.position_weight=linear", "train.position_weight"),
        ("train.dpace_alpha=1.5", "train.dpace_alpha"),
        ("train.selector_alpha=-1", "train.selector_alpha"),
    ],
)
def test_bad_loss_settings_name_the_field(override, field):
    from flashdraft.config import load_config
    from flashdraft.errors import FlashdraftError

    with pytest.raises(FlashdraftError, match=field.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize("kind", ["ce", "lk"])
def test_compiled_chunks_are_one_graph_dynamic_in_rows_only(kind):
    """Full chunks and the remainder reach the compiled chunk function as one graph (one compile in the
    first step), even when the hidden size equals the chunk; dynamo's own graph count, through its eager
    backend (inductor's kernels are checked on the GPU: tests/gpu/test_gpu_training.py)."""
    from torch._dynamo.utils import counters

    from flashdraft.train.loss import chunk_rows

    torch._dynamo.reset()
    counters.clear()
    loss = WeightedHeadLoss(chunk=32, loss=kind, compile=True)
    loss.chunk_fn = torch.compile(chunk_rows, fullgraph=True, backend="eager")
    eager = WeightedHeadLoss(chunk=32, loss=kind)
    g = torch.Generator().manual_seed(0)
    head = torch.randn(100, 32, generator=g)
    for rows in (90, 45, 32):  # 2 full chunks and 26 rows; one and 13 rows; one full chunk
        hidden, teacher = torch.randn(rows, 32, generator=g), torch.randn(rows, 32, generator=g)
        labels = torch.randint(0, 100, (rows,), generator=g)
        got, want = loss.rows(hidden, head, labels, teacher), eager.rows(hidden, head, labels, teacher)
        torch.testing.assert_close(got.loss, want.loss)
        torch.testing.assert_close(got.grad, want.grad)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])

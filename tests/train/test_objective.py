"""The batched DFlash objective equals a brute-force per-block loop, and each alignment trap is caught."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashdraft.model.attention import LayerKind, dense_mask, flex_mask_mod
from flashdraft.train.blocks import build_blocks, dense_masks, sample_anchors
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective

from .helpers import MASK_ID, tiny_pair, token_batch

GAMMA = 3.0


def reference_loss(drafter, target, batch, anchors_per_row, block_size):
    """Brute force: one block at a time, its own context slice, an explicit dense mask, explicit labels."""
    head = target.lm_head_weight
    num, den = 0.0, 0.0
    for row, anchors in enumerate(anchors_per_row):
        n = int(batch.lengths[row])
        ids = batch.input_ids[row, :n]
        feats = target.features(ids[None])
        for a in anchors:
            block = torch.tensor([[int(ids[a])] + [MASK_ID] * (block_size - 1)])
            ctx_pos = torch.arange(a)[None]
            blk_pos = torch.arange(a, a + block_size)[None]
            masks = {}
            for kind in drafter.layer_kinds():
                m = torch.zeros(1, 1, block_size, a + block_size, dtype=torch.bool)
                for qi in range(block_size):
                    qp = a + qi
                    for kj in range(a + block_size):
                        kp = kj if kj < a else a + (kj - a)
                        ok = True
                        if kind.causal and kj >= a:
                            ok &= kp <= qp
                        if kind.window is not None:
                            ok &= qp - kp < kind.window and kp - qp < kind.window
                        m[0, 0, qi, kj] = ok
                masks[kind.key] = m
            hidden = drafter(target.embed(block), feats[:, :a], ctx_pos, blk_pos, masks)
            logits = hidden[0] @ head.T
            for k in range(1, block_size):
                p = a + k
                if p < n and batch.loss_mask[row, p]:
                    w = math.exp(-(k - 1) / GAMMA)
                    num = num + w * F.cross_entropy(logits[k][None], ids[p][None])
                    den += w
    return num / den


def batched_loss(drafter, target, batch, num_anchors, blocks=None):
    objective = Objective(
        drafter, target, num_anchors=num_anchors, gamma=GAMMA, loss=WeightedHeadLoss(chunk=7)
    )
    out = objective(batch, blocks)
    return out.loss_sum / out.weight_sum, out


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("sliding", [False, True])
def test_batched_objective_equals_per_block_reference(qwen3_target, sliding):
    kwargs = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5} if sliding else {}
    drafter, target = tiny_pair(qwen3_target, block_size=4, **kwargs)
    batch = token_batch([23, 15], prompt_lengths=[5, 9], seq_len=26)
    loss, _ = batched_loss(drafter, target, batch, num_anchors=6)
    loss.backward()
    g_batched = grads(drafter)
    drafter.zero_grad()

    objective = Objective(drafter, target, num_anchors=6, gamma=GAMMA, loss=WeightedHeadLoss())
    blocks = objective.blocks(batch)
    anchors = [blocks.anchors[r][blocks.keep[r]].tolist() for r in range(2)]
    assert len(anchors[0]) == 6 and 0 < len(anchors[1]) < 6  # row 1 has padding blocks
    ref = reference_loss(drafter, target, batch, anchors, 4)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    for name, g in grads(drafter).items():
        assert torch.allclose(g_batched[name], g, atol=1e-5, rtol=1e-4), name


def test_weighted_rows_come_with_the_blocks_and_give_the_same_loss(qwen3_target):
    """The LM-head rows are found where the blocks are built (the host), not by nonzero() on the device,
    which would wait for the GPU mid-step; recomputing them gives the same loss."""
    import dataclasses

    drafter, target = tiny_pair(qwen3_target, block_size=4)
    batch = token_batch([23, 15], prompt_lengths=[5, 9], seq_len=26)
    objective = Objective(drafter, target, num_anchors=6, gamma=GAMMA, loss=WeightedHeadLoss(chunk=7))
    blocks = objective.blocks(batch)
    assert torch.equal(blocks.rows, blocks.weights.flatten().nonzero().flatten())
    assert torch.equal(blocks.to(torch.device("cpu")).rows, blocks.rows)
    with_rows = objective(batch, blocks).loss_sum
    recomputed = blocks.weights.flatten().nonzero().flatten()  # as the device would find them
    without = objective(batch, dataclasses.replace(blocks, rows=recomputed)).loss_sum
    assert torch.equal(with_rows, without)


def test_labels_are_same_position_not_shifted():
    ids = torch.arange(100, 120)[None]
    mask = torch.ones_like(ids)
    blocks = build_blocks(
        ids,
        mask,
        torch.tensor([20]),
        torch.tensor([[3, 10]]),
        torch.tensor([[True, True]]),
        4,
        MASK_ID,
        GAMMA,
    )
    assert blocks.block_ids.tolist() == [[103, MASK_ID, MASK_ID, MASK_ID, 110, MASK_ID, MASK_ID, MASK_ID]]
    assert blocks.block_positions.tolist() == [[3, 4, 5, 6, 10, 11, 12, 13]]
    # position k predicts input_ids[anchor + k]; position 0 (the anchor itself) carries no loss
    assert blocks.labels.tolist() == [[0, 104, 105, 106, 0, 111, 112, 113]]
    w = blocks.weights[0].tolist()
    assert (
        w[0] == 0
        and w[1] == 1
        and abs(w[2] - math.exp(-1 / GAMMA)) < 1e-7
        and abs(w[3] - math.exp(-2 / GAMMA)) < 1e-7
    )


def test_labels_respect_loss_mask_and_sequence_end():
    ids = torch.arange(100, 110)[None]
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 1]])
    blocks = build_blocks(
        ids, mask, torch.tensor([9]), torch.tensor([[3, 7]]), torch.tensor([[True, True]]), 4, MASK_ID, GAMMA
    )
    supervised = (blocks.weights[0] > 0).tolist()
    assert supervised == [
        False,
        True,
        False,
        False,
        False,
        True,
        False,
        False,
    ]  # 5,6 unsupervised; 9,10 past the end


def test_context_is_strictly_before_the_anchor(qwen3_target):
    """Trap: `kv <= anchor` leaks the anchor's own target feature, which does not exist at inference."""
    drafter, target = tiny_pair(qwen3_target)
    batch = token_batch([20], prompt_lengths=[2])
    anchor = 9
    blocks = build_blocks(
        batch.input_ids,
        batch.loss_mask,
        batch.lengths,
        torch.tensor([[anchor]]),
        torch.tensor([[True]]),
        4,
        MASK_ID,
        GAMMA,
    )
    feats = target.features(batch.input_ids).requires_grad_(True)
    masks = dense_masks(blocks, 20, drafter.layer_kinds())
    hidden = drafter(
        target.embed(blocks.block_ids), feats, torch.arange(20)[None], blocks.block_positions, masks
    )
    hidden.square().sum().backward()
    seen = feats.grad[0].abs().sum(-1)
    assert torch.all(seen[:anchor] > 0) and torch.all(seen[anchor:] == 0)


def test_blocks_do_not_see_each_other(qwen3_target):
    drafter, target = tiny_pair(qwen3_target)
    batch = token_batch([24], prompt_lengths=[2])
    feats = target.features(batch.input_ids)
    outs = []
    for second_anchor_token in (5, 6):
        ids = batch.input_ids.clone()
        ids[0, 14] = second_anchor_token
        blocks = build_blocks(
            ids,
            batch.loss_mask,
            batch.lengths,
            torch.tensor([[6, 14]]),
            torch.tensor([[True, True]]),
            4,
            MASK_ID,
            GAMMA,
        )
        masks = dense_masks(blocks, 24, drafter.layer_kinds())
        outs.append(
            drafter(
                target.embed(blocks.block_ids), feats, torch.arange(24)[None], blocks.block_positions, masks
            )
        )
    assert torch.equal(outs[0][:, :4], outs[1][:, :4])  # block 0 unchanged
    assert not torch.equal(outs[0][:, 4:], outs[1][:, 4:])  # block 1 did change


def test_padding_blocks_contribute_nothing(qwen3_target):
    drafter, target = tiny_pair(qwen3_target)
    batch = token_batch([20, 12], prompt_lengths=[3, 4], seq_len=20)
    anchors = sample_anchors(batch.loss_mask, batch.lengths, 3, 4, batch.seeds)
    results = []
    for extra in (0, 5):  # the same real anchors, with 0 or 5 padding blocks appended per row
        pad = torch.zeros(2, extra, dtype=torch.long)
        blocks = build_blocks(
            batch.input_ids,
            batch.loss_mask,
            batch.lengths,
            torch.cat([anchors[0], pad], 1),
            torch.cat([anchors[1], pad.bool()], 1),
            4,
            MASK_ID,
            GAMMA,
        )
        drafter.zero_grad()
        loss, _ = batched_loss(drafter, target, batch, 3 + extra, blocks)
        loss.backward()
        results.append((loss.item(), grads(drafter)))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    for name, g in results[0][1].items():
        assert torch.allclose(g, results[1][1][name], atol=1e-6), name


def test_anchor_sampling_is_supervised_distinct_seeded_and_fresh_per_seed():
    batch = token_batch([40, 12], prompt_lengths=[10, 4], seq_len=40)
    a1, k1 = sample_anchors(batch.loss_mask, batch.lengths, 8, 4, [1, 2])
    a2, _ = sample_anchors(batch.loss_mask, batch.lengths, 8, 4, [1, 2])
    a3, _ = sample_anchors(batch.loss_mask, batch.lengths, 8, 4, [3, 4])
    assert torch.equal(a1, a2) and not torch.equal(a1[0], a3[0])
    row0 = a1[0][k1[0]]
    assert len(set(row0.tolist())) == 8 and row0.min() >= 10 and row0.max() <= 36
    assert row0.tolist() == sorted(row0.tolist())
    assert k1[1].sum() == 5  # positions 4..8 only: a block must fit inside the 12 tokens


@pytest.mark.parametrize(
    "kind", [LayerKind(), LayerKind(causal=True, window=6), LayerKind(causal=False, window=3)]
)
def test_flex_mask_mod_equals_dense_mask(kind):
    from torch.nn.attention.flex_attention import create_mask

    anchors = torch.tensor([[0, 5, 17, 0], [3, 9, 0, 0]])
    keep = torch.tensor([[True, True, True, False], [True, True, False, False]])
    ctx = 24
    dense = dense_mask(anchors, keep, torch.arange(ctx).expand(2, -1), 4, kind)
    flex = create_mask(flex_mask_mod(anchors, keep, ctx, 4, kind), 2, 1, 16, ctx + 16, device="cpu")
    assert torch.equal(dense, flex)
    assert dense[0, 0, 5, :ctx].sum() == 5 if kind.window is None else True  # block 1 sees positions 0..4


def test_fused_head_loss_equals_plain_cross_entropy():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    head = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    w = torch.rand(37, generator=g)
    total, correct = WeightedHeadLoss(chunk=8)(hidden, head, labels, w)
    total.backward()
    g_fused = hidden.grad.clone()
    hidden.grad = None
    logits = hidden @ head.T
    ref = (F.cross_entropy(logits, labels, reduction="none") * w).sum()
    ref.backward()
    assert torch.allclose(total, ref, atol=1e-5) and torch.allclose(g_fused, hidden.grad, atol=1e-6)
    assert torch.equal(correct, logits.argmax(-1) == labels)


def test_the_compiled_drafters_block_input_hook_changes_no_gradient(qwen3_target):
    """parallelize gives a compiled drafter's first-layer input a gradient (so every layer is one compiled
    graph): in training the layer sees an input that asks for one, under no_grad it does not, and the
    parameters' gradients are those without the hook."""
    from flashdraft.distributed.parallelize import block_input_needs_grad

    drafter, target = tiny_pair(qwen3_target, block_size=4)
    batch = token_batch([23, 15], prompt_lengths=[5, 9], seq_len=26)
    objective = Objective(drafter, target, num_anchors=6, gamma=GAMMA, loss=WeightedHeadLoss(chunk=7))
    blocks = objective.blocks(batch)

    def step() -> dict[str, torch.Tensor]:
        out = objective(batch, blocks)
        (out.loss_sum / out.weight_sum).backward()
        result = grads(drafter)
        drafter.zero_grad()
        return result

    plain = step()
    seen = []
    drafter.layers[0].register_forward_pre_hook(lambda _module, args: seen.append(args[0].requires_grad))
    drafter.register_forward_pre_hook(block_input_needs_grad, with_kwargs=True)
    hooked = step()
    with torch.no_grad():
        objective(batch, blocks)
    assert seen == [True, False]
    for name, g in plain.items():
        torch.testing.assert_close(hooked[name], g, rtol=0, atol=0, msg=name)

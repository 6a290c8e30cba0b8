"""Sequence packing and the anchor budget (docs/packing.md): the packer, the target's per-sample forward,
the packed loss against each sample alone, anchors inside their sample, the budget, exact resume."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from flashdraft.config import load_config
from flashdraft.data.packing import PackedEpochSampler, pack_rows, packing_refusal
from flashdraft.data.tokens import EpochSampler, TokenBatch, collate, collate_packed, load_token_dataset
from flashdraft.errors import FlashdraftError
from flashdraft.model.target import TargetModel, load_target_config
from flashdraft.train.blocks import anchor_counts, dense_masks, flex_block_masks, sample_anchors
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective
from flashdraft.train.trainer import train

from .helpers import tiny_pair
from .test_objective import GAMMA, grads, reference_loss

BLOCK = 4


def write_samples(path: Path, lengths: list[int], prompts: list[int], seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for n, p in zip(lengths, prompts, strict=True):
            ids = torch.randint(0, 299, (n,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * p + [1] * (n - p)}) + "\n")
    return path


@pytest.fixture(scope="module")
def samples_file(tmp_path_factory) -> Path:
    return write_samples(tmp_path_factory.mktemp("packing") / "s.jsonl", [23, 15, 20, 9], [5, 9, 3, 2])


def dataset(path: Path, max_length: int = 64):
    return load_token_dataset([str(path)], max_length=max_length, block_size=BLOCK)


# ---------------------------------------------------------------- the packer


def test_every_sample_is_packed_exactly_once_per_epoch_within_the_row_limit():
    lengths = np.random.default_rng(0).integers(5, 300, size=500)
    sampler = PackedEpochSampler(lengths, 3, seed=4, capacity=512)
    for epoch in (0, 1):
        rows = sampler.rows(epoch)
        packed = [i for row in rows for i in row]
        assert sorted(packed) == list(range(500))
        assert max(int(lengths[row].sum()) for row in rows) <= 512
        # first-fit over the epoch's own permutation: the unpacked order, regrouped
        order = EpochSampler(500, 3, seed=4).order(epoch).tolist()
        assert sorted(packed, key=order.index) == order
        assert len(rows) < 500 * 152 / 512 * 1.1  # rows are mostly full (mean length 152)
    assert sampler.rows(0) != sampler.rows(1)  # a fresh packing each epoch
    assert PackedEpochSampler(lengths, 3, seed=4, capacity=512).rows(1) == sampler.rows(1)


def test_pack_rows_places_each_sample_in_the_first_open_row_with_room():
    lengths = np.array([6, 5, 4, 3, 2, 1])
    assert pack_rows([0, 1, 2, 3, 4, 5], lengths, 10) == [[0, 2], [1, 3, 4], [5]]
    # with one open row the oldest is closed as soon as a second opens
    assert pack_rows([0, 1, 2, 3, 4, 5], lengths, 10, open_rows=1) == [[0], [1, 2], [3, 4, 5]]


def test_the_packed_sampler_resumes_mid_epoch_on_the_same_rows_and_refuses_an_unpacked_position():
    lengths = np.random.default_rng(1).integers(5, 60, size=40)
    sampler = PackedEpochSampler(lengths, 2, seed=0, capacity=100)
    draws = [sampler.next_batch() for _ in range(30)]  # crosses into later epochs
    assert {epoch for epoch, _ in draws} >= {0, 1}
    resumed = PackedEpochSampler(lengths, 2, seed=0, capacity=100)
    replay = PackedEpochSampler(lengths, 2, seed=0, capacity=100)
    for _ in range(7):
        replay.next_batch()
    resumed.load_state_dict(replay.state_dict())
    assert [resumed.next_batch() for _ in range(23)] == draws[7:]
    with pytest.raises(FlashdraftError, match=r"data\.packing=false"):
        resumed.load_state_dict(EpochSampler(40, 2, seed=0).state_dict())
    with pytest.raises(FlashdraftError, match=r"data\.packing=true"):
        EpochSampler(40, 2, seed=0).load_state_dict(sampler.state_dict())


def test_a_packed_batch_holds_each_sample_with_its_own_positions_and_seed(samples_file):
    data = dataset(samples_file)
    packed = collate_packed(data, 3, [[1, 0], [2]], seed=5, pad_multiple=8)
    alone = collate(data, 3, [1, 0, 2], seed=5)
    assert packed.doc_lengths == [[15, 23], [20]] and packed.lengths.tolist() == [38, 20]
    assert packed.input_ids.shape == (2, 40)
    assert torch.equal(packed.input_ids[0, :15], alone.input_ids[0, :15])
    assert torch.equal(packed.input_ids[0, 15:38], alone.input_ids[1, :23])
    assert packed.position_ids[0, :38].tolist() == list(range(15)) + list(range(23))
    assert packed.loss_mask[0, 38:].sum() == 0 and packed.loss_mask[1, 20:].sum() == 0
    assert packed.seeds == alone.seeds  # the same anchors as unpacked


# ---------------------------------------------------------------- the target


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_target_features_of_a_packed_row_equal_each_sample_alone(target_dirs, samples_file, kind):
    target = TargetModel.load(target_dirs[kind], [1, 4])
    data = dataset(samples_file)
    packed = collate_packed(data, 0, [[0, 1, 3]], seed=0, pad_multiple=80)  # 47 tokens and 33 of padding
    features = target.features(packed.input_ids, position_ids=packed.position_ids)
    start = 0
    for i in (0, 1, 3):
        ids = torch.from_numpy(data[i].input_ids.astype(np.int64))[None]
        alone = target.features(ids)
        torch.testing.assert_close(features[:, start : start + ids.shape[1]], alone, atol=1e-5, rtol=0)
        start += ids.shape[1]


def test_packing_is_refused_for_a_target_whose_recurrent_layers_would_carry_state_across_samples(
    target_dirs, samples_file, tmp_path
):
    assert packing_refusal(load_target_config(target_dirs["qwen3"])) is None
    overrides = [
        f"model.target={target_dirs['qwen3_5']}",
        "model.mask_token_id=300",
        "model.num_layers=1",
        "model.block_size=4",
        f"data.train=[{samples_file}]",
        "data.packing=true",
        f"train.out_dir={tmp_path / 'run'}",
        "train.device=cpu",
    ]
    with pytest.raises(FlashdraftError, match=r"data\.packing=true: the target has linear_attention layers"):
        train(load_config(None, overrides))


# ---------------------------------------------------------------- anchors and masks


def packed_and_alone(path: Path, rows: list[list[int]]) -> tuple[TokenBatch, TokenBatch]:
    data = dataset(path)
    return collate_packed(data, 2, rows, seed=9), collate(data, 2, [i for row in rows for i in row], seed=9)


def test_anchors_stay_inside_their_sample_with_room_for_a_whole_block(samples_file):
    packed, _ = packed_and_alone(samples_file, [[0, 1, 3], [2]])
    anchors, keep = sample_anchors(
        packed.loss_mask, packed.lengths, 50, BLOCK, packed.seeds, packed.doc_lengths
    )
    for row, docs in enumerate(packed.doc_lengths):
        chosen = anchors[row][keep[row]].tolist()
        inside = 0
        for start, end in itertools.pairwise(np.cumsum([0, *docs]).tolist()):
            mine = [a for a in chosen if start <= a < end]
            supervised = packed.loss_mask[row, start : end - BLOCK + 1].nonzero().flatten() + start
            assert mine == supervised.tolist()  # 50 per sample is more than any has: every candidate
            inside += len(mine)
        assert inside == len(chosen)


@pytest.mark.parametrize("sliding", [False, True])
def test_the_packed_loss_equals_each_sample_alone_with_the_same_anchors(qwen3_target, samples_file, sliding):
    """Brute force per sample and per block (tests/train/test_objective.py's reference) against one packed
    forward, loss and gradients; fp32, atol 1e-5. The anchors are the packed batch's, read back per sample."""
    kwargs = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5} if sliding else {}
    drafter, target = tiny_pair(qwen3_target, block_size=BLOCK, **kwargs)
    packed, alone = packed_and_alone(samples_file, [[0, 1, 3], [2]])
    objective = Objective(drafter, target, num_anchors=5, gamma=GAMMA, loss=WeightedHeadLoss(chunk=7))
    blocks = objective.blocks(packed)
    out = objective(packed, blocks)
    loss = out.loss_sum / out.weight_sum
    loss.backward()
    g_packed = grads(drafter)
    drafter.zero_grad()

    per_sample, row_of = (
        [],
        [(r, s) for r, docs in enumerate(packed.doc_lengths) for s in np.cumsum([0, *docs])[:-1]],
    )
    lengths = [n for docs in packed.doc_lengths for n in docs]
    for (row, start), n in zip(row_of, lengths, strict=True):
        a = blocks.anchors[row][blocks.keep[row]]
        per_sample.append((a[(a >= start) & (a < start + n)] - start).tolist())
    assert [len(a) for a in per_sample] == [5, 3, 4, 5]  # samples 1 and 3 have only 3 and 4 candidates
    ref = reference_loss(drafter, target, alone, per_sample, BLOCK)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    for name, g in grads(drafter).items():
        torch.testing.assert_close(g_packed[name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("sliding", [False, True])
def test_the_flex_block_mask_keeps_the_document_rule_of_the_dense_mask(qwen3_target, samples_file, sliding):
    """Flex attention runs only compiled (not on this CPU); its mask_mod, evaluated everywhere, must equal the
    dense mask the loss test above checks (its tiles equal create_block_mask's: tests/model/test_block_mask.py)."""
    from torch.nn.attention.flex_attention import create_mask

    kwargs = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5} if sliding else {}
    drafter, target = tiny_pair(qwen3_target, block_size=BLOCK, **kwargs)
    packed, _ = packed_and_alone(samples_file, [[0, 1, 3], [2]])
    blocks = Objective(drafter, target, num_anchors=5, gamma=GAMMA, loss=WeightedHeadLoss()).blocks(packed)
    s = packed.input_ids.shape[1]
    kinds = drafter.layer_kinds()

    flex = flex_block_masks(blocks, s, kinds)
    dense = dense_masks(blocks, s, kinds)
    assert flex.keys() == dense.keys()
    for key in dense:
        b, _, q, kv = dense[key].shape
        assert torch.equal(create_mask(flex[key].mask_mod, b, 1, q, kv, device="cpu"), dense[key]), key


@pytest.mark.slow
def test_compiled_flex_attention_gives_the_packed_loss_of_the_dense_mask(qwen3_target, samples_file):
    """Flex attention on the CPU: forward only (no CPU backward in torch), compiled drafter layers (eager flex
    would materialise dense scores and is refused), the BlockMask built from the rule's intervals. About a minute of compilation."""
    drafter, target = tiny_pair(qwen3_target, block_size=BLOCK)
    packed, _ = packed_and_alone(samples_file, [[0, 1, 3], [2]])
    dense = Objective(drafter, target, num_anchors=5, gamma=GAMMA, loss=WeightedHeadLoss())
    blocks = dense.blocks(packed)
    try:
        with torch.no_grad():
            expected = dense(packed, blocks)
            for layer in drafter.layers:
                layer.compile(fullgraph=True)
            flex = Objective(
                drafter,
                target,
                num_anchors=5,
                gamma=GAMMA,
                loss=WeightedHeadLoss(),
                attention="flex",
            )
            got = flex(packed, blocks)
    finally:
        torch._dynamo.reset()
    assert got.weight_sum == expected.weight_sum
    assert abs((got.loss_sum - expected.loss_sum).item()) / expected.weight_sum.item() < 1e-5


# ---------------------------------------------------------------- the anchor budget


def test_the_anchor_budget_shares_num_anchors_times_rows_in_proportion_to_candidates():
    assert anchor_counts([97, 37, 17], 10, 3, budget=True) == [19, 7, 4]  # 30 = 10 x 3 rows
    assert anchor_counts([97, 37, 17], 10, 3, budget=False) == [10, 10, 10]
    assert anchor_counts([5, 3], 10, 2, budget=True) == [5, 3]  # fewer candidates than the budget: all
    counts = anchor_counts([1000, 1, 1, 1], 2, 2, budget=True)
    assert sum(counts) == 4 and counts[0] >= 3


def test_budget_anchors_give_short_rows_fewer_blocks_and_the_batch_its_total(samples_file, tmp_path):
    path = write_samples(tmp_path / "b.jsonl", [60, 20, 12], [0, 0, 0])
    batch = collate(dataset(path), 0, [0, 1, 2], seed=1)
    anchors, keep = sample_anchors(batch.loss_mask, batch.lengths, 8, BLOCK, batch.seeds, budget=True)
    per_row = keep.sum(1).tolist()
    assert sum(per_row) == 24 and per_row[0] > 8 > per_row[1] > per_row[2] >= 1
    assert anchors.shape[1] == per_row[0]  # no wider than the fullest row
    # a sample's budget anchors are the first of its own seeded draw: those of per_row, fewer
    a_row, k_row = sample_anchors(batch.loss_mask, batch.lengths, 60, BLOCK, batch.seeds)
    for r in range(3):
        assert set(anchors[r][keep[r]].tolist()) <= set(a_row[r][k_row[r]].tolist())


# ---------------------------------------------------------------- training


def test_packed_training_resumes_exactly(tmp_path, qwen3_target, monkeypatch):
    from .test_trainer import _straight_then_crash_and_resume

    lengths = [30 + 3 * i for i in range(12)]
    data = write_samples(tmp_path / "train.jsonl", lengths, [4 + i % 5 for i in range(12)])
    extra = {"data.packing": "true", "data.max_length": 96, "train.anchors": "budget", "train.batch_size": 1}
    a, b, _ = _straight_then_crash_and_resume(tmp_path, qwen3_target, data, monkeypatch, extra)
    assert sorted(a) == list(range(1, 9)) and all(a[s] == b[s] for s in range(1, 9)), (a, b)


def test_a_block_placed_at_a_samples_end_supervises_nothing_of_the_next_sample():
    from flashdraft.train.blocks import build_blocks

    ids = torch.arange(100, 112)[None]
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])  # two samples of 6 tokens
    blocks = build_blocks(
        ids,
        torch.ones_like(ids),
        torch.tensor([12]),
        torch.tensor([[4, 6]]),
        torch.tensor([[True, True]]),
        BLOCK,
        300,
        GAMMA,
        positions,
    )
    assert (blocks.weights[0] > 0).tolist() == [False, True, False, False, False, True, True, True]
    assert blocks.block_positions.tolist() == [[4, 5, 6, 7, 0, 1, 2, 3]]
    assert blocks.doc_starts.tolist() == [[0, 6]] and blocks.context_lengths.tolist() == [[4, 0]]


# ---------------------------------------------------------------- the benchmark


def test_bench_train_on_shards_times_real_steps_with_packing_on_and_off_on_the_cpu(qwen3_target, tmp_path):
    from flashdraft.bench.train_bench import main as bench_train
    from flashdraft.data.shards import write_shards

    rng = np.random.default_rng(0)
    lengths = rng.integers(12, 60, size=40).tolist()
    samples = [(rng.integers(0, 299, size=n), [0] * (n // 4) + [1] * (n - n // 4)) for n in lengths]
    write_shards(tmp_path / "shards", samples, {"tokenizer_name": "test"})
    out = tmp_path / "bench.json"
    args = ["--data", str(tmp_path / "shards"), "--target-dir", qwen3_target, "--mask-token-id", "300"]
    args += ["--device", "cpu", "--max-length", "128", "--block-size", "4", "--num-anchors", "8"]
    args += ["--drafter-layers", "1", "--steps", "2", "--warmup", "1", "--out", str(out)]
    assert bench_train(args) == 0
    report = json.loads(out.read_text())
    off, on = report["results"]["packing_off"], report["results"]["packing_on"]
    assert off["mean_samples_per_row"] == 1 and on["mean_samples_per_row"] > 2
    for result in (off, on):
        assert (
            result["samples_per_s"] > 0 and result["tokens_per_s"] > 0 and result["useful_drafter_tflops"] > 0
        )
        assert (
            0 < result["useful_flop_share"] <= 1 and result["mfu_useful"] is None
        )  # no CPU peak to divide by
    assert on["row_padding"] < off["row_padding"]
    assert report["command"].startswith("flashdraft bench train --data")

    waste = tmp_path / "waste.json"
    assert bench_train([*args[:-1], str(waste), "--waste-only", "--pad-multiple", "1"]) == 0
    counted = json.loads(waste.read_text())["results"]
    assert counted["packing_off"]["samples"] == counted["packing_on"]["samples"] == 40  # one whole epoch
    assert counted["packing_on"]["block_padding"] < counted["packing_off"]["block_padding"]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.anchors=per_batch", "train.anchors must be per_row or budget, got 'per_batch'"),
        ("data.packing=sometimes", "data.packing"),
    ],
)
def test_a_bad_packing_or_anchors_setting_is_one_line_naming_the_field(override, needle):
    with pytest.raises(FlashdraftError, match=re.escape(needle)):
        load_config(None, [override])

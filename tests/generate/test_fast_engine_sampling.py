"""Sampled decoding on the fast engine (flashdraft/generate/fast.py) against the eager loop, in fp32 on the
CPU: for the same per-prompt seeds, the same tokens and the same acceptance length at every step, batch 1
and ragged batch 3, whatever the logit filter and however the draft is proposed. A random target and
drafter at these temperatures accept several drafts per step often enough to exercise the rejection rule,
the residual draw and the bonus; every prompt ends on a block cut at the token limit."""

from __future__ import annotations

import pytest
import torch

from flashdraft.generate.fast import FastEngine, unsupported_reason
from flashdraft.generate.speculative import generate
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import make_drafter_config
from flashdraft.model.target import TargetModel
from flashdraft.model.tiny import build_model, tiny_config

VOCAB = 64
NEW = 23  # not a multiple of the block: the last blocks are cut
BLOCK = 4
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair() -> tuple[TargetModel, DFlashDraftModel]:
    model = build_model(tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=4), seed=0)
    target = TargetModel(model, [1, 2])
    config = make_drafter_config(
        target.config, num_layers=1, block_size=BLOCK, mask_token_id=VOCAB - 1, target_layer_ids=[1, 2]
    )
    drafter = DFlashDraftModel(config)
    drafter.init_weights(torch.Generator().manual_seed(0))
    return target, drafter


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(0, VOCAB - 1, (1, int(torch.randint(5, 16, (1,), generator=g))), generator=g)
        for _ in range(5)
    ]


SEEDS = [100, 101, 102, 103, 104]


def _eager(target, drafter, prompts, **sampling):
    return [
        generate(target, drafter, p, NEW, generator=torch.Generator().manual_seed(seed), **sampling)
        for p, seed in zip(prompts, SEEDS, strict=True)
    ]


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 20},
        {"temperature": 1.0, "draft_sampling": "argmax"},
    ],
    ids=["T1", "filtered", "argmax-drafts"],
)
def test_sampled_speculative_decoding_equals_the_eager_loop_draw_for_draw(pair, prompts, sampling):
    target, drafter = pair
    eager = _eager(target, drafter, prompts, **sampling)
    if sampling == {"temperature": 1.0}:
        assert max(max(run.accepted) for run in eager) == BLOCK  # whole blocks accepted, bonus drawn
        assert any(1 < a < BLOCK for run in eager for a in run.accepted)  # rejections mid-block
    for rows in (1, 3):
        fast = FastEngine(target, drafter, NEW, rows=rows, **sampling).generate(prompts, seeds=SEEDS)
        assert [run.tokens for run in fast] == [run.tokens for run in eager], rows
        assert [run.accepted for run in fast] == [run.accepted for run in eager], rows


def test_sampled_plain_decoding_equals_the_eager_loop(pair, prompts):
    target, _ = pair
    eager = _eager(target, None, prompts, temperature=1.0)
    fast = FastEngine(target, None, NEW, rows=3, temperature=1.0).generate(prompts, seeds=SEEDS)
    assert [run.tokens for run in fast] == [run.tokens for run in eager]
    # the seed is what decides: another seed writes another text
    other = FastEngine(target, None, NEW, temperature=1.0).generate(prompts[:1], seeds=[7])
    assert other[0].tokens != eager[0].tokens


def test_a_prompts_tokens_do_not_depend_on_its_batch(pair, prompts):
    target, drafter = pair
    alone = FastEngine(target, drafter, NEW, temperature=1.0).generate(prompts[2:3], seeds=SEEDS[2:3])
    batched = FastEngine(target, drafter, NEW, rows=3, temperature=1.0).generate(prompts, seeds=SEEDS)
    assert batched[2].tokens == alone[0].tokens and batched[2].accepted == alone[0].accepted


def test_sampling_settings_are_checked(pair):
    target, drafter = pair
    assert unsupported_reason(target, drafter, 0.7) is None
    with pytest.raises(Exception, match="top_p"):
        FastEngine(target, drafter, NEW, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="draft_sampling"):
        FastEngine(target, drafter, NEW, temperature=1.0, draft_sampling="greedy")
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        FastEngine(target, drafter, NEW, temperature=1.0).generate([torch.tensor([[1, 2]])], seeds=[1, 2])

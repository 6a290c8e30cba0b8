"""One logit filter for every loop: the eager speculative loop's distributions (`sampling_probs`) and
regeneration's seeded draw (`seeded_token`) keep the same tokens, and the filter keeps what top-k and
top-p promise."""

from __future__ import annotations

import math

import pytest
import torch

from flashdraft.config import Sampling
from flashdraft.generate.sampling import filter_logits, sampling_probs, seeded_token


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (5, 1.0), (0, 0.6), (7, 0.8)])
def test_seeded_draws_stay_inside_the_support_of_sampling_probs(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 20) * 3
    probs = sampling_probs(logits, 0.7, top_p, top_k)
    sampling = Sampling(temperature=0.7, top_p=top_p, top_k=top_k)
    seeds = torch.arange(3, dtype=torch.int64)
    drawn = torch.stack([seeded_token(logits, seeds, step, sampling) for step in range(600)])  # [600, 3]
    for row in range(3):
        support = set(torch.nonzero(probs[row]).flatten().tolist())
        seen = set(drawn[:, row].tolist())
        assert seen <= support
        # the likeliest kept tokens do come up: the draw follows the distribution, not just its support
        likely = {t for t in support if probs[row, t] > 0.05}
        assert likely <= seen


def test_top_k_keeps_the_k_best_and_top_p_the_smallest_nucleus():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.isfinite(filter_logits(logits, 1.0, top_k=2)).tolist() == [[True, True, False, False, False]]
    probs = torch.softmax(logits, -1)[0].tolist()
    mass = probs[0] + probs[1]
    # a nucleus that needs the 2nd token keeps exactly two; one reached by the first alone keeps one
    kept = torch.isfinite(filter_logits(logits, 1.0, top_p=mass - 1e-3))[0].tolist()
    assert kept == [True, True, False, False, False]
    assert torch.isfinite(filter_logits(logits, 1.0, top_p=probs[0] / 2))[0].tolist()[:2] == [True, False]
    filtered = filter_logits(logits, 2.0)
    assert torch.allclose(filtered, logits / 2.0) and not any(math.isinf(v) for v in filtered[0].tolist())

"""The fast engine on a sliding-window target run well past its window, and what it leaves to the eager
loop (CPU, fp32). The target is sharpened so that the next token depends on the whole context: with a
key the mask should hide (a rejected draft's, or one outside the window) in view, the tokens change."""

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
NEW = 40
pytestmark = pytest.mark.usefixtures("one_thread")


def _sharpened(kind: str, **overrides) -> TargetModel:
    model = build_model(
        tiny_config(kind, vocab_size=VOCAB, hidden_size=32, num_layers=4, **overrides), seed=0
    )
    with torch.no_grad():  # larger projections: attention weighs the whole context
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(4.0)
    return TargetModel(model, [1, 2])


def _drafter(target: TargetModel) -> DFlashDraftModel:
    config = make_drafter_config(
        target.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, target_layer_ids=[1, 2]
    )
    drafter = DFlashDraftModel(config)
    drafter.init_weights(torch.Generator().manual_seed(0))
    return drafter


def _prompts(n: int, low: int, high: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(0, VOCAB - 1, (1, int(torch.randint(low, high, (1,), generator=g))), generator=g)
        for _ in range(n)
    ]


@pytest.mark.parametrize("rows", [1, 3])
def test_sliding_window_target_past_its_window_equals_the_eager_loop(rows):
    # layers 0-1 full attention, 2-3 sliding over 8 positions; prompts + answers reach ~55
    target = _sharpened("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert target.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    drafter = _drafter(target)
    prompts = _prompts(4, 5, 16)
    for proposer in (None, drafter):
        eager = [generate(target, proposer, p, NEW) for p in prompts]
        fast = FastEngine(target, proposer, NEW, rows=rows).generate(prompts)
        assert [r.tokens for r in fast] == [r.tokens for r in eager]
        assert [r.accepted for r in fast] == [r.accepted for r in eager]
    # the window matters here: the same engine with the window ignored writes another text
    engine = FastEngine(target, None, NEW)
    engine.window = None
    assert [r.tokens for r in engine.generate(prompts)] != [r.tokens for r in eager]


def test_layer_kinds_the_fast_engine_does_not_know_stay_on_the_eager_loop(monkeypatch):
    """Full attention decodes, greedy and sampled; a layer kind it does not know is refused with its name
    (Gated DeltaNet hybrids: tests/generate/test_fast_engine_hybrid.py)."""
    full = TargetModel(build_model(tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=2)), [1])
    assert unsupported_reason(full, None, 0.0) is None
    assert (
        unsupported_reason(full, None, 0.7) is None
    )  # sampling: tests/generate/test_fast_engine_sampling.py
    monkeypatch.setattr(full.config, "layer_types", ["full_attention", "chunked_attention"])
    assert "chunked_attention" in unsupported_reason(full, None, 0.0)
    with pytest.raises(ValueError, match="chunked_attention"):
        FastEngine(full, None, 4)

"""One stop rule for regeneration and eval (issue 28): a target whose generation_config.json lists several
eos ids ends its answer at any of them in `eval` too, not only at the tokenizer's eos."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashdraft.cli import main
from flashdraft.config import Sampling
from flashdraft.data.stops import target_stop_ids
from flashdraft.generate.speculative import generate
from flashdraft.infer.evaluate import EvalSettings, run_eval
from flashdraft.model.target import TargetModel
from flashdraft.model.tiny import save_tiny_target

VOCAB = 64
PROMPTS = [[1, 2, 3, 4], [9, 8, 7]]
NEW = 16


def _first_new_token(tokens: list[int], at_least: int) -> int | None:
    """A token whose first occurrence in `tokens` is at index `at_least` or later."""
    return next((t for i, t in enumerate(tokens) if i >= at_least and t not in tokens[:i]), None)


@pytest.fixture(scope="module")
def several_eos(tmp_path_factory) -> dict:
    """A tiny target without a tokenizer whose generation config lists two eos ids: one its greedy answer
    to the first prompt reaches after a few tokens, and one it never writes."""
    root = tmp_path_factory.mktemp("several-eos")
    target = save_tiny_target(root / "target", "qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=4)
    drafter = root / "drafter"
    init = ["init", "--target", str(target), "--out", str(drafter), "--num-layers", "1"]
    assert main([*init, "--block-size", "4", "--mask-token-id", str(VOCAB - 1)]) == 0
    model = TargetModel.load(target, [1], device="cpu", dtype=torch.float32)
    free = [generate(model, None, torch.tensor([p]), NEW).tokens for p in PROMPTS]
    stop = _first_new_token(free[0], 3)
    assert stop is not None, f"the tiny target's greedy answer repeats from the start: {free[0]}"
    never = next(t for t in range(VOCAB - 2, 0, -1) if all(t not in f for f in free))
    config = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [never, stop]}))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    return {"target": target, "drafter": drafter, "prompts": prompts, "free": free, "stops": [never, stop]}


def _cut(tokens: list[int], stops: list[int]) -> list[int]:
    end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:end]


def test_the_stop_rule_reads_every_eos_id_of_the_generation_config(several_eos):
    assert target_stop_ids(several_eos["target"], None, None, required=False) == several_eos["stops"]


@pytest.mark.parametrize("block_size", [1, 4])
def test_eval_stops_at_any_eos_id_of_the_generation_config(several_eos, block_size):
    report = run_eval(
        str(several_eos["target"]),
        str(several_eos["drafter"]),
        str(several_eos["prompts"]),
        EvalSettings(block_size=block_size, sampling=Sampling(max_new_tokens=NEW)),
        device="cpu",
    )
    expected = [_cut(free, several_eos["stops"]) for free in several_eos["free"]]
    assert len(expected[0]) < NEW  # the first answer really ends at the second eos id, before the limit
    assert report["output_tokens"] == sum(len(e) for e in expected)


def test_a_target_with_no_stop_at_all_is_refused_for_regeneration(tmp_path: Path):
    target = save_tiny_target(tmp_path / "target", "qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=2)
    from flashdraft.errors import FlashdraftError

    with pytest.raises(FlashdraftError, match="no end-of-turn token"):
        target_stop_ids(target, None, None)
    assert target_stop_ids(target, None, None, required=False) == []

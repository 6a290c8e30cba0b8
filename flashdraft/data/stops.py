"""The one stop rule: which token ids end an answer of a target (docs/regeneration.md, "Stop tokens").

An answer ends at any of the tokenizer's eos, the target's `generation_config.json` `eos_token_id` (an int
or a list) and the chat template's end-of-turn token. Regeneration and `eval` both stop by it: a target
whose generation config lists several eos ids ends its turn at the same token in both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashdraft.data.render import end_of_turn_id
from flashdraft.errors import FlashdraftError


def stop_token_ids(tokenizer, generation_config: Any, end_of_turn: int | None) -> list[int]:
    """Every id that ends an answer: the tokenizer's eos, the generation config's eos_token_id (an int or a
    list) and the chat template's end-of-turn token, in that order, each once."""
    ids: list[int] = []
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None), end_of_turn]
    config_eos = getattr(generation_config, "eos_token_id", None)
    candidates += list(config_eos) if isinstance(config_eos, (list, tuple)) else [config_eos]
    for token in candidates:
        if isinstance(token, int) and token not in ids:
            ids.append(token)
    return ids


def target_stop_ids(
    target: str | Path, tokenizer, thinking: str | None, *, required: bool = True
) -> list[int]:
    """The ids that end an answer of this target (`stop_token_ids`), its generation config read when it
    ships one. A target with none at all is a one-line error when `required` (regeneration: its answers
    would never end); otherwise (eval of token-id prompts on a target without a tokenizer) decoding runs to
    its token limit."""
    from transformers import GenerationConfig

    from flashdraft.model.gguf import target_directory

    try:
        generation_config = GenerationConfig.from_pretrained(target_directory(target))
    except (OSError, ValueError):
        generation_config = None  # no generation_config.json: the tokenizer and template name the stops
    end_of_turn = end_of_turn_id(tokenizer, thinking) if tokenizer is not None else None
    stops = stop_token_ids(tokenizer, generation_config, end_of_turn)
    if not stops and required:
        raise FlashdraftError(
            f"target {target}: no end-of-turn token (no eos in its tokenizer or generation config)"
        )
    return stops

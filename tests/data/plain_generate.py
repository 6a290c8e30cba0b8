"""Plain `model.generate` greedy answers: the reference every local regeneration engine must equal."""

from __future__ import annotations

import torch


def plain_greedy(model, prompt: list[int], stops: list[int], max_new: int) -> list[int]:
    """One prompt alone (no padding), greedy, stopping at `stops`: the new tokens."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def emitted_stop_ids(model, prompts: list[list[int]], max_new: int) -> list[int]:
    """Token 2 and a token the model really emits mid-answer, so stopping (and what follows it) is
    exercised."""
    emitted = [token for p in prompts for token in plain_greedy(model, p, [2], max_new)[2:6]]
    return [2, max(set(emitted), key=emitted.count)]

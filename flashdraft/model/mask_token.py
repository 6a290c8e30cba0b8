"""The mask token for a target whose tokenizer fills every embedding row (docs/real-target.md, "Mask token").

The drafter's block inputs are the mask token's embedding wherever a token is still to be drafted, so the
mask id must never stand for a real token in a prompt or an answer: a reserved special token of the
tokenizer that nothing in use produces. Not eos/bos/pad/unk, not an end-of-turn id of the generation
config, not a token the chat template writes (`<|im_start|>`, `<|im_end|>`, `<think>`...), and not a
non-special added token (those are ordinary text pieces the model writes).
"""

from __future__ import annotations

from pathlib import Path


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates (default, tool_use...)
        return "\n".join(str(t) for t in template.values())
    return template or ""


def _rendered_ids(tokenizer) -> set[int]:
    """The ids a short conversation renders to through the chat template (empty without one)."""
    if not _template_text(tokenizer):
        return set()
    conversation = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    ids: set[int] = set()
    for generation_prompt in (False, True):
        try:
            rendered = tokenizer.apply_chat_template(
                conversation[: 3 - generation_prompt],
                tokenize=True,
                add_generation_prompt=generation_prompt,
                return_dict=False,
            )
        except Exception:  # a template that rejects this shape: its literal text is still checked
            continue
        if isinstance(rendered, dict):
            rendered = rendered["input_ids"]
        ids.update(int(i) for i in rendered)
    return ids


def _generation_stop_ids(target_path: str | Path) -> set[int]:
    """eos/bos/pad ids of the target's generation_config.json and config.json (ints or lists)."""
    import json

    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        try:
            data = json.loads((Path(target_path) / name).read_text())
        except (OSError, ValueError):
            continue
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = data.get(key)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, int):
                    ids.add(item)
    return ids


def unused_special_tokens(tokenizer, vocab_size: int, target_path: str | Path) -> list[tuple[int, str]]:
    """(id, text) of every special token that may serve as the mask token, in id order."""
    template = _template_text(tokenizer)
    # The named roles only: `all_special_ids` also lists every "additional" special token, the candidates.
    named = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id")
    excluded = {int(i) for i in (getattr(tokenizer, n, None) for n in named) if isinstance(i, int)}
    excluded |= _rendered_ids(tokenizer)
    excluded |= _generation_stop_ids(target_path)
    found = []
    for token_id, token in sorted(tokenizer.added_tokens_decoder.items()):
        if not getattr(token, "special", False) or not 0 <= token_id < vocab_size:
            continue
        if token_id in excluded or token.content in template:
            continue
        found.append((int(token_id), str(token.content)))
    return found


def pick_unused_special_token(tokenizer, vocab_size: int, target_path: str | Path) -> tuple[int, str] | None:
    """The qualifying special token with the highest id (a fixed, documented choice), or None."""
    found = unused_special_tokens(tokenizer, vocab_size, target_path)
    return found[-1] if found else None

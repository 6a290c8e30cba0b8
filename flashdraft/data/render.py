"""Chat rendering with the target tokenizer's own template and an assistant-only loss mask.

The mask covers exactly the tokens the model generates for each assistant turn: its content and the
end-of-turn token, never the template's header ("<|im_start|>assistant\\n") nor what the template adds
after the end-of-turn token ("\\n"). A mask off by one token, or a template rendered differently from
serving, silently ruins acceptance (docs/dflash.md §4, trap 6).

Spans come from rendering prefixes, never from searching decoded text: for assistant turn i, the
template renders messages[:i] with the generation prompt (what the server feeds the model) and
messages[:i+1] (that plus the answer); the answer is what lies between, up to and including the last
special token (the end of turn). Templates with `{% generation %}` markers give the mask directly.
When a template rewrites history (so an earlier turn renders differently once later turns follow), each
assistant turn becomes its own sample, rendered exactly as it is served.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from jinja2 import TemplateError

from flashdraft.errors import FlashdraftError


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]


def apply_chat_template(tokenizer, messages, thinking: str | None, where: str, **kwargs):
    """The tokenizer's own chat template with the thinking switch; a template that refuses the
    conversation (Gemma and Mistral templates raise on a system turn or on roles that do not alternate)
    is an error naming the conversation and the template's own message."""
    if thinking is not None:
        kwargs["enable_thinking"] = thinking == "on"
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlashdraftError(
            f"{where}: the target's chat template refused this conversation: {message}"
        ) from None


def check_renders(tokenizer, messages, thinking: str | None, where: str) -> None:
    """Render the whole conversation once, so a template that refuses it is found before any long work."""
    apply_chat_template(tokenizer, messages, thinking, where, tokenize=False)


def _render_text(
    tokenizer, messages, *, add_generation_prompt: bool, thinking: str | None, where: str
) -> str:
    return apply_chat_template(
        tokenizer, messages, thinking, where, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def _mark_span(ids, offsets, mask, start_char: int, end_char: int, specials: set[int]) -> None:
    """Mask the tokens inside [start_char, end_char) up to and including the last special token there."""
    inside = [i for i, (s, e) in enumerate(offsets) if e > start_char and s < end_char and e > s]
    inside += [
        i for i, (s, e) in enumerate(offsets) if s == e == start_char
    ]  # zero-width specials at the edge
    inside = sorted(set(inside))
    if not inside:
        return
    last_special = max((i for i in inside if ids[i] in specials), default=None)
    stop = last_special if last_special is not None else inside[-1]
    for i in inside:
        if i <= stop:
            mask[i] = 1


def render_conversation(tokenizer, messages: list[dict], thinking: str | None, where: str) -> list[Rendered]:
    """One or more (ids, mask) samples for a conversation; errors name `where`."""
    if not getattr(tokenizer, "chat_template", None):
        raise FlashdraftError(f"{where}: the target tokenizer has no chat template")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise FlashdraftError(f"{where}: no assistant turn to learn from")
    if messages[0]["role"] == "assistant":
        raise FlashdraftError(f"{where}: the conversation starts with an assistant turn (no prompt)")
    template = (
        tokenizer.chat_template
        if isinstance(tokenizer.chat_template, str)
        else json.dumps(tokenizer.chat_template)
    )
    if "{% generation %}" in template or "{%- generation %}" in template:
        return [_render_with_generation_markers(tokenizer, messages, thinking, where)]

    specials = special_ids(tokenizer)
    full_text = _render_text(
        tokenizer, messages[: turns[-1] + 1], add_generation_prompt=False, thinking=thinking, where=where
    )
    spans, consistent = [], True
    for i in turns:
        before = _render_text(
            tokenizer, messages[:i], add_generation_prompt=True, thinking=thinking, where=where
        )
        through = _render_text(
            tokenizer, messages[: i + 1], add_generation_prompt=False, thinking=thinking, where=where
        )
        if not through.startswith(before):
            raise FlashdraftError(
                f"{where}: the chat template renders assistant turn {i} differently from its generation prompt, "
                "so the loss mask cannot be derived; check --thinking or the template"
            )
        spans.append((len(before), len(through), through))
        consistent &= full_text.startswith(through)
    if consistent:
        ids, offsets = _encode(tokenizer, full_text)
        mask = [0] * len(ids)
        for start, end, _ in spans:
            _mark_span(ids, offsets, mask, start, end, specials)
        return [Rendered(ids, mask)]
    samples = []  # the template rewrites history: one sample per turn, exactly as served
    for start, end, through in spans:
        ids, offsets = _encode(tokenizer, through)
        mask = [0] * len(ids)
        _mark_span(ids, offsets, mask, start, end, specials)
        samples.append(Rendered(ids, mask))
    return samples


def _render_with_generation_markers(tokenizer, messages, thinking, where) -> Rendered:
    out = apply_chat_template(
        tokenizer,
        messages,
        thinking,
        where,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    mask = list(out["assistant_masks"])
    if not any(mask):
        raise FlashdraftError(f"{where}: the template's {{% generation %}} markers selected no tokens")
    return Rendered(list(out["input_ids"]), [int(m) for m in mask])


def tokenizer_fingerprint(tokenizer) -> dict[str, str]:
    """Hashes that tie shards to the tokenizer and chat template they were made with."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode()
    specials = json.dumps(sorted(tokenizer.all_special_tokens)).encode()
    template = (
        tokenizer.chat_template
        if isinstance(tokenizer.chat_template, str)
        else json.dumps(tokenizer.chat_template or "")
    )
    return {
        "tokenizer_sha256": hashlib.sha256(vocab + b"\0" + specials).hexdigest(),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
    }

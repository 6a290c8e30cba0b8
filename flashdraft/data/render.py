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

Messages reach the template as a serving engine hands them over (docs/inputs-and-outputs.md): the
record's `tools` list (carried on the first message, see `flashdraft.data.chat`) goes to the template's
`tools` argument, tool-call arguments given as JSON text become objects, and an assistant turn's reasoning
(`reasoning_content`) is kept as that field when the template renders it, or put back inside
`<think>...</think>` at the start of the content for templates that only know the think tokens.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache

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
    messages, tools = template_messages(tokenizer, messages, thinking, where)
    if tools:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlashdraftError(
            f"{where}: the target's chat template refused this conversation: {message}"
        ) from None


TOOLS_KEY = "tools"  # the record's tool list, carried on its first message (flashdraft.data.chat)
_REASONING_PROBE = "flashdraft reasoning probe"


def split_tools(messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """The messages without the carried tool list, and that list (None when the record has none)."""
    if not messages or TOOLS_KEY not in messages[0]:
        return messages, None
    first = {k: v for k, v in messages[0].items() if k != TOOLS_KEY}
    return [first, *messages[1:]], messages[0][TOOLS_KEY]


def _template_text(tokenizer) -> str:
    template = tokenizer.chat_template
    return template if isinstance(template, str) else json.dumps(template or "")


@lru_cache(maxsize=64)
def _placement(tokenizer, template: str, thinking: str | None) -> str | None:
    kwargs = {"tokenize": False} | ({} if thinking is None else {"enable_thinking": thinking == "on"})
    plain = [{"role": "user", "content": "probe question"}, {"role": "assistant", "content": "probe answer"}]
    with_field = [plain[0], {**plain[1], "reasoning_content": _REASONING_PROBE}]
    try:
        if _REASONING_PROBE in tokenizer.apply_chat_template(with_field, **kwargs) and (
            tokenizer.apply_chat_template(plain, **kwargs)
            != tokenizer.apply_chat_template(with_field, **kwargs)
        ):
            return "reasoning_content"
    except (TemplateError, TypeError, ValueError, KeyError, IndexError):
        pass  # a template that refuses the probe does not render the field
    vocab = tokenizer.get_vocab()
    if ("<think>" in template and "</think>" in template) or ("<think>" in vocab and "</think>" in vocab):
        return "think"
    return None


def reasoning_placement(tokenizer, thinking: str | None) -> str | None:
    """Where the target's chat template expects an assistant turn's reasoning: "reasoning_content" when it
    renders that message field (found by rendering a probe conversation with and without it), "think" when
    it only knows `<think>...</think>` inside the content (Qwen3 style), None when it can render neither."""
    return _placement(tokenizer, _template_text(tokenizer), thinking)


def reasoning_refusal(where: str) -> FlashdraftError:
    return FlashdraftError(
        f"{where}: the answer has reasoning (reasoning_content) but the target's chat template cannot render it "
        "(it renders no reasoning_content field and has no <think> tokens); regenerate with --thinking off "
        "(or the server's reasoning parser off), or give the target a chat template that renders reasoning"
    )


def template_messages(
    tokenizer, messages: list[dict], thinking: str | None, where: str
) -> tuple[list[dict], list[dict] | None]:
    """The messages as the template receives them from a serving engine, and the record's tool list."""
    messages, tools = split_tools(messages)
    if not any("tool_calls" in m or m.get("reasoning_content") for m in messages):
        return messages, tools
    out = []
    for m in messages:
        m = copy.deepcopy(m)
        for call in m.get("tool_calls") or []:
            # OpenAI sends arguments as JSON text; serving engines decode them before templating, and
            # templates print them with `tojson` (text would be quoted twice).
            function = call.get("function", {})
            if isinstance(function.get("arguments"), str):
                with contextlib.suppress(json.JSONDecodeError):  # not JSON: the text the model wrote
                    function["arguments"] = json.loads(function["arguments"])
        reasoning = m.get("reasoning_content")
        if reasoning:
            placement = reasoning_placement(tokenizer, thinking)
            if placement is None:
                raise reasoning_refusal(where)
            if placement == "think":
                del m["reasoning_content"]
                m["content"] = f"<think>\n{reasoning}\n</think>\n\n{m.get('content') or ''}"
        out.append(m)
    return out, tools


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


def assistant_turns(messages: list[dict]) -> list[int]:
    """Indices of the assistant messages of a conversation, in order."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def render_conversation(tokenizer, messages: list[dict], thinking: str | None, where: str) -> list[Rendered]:
    """One or more (ids, mask) samples for a conversation; errors name `where`."""
    if not getattr(tokenizer, "chat_template", None):
        raise FlashdraftError(f"{where}: the target tokenizer has no chat template")
    turns = assistant_turns(messages)
    if not turns:
        raise FlashdraftError(f"{where}: no assistant turn to learn from")
    if messages[0]["role"] == "assistant":
        raise FlashdraftError(f"{where}: the conversation starts with an assistant turn (no prompt)")
    template = _template_text(tokenizer)
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
        through = (  # the last turn's is the whole conversation's, rendered above
            full_text
            if i == turns[-1]
            else _render_text(
                tokenizer, messages[: i + 1], add_generation_prompt=False, thinking=thinking, where=where
            )
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
    template = _template_text(tokenizer)
    return {
        "tokenizer_sha256": hashlib.sha256(vocab + b"\0" + specials).hexdigest(),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
    }


def prompt_ids(
    tokenizer, messages: list[dict], thinking: str | None, where: str = "regeneration prompt"
) -> list[int]:
    """The ids the target is prompted with for the next assistant turn (also what the tokenization step
    compares its rendered prefix with before it trains on generated ids); `where` names the conversation
    in a template's refusal."""
    ids = apply_chat_template(tokenizer, messages, thinking, where, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def end_of_turn_id(tokenizer, thinking: str | None) -> int | None:
    """The special token the chat template puts right after an assistant answer, if there is one."""
    marker = "\u2063flashdraft\u2063"
    try:
        text = apply_chat_template(
            tokenizer,
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
            thinking,
            "end-of-turn probe",
            tokenize=False,
        )
    except FlashdraftError:
        return None
    if marker not in text:
        return None
    after = tokenizer(text[text.index(marker) + len(marker) :], add_special_tokens=False)["input_ids"]
    return after[0] if after and after[0] in special_ids(tokenizer) else None

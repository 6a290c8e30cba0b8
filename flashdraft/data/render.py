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
import re
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
                with contextlib.suppress(json.JSONDecodeError, RecursionError):  # the text the model wrote
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


# Content may not inject template tokens (docs/inputs-and-outputs.md, "Special tokens in content"): a
# special token's text typed inside a message ("<|im_start|>") is tokenized as plain text; only the
# template's own markup yields special ids. The occurrences are found by rendering the conversation once
# more with each one wrapped in private-use markers, which the template copies through like any text.
_MARK_START, _MARK_END = "\ue0f0", "\ue0f1"


@lru_cache(maxsize=64)
def _special_text_pattern(tokenizer) -> re.Pattern | None:
    """A regex matching the text of any special token (longest first), or None when there are none."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    texts = {decoder[i].content for i in special_ids(tokenizer) if i in decoder}
    texts |= {t for t in tokenizer.all_special_tokens if t}
    texts = sorted((t for t in texts if t and not t.isspace()), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def _marked(value, pattern: re.Pattern):
    """`value` (messages, tools) with every special token's text inside its strings wrapped in markers."""
    if isinstance(value, str):
        return pattern.sub(lambda m: f"{_MARK_START}{m.group(0)}{_MARK_END}", value)
    if isinstance(value, dict):
        return {k: _marked(v, pattern) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_marked(v, pattern) for v in value]
    return value


def _holds_special_text(value, pattern: re.Pattern) -> bool:
    if isinstance(value, str):
        return pattern.search(value) is not None
    if isinstance(value, dict):
        return any(_holds_special_text(v, pattern) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_special_text(v, pattern) for v in value)
    return False


def _typed_special_spans(
    tokenizer, messages, thinking, where: str, text: str, kwargs: dict
) -> list[tuple[int, int]]:
    """Character spans of `text` (the conversation rendered with `kwargs`) where a special token's text
    comes from the messages rather than from the template; [] when none does."""
    pattern = _special_text_pattern(tokenizer)
    if pattern is None or not _holds_special_text(messages, pattern):
        return []
    marked = apply_chat_template(
        tokenizer, _marked(messages, pattern), thinking, where, tokenize=False, **kwargs
    )
    spans, plain, start = [], [], None
    for char in marked:
        if char == _MARK_START:
            start = sum(map(len, plain))
        elif char == _MARK_END and start is not None:
            spans.append((start, sum(map(len, plain))))
            start = None
        elif char not in (_MARK_START, _MARK_END):
            plain.append(char)
    if "".join(plain) != text:  # the template changed the typed text (or the markers stopped it)
        raise FlashdraftError(
            f"{where}: a message holds a special token's text ({pattern.search(text).group(0)!r}) and the chat "
            "template rewrites it, so it cannot be kept as plain text; remove it from the record "
            "(or pass --skip-bad-records)"
        )
    return spans


def _encode_piece(
    tokenizer, piece: str, plain: bool, at_start: bool
) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and offsets (in `piece`) of a piece of a rendering, tokenized where it stands: after a newline
    unless it opens the text, so a SentencePiece tokenizer does not add the prefix space it adds at the start
    of a string (the trick transformers' own control-token sanitizing uses). `plain`: special tokens' text
    is plain text."""
    kwargs = {"add_special_tokens": False, "return_offsets_mapping": True}
    if plain:
        kwargs["split_special_tokens"] = True
    if not at_start:
        newline = list(tokenizer("\n", add_special_tokens=False)["input_ids"])
        enc = tokenizer("\n" + piece, **kwargs)
        ids = list(enc["input_ids"])
        if ids[: len(newline)] == newline:
            offsets = [(max(0, s - 1), max(0, e - 1)) for s, e in enc["offset_mapping"][len(newline) :]]
            return ids[len(newline) :], offsets
    enc = tokenizer(piece, **kwargs)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def encode_rendering(
    tokenizer, text: str, messages, thinking: str | None, where: str, **kwargs
) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets of `text`, the messages rendered by the template with `kwargs`: the
    tokenizer's own encoding, except that a special token's text typed inside a message is tokenized as
    plain text (with the text around it, up to the template's neighbouring special tokens)."""
    ids, offsets = _encode(tokenizer, text)
    typed = set(_typed_special_spans(tokenizer, messages, thinking, where, text, kwargs))
    if not typed:
        return ids, offsets
    specials = special_ids(tokenizer)
    injected = [i for i, (t, o) in enumerate(zip(ids, offsets, strict=True)) if t in specials and o in typed]
    if not injected:
        return ids, offsets
    markup = [i for i, t in enumerate(ids) if t in specials and i not in set(injected)]
    regions = set()  # token index ranges [lo, hi) between two of the template's special tokens
    for i in injected:
        lo = max((m for m in markup if m < i), default=-1) + 1
        hi = min((m for m in markup if m > i), default=len(ids))
        regions.add((lo, hi))
    typed_text = text[offsets[injected[0]][0] : offsets[injected[0]][1]]
    out_ids, out_offsets, cursor = [], [], 0
    for lo, hi in sorted(regions):
        start = offsets[lo - 1][1] if lo else 0
        end = offsets[hi][0] if hi < len(ids) else len(text)
        piece = text[start:end]
        # where this tokenizer encodes the piece alone as it does in place, it encodes the plain piece right too
        if _encode_piece(tokenizer, piece, plain=False, at_start=start == 0)[0] != ids[lo:hi]:
            raise FlashdraftError(
                f"{where}: a message holds a special token's text ({typed_text!r}) that this tokenizer cannot "
                "tokenize as plain text where it stands; remove it from the record (or pass --skip-bad-records)"
            )
        piece_ids, piece_offsets = _encode_piece(tokenizer, piece, plain=True, at_start=start == 0)
        out_ids += ids[cursor:lo] + piece_ids
        out_offsets += offsets[cursor:lo] + [(s + start, e + start) for s, e in piece_offsets]
        cursor = hi
    return out_ids + ids[cursor:], out_offsets + offsets[cursor:]


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
        spans.append((len(before), len(through), through, i))
        consistent &= full_text.startswith(through)
    if consistent:
        ids, offsets = encode_rendering(
            tokenizer, full_text, messages[: turns[-1] + 1], thinking, where, add_generation_prompt=False
        )
        mask = [0] * len(ids)
        for start, end, _, _ in spans:
            _mark_span(ids, offsets, mask, start, end, specials)
        return [Rendered(ids, mask)]
    samples = []  # the template rewrites history: one sample per turn, exactly as served
    for start, end, through, i in spans:
        ids, offsets = encode_rendering(
            tokenizer, through, messages[: i + 1], thinking, where, add_generation_prompt=False
        )
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
    ids, mask = list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
    if not any(mask):
        raise FlashdraftError(f"{where}: the template's {{% generation %}} markers selected no tokens")
    pattern = _special_text_pattern(tokenizer)
    if pattern is None or not _holds_special_text(messages, pattern):
        return Rendered(ids, mask)
    # special tokens' text typed in the messages: re-encode as plain text, carrying the mask over by characters
    text = apply_chat_template(tokenizer, messages, thinking, where, tokenize=False)
    own_ids, own_offsets = _encode(tokenizer, text)
    if own_ids != ids:
        raise FlashdraftError(
            f"{where}: the template's {{% generation %}} rendering tokenizes differently from its text, so a special "
            "token's text typed in a message cannot be kept as plain text; remove it from the record"
        )
    plain_ids, plain_offsets = encode_rendering(tokenizer, text, messages, thinking, where)
    masked = [own_offsets[i] for i, m in enumerate(mask) if m]
    plain_mask = [int(any(s < me and e > ms for ms, me in masked)) for s, e in plain_offsets]
    return Rendered(plain_ids, plain_mask)


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
    """The ids the target is prompted with for the next assistant turn (regeneration and eval; also what the
    tokenization step compares its rendered prefix with before it trains on generated ids). Encoded like a
    training sample: a special token's text typed in a message is plain text."""
    text = apply_chat_template(
        tokenizer, messages, thinking, where, add_generation_prompt=True, tokenize=False
    )
    return encode_rendering(tokenizer, text, messages, thinking, where, add_generation_prompt=True)[0]


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

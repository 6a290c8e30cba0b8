"""Conversations in the common dataset shapes, normalised to OpenAI-style messages.

Shapes: OpenAI `messages` ({role, content}), ShareGPT `conversations` ({from, value}), {prompt, response}
and {prompt, completion} pairs, and pre-tokenized `input_ids`. Errors name the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from flashdraft.data.render import apply_chat_template
from flashdraft.errors import FlashdraftError

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
}
ROLES = ("system", "user", "assistant", "tool")
_ANSWER_KEYS = ("response", "completion")  # the answer of a {prompt, ...} record


@dataclass
class Conversation:
    messages: list[dict[str, str]] | None  # None when the record is pre-tokenized
    input_ids: list[int] | None
    where: str


# list key -> (role field, content field, role names mapped to OpenAI roles or None to keep them)
_TURN_LISTS = {"messages": ("role", "content", None), "conversations": ("from", "value", _SHAREGPT_ROLES)}


def _turns(raw, shape: str, where: str) -> list[dict[str, str]]:
    role_key, content_key, role_map = _TURN_LISTS[shape]
    if not isinstance(raw, list):
        raise FlashdraftError(
            f"{where}: '{shape}' must be a list of {{{role_key}, {content_key}}} objects, "
            f"found {_json_type(raw)}"
        )
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or role_key not in m or content_key not in m:
            raise FlashdraftError(f"{where}: {shape}[{i}] needs '{role_key}' and '{content_key}'")
        role = m[role_key] if role_map is None else role_map.get(str(m[role_key]).lower())
        if role is None:
            raise FlashdraftError(f"{where}: {shape}[{i}] has unknown role {m[role_key]!r}")
        messages.append({"role": role, "content": m[content_key]})
    return messages


def _json_type(value) -> str:
    names = {str: "a string", dict: "an object", list: "a list", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def parse_json_object(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise FlashdraftError(f"{where}: invalid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise FlashdraftError(f"{where}: expected a JSON object")
    return record


def normalise(record: dict, where: str) -> Conversation:
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise FlashdraftError(f"{where}: 'input_ids' must be a non-empty list of non-negative integers")
        return Conversation(None, ids, where)
    shape = next((key for key in _TURN_LISTS if key in record), None)
    if shape is not None:
        messages = _turns(record[shape], shape, where)
    elif "prompt" in record:
        messages = [{"role": "user", "content": record["prompt"]}]
        answer_keys = [k for k in _ANSWER_KEYS if record.get(k) is not None]
        if len(answer_keys) > 1:
            raise FlashdraftError(f"{where}: both {' and '.join(map(repr, answer_keys))}; give one answer")
        if answer_keys:
            messages.append({"role": "assistant", "content": record[answer_keys[0]]})
    else:
        keys = ", ".join(map(repr, list(record)[:6])) or "none"
        raise FlashdraftError(
            f"{where}: expected 'messages', 'conversations', 'prompt' (with 'response' or 'completion') "
            f"or 'input_ids'; found keys {keys}"
        )
    if not messages:
        raise FlashdraftError(f"{where}: empty conversation")
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise FlashdraftError(
                f"{where}: message {i} has unknown role {m['role']!r} (expected one of {', '.join(ROLES)})"
            )
        if not isinstance(m["content"], str):
            raise FlashdraftError(
                f"{where}: message {i} content must be a string, found {_json_type(m['content'])}"
            )
    return Conversation(messages, None, where)


def prompt_ids(conversation: Conversation, tokenizer, thinking: str | None) -> list[int]:
    """Token ids of the conversation up to its last user turn, ready for the assistant's answer, rendered
    with the target's own chat template (as a serving engine renders it)."""
    if conversation.input_ids is not None:
        return conversation.input_ids
    messages = list(conversation.messages)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages:
        raise FlashdraftError(f"{conversation.where}: no user turn to answer")
    if tokenizer is None:
        raise FlashdraftError(
            f"{conversation.where}: text prompts need the target's tokenizer (none found next to the target)"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise FlashdraftError(f"{conversation.where}: the target tokenizer has no chat template")
    ids = apply_chat_template(tokenizer, messages, thinking, conversation.where, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)

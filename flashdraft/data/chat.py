"""Conversations in the common dataset shapes, normalised to OpenAI-style messages.

Shapes: OpenAI `messages` ({role, content}), ShareGPT `conversations` ({from, value}), {prompt, response}
and {prompt, completion} pairs, and pre-tokenized `input_ids`. Errors name the file and line.

OpenAI messages keep their tool calls (`tool_calls` of an assistant turn; `tool_call_id` and `name` of a
`tool` turn) and an assistant turn's reasoning (`reasoning_content`, or vLLM's `reasoning`). The record's
`tools` list rides on the first message under `render.TOOLS_KEY`, so it travels with the conversation
through regeneration and the journal (and changes its key); rendering and the server client take it
back out (docs/inputs-and-outputs.md).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from flashdraft.data.render import TOOLS_KEY, prompt_ids
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
        calls = isinstance(m, dict) and shape == "messages" and m.get("tool_calls")
        if not isinstance(m, dict) or role_key not in m or (content_key not in m and not calls):
            raise FlashdraftError(f"{where}: {shape}[{i}] needs '{role_key}' and '{content_key}'")
        role = m[role_key] if role_map is None else role_map.get(str(m[role_key]).lower())
        if role is None:
            raise FlashdraftError(f"{where}: {shape}[{i}] has unknown role {m[role_key]!r}")
        content = m.get(content_key)
        if content is None and calls:
            content = ""  # OpenAI gives null content beside tool calls
        message = {"role": role, "content": content}
        if shape == "messages":
            message.update(_openai_extras(m, i, where))
        messages.append(message)
    return messages


def _openai_extras(m: dict, i: int, where: str) -> dict:
    """Tool calls, tool-result fields and reasoning of OpenAI message `i`, checked."""
    extras = {}
    reasoning = m.get("reasoning_content")
    if reasoning is None:
        reasoning = m.get("reasoning")  # newer vLLM's name for the field
    if reasoning is not None:
        if m["role"] != "assistant" or not isinstance(reasoning, str):
            raise FlashdraftError(
                f"{where}: messages[{i}] reasoning_content must be a string of an assistant turn"
            )
        if reasoning:
            extras["reasoning_content"] = reasoning
    if m.get("tool_calls") is not None:
        if m["role"] != "assistant":
            raise FlashdraftError(f"{where}: messages[{i}] has tool_calls but its role is {m['role']!r}")
        extras["tool_calls"] = check_tool_calls(m["tool_calls"], f"{where}: messages[{i}]")
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            if m["role"] != "tool" or not isinstance(m[key], str):
                raise FlashdraftError(f"{where}: messages[{i}] {key} must be a string of a 'tool' turn")
            extras[key] = m[key]
    return extras


def check_tool_calls(calls, where: str) -> list[dict]:
    """OpenAI tool calls: [{id?, type?, function: {name, arguments (JSON text or object)}}]."""
    if not isinstance(calls, list):
        raise FlashdraftError(f"{where} tool_calls must be a list, found {_json_type(calls)}")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise FlashdraftError(f"{where} tool_calls[{j}] needs 'function' with a string 'name'")
        if not isinstance(function.get("arguments", ""), str | dict):
            raise FlashdraftError(
                f"{where} tool_calls[{j}].function.arguments must be JSON text or an object, "
                f"found {_json_type(function['arguments'])}"
            )
        if not isinstance(call.get("id", ""), str):
            raise FlashdraftError(f"{where} tool_calls[{j}].id must be a string")
    return calls


def _is_named(schema) -> bool:
    return isinstance(schema, dict) and isinstance(schema.get("name"), str)


def _tools(raw, where: str) -> list[dict]:
    """The record's tool list: function schemas, as a list or as JSON text of one (some datasets)."""
    if isinstance(raw, str):
        try:
            raw = load_json(raw, f"{where}: 'tools'")
        except json.JSONDecodeError:
            raise FlashdraftError(f"{where}: 'tools' is text that is not JSON") from None
    if not isinstance(raw, list) or not all(
        isinstance(t, dict) and _is_named(t.get("function") or t) for t in raw
    ):
        raise FlashdraftError(
            f"{where}: 'tools' must be a list of tool objects, each with a 'name' (or 'function.name')"
        )
    return raw


def _json_type(value) -> str:
    names = {str: "a string", dict: "an object", list: "a list", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def load_json(text: str, where: str):
    """`json.loads`, with a value nested too deeply for Python's parser (RecursionError) reported as an
    error naming `where`, like any other malformed JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise FlashdraftError(
            f"{where}: JSON nested too deeply to read (more than {sys.getrecursionlimit()} levels); "
            "fix or remove that record"
        ) from None


def parse_json_object(line: str, where: str) -> dict:
    try:
        record = load_json(line, where)
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
    if record.get("tools") is not None:
        messages[0] = {**messages[0], TOOLS_KEY: _tools(record["tools"], where)}
    for i, m in enumerate(messages):
        _check_text(m, f"messages[{i}]", where)
    return Conversation(messages, None, where)


def _check_text(value, field: str, where: str) -> None:
    """Every string in `value` must be encodable text: JSON may spell a lone UTF-16 surrogate ("\\ud800"),
    which no tokenizer accepts (a TypeError deep inside it), so it is named here with its field."""
    pending = [(value, field)]
    while pending:  # a loop, not recursion: the record may be nested as deeply as JSON parsing allowed
        item, name = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise FlashdraftError(
                    f"{where}: {name} holds a lone UTF-16 surrogate (\\u{ord(item[exc.start]):04x} at "
                    f"character {exc.start + 1}), which is not text; fix the record or drop it"
                ) from None
        elif isinstance(item, dict):
            pending.extend((v, f"{name}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            pending.extend((v, f"{name}[{j}]") for j, v in enumerate(item))


def conversation_prompt_ids(conversation: Conversation, tokenizer, thinking: str | None) -> list[int]:
    """Token ids of the conversation up to its last user turn, ready for the assistant's answer: its own
    `input_ids` when it came as ids, else rendered by `render.prompt_ids` (the one prompt renderer, with the
    target's own chat template, as a serving engine renders it)."""
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
    return prompt_ids(tokenizer, messages, thinking, conversation.where)

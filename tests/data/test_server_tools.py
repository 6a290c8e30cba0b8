"""Tool calls survive: the record's tools and tool turns are checked, sent to the server, the server's tool
calls kept on the regenerated answer, and everything rendered through the target's chat template with the
tool-call text supervised like content (docs/inputs-and-outputs.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashdraft.cli import main
from flashdraft.data.chat import normalise
from flashdraft.data.regenerate import read_journal
from flashdraft.data.shards import open_shards
from flashdraft.errors import FlashdraftError
from flashdraft.model.tiny import save_tiny_target

from .helpers import fake_chat_server, make_char_tokenizer, supervised_spans

# Qwen-like: the tool schemas in a system block, calls as <tool_call> JSON, results as a user turn
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def call(city: str, call_id: str) -> dict:
    arguments = json.dumps({"city": city})  # OpenAI sends arguments as JSON text
    return {"id": call_id, "type": "function", "function": {"name": "weather", "arguments": arguments}}


RECORD = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("Paris", "c1")]},
        {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ],
    "tools": TOOLS,
}


@pytest.fixture(scope="module")
def tools_target(tmp_path_factory) -> Path:
    tokenizer = make_char_tokenizer(TOOLS_TEMPLATE)
    path = tmp_path_factory.mktemp("t") / "target"
    return save_tiny_target(path, "qwen3", vocab_size=128, hidden_size=32, num_layers=2, tokenizer=tokenizer)


def _prepare(tmp_path: Path, target: Path, *flags: str) -> Path:
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps(RECORD) + "\n")
    out = tmp_path / "s"
    assert main(["prepare", str(data), "--target", str(target), "--out", str(out), *flags]) == 0
    return out


def _texts(out: Path, target: Path) -> tuple[str, list[str]]:
    """The first sample's whole text and its supervised spans."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    ids, mask = open_shards(out)[1].sample(0)
    return tok.decode(list(ids)), supervised_spans(tok, ids, mask)


def test_the_datasets_tool_calls_are_rendered_and_supervised_like_content(tmp_path, tools_target):
    text, spans = _texts(_prepare(tmp_path, tools_target), tools_target)
    assert text.startswith(
        "<|im_start|>system\n# Tools\n" + json.dumps(TOOLS[0]) + "\n<|im_end|>"
    )  # not taught
    assert "<tool_response>sunny</tool_response>" in text
    # the arguments reach the template as an object, as a serving engine hands them over
    assert spans == [
        '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>',
        "It is sunny.<|im_end|>",
    ]


def test_regenerated_tool_calls_are_sent_back_kept_and_rendered(tmp_path, tools_target):
    def answer(body):
        if body["messages"][-1]["role"] == "user":
            return {"role": "assistant", "content": "", "tool_calls": [call("Rome", "srv1")]}
        return "Sunny in Rome."

    with fake_chat_server(answer) as fake:
        out = _prepare(tmp_path, tools_target, "--regenerate", "--server-url", fake.url, "--concurrency", "1")
    first, second = fake.seen
    assert first["tools"] == second["tools"] == TOOLS
    assert not any("tools" in m for body in fake.seen for m in body["messages"])  # the list is the request's
    assert second["messages"][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [call("Rome", "srv1")]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "weather"},
    ]
    (done,) = read_journal(out / "regenerated.jsonl").values()
    assert done.messages[1]["tool_calls"] == [call("Rome", "srv1")]
    _, spans = _texts(out, tools_target)
    assert spans == [
        '<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call><|im_end|>',
        "Sunny in Rome.<|im_end|>",
    ]


def test_the_tool_list_is_part_of_the_journal_key(tmp_path, tools_target):
    """Other tools, other answers: a rerun with another tool list must not reuse the journaled answers."""
    with fake_chat_server(lambda body: "It is sunny.") as fake:
        out = _prepare(tmp_path, tools_target, "--regenerate", "--server-url", fake.url)
        RECORD["tools"] = TOOLS * 2
        try:
            _prepare(tmp_path, tools_target, "--regenerate", "--server-url", fake.url, "--force")
        finally:
            RECORD["tools"] = TOOLS
    assert len(fake.seen) == 4 and len(read_journal(out / "regenerated.jsonl")) == 2


@pytest.mark.parametrize(
    "message,needle",
    [
        (
            {"role": "assistant", "content": "", "tool_calls": {"a": 1}},
            r"messages\[1\] tool_calls must be a list",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},
            r"messages\[1\] tool_calls\[0\] needs 'function' with a string 'name'",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
            r"tool_calls\[0\].function.arguments must be JSON text or an object, found a number",
        ),
        (
            {"role": "user", "content": "x", "tool_calls": []},
            r"messages\[1\] has tool_calls but its role is 'user'",
        ),
        (
            {"role": "assistant", "content": "x", "tool_call_id": "c1"},
            r"tool_call_id must be a string of a 'tool'",
        ),
        (
            {"role": "tool", "content": "x", "name": 7},
            r"messages\[1\] name must be a string of a 'tool' turn",
        ),
        ({"role": "assistant", "content": None}, r"message 1 content must be a string, found null"),
        (
            {"role": "user", "content": "x", "reasoning_content": "r"},
            r"reasoning_content must be a string of an",
        ),
    ],
)
def test_bad_tool_fields_are_named_with_file_and_line(message, needle):
    record = {"messages": [{"role": "user", "content": "hi"}, message]}
    with pytest.raises(FlashdraftError, match="^f.jsonl line 3: .*" + needle):
        normalise(record, "f.jsonl line 3")


@pytest.mark.parametrize(
    "tools,needle",
    [
        ({"name": "f"}, "'tools' must be a list of tool objects"),
        ([{"type": "function", "function": {"parameters": {}}}], "'tools' must be a list of tool objects"),
        ("[{oops", "'tools' is text that is not JSON"),
    ],
)
def test_bad_tool_lists_are_named_with_file_and_line(tools, needle):
    with pytest.raises(FlashdraftError, match="f.jsonl line 3: " + needle):
        normalise({"messages": RECORD["messages"], "tools": tools}, "f.jsonl line 3")


def test_a_tool_list_given_as_json_text_is_read():
    conversation = normalise({"messages": RECORD["messages"], "tools": json.dumps(TOOLS)}, "x")
    assert conversation.messages[0]["tools"] == TOOLS

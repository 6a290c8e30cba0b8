"""A server's reasoning (`reasoning_content`, or vLLM's `reasoning`) is put back where the target's chat template
expects it, or refused at the first answer when the template cannot render it (docs/inputs-and-outputs.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashdraft.cli import main
from flashdraft.data.regenerate import read_journal
from flashdraft.data.render import reasoning_placement, render_conversation
from flashdraft.data.shards import open_shards
from flashdraft.model.tiny import save_tiny_target

from .helpers import QWEN_TEMPLATE, fake_chat_server, make_char_tokenizer, supervised_spans

# Renders the reasoning field itself (as Qwen3's own template does), written without newlines so that a
# test tells it from the <think> block rebuilt inside the content.
FIELD_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML with neither the field nor think tokens
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZERS = {
    "field": lambda: make_char_tokenizer(FIELD_TEMPLATE),
    "think": lambda: make_char_tokenizer(QWEN_TEMPLATE),
    "plain": lambda: make_char_tokenizer(PLAIN_TEMPLATE, ("<|im_start|>", "<|im_end|>")),
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {
        name: save_tiny_target(
            root / name, "qwen3", vocab_size=128, hidden_size=32, num_layers=2, tokenizer=make()
        )
        for name, make in TOKENIZERS.items()
    }


def _prepare(tmp_path: Path, target: Path, records: list[dict], *flags: str) -> int:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return main(["prepare", str(data), "--target", str(target), "--out", str(tmp_path / "s"), *flags])


def _spans(out: Path, target: Path) -> list[list[str]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    manifest, shards = open_shards(out)
    return [supervised_spans(tok, *shards.sample(i)) for i in range(manifest["samples"])]


def test_the_placement_follows_what_the_template_renders():
    assert reasoning_placement(TOKENIZERS["field"](), None) == "reasoning_content"
    assert reasoning_placement(TOKENIZERS["think"](), "on") == "think"
    assert reasoning_placement(TOKENIZERS["plain"](), None) is None
    # the think tokens found in the template's text alone, or in the tokenizer's vocabulary alone
    assert (
        reasoning_placement(make_char_tokenizer(QWEN_TEMPLATE, ("<|im_start|>", "<|im_end|>")), "on")
        == "think"
    )
    assert reasoning_placement(make_char_tokenizer(PLAIN_TEMPLATE), None) == "think"


def test_reasoning_is_kept_as_the_field_a_template_renders(tmp_path, targets):
    def answer(body):
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        return {"role": "assistant", "content": f"answer {turn}", "reasoning_content": f"thought {turn}"}

    conversation = {
        "messages": [
            {"role": "user", "content": "q0"},
            {"role": "assistant", "content": "old"},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "old"},
        ]
    }
    with fake_chat_server(answer) as fake:
        assert (
            _prepare(tmp_path, targets["field"], [conversation], "--regenerate", "--server-url", fake.url)
            == 0
        )
    # the second request carries the first regenerated turn with its reasoning, as the API takes it back
    assert fake.seen[1]["messages"][1] == {
        "role": "assistant",
        "content": "answer 0",
        "reasoning_content": "thought 0",
    }
    (done,) = read_journal(tmp_path / "s" / "regenerated.jsonl").values()
    assert done.messages[-1] == {"role": "assistant", "content": "answer 1", "reasoning_content": "thought 1"}
    assert _spans(tmp_path / "s", targets["field"]) == [
        ["<think>thought 0</think>answer 0<|im_end|>", "<think>thought 1</think>answer 1<|im_end|>"]
    ]


def test_reasoning_goes_inside_think_tags_for_a_template_that_only_knows_them(tmp_path, targets):
    reply = {"role": "assistant", "content": "4", "reasoning": "2 and 2"}  # vLLM's newer name for the field
    with fake_chat_server(lambda body: reply) as fake:
        flags = ("--regenerate", "--server-url", fake.url, "--thinking", "on")
        assert _prepare(tmp_path, targets["think"], [{"prompt": "2+2"}], *flags) == 0
    (done,) = read_journal(tmp_path / "s" / "regenerated.jsonl").values()
    assert done.messages[-1] == {"role": "assistant", "content": "4", "reasoning_content": "2 and 2"}
    assert _spans(tmp_path / "s", targets["think"]) == [["<think>\n2 and 2\n</think>\n\n4<|im_end|>"]]


def test_reasoning_a_template_cannot_render_stops_the_run_at_the_first_answer(tmp_path, targets, capsys):
    reply = {"role": "assistant", "content": "4", "reasoning_content": "2 and 2"}
    with fake_chat_server(lambda body: reply) as fake:
        flags = ("--regenerate", "--server-url", fake.url, "--concurrency", "1")
        assert _prepare(tmp_path, targets["plain"], [{"prompt": p} for p in "abc"], *flags) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the target's chat template cannot render it" in error and "--thinking off" in error
    assert len(fake.seen) == 1 and not (tmp_path / "s" / "manifest.json").exists()


def test_reasoning_in_the_input_data_is_checked_while_reading(tmp_path, targets, capsys):
    record = {
        "messages": [
            {"role": "user", "content": "2+2"},
            {"role": "assistant", "content": "4", "reasoning_content": "2 and 2"},
        ]
    }
    assert _prepare(tmp_path, targets["plain"], [{"prompt": "hi", "response": "ok"}, record]) == 2
    assert "in.jsonl line 2: the answer has reasoning" in capsys.readouterr().err
    assert _prepare(tmp_path, targets["think"], [record]) == 0
    assert _spans(tmp_path / "s", targets["think"]) == [["<think>\n2 and 2\n</think>\n\n4<|im_end|>"]]


def test_rendering_never_changes_the_callers_messages():
    tok = TOKENIZERS["think"]()
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
    ]
    before = json.dumps(messages)
    render_conversation(tok, messages, None, "x")
    assert json.dumps(messages) == before

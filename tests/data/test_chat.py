"""Dataset shapes normalise to messages; prompts render with the target's own chat template."""

from __future__ import annotations

import json

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from flashdraft.data.chat import conversation_prompt_ids, normalise
from flashdraft.data.sources import read_records
from flashdraft.errors import FlashdraftError

QWEN_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    words = [
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "user",
        "assistant",
        "system",
        "\n",
        "\n\n",
        "hi",
        "there",
        "be",
        "brief",
        "ok",
        " ",
        "[UNK]",
    ]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex(r"<\|im_start\|>|<\|im_end\|>|<think>|</think>|\n\n|\n| "), "isolated"
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>")
    fast.chat_template = QWEN_STYLE
    return fast


@pytest.mark.parametrize(
    "record",
    [
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok"},
            ]
        },
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "ok"},
            ]
        },
    ],
)
def test_shapes_render_the_same_prompt(record):
    tok = tiny_tokenizer()
    ids = conversation_prompt_ids(normalise(record, "x"), tok, thinking=None)
    text = tok.decode(ids)
    assert (
        text.replace(" ", "")
        == "<|im_start|>system\nbebrief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_prompt_response_pairs_and_thinking_switch():
    tok = tiny_tokenizer()
    conv = normalise({"prompt": "hi", "response": "ok"}, "x")
    on = tok.decode(conversation_prompt_ids(conv, tok, thinking="on"))
    off = tok.decode(conversation_prompt_ids(conv, tok, thinking="off"))
    assert on.replace(" ", "").endswith("assistant\n") and off.replace(" ", "").endswith(
        "assistant\n<think>\n\n</think>\n\n"
    )


@pytest.mark.parametrize(
    "record,needle",
    [
        ({"messages": []}, "empty conversation"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown role 'alien'"),
        ({"text": "x"}, "expected 'messages'"),
        ({"input_ids": [1, -2]}, "non-negative"),
    ],
)
def test_bad_records_name_the_place(record, needle):
    with pytest.raises(FlashdraftError, match=needle):
        normalise(record, "f.jsonl line 3")


def test_assistant_only_conversation_has_no_prompt():
    with pytest.raises(FlashdraftError, match="no user turn"):
        conversation_prompt_ids(
            normalise({"messages": [{"role": "assistant", "content": "ok"}]}, "x"), tiny_tokenizer(), None
        )


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n{oops\n")
    with pytest.raises(FlashdraftError, match=r"p.jsonl line 2: invalid JSON"):
        read_records(path)

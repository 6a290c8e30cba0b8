"""Golden rendering and loss masks: hand-written token-by-token expectations (1 = the model generates it)."""

from __future__ import annotations

import pytest

from flashdraft.data.render import render_conversation
from flashdraft.errors import FlashdraftError

from .helpers import make_tokenizer

ONE_TURN = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hi there"},
]
TWO_TURNS = [
    {"role": "user", "content": "2+2"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "why"},
    {"role": "assistant", "content": "because"},
]


def pairs(tokenizer, rendered):
    return [
        (tokenizer.convert_ids_to_tokens(i), m)
        for i, m in zip(rendered.input_ids, rendered.loss_mask, strict=True)
    ]


def test_qwen_style_single_turn_thinking_on():
    tok = make_tokenizer("qwen")
    (sample,) = render_conversation(tok, ONE_TURN, "on", "x")
    assert pairs(tok, sample) == [
        ("<|im_start|>", 0),
        ("system", 0),
        ("\n", 0),
        ("be", 0),
        (" ", 0),
        ("brief", 0),
        ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("user", 0),
        ("\n", 0),
        ("hi", 0),
        ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("assistant", 0),
        ("\n", 0),
        ("hi", 1),
        (" ", 1),
        ("there", 1),
        ("<|im_end|>", 1),
        ("\n", 0),
    ]


def test_qwen_style_thinking_off_keeps_the_empty_think_block_in_the_prompt():
    tok = make_tokenizer("qwen")
    (sample,) = render_conversation(tok, ONE_TURN[1:], "off", "x")
    assert pairs(tok, sample) == [
        ("<|im_start|>", 0),
        ("user", 0),
        ("\n", 0),
        ("hi", 0),
        ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("assistant", 0),
        ("\n", 0),
        ("<think>", 0),
        ("\n\n", 0),
        ("</think>", 0),
        ("\n\n", 0),
        ("hi", 1),
        (" ", 1),
        ("there", 1),
        ("<|im_end|>", 1),
        ("\n", 0),
    ]


def test_qwen_style_multi_turn_thinking_on_is_one_sample():
    tok = make_tokenizer("qwen")
    (sample,) = render_conversation(tok, TWO_TURNS, "on", "x")
    assert pairs(tok, sample) == [
        ("<|im_start|>", 0),
        ("user", 0),
        ("\n", 0),
        ("2+2", 0),
        ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("assistant", 0),
        ("\n", 0),
        ("4", 1),
        ("<|im_end|>", 1),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("user", 0),
        ("\n", 0),
        ("why", 0),
        ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("assistant", 0),
        ("\n", 0),
        ("because", 1),
        ("<|im_end|>", 1),
        ("\n", 0),
    ]


def test_qwen_style_multi_turn_thinking_off_splits_turns_as_served():
    """The template drops the empty think block from earlier turns, so each turn is rendered as served."""
    tok = make_tokenizer("qwen")
    first, second = render_conversation(tok, TWO_TURNS, "off", "x")
    think = [("<think>", 0), ("\n\n", 0), ("</think>", 0), ("\n\n", 0)]
    assert pairs(tok, first) == [
        ("<|im_start|>", 0),
        ("user", 0),
        ("\n", 0),
        ("2+2", 0),
        ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("assistant", 0),
        ("\n", 0),
        *think,
        ("4", 1),
        ("<|im_end|>", 1),
        ("\n", 0),
    ]
    assert pairs(tok, second) == [
        ("<|im_start|>", 0),
        ("user", 0),
        ("\n", 0),
        ("2+2", 0),
        ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("assistant", 0),
        ("\n", 0),
        ("4", 0),
        ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("user", 0),
        ("\n", 0),
        ("why", 0),
        ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("assistant", 0),
        ("\n", 0),
        *think,
        ("because", 1),
        ("<|im_end|>", 1),
        ("\n", 0),
    ]


@pytest.mark.parametrize("style", ["llama", "llama-generation"])
def test_llama3_style_multi_turn_with_and_without_generation_markers(style):
    tok = make_tokenizer(style)
    (sample,) = render_conversation(tok, TWO_TURNS, None, "x")
    head = [("<|start_header_id|>", 0)]
    assert pairs(tok, sample) == [
        ("<|begin_of_text|>", 0),
        *head,
        ("user", 0),
        ("<|end_header_id|>", 0),
        ("\n\n", 0),
        ("2+2", 0),
        ("<|eot_id|>", 0),
        *head,
        ("assistant", 0),
        ("<|end_header_id|>", 0),
        ("\n\n", 0),
        ("4", 1),
        ("<|eot_id|>", 1),
        *head,
        ("user", 0),
        ("<|end_header_id|>", 0),
        ("\n\n", 0),
        ("why", 0),
        ("<|eot_id|>", 0),
        *head,
        ("assistant", 0),
        ("<|end_header_id|>", 0),
        ("\n\n", 0),
        ("because", 1),
        ("<|eot_id|>", 1),
    ]


def test_no_assistant_turn_is_an_error():
    with pytest.raises(FlashdraftError, match=r"f\.jsonl line 2: no assistant turn"):
        render_conversation(
            make_tokenizer("qwen"), [{"role": "user", "content": "hi"}], None, "f.jsonl line 2"
        )

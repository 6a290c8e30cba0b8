"""The mask token of a target whose tokenizer fills every embedding row: an unused special token, never one
that the chat template, the end-of-turn ids or ordinary text produce (docs/real-target.md)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter_dir import resolve_mask_token_id
from flashdraft.model.target import load_target_config
from flashdraft.model.tiny import save_tiny_target

WORDS = ["[UNK]", "user", "assistant", "system", "\n", " ", "hi", "ok"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<tool_call>{% endif %}"  # in the template, though this conversation never renders it
    "{% if messages[0].role == 'system' %}{{ '<|s' ~ 'ep|>' }}{% endif %}"  # rendered, not written whole
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def full_vocab_target(tmp_path, specials: list[str], *, plain_added=(), generation_eos=None) -> str:
    """A tiny target whose embedding has exactly one row per tokenizer entry (no free row)."""
    vocab = {w: i for i, w in enumerate(WORDS + specials)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<[^>]+>|\n| "), "isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=specials,
    )
    fast.add_tokens(list(plain_added))  # ordinary (non-special) added tokens: text the model writes
    fast.chat_template = TEMPLATE
    out = save_tiny_target(
        tmp_path / "target", "llama", vocab_size=len(fast), hidden_size=32, num_layers=2, tokenizer=fast
    )
    if generation_eos is not None:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return str(out)


def mask_for(target: str) -> int:
    return resolve_mask_token_id(target, load_target_config(target), None)


def token_id(target: str, text: str) -> int:
    return PreTrainedTokenizerFast.from_pretrained(target).convert_tokens_to_ids(text)


def test_full_vocabulary_takes_the_last_unused_special_token(tmp_path):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>"]
    target = full_vocab_target(tmp_path, specials)
    assert mask_for(target) == token_id(target, "<file_sep>")


def test_a_token_the_chat_template_writes_is_never_the_mask(tmp_path):
    # <tool_call> has the highest id and is unused by this conversation, but the template can write it.
    target = full_vocab_target(
        tmp_path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<a>", "<tool_call>"]
    )
    assert mask_for(target) == token_id(target, "<a>")


def test_a_token_the_template_renders_from_pieces_is_never_the_mask(tmp_path):
    target = full_vocab_target(tmp_path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<a>", "<|sep|>"])
    assert mask_for(target) == token_id(target, "<a>")


def test_template_tokens_and_special_ids_are_never_the_mask(tmp_path):
    # Every candidate but <a> is eos/bos or rendered by the template; they have the highest ids.
    target = full_vocab_target(tmp_path, ["<a>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert mask_for(target) == token_id(target, "<a>")


def test_an_end_of_turn_id_of_the_generation_config_is_never_the_mask(tmp_path):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<a>", "<|eot|>"]
    target = full_vocab_target(tmp_path, specials, generation_eos=[2 + len(WORDS), 4 + len(WORDS)])
    assert token_id(target, "<|eot|>") == 4 + len(WORDS)
    assert mask_for(target) == token_id(target, "<a>")


def test_ordinary_added_tokens_are_never_the_mask(tmp_path):
    target = full_vocab_target(
        tmp_path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<a>"], plain_added=["<b>"]
    )
    assert token_id(target, "<b>") > token_id(target, "<a>")
    assert mask_for(target) == token_id(target, "<a>")


def test_no_unused_special_token_is_an_error_with_the_reason(tmp_path):
    target = full_vocab_target(tmp_path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"])
    with pytest.raises(
        FlashdraftError, match=r"fills all \d+ embedding rows and has no unused special token"
    ):
        mask_for(target)


def test_a_free_row_is_still_preferred(tmp_path):
    target = save_tiny_target(tmp_path / "t", "llama", vocab_size=64, hidden_size=32, num_layers=2)
    from tests.data.helpers import make_tokenizer

    tok = make_tokenizer("qwen")
    tok.save_pretrained(target)
    assert mask_for(str(target)) == len(tok)

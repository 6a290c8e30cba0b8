"""Training on the ids the target generated (journaled beside the text) instead of the text encoded again."""

from __future__ import annotations

import json
from collections import Counter

from flashdraft.cli import main
from flashdraft.data.generated_ids import USED, use_generated_ids
from flashdraft.data.regenerate import read_journal
from flashdraft.data.render import prompt_ids, render_conversation
from flashdraft.data.shards import open_shards

from .helpers import make_tokenizer

TOK = make_tokenizer("qwen")
ID = TOK.convert_tokens_to_ids
END = ID("<|im_end|>")
OUTSIDE = 40  # an id of the target's vocabulary that the tokenizer cannot decode: lost by decode -> encode


def _answer(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


def _splice(messages, generated):
    counts: Counter[str] = Counter()
    rendered = render_conversation(TOK, messages, None, "test")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    out = use_generated_ids(rendered, turns, generated, lambda i: prompt_ids(TOK, messages[:i], None), counts)
    return rendered, out, counts


def test_the_generated_ids_replace_the_reencoded_answer():
    generated = [ID("hi"), ID(" "), ID("there"), OUTSIDE, END]
    messages = [{"role": "user", "content": "why"}, {"role": "assistant", "content": _answer(generated)}]
    (before,), (after,), counts = _splice(messages, [generated])
    prompt = prompt_ids(TOK, messages[:1], None)
    assert before.input_ids[len(prompt) :] != [*generated, ID("\n")]  # encoding the text again loses ids
    assert after.input_ids == prompt + generated + [ID("\n")]
    assert after.loss_mask == [0] * len(prompt) + [1] * len(generated) + [0]
    assert counts == {USED: 1}


def test_an_answer_that_ends_with_another_token_is_reencoded_and_counted():
    generated = [ID("hi"), OUTSIDE, ID("there")]  # stopped on a generation-config stop, not <|im_end|>
    messages = [{"role": "user", "content": "why"}, {"role": "assistant", "content": _answer(generated)}]
    (before,), (after,), counts = _splice(messages, [generated])
    assert after == before
    assert counts == {"re-encoded: the answer ends with another token than the template's": 1}


def test_a_later_turn_whose_rendered_prefix_differs_from_its_prompt_is_reencoded():
    first = [ID("hi"), OUTSIDE, END]  # re-encoded differently, so turn 2's prompt (from text) differs
    second = [ID("ok"), END]
    messages = [
        {"role": "user", "content": "why"},
        {"role": "assistant", "content": _answer(first)},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": _answer(second)},
    ]
    (before,), (after,), counts = _splice(messages, [first, second])
    assert counts == {USED: 1, "re-encoded: the rendered prefix differs from the prompt": 1}
    assert OUTSIDE in after.input_ids and OUTSIDE not in before.input_ids
    assert sum(after.loss_mask) == sum(before.loss_mask) + 1  # turn 1 got its extra id; turn 2 unchanged


def test_server_answers_without_ids_are_left_alone():
    messages = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "because"}]
    rendered, out, counts = _splice(messages, [None])
    assert out == rendered and not counts


def test_prepare_trains_on_the_journaled_ids(tmp_path, target):
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "why"}]}) + "\n")
    out = tmp_path / "s"
    args = [
        "prepare",
        str(data),
        "--target",
        str(target),
        "--out",
        str(out),
        "--regenerate",
        "--device",
        "cpu",
    ]
    assert (
        main([*args, "--max-new-tokens", "3", "--cut-answers", "drop"]) == 2
    )  # the random target never ends its turn: journaled, cut
    journal = out / "regenerated.jsonl"
    (record,) = [json.loads(line) for line in journal.read_text().splitlines()]
    assert len(record["token_ids"][0]) == 3
    # The journal as if the target had ended its answer: its ids and their decoded text.
    generated = [ID("because"), OUTSIDE, ID("4"), END]
    record["token_ids"] = [generated]
    record["finish_reasons"] = ["stop"]
    record["messages"][-1]["content"] = _answer(generated)
    journal.write_text(json.dumps(record) + "\n")
    assert main([*args, "--max-new-tokens", "3"]) == 0  # resumed from the journal: nothing generated
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["generated_ids"] == {USED: 1}
    _, shards = open_shards(out)
    ids, mask = shards.sample(0, 10**6)
    prompt = prompt_ids(TOK, record["messages"][:1], None)
    assert list(ids) == prompt + generated + [ID("\n")]
    assert list(mask) == [0] * len(prompt) + [1] * len(generated) + [0]
    assert read_journal(journal)[record["key"]].token_ids == [generated]

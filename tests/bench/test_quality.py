"""`flashdraft bench quality` and what it stands on: stdlib prompts, the training-time budget, simulated τ
beside real τ in `flashdraft eval`."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from flashdraft.bench.tiny import save_tiny_target
from flashdraft.data.stdlib_prompts import split_prompts, stdlib_prompts, write_prompt_files
from flashdraft.errors import FlashdraftError
from tests.data.helpers import make_tokenizer

# The chain target's greedy answer to any prompt ending in "\n" (the Qwen template's generation prompt):
# each token is followed by the next one, so every answer is CHAIN[1:].
CHAIN = ["\n", "sure", " ", "ok", "\n\n", "hi", "there", "be", "brief", "why", "because", "4", "thanks"]
CHAIN += ["<|im_end|>"]


def save_chain_target(out: Path) -> Path:
    """A tiny Qwen3 target that answers every chat prompt with the same dozen tokens and ends its turn: its
    residual branches are zeroed (the last hidden state is the last token's normalised embedding) and its
    head maps each chain token to the next one. A random tiny target never ends a turn, and prepare drops
    answers cut at the token limit."""
    tokenizer = make_tokenizer("qwen")
    save_tiny_target(out, "qwen3", vocab_size=64, hidden_size=64, num_layers=4, tokenizer=tokenizer)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        unit = embed / embed.norm(dim=1, keepdim=True)
        head = torch.zeros_like(model.lm_head.weight)
        for here, after in itertools.pairwise(CHAIN):
            head[ids(after)] += 50 * unit[ids(here)]
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def chain_target(tmp_path_factory) -> Path:
    return save_chain_target(tmp_path_factory.mktemp("chain") / "target")


# --------------------------------------------------------------------------- prompts


def write_fake_stdlib(root: Path) -> Path:
    """A small library tree: a package, modules, a duplicate docstring, a test dir, an unparsable file."""
    long = "Return the {} of the two numbers given, rounding towards zero when they are not integers."
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text(f'"""{long.format("package summary")}"""\n')
    (root / "pkg" / "inner.py").write_text(
        f'def add(a, b):\n    """{long.format("sum")}"""\n\n\ndef _hidden():\n    """{long.format("hidden")}"""\n'
    )
    (root / "alpha.py").write_text(
        f'class Box:\n    """{long.format("box")}"""\n\n    def size(self):\n        """{long.format("size")}"""\n'
        f'\n\ndef short():\n    """Too short."""\n\n\ndef again():\n    """{long.format("sum")}"""\n'
    )
    (root / "beta.py").write_text(f'def mul(a, b):\n    """{long.format("product")}"""\n')
    (root / "gamma.py").write_text(f'"""{long.format("gamma module")}"""\n')
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text(f'def t():\n    """{long.format("test")}"""\n')
    (root / "broken.py").write_text("def (:\n")
    return root


def test_prompts_come_from_every_documented_definition_once_and_skip_tests_short_and_broken(tmp_path):
    prompts = stdlib_prompts(write_fake_stdlib(tmp_path / "lib"))
    sources = [(p.group, p.source) for p in prompts]
    # public functions give an "explain" and a "write" prompt, _hidden only "explain"; pkg.inner.add repeats
    # alpha.again's docstring (files are read in path order), and short, test and unparsable ones give none
    assert sources == [
        ("alpha", "alpha.Box"),
        ("alpha", "alpha.Box.size"),
        ("alpha", "alpha.Box.size"),
        ("alpha", "alpha.again"),
        ("alpha", "alpha.again"),
        ("beta", "beta.mul"),
        ("beta", "beta.mul"),
        ("gamma", "gamma"),
        ("pkg", "pkg"),
        ("pkg", "pkg.inner._hidden"),
    ]
    assert sum("Write a Python function named `again`" in p.text for p in prompts) == 1


def test_held_out_prompts_share_no_module_with_training_and_counts_are_exact(tmp_path):
    prompts = stdlib_prompts(write_fake_stdlib(tmp_path / "lib"))
    train, held = split_prompts(prompts, 4, 2)
    assert (len(train), len(held)) == (4, 2)
    assert not {p.group for p in train} & {p.group for p in held}
    assert split_prompts(list(prompts), 4, 2) == (train, held)  # deterministic
    with pytest.raises(FlashdraftError, match="--prompts 9 --eval-prompts 2: the standard library gives 10"):
        split_prompts(prompts, 9, 2)


@pytest.mark.slow
def test_the_real_standard_library_gives_the_default_counts_deterministically(tmp_path):
    first = write_prompt_files(tmp_path / "a.jsonl", tmp_path / "b.jsonl", 2000, 64)
    stdlib_prompts.cache_clear()  # a second scan from scratch must write the same files
    second = write_prompt_files(tmp_path / "c.jsonl", tmp_path / "d.jsonl", 2000, 64)
    assert first == second and first["train_prompts"] == 2000 and first["eval_prompts"] == 64
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "c.jsonl").read_bytes()
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "d.jsonl").read_bytes()
    train = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    top = {r["source"].split(".")[0] for r in train}
    assert not top & {r["source"].split(".")[0] for r in held}
    assert len({r["messages"][0]["content"] for r in train + held}) == 2064  # no prompt twice

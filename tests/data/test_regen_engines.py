"""The local regeneration engines: greedy output equal to plain `model.generate`, sampling that does not depend
on the batch, stop tokens, and the engine choice."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from flashdraft.config import Sampling
from flashdraft.data.render import end_of_turn_id
from flashdraft.data.stops import stop_token_ids
from flashdraft.errors import FlashdraftError
from flashdraft.generate.engines import (
    ContinuousBatchingEngine,
    HFGenerateEngine,
    choose_engine,
    cut_at_stop,
    vllm_available,
)
from flashdraft.model.tiny import build_model, tiny_config
from tests.data.plain_generate import emitted_stop_ids, plain_greedy

from .helpers import make_tokenizer

NEW = 10


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model(tiny_config("qwen3", vocab_size=64, hidden_size=32, num_layers=4)).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 20, 1, 4, 9)]


def _plain(model, prompt, stops, max_new=NEW):
    return plain_greedy(model, prompt, stops, max_new)


@pytest.fixture(scope="module")
def stops(model, prompts):
    return emitted_stop_ids(model, prompts, NEW)


def _engines(model, stops):
    s = Sampling(max_new_tokens=NEW)
    return {
        "hf": HFGenerateEngine(model, s, stops, 0, batch_size=4),
        "hf fixed shapes (the GPU path)": HFGenerateEngine(
            model, s, stops, 0, batch_size=4, fixed_shapes=True
        ),
        "hf-cb": ContinuousBatchingEngine(model, s, stops, 0),
    }


@pytest.mark.parametrize("name", ["hf", "hf fixed shapes (the GPU path)", "hf-cb"])
def test_greedy_output_equals_plain_generate_token_for_token(model, prompts, stops, name):
    expected = [cut_at_stop(_plain(model, p, stops), stops) for p in prompts]
    assert any(len(e) < NEW for e in expected), "the stop token must end some answers early"
    got = _engines(model, stops)[name].generate_ids(prompts, list(range(len(prompts))))
    assert got == expected


def test_sampled_answers_depend_on_their_seed_not_on_their_batch(model, prompts, stops):
    engine = HFGenerateEngine(
        model, Sampling(max_new_tokens=NEW, temperature=1.0, top_k=20, top_p=0.9), stops, 0, 3
    )
    seeds = [101 + i for i in range(len(prompts))]
    together = engine.generate_ids(prompts, seeds)
    alone = [engine.generate_ids([p], [seed])[0] for p, seed in zip(prompts, seeds, strict=True)]
    reversed_batch = engine.generate_ids(prompts[::-1], seeds[::-1])[::-1]
    assert together == alone == reversed_batch
    assert together != [_plain(model, p, stops) for p in prompts]  # it samples: not the greedy answers
    other = engine.generate_ids(prompts, [seed + 1 for seed in seeds])
    assert other != together


def test_stop_tokens_come_from_tokenizer_generation_config_and_template():
    qwen = make_tokenizer("qwen")
    end = end_of_turn_id(qwen, None)
    assert end == qwen.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(qwen, GenerationConfig(eos_token_id=[7, 19]), end) == [19, 7]
    assert stop_token_ids(qwen, GenerationConfig(eos_token_id=5), end) == [19, 5]
    llama = make_tokenizer("llama")
    llama.eos_token = "<|begin_of_text|>"  # a tokenizer whose eos is not the end of a turn
    eot = llama.convert_tokens_to_ids("<|eot_id|>")
    assert end_of_turn_id(llama, None) == eot
    assert eot in stop_token_ids(llama, None, end_of_turn_id(llama, None))


def test_engine_choice_and_refusals(model):
    cpu, greedy = torch.device("cpu"), Sampling()
    assert choose_engine("auto", cpu, greedy)[0] == "hf"
    assert choose_engine("hf-cb", cpu, greedy, model) == ("hf-cb", "asked for")
    with pytest.raises(FlashdraftError, match=r"--engine hf-cb: .*--temperature 0"):
        choose_engine("hf-cb", cpu, Sampling(temperature=0.7), model)
    if not vllm_available():
        with pytest.raises(FlashdraftError, match=r"^--engine vllm: the vllm package is not installed"):
            choose_engine("vllm", cpu, greedy)
    with pytest.raises(
        FlashdraftError, match="--engine 'fast': expected one of auto, static, hf, hf-cb, vllm"
    ):
        choose_engine("fast", cpu, greedy)

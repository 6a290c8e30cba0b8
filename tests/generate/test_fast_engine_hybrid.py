"""The fast engine on a Qwen3.5-style hybrid target (Gated DeltaNet linear attention + full attention),
against the eager loop and its `DecodingCache` (CPU, fp32): each row's linear states after a ragged
acceptance, greedy and sampled outputs with every step's acceptance length, batch 1 and batched rows
refilled with more prompts than rows, plain decoding, and the engine `eval --engine auto` picks. The target
is sharpened so that the next token depends on the whole context: a wrong recurrent or conv state changes
the text."""

from __future__ import annotations

import importlib
import random
from types import SimpleNamespace

import pytest
import torch

from flashdraft.config import EvalSettings
from flashdraft.generate import linear_state
from flashdraft.generate.fast import FastEngine, unsupported_reason
from flashdraft.generate.kv_cache import step_masks
from flashdraft.generate.speculative import generate
from flashdraft.infer.evaluate import _decoder_record
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import make_drafter_config
from flashdraft.model.target import DecodingCache, TargetModel
from flashdraft.model.tiny import build_model, tiny_config

VOCAB = 64
BLOCK = 5
NEW = 30
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hybrid() -> TargetModel:
    model = build_model(tiny_config("qwen3_5", vocab_size=VOCAB, hidden_size=32, num_layers=4), seed=0)
    with torch.no_grad():  # larger projections: the recurrences and attention weigh the whole context
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(4.0)
    target = TargetModel(model, [1, 2])
    assert target.config.layer_types == ["linear_attention"] * 2 + ["full_attention", "linear_attention"]
    return target


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(0, VOCAB - 1, (1, int(torch.randint(4, 14, (1,), generator=g))), generator=g)
        for _ in range(5)
    ]


def _config(target: TargetModel):
    return make_drafter_config(
        target.config, num_layers=1, block_size=BLOCK, mask_token_id=VOCAB - 1, target_layer_ids=[1, 2]
    )


def _random_drafter(target: TargetModel) -> DFlashDraftModel:
    drafter = DFlashDraftModel(_config(target))
    drafter.init_weights(torch.Generator().manual_seed(0))
    return drafter.eval()


class TableDrafter(DFlashDraftModel):
    """A real drafter whose proposals come from known continuations (the target's plain greedy texts),
    looked up by the block's anchor position and token, each proposed token corrupted with probability 1/4
    by a rule of its position alone: every acceptance length happens, rows of one batch accept different
    counts, and the eager loop and the fast engine get the same proposals whatever the order of calls."""

    def __init__(self, config, embed_weight: torch.Tensor, sequences: list[list[int]]):
        super().__init__(config)
        self.init_weights(torch.Generator().manual_seed(0))
        self.embed_weight = embed_weight.detach()  # a plain tensor: not one of the drafter's parameters
        self.table: dict[tuple[int, int], list[int]] = {}
        for sequence in sequences:
            for position, token in enumerate(sequence):
                self.table.setdefault((position, token), sequence)

    def _look_up(self, noise_embedding, block_positions) -> None:
        anchors = (noise_embedding[:, 0, None, :] == self.embed_weight[None]).all(-1).float().argmax(-1)
        self.keys = list(zip(block_positions[:, 0].tolist(), anchors.tolist(), strict=True))

    def forward(self, noise_embedding, target_hidden, ctx_positions, block_positions, masks, **kwargs):
        self._look_up(noise_embedding, block_positions)  # the eager loop's call
        return super().forward(
            noise_embedding, target_hidden, ctx_positions, block_positions, masks, **kwargs
        )

    def forward_cached(self, noise_embedding, block_positions, *args):
        self._look_up(noise_embedding, block_positions)  # the fast engine's call
        return super().forward_cached(noise_embedding, block_positions, *args)

    def compute_logits(self, hidden, lm_head_weight):
        logits = super().compute_logits(hidden, lm_head_weight)
        rows = logits if logits.dim() == 3 else logits[None]  # the fast engine's [rows, n, V], else [n, V]
        proposal = torch.full_like(rows, -30.0)
        for row, (anchor, token) in enumerate(self.keys):
            sequence = self.table.get((anchor, token), [])
            for offset in range(rows.shape[1]):
                position = anchor + 1 + offset
                proposed = sequence[position] if position < len(sequence) else 0
                corrupt = random.Random(position * 131 + offset)
                if corrupt.random() < 0.25:
                    proposed = corrupt.randrange(VOCAB - 1)
                proposal[row, offset, proposed] = 0.0
        return proposal if logits.dim() == 3 else proposal[0]


@pytest.fixture(scope="module")
def plain_texts(hybrid, prompts) -> list[list[int]]:
    return [generate(hybrid, None, prompt, NEW).tokens for prompt in prompts]


@pytest.fixture(scope="module")
def table_drafter(hybrid, prompts, plain_texts) -> TableDrafter:
    sequences = [p[0].tolist() + text for p, text in zip(prompts, plain_texts, strict=True)]
    return TableDrafter(_config(hybrid), hybrid.embed_weight, sequences).eval()


def _uncached_argmax_mismatches(target: TargetModel, prompt: torch.Tensor, tokens: list[int]) -> list[int]:
    sequence = torch.cat([prompt, torch.tensor([tokens])], dim=1)
    with torch.no_grad():
        argmax = target.model(sequence, use_cache=False).logits[0, prompt.shape[1] - 1 : -1].argmax(-1)
    return [i for i, (a, b) in enumerate(zip(argmax.tolist(), tokens, strict=True)) if a != b]


def _states_after(target: TargetModel, prompt: torch.Tensor, block: torch.Tensor) -> DecodingCache:
    """The eager loop's cache after the prompt and then `block` (the positions a row kept)."""
    cache = DecodingCache(target)
    length = prompt.shape[1]
    target.forward_cached(prompt, torch.arange(length)[None], cache, logits_to_keep=1)
    cache.keep(length)
    if block.shape[1]:
        target.forward_cached(block, torch.arange(length, length + block.shape[1])[None], cache)
        cache.keep(block.shape[1])
    return cache


def _forward(target: TargetModel, cache, ids: torch.Tensor, positions: torch.Tensor, width: int) -> None:
    masks = {"full_attention": step_masks(torch.arange(width), positions, None), "linear_attention": None}
    target.model(
        input_ids=ids,
        position_ids=positions,
        attention_mask=masks,
        use_cache=True,
        **{target._cache_kwarg: cache},
    )


@torch.no_grad()
def test_commit_gives_each_row_the_state_of_its_own_kept_positions(hybrid, prompts):
    """Rows of different prompt lengths verify one block each and keep 0, 1, 3 and all 5 positions: every
    conv and recurrent state equals the eager `DecodingCache`'s after exactly the kept tokens."""
    rows, width = 4, 32
    mixers = linear_state.linear_mixers(hybrid)
    assert sorted(mixers) == [0, 1, 3]
    cache = linear_state.StaticHybridCache(
        hybrid.model.config, mixers, rows, width, torch.float32, torch.device("cpu"), queries=BLOCK
    )
    for row, prompt in enumerate(prompts[:rows]):
        length = prompt.shape[1]
        with cache.prefilling(slice(row, row + 1), slice(0, length)):
            _forward(hybrid, cache, prompt, torch.arange(length)[None], length)
    block = torch.randint(0, VOCAB - 1, (rows, BLOCK), generator=torch.Generator().manual_seed(5))
    starts = torch.tensor([p.shape[1] for p in prompts[:rows]])
    positions = starts[:, None] + torch.arange(BLOCK)
    cache.columns.copy_(positions)
    with cache.verifying():
        _forward(hybrid, cache, block, positions, width)
    kept = torch.tensor([0, 1, 3, BLOCK])
    cache.commit(kept)
    for row, prompt in enumerate(prompts[:rows]):
        reference = _states_after(hybrid, prompt, block[row : row + 1, : int(kept[row])])
        unrolled = _states_after(hybrid, prompt, block[row : row + 1])  # every block position kept
        for index in mixers:
            layer = reference.cache.layers[index]
            assert torch.allclose(cache.conv[index][row], layer.conv_states[0][0], atol=1e-5), (row, index)
            assert torch.allclose(cache.recurrent[index][row], layer.recurrent_states[0][0], atol=1e-5)
            if kept[row] < BLOCK:  # the rollback did undo something
                whole = unrolled.cache.layers[index].recurrent_states[0][0]
                assert not torch.allclose(cache.recurrent[index][row], whole, atol=1e-3), (row, index)


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_hybrid_decoding_equals_the_eager_loop_step_by_step(hybrid, prompts, table_drafter, rows):
    """Five prompts through 1 or 3 rows (finished rows refilled), a drafter accepted 1..5 tokens a step:
    the same tokens and the same acceptance length at every step as the eager loop."""
    eager = [generate(hybrid, table_drafter, p, NEW) for p in prompts]
    lengths = {a for run in eager for a in run.accepted}
    assert {1, 2, 3, BLOCK} <= lengths, sorted(lengths)  # every kind of rollback is exercised
    fast = FastEngine(hybrid, table_drafter, NEW, rows=rows).generate(prompts)
    assert [run.tokens for run in fast] == [run.tokens for run in eager]
    assert [run.accepted for run in fast] == [run.accepted for run in eager]


def test_greedy_hybrid_decoding_is_the_plain_greedy_text(hybrid, prompts, plain_texts, table_drafter):
    """Speculative (random and table drafters) and plain decoding on the fast engine write the target's
    greedy text, which is the argmax of one uncached forward over it at every position."""
    for i, (prompt, text) in enumerate(zip(prompts, plain_texts, strict=True)):
        assert _uncached_argmax_mismatches(hybrid, prompt, text) == [], i
    plain = FastEngine(hybrid, None, NEW, rows=2).generate(prompts)
    assert [run.tokens for run in plain] == plain_texts
    assert all(run.accepted == [1] * len(run.accepted) for run in plain)
    for drafter in (table_drafter, _random_drafter(hybrid)):
        fast = FastEngine(hybrid, drafter, NEW, rows=3).generate(prompts)
        assert [run.tokens for run in fast] == plain_texts


def test_a_rollback_that_keeps_every_verified_position_writes_another_text(hybrid, prompts, table_drafter):
    """The negative control: with each row's linear states advanced over its whole block (no rollback),
    the fast engine's text leaves the target's greedy text."""
    engine = FastEngine(hybrid, table_drafter, NEW, rows=3)
    engine._allocate(engine._bucketed(max(p.shape[1] for p in prompts) + NEW + BLOCK))  # generate()'s width
    commit = engine.kv.commit
    engine.kv.commit = lambda kept: commit(torch.full_like(kept, BLOCK))
    wrong = engine.generate(prompts)
    right = FastEngine(hybrid, table_drafter, NEW, rows=3).generate(prompts)
    assert [run.tokens for run in wrong] != [run.tokens for run in right]


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20}],
    ids=["T1", "filtered"],
)
def test_sampled_hybrid_decoding_equals_the_eager_loop_draw_for_draw(hybrid, prompts, sampling):
    seeds = [100, 101, 102, 103, 104]
    drafter = _random_drafter(hybrid)
    for proposer in (drafter, None):
        eager = [
            generate(hybrid, proposer, p, NEW, generator=torch.Generator().manual_seed(seed), **sampling)
            for p, seed in zip(prompts, seeds, strict=True)
        ]
        if proposer is not None and sampling == {"temperature": 1.0}:
            lengths = {a for run in eager for a in run.accepted}
            assert {1, 2, 3} <= lengths, sorted(lengths)  # rejections mid-block: ragged rollbacks
        for rows in (1, 3):
            fast = FastEngine(hybrid, proposer, NEW, rows=rows, **sampling).generate(prompts, seeds=seeds)
            assert [run.tokens for run in fast] == [run.tokens for run in eager], rows
            assert [run.accepted for run in fast] == [run.accepted for run in eager], rows


def test_what_the_fast_engine_refuses_of_linear_attention(hybrid, monkeypatch):
    assert unsupported_reason(hybrid, None, 0.0) is None
    assert unsupported_reason(hybrid, _random_drafter(hybrid), 0.7) is None
    modeling = importlib.import_module(type(linear_state.linear_mixers(hybrid)[0]).__module__)
    with monkeypatch.context() as patch:
        patch.delattr(modeling, linear_state.DELTA_RULE)
        assert linear_state.DELTA_RULE in unsupported_reason(hybrid, None, 0.0)
    with monkeypatch.context() as patch:
        patch.setattr(linear_state, "recurrent_mixer", lambda target, index: torch.nn.Identity())
        assert "mixes with Identity" in unsupported_reason(hybrid, None, 0.0)
        with pytest.raises(ValueError, match="Gated DeltaNet states only"):
            FastEngine(hybrid, None, 4)
    with monkeypatch.context() as patch:  # attention keys and a recurrent state in one layer
        patch.setattr(hybrid.config, "layer_types", ["hybrid", *hybrid.config.layer_types[1:]])
        assert "in one layer" in unsupported_reason(hybrid, None, 0.0)


def test_eval_auto_picks_the_fast_engine_for_a_hybrid_on_a_gpu(hybrid, monkeypatch):
    """`eval --engine auto` on a GPU takes the fast engine when it can decode the pair: now also a hybrid
    (the device is what the chooser reads; the model stays on the CPU)."""
    drafter = _random_drafter(hybrid)
    settings = EvalSettings()
    assert _decoder_record(settings, hybrid, drafter) == {"engine": "eager", "batch_size": 1}  # CPU, batch 1
    on_gpu = SimpleNamespace(device=torch.device("cuda"))
    monkeypatch.setattr(hybrid.model, "parameters", lambda: iter([on_gpu]))
    assert _decoder_record(settings, hybrid, drafter) == {"engine": "fast", "batch_size": 1}
    with monkeypatch.context() as patch:  # what is still refused falls back to the eager loop, with a note
        patch.setattr(linear_state, "recurrent_mixer", lambda target, index: torch.nn.Identity())
        record = _decoder_record(settings, hybrid, drafter)
        assert record["engine"] == "eager" and "Gated DeltaNet" in record["note"]


def test_a_qwen3_next_hybrid_equals_the_eager_loop(prompts):
    """Qwen3-Next's Gated DeltaNet (its own modeling module, fused projections, MoE MLPs) on the same
    path: greedy and sampled, 3 rows over five prompts."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(4.0)
    target = TargetModel(model, [1, 2])
    assert unsupported_reason(target, None, 1.0) is None
    drafter, seeds = _random_drafter(target), [5, 6, 7, 8, 9]
    for sampling in ({}, {"temperature": 1.0}):
        eager = [
            generate(target, drafter, p, NEW, generator=torch.Generator().manual_seed(seed), **sampling)
            for p, seed in zip(prompts, seeds, strict=True)
        ]
        fast = FastEngine(target, drafter, NEW, rows=3, **sampling).generate(prompts, seeds=seeds)
        assert [run.tokens for run in fast] == [run.tokens for run in eager], sampling
        assert [run.accepted for run in fast] == [run.accepted for run in eager], sampling
    assert max(a for run in eager for a in run.accepted) > 2  # sampled: multi-token acceptances, rollbacks

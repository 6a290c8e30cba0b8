"""The `static` engine (flashdraft/generate/static.py): greedy output equal to plain `model.generate`,
sampling equal to the `hf` engine's and independent of the batch, early stop, CUDA-graph fallback said."""

from __future__ import annotations

import pytest
import torch

from flashdraft.config import Sampling
from flashdraft.errors import FlashdraftError
from flashdraft.generate.engines import HFGenerateEngine, choose_engine, cut_at_stop, vllm_available
from flashdraft.generate.static import StaticEngine, unsupported_reason
from flashdraft.model.tiny import build_model, tiny_config
from tests.data.plain_generate import emitted_stop_ids, plain_greedy

NEW = 10
LENGTHS = (5, 9, 3, 12, 7, 20, 1, 4, 9)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request):
    torch.set_num_threads(1)
    return build_model(tiny_config(request.param, vocab_size=64, hidden_size=32, num_layers=4)).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in LENGTHS]


def _plain(model, prompt, stops, max_new=NEW):
    return plain_greedy(model, prompt, stops, max_new)


@pytest.fixture(scope="module")
def stops(model, prompts):
    return emitted_stop_ids(model, prompts, NEW)


def test_one_batch_decodes_by_row_groups_with_the_same_answers(model, prompts, stops, monkeypatch):
    """One batch: the rows, sorted longest prompt first, go in up to 4 groups that each read the columns
    from their longest prompt's start; the answers equal one group reading every column."""
    import flashdraft.generate.decode_attention as decode_attention

    calls = []
    real = decode_attention.by_row_groups
    monkeypatch.setattr(decode_attention, "by_row_groups", lambda *a: calls.append(a[-1]) or real(*a))
    expected = [cut_at_stop(_plain(model, p, stops), stops) for p in prompts]
    grouped = StaticEngine(model, Sampling(max_new_tokens=NEW), stops, 0, bucket=4)
    assert grouped.generate_ids(prompts, [0] * len(prompts)) == expected
    # the groups reach the attention through the model's forward: every decode step, every layer
    steps, layers = grouped.describe()["decode_steps"], model.config.num_hidden_layers
    assert len(calls) == steps * layers and all(g == calls[0] for g in calls)
    # lengths sorted 20, 12, 9, 9, 7, 5, 4, 3, 1 (width 20), in 4 groups of rows:
    # [0, 2), [2, 4), [4, 6), [6, 9)
    assert grouped.describe()["row_groups"] == [[0, 2, 0], [2, 4, 11], [4, 6, 13], [6, 9, 16]]
    whole = StaticEngine(model, Sampling(max_new_tokens=NEW), stops, 0, bucket=4, row_groups=1)
    assert whole.generate_ids(prompts, [0] * len(prompts)) == expected
    assert whole.describe()["row_groups"] is None
    # several batches: no groups (the captured steps are shared by the batches)
    batched = StaticEngine(model, Sampling(max_new_tokens=NEW), stops, 0, batch_size=4)
    assert batched.generate_ids(prompts, [0] * len(prompts)) == expected
    assert batched.describe()["row_groups"] is None


@pytest.mark.parametrize("batch_size", [4, 0])  # several batches (padded last one), or all rows at once
def test_greedy_output_equals_plain_generate_token_for_token(model, prompts, stops, batch_size):
    expected = [cut_at_stop(_plain(model, p, stops), stops) for p in prompts]
    assert any(len(e) < NEW for e in expected) and any(len(e) == NEW for e in expected)
    # bucket 4: the attended width grows several times within an answer
    engine = StaticEngine(model, Sampling(max_new_tokens=NEW), stops, 0, batch_size, bucket=4, check_every=3)
    assert engine.generate_ids(prompts, list(range(len(prompts)))) == expected


# prompts of 20, 12, 9, 9, 7, 5, 4, 3, 1 tokens in chunks of at most 25 (padded) tokens; 8: widths
# rounded up to 8, as on a GPU (to 64 there)
@pytest.mark.parametrize(
    "pad_multiple, prefills, rows",
    [(1, [20, 12, 9, 5], [1, 2, 2, 4]), (8, [24, 16, 16, 16, 8, 8], [1, 1, 1, 1, 3, 2])],
    ids=["unpadded", "padded"],
)
def test_prefill_in_row_chunks_of_their_own_width_gives_the_same_answers(
    model, prompts, stops, pad_multiple, prefills, rows
):
    whole = StaticEngine(model, Sampling(max_new_tokens=NEW), stops, 0).generate_ids(prompts, [0] * 9)
    # 25 tokens a chunk: the longest prompt (20) alone, then chunks as wide as their own longest prompt,
    # whose keys land in the columns that end where the batch's longest prompt ends
    chunked = StaticEngine(model, Sampling(max_new_tokens=NEW), stops, 0, prefill_tokens=25)
    chunked.pad_multiple = pad_multiple
    widths = []
    forward = chunked._forward
    chunked._forward = lambda **kwargs: widths.append(kwargs["input_ids"].shape[1]) or forward(**kwargs)
    assert chunked.generate_ids(prompts, [0] * 9) == whole
    assert widths[: len(prefills)] == prefills and set(widths[len(prefills) :]) == {1}
    # the engine's record of the prefill, chunk by chunk: rows, width, seconds
    chunks = chunked.timing_record()["prefill_chunks"]
    assert [c[:2] for c in chunks] == [list(pair) for pair in zip(rows, prefills, strict=True)]
    assert all(c[2] >= 0 for c in chunks)


@pytest.mark.parametrize("batch_size", [0, 4])
def test_graphs_are_made_only_for_the_widths_the_decode_steps_attend_to(model, prompts, stops, batch_size):
    """A decode step never attends to fewer columns than its batch's prompts fill, so the widths worth a
    CUDA graph start at the narrowest batch's prompt width (fewer graphs, less capture time)."""
    engine = StaticEngine(model, Sampling(max_new_tokens=NEW), stops, 0, batch_size, bucket=4)
    asked = []
    step = engine._step
    engine._step = lambda visible: asked.append(visible) or step(visible)
    captured = []
    engine._capture_all = lambda widths: captured.append(widths)  # the CPU captures nothing: the list
    engine.generate_ids(prompts, [0] * len(prompts))
    # longest prompt 20 + 10 new tokens: 30 columns; the narrowest batch starts at 20 (one batch) or at
    # 4 (batch size 4 makes 3 even batches of 3 rows: 20, 12, 9 | 9, 7, 5 | 4, 3, 1)
    first = 20 if batch_size == 0 else 4
    assert captured == [engine._decode_widths(first, 30)]
    assert set(asked) <= set(captured[0]) and min(captured[0]) == engine._visible(first, 30)


def test_sampled_answers_equal_the_hf_engines_whatever_the_batch(model, prompts, stops):
    s = Sampling(max_new_tokens=NEW, temperature=1.0, top_k=20, top_p=0.9)
    seeds = [101 + i for i in range(len(prompts))]
    together = StaticEngine(model, s, stops, 0, batch_size=3).generate_ids(prompts, seeds)
    alone = [
        StaticEngine(model, s, stops, 0).generate_ids([p], [seed])[0]
        for p, seed in zip(prompts, seeds, strict=True)
    ]
    reversed_batch = StaticEngine(model, s, stops, 0).generate_ids(prompts[::-1], seeds[::-1])[::-1]
    assert together == alone == reversed_batch
    assert together == HFGenerateEngine(model, s, stops, 0, 4).generate_ids(prompts, seeds)
    assert together != [cut_at_stop(_plain(model, p, stops), stops) for p in prompts]  # it samples


def test_the_loop_stops_once_every_answer_has_ended(model, prompts):
    """Finished rows are checked every `check_every` steps, and the loop ends then, not at max_new."""
    first = [_plain(model, p, [2], 1)[0] for p in prompts]  # every answer ends at its first token
    calls = []
    hook = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        engine = StaticEngine(model, Sampling(max_new_tokens=200), first, 0, check_every=4)
        assert engine.generate_ids(prompts, [0] * 9) == [[t] for t in first]
    finally:
        hook.remove()
    assert len(calls) == 1 + 4  # the prefill, then steps until the first check


def test_a_failed_cuda_graph_capture_falls_back_to_eager_and_says_so(model, prompts, stops):
    expected = StaticEngine(model, Sampling(max_new_tokens=NEW), stops, 0).generate_ids(prompts, [0] * 9)
    engine = StaticEngine(model, Sampling(max_new_tokens=NEW), stops, 0, cuda_graphs=True)  # on the CPU
    assert engine.generate_ids(prompts, [0] * 9) == expected
    record = engine.describe()
    assert record["engine"] == "static" and record["cuda_graphs"] is False
    assert record["cuda_graphs_failed"].startswith("fell back to eager steps: ")


def test_hybrid_targets_are_refused_and_auto_picks_static_on_a_gpu():
    hybrid = build_model(tiny_config("qwen3_5", vocab_size=64, hidden_size=32, num_layers=3))
    assert "linear_attention" in unsupported_reason(hybrid)
    with pytest.raises(FlashdraftError, match=r"^--engine static: cannot drive this target: .*--engine hf$"):
        StaticEngine(hybrid, Sampling(), [2], 0)
    gpu, greedy = torch.device("cuda"), Sampling()
    if not vllm_available():
        assert choose_engine("auto", gpu, greedy)[0] == "static"
    assert choose_engine("auto", torch.device("cpu"), greedy)[0] == "hf"
    assert choose_engine("static", torch.device("cpu"), Sampling(temperature=0.7)) == ("static", "asked for")


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_steps(prompts):
    """On the GPU machine: captured steps give the eager steps' answers (fp32, greedy and sampled)."""
    torch.manual_seed(0)
    model = build_model(tiny_config("llama", vocab_size=64, hidden_size=32, num_layers=4)).cuda().eval()
    for s in (Sampling(max_new_tokens=40), Sampling(max_new_tokens=40, temperature=1.0, top_p=0.9)):
        graphs = StaticEngine(model, s, [2], 0, cuda_graphs=True)
        eager = StaticEngine(model, s, [2], 0, cuda_graphs=False)
        seeds = list(range(len(prompts)))
        assert graphs.generate_ids(prompts, seeds) == eager.generate_ids(prompts, seeds)
        assert graphs.describe()["cuda_graphs"] is True, graphs.describe()
    # and greedy equals plain generate (padding queries see themselves: no NaN reaches the real rows)
    greedy = StaticEngine(model, Sampling(max_new_tokens=40), [2], 0).generate_ids(prompts, seeds)
    assert greedy == [cut_at_stop(_plain(model.cpu(), p, [2], 40), [2]) for p in prompts]

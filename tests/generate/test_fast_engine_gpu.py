"""GPU checks (marker `gpu`) of the fast engine's CUDA graphs (flashdraft/generate/fast.py): captured, and
replaying them (the step's model code compiled, as by default on a GPU) gives what eager steps of eager
model code give, token for token and step for step, for
batch 1 and for ragged batched rows, greedy and sampled, and on a Gated DeltaNet hybrid. Run on the device
machine: `python -m pytest -m gpu tests/generate/test_fast_engine_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from flashdraft.generate.fast import FastEngine
from flashdraft.generate.speculative import generate
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import make_drafter_config, new_drafter
from flashdraft.model.target import TargetModel
from flashdraft.model.tiny import build_model, tiny_config

pytestmark = pytest.mark.gpu
VOCAB = 64
NEW = 48


@pytest.fixture(scope="module")
def pair() -> tuple[TargetModel, DFlashDraftModel]:
    model = build_model(tiny_config("qwen3", vocab_size=VOCAB, hidden_size=64, num_layers=4), seed=0)
    target = TargetModel(model.to("cuda"), [1, 2])
    config = make_drafter_config(
        target.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, target_layer_ids=[1, 2]
    )
    drafter = DFlashDraftModel(config)
    drafter.init_weights(torch.Generator().manual_seed(0))
    return target, drafter.to("cuda").eval()


def _prompts(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(0, VOCAB - 1, (1, int(torch.randint(5, 90, (1,), generator=g))), generator=g)
        for _ in range(n)
    ]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("speculative", [False, True])
def test_cuda_graphs_replay_what_eager_steps_compute(pair, rows, speculative):
    target, drafter = pair
    drafter = drafter if speculative else None
    prompts = _prompts(5)
    graphs = FastEngine(target, drafter, NEW, rows=rows)
    replayed = graphs.generate(prompts)
    record = graphs.describe()
    assert record["cuda_graphs"], record.get("cuda_graphs_failed")
    assert record["compiled"] and record["fused_layers"], record.get("compile_note")  # inside the graphs
    assert record["fused_stack"] and record["stack_difference"] < 1e-4, record  # fp32 rounding alone
    assert record["graphs_captured"] >= 2  # prompts of 5-90 tokens + 48 new: several width buckets
    stepped = FastEngine(target, drafter, NEW, rows=rows, cuda_graphs=False).generate(prompts)
    assert [r.tokens for r in replayed] == [r.tokens for r in stepped]
    assert [r.accepted for r in replayed] == [r.accepted for r in stepped]


def test_a_block_of_16_replays_what_eager_steps_compute(pair):
    """The paper's (and the default) block size through the compiled, captured steps: the fused stack's
    check fits its cache (at c21111c it indexed past it, a device-side assert that lost the process)."""
    torch._dynamo.reset()  # its own recompile budget: the block of 16 is a new shape for every graph
    target, drafter = pair
    prompts = _prompts(4)
    graphs = FastEngine(target, drafter, NEW, block_size=16, rows=3)
    replayed = graphs.generate(prompts)
    record = graphs.describe()
    assert record["cuda_graphs"] and record["compiled"] and record["fused_stack"], record
    stepped = FastEngine(target, drafter, NEW, block_size=16, rows=3, cuda_graphs=False).generate(prompts)
    assert [r.tokens for r in replayed] == [r.tokens for r in stepped]
    assert [r.accepted for r in replayed] == [r.accepted for r in stepped]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("speculative", [False, True])
def test_sampled_cuda_graphs_replay_what_eager_steps_draw(pair, rows, speculative):
    """Every row's generator is registered with the graphs: a replay advances it as an eager step does,
    and reseeding it at a row's admission restarts the row's stream, so the tokens are the same."""
    target, drafter = pair
    drafter = drafter if speculative else None
    prompts, seeds = _prompts(5), [11, 12, 13, 14, 15]
    sampling = {"temperature": 0.8, "top_p": 0.95, "top_k": 32}
    graphs = FastEngine(target, drafter, NEW, rows=rows, **sampling)
    replayed = graphs.generate(prompts, seeds)
    record = graphs.describe()
    assert record["cuda_graphs"], record.get("cuda_graphs_failed")
    stepped = FastEngine(target, drafter, NEW, rows=rows, cuda_graphs=False, **sampling).generate(
        prompts, seeds
    )
    assert [r.tokens for r in replayed] == [r.tokens for r in stepped]
    assert [r.accepted for r in replayed] == [r.accepted for r in stepped]
    for prompt, seed, run in zip(prompts[:2], seeds, replayed, strict=False):  # and the eager loop's draws
        g = torch.Generator(device="cuda").manual_seed(seed)
        reference = generate(target, drafter, prompt, NEW, generator=g, **sampling)
        assert run.tokens == reference.tokens and run.accepted == reference.accepted


def test_fast_greedy_on_the_gpu_equals_the_eager_loop_in_fp32(pair):
    target, drafter = pair
    prompts = _prompts(3)
    fast = FastEngine(target, drafter, NEW, rows=2).generate(prompts)
    for prompt, run in zip(prompts, fast, strict=True):
        assert run.tokens == generate(target, None, prompt, NEW).tokens


@pytest.mark.parametrize("rows", [1, 3])
def test_dflash2_cuda_graphs_replay_the_eager_loops_candidate_walk(pair, rows):
    """A DFlash2 drafter's candidate walk compiled and captured with the step (fast.py::candidate_walk):
    the same tokens and acceptance lengths as the eager loop's walk."""
    target, _ = pair
    config = make_drafter_config(
        target.config,
        num_layers=1,
        block_size=4,
        mask_token_id=VOCAB - 1,
        target_layer_ids=[1, 2],
        arch="dflash2",
    )
    config.dflash_config["selector_top_k"] = 8
    dflash2 = new_drafter(config)
    dflash2.init_weights(torch.Generator().manual_seed(0))
    dflash2 = dflash2.to("cuda").eval()
    prompts = _prompts(4)
    graphs = FastEngine(target, dflash2, NEW, rows=rows)
    replayed = graphs.generate(prompts)
    record = graphs.describe()
    assert record["cuda_graphs"] and record["compiled"], record
    for prompt, run in zip(prompts, replayed, strict=True):
        reference = generate(target, dflash2, prompt, NEW)
        assert run.tokens == reference.tokens and run.accepted == reference.accepted


@pytest.fixture(scope="module")
def hybrid_pair() -> tuple[TargetModel, DFlashDraftModel]:
    """A Qwen3.5-style hybrid (Gated DeltaNet + full attention), on whatever kernels transformers picks
    here (flash-linear-attention and causal-conv1d where installed)."""
    model = build_model(tiny_config("qwen3_5", vocab_size=VOCAB, hidden_size=64, num_layers=4), seed=0)
    target = TargetModel(model.to("cuda"), [1, 2])
    config = make_drafter_config(
        target.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, target_layer_ids=[1, 2]
    )
    drafter = DFlashDraftModel(config)
    drafter.init_weights(torch.Generator().manual_seed(0))
    return target, drafter.to("cuda").eval()


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("speculative", [False, True])
def test_hybrid_cuda_graphs_replay_what_eager_steps_compute(hybrid_pair, rows, speculative):
    """The linear states' verify, ragged commit and refill inside the captured step: replays equal eager
    steps of the same engine, and the eager loop."""
    target, drafter = hybrid_pair
    drafter = drafter if speculative else None
    prompts = _prompts(5)
    graphs = FastEngine(target, drafter, NEW, rows=rows)
    replayed = graphs.generate(prompts)
    record = graphs.describe()
    assert record["linear_attention_layers"] == 3
    assert record["cuda_graphs"], record.get("cuda_graphs_failed")
    stepped = FastEngine(target, drafter, NEW, rows=rows, cuda_graphs=False).generate(prompts)
    assert [r.tokens for r in replayed] == [r.tokens for r in stepped]
    assert [r.accepted for r in replayed] == [r.accepted for r in stepped]
    for prompt, run in zip(prompts[:2], replayed, strict=False):
        reference = generate(target, drafter, prompt, NEW)
        assert run.tokens == reference.tokens and run.accepted == reference.accepted

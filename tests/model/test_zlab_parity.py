"""flashdraft drafters and z-lab's reference package (dflash==0.1.0) agree on format and numbers."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from flashdraft.cli import main
from flashdraft.model.drafter_dir import load_drafter
from flashdraft.model.target import TargetModel

zlab = pytest.importorskip("dflash.model", reason="install with: pip install --no-deps dflash==0.1.0")

CTX = 9  # committed tokens before the block


def _features_and_block(target: TargetModel, block_size: int, mask_id: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size - 1, (1, CTX + 1), generator=g)
    features = target.features(ids[:, :CTX])
    block = torch.full((1, block_size), mask_id)
    block[0, 0] = ids[0, CTX]
    return ids, features, target.embed(block)


def _zlab_logits(zmodel, target: TargetModel, features, noise, block_size):
    pos = torch.arange(CTX + block_size)[None]
    hidden = zmodel(position_ids=pos, noise_embedding=noise, target_hidden=features)
    return zmodel.compute_logits(hidden[:, 1:], target.model.get_output_embeddings())


def _our_logits(model, target: TargetModel, features, noise, block_size):
    pos = torch.arange(CTX + block_size)[None]
    masks = {kind.key: None for kind in model.layer_kinds()}
    if any(k.causal or k.window for k in model.layer_kinds()):
        from flashdraft.model.attention import dense_mask

        masks = {
            k.key: dense_mask(torch.tensor([[CTX]]), torch.tensor([[True]]), pos[:, :CTX], block_size, k)
            for k in model.layer_kinds()
        }
    hidden = model(noise, features, pos[:, :CTX], pos[:, CTX:], masks)
    return model.compute_logits(hidden[:, 1:], target.lm_head_weight)


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("qwen3", []),
        ("llama", []),
        ("qwen3_5", []),
        (
            "qwen3",
            ["--sliding-window", "4", "--num-layers", "3"],
        ),  # window shorter than the context: it matters
    ],
)
def test_init_directory_loads_in_zlab_with_equal_logits(tmp_path, target_dirs, kind, extra):
    out = tmp_path / "drafter"
    assert (
        main(
            [
                "init",
                "--target",
                target_dirs[kind],
                "--out",
                str(out),
                "--num-layers",
                "2",
                "--block-size",
                "4",
                "--mask-token-id",
                "300",
                *extra,
            ]
        )
        == 0
    )
    ours = load_drafter(out, dtype=torch.float32)
    theirs = zlab.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    assert list(theirs.target_layer_ids) == list(ours.spec.target_layer_ids)
    assert theirs.mask_token_id == 300 and theirs.block_size == 4

    target = TargetModel.load(target_dirs[kind], ours.spec.target_layer_ids)
    _, features, noise = _features_and_block(target, 4, 300)
    with torch.no_grad():
        a = _our_logits(ours, target, features, noise, 4)
        b = _zlab_logits(theirs, target, features, noise, 4)
    assert a.shape == b.shape == (1, 3, target.vocab_size)
    assert (a - b).abs().max().item() < 1e-4


def test_zlab_features_match_ours(target_dirs):
    for kind, path in target_dirs.items():
        target = TargetModel.load(path, [0, 2, 5])
        ids = torch.randint(0, 300, (2, 11))
        with torch.no_grad():
            hf = target.model(ids, output_hidden_states=True).hidden_states
        expected = zlab.extract_context_feature(hf, [0, 2, 5])
        assert torch.allclose(target.features(ids), expected, atol=1e-6), kind


def test_zlab_written_directory_loads_in_flashdraft(tmp_path, qwen3_target):
    from transformers import Qwen3Config

    config = Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=320,
        rope_theta=1e6,
    )
    config.architectures = ["DFlashDraftModel"]
    config.block_size = 4
    config.num_target_layers = 6
    config.dflash_config = {"mask_token_id": 300, "target_layer_ids": [1, 3]}
    torch.manual_seed(3)
    theirs = zlab.DFlashDraftModel(config).float().eval()
    for p in theirs.parameters():  # post_init leaves norms at 1: perturb them so the test sees them
        p.data.add_(0.05 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path / "z")
    ours = load_drafter(tmp_path / "z", dtype=torch.float32)
    target = TargetModel.load(qwen3_target, [1, 3])
    _, features, noise = _features_and_block(target, 4, 300, seed=1)
    with torch.no_grad():
        a = _our_logits(ours, target, features, noise, 4)
        b = _zlab_logits(theirs, target, features, noise, 4)
    assert (a - b).abs().max().item() < 1e-4


def _pinned_transformers() -> SpecifierSet:
    """The transformers range pyproject.toml allows."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    (requirement,) = [
        Requirement(r) for r in project["dependencies"] if Requirement(r).name == "transformers"
    ]
    return requirement.specifier


def test_no_removal_announced_for_the_oracles_calls_falls_inside_the_pinned_range(tmp_path, qwen3_target):
    """z-lab's loop (the oracle) passes arguments transformers deprecates; the pin must end before the version
    that removes any of them, or the oracle (and `flashdraft eval --engine zlab`) breaks inside the range."""
    import transformers
    from transformers import AutoModelForCausalLM

    pinned = _pinned_transformers()
    assert Version(transformers.__version__) in pinned, f"testing outside the pinned range {pinned}"
    out = tmp_path / "drafter"
    argv = ["init", "--target", qwen3_target, "--out", str(out), "--num-layers", "2", "--block-size", "4"]
    assert main([*argv, "--mask-token-id", "300"]) == 0
    drafter = zlab.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        zlab.dflash_generate(drafter, target, torch.tensor([[1, 2, 3, 4, 5]]), 6, None)
    removals = {
        (match.group(2), str(w.message).split("`")[1] if "`" in str(w.message) else str(w.message))
        for w in caught
        if (match := re.search(r"(removed|deleted) in (?:version |v)?(\d+(?:\.\d+)+)", str(w.message)))
    }
    inside = sorted(
        f"{arg} (removed in {version})" for version, arg in removals if Version(version) in pinned
    )
    assert not inside, (
        f"pyproject allows transformers {pinned}, which removes what the oracle passes: {inside}"
    )

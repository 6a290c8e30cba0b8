"""`flashdraft export`: z-lab's code loads the zlab export with equal logits, the vllm export has the
speculators fields (aux ids = target layer ids + 1), and drafter properties an engine would ignore are
refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashdraft.cli import main
from flashdraft.model.drafter_dir import load_drafter
from flashdraft.model.target import TargetModel

from .test_zlab_parity import _features_and_block, _our_logits, _zlab_logits


def _init(target: str, out: Path, *extra: str) -> Path:
    argv = ["init", "--target", target, "--out", str(out), "--num-layers", "2", "--block-size", "4"]
    assert main([*argv, "--mask-token-id", "300", *extra]) == 0
    return out


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashdraft: error: ") and "\n" not in err
    return err


def test_zlab_export_loads_in_zlab_with_equal_logits(tmp_path, qwen3_target, capsys):
    zlab = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    drafter = _init(qwen3_target, tmp_path / "d")
    out = tmp_path / "zlab"
    assert main(["export", str(drafter), "--to", "zlab", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    ours = load_drafter(drafter)
    theirs = zlab.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    target = TargetModel.load(qwen3_target, ours.spec.target_layer_ids)
    _, features, noise = _features_and_block(target, 4, 300)
    with torch.no_grad():
        a = _our_logits(ours, target, features, noise, 4)
        b = _zlab_logits(theirs, target, features, noise, 4)
    assert (a - b).abs().max().item() < 1e-4
    # a rerun replaces its own export without --force; a foreign directory needs --force
    assert main(["export", str(drafter), "--to", "zlab", "--out", str(out)]) == 0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    err = _one_line_error(capsys, ["export", str(drafter), "--to", "zlab", "--out", str(foreign)])
    assert "--force" in err and (foreign / "notes.txt").exists()
    # the output can never be the drafter itself
    err = _one_line_error(capsys, ["export", str(drafter), "--to", "zlab", "--out", str(drafter), "--force"])
    assert "same path" in err


def test_vllm_export_has_the_speculators_fields(tmp_path, qwen3_target, capsys):
    drafter = _init(qwen3_target, tmp_path / "d", "--target-layer-ids", "0,2,3")
    out = tmp_path / "vllm"
    argv = ["export", str(drafter), "--to", "vllm", "--out", str(out), "--target", qwen3_target]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert '"method":"dflash"' in printed and '"num_speculative_tokens":3' in printed
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [1, 3, 4]  # z-lab's ids + 1
    assert config["mask_token_id"] == 300 and config["block_size"] == 4
    assert config["draft_vocab_size"] == config["transformer_layer_config"]["vocab_size"] == 320
    assert "dflash_config" not in config["transformer_layer_config"]
    spec_config = config["speculators_config"]
    assert spec_config["algorithm"] == "dflash" and spec_config["default_proposal_method"] == "greedy"
    assert spec_config["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec_config["verifier"] == {"name_or_path": qwen3_target, "architectures": ["Qwen3ForCausalLM"]}
    from safetensors.torch import load_file

    assert (
        load_file(str(out / "model.safetensors")).keys()
        == load_file(str(drafter / "model.safetensors")).keys()
    )
    try:  # the real config class, where it can be imported (it pins transformers <= 5.19)
        from speculators.models.dflash import DFlashSpeculatorConfig
    except ImportError:
        return
    assert DFlashSpeculatorConfig.from_dict(config).aux_hidden_state_layer_ids == [1, 3, 4]


def test_sglang_export_prints_the_serve_flags(tmp_path, target_dirs, capsys):
    target = target_dirs["qwen3_5"]  # hybrid linear-attention target
    drafter = _init(target, tmp_path / "d")
    out = tmp_path / "sg"
    assert main(["export", str(drafter), "--to", "sglang", "--out", str(out), "--target", target]) == 0
    printed = capsys.readouterr().out
    assert f"--speculative-algorithm DFLASH --speculative-draft-model-path {out}" in printed
    assert "--speculative-num-draft-tokens 4" in printed
    assert "--mamba-scheduler-strategy extra_buffer" in printed


def _edit_config(drafter: Path, **fields) -> None:
    path = drafter / "config.json"
    config = json.loads(path.read_text())
    for key, value in fields.items():
        if key in ("output_multiplier",):
            config["dflash_config"][key] = value
        else:
            config[key] = value
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "engine,edit,needle",
    [
        ("vllm", {"output_multiplier": 2.0}, "output_multiplier"),
        ("vllm", {}, "PR #40898"),  # a sliding-window drafter, without --allow-sliding-window
        ("vllm", {"is_causal": False}, "non-causal sliding"),
        ("sglang", {"is_causal": False}, "SGLang runs every sliding layer causally"),
    ],
)
def test_fields_an_engine_would_ignore_are_refused(tmp_path, qwen3_target, capsys, engine, edit, needle):
    drafter = _init(qwen3_target, tmp_path / "d", "--sliding-window", "4", "--sliding-layers", "1")
    _edit_config(drafter, **edit)
    out = tmp_path / "out"
    argv = ["export", str(drafter), "--to", engine, "--out", str(out), "--target", qwen3_target]
    err = _one_line_error(capsys, argv)
    assert needle in err and f"cannot export to {engine}" in err
    assert not out.exists()


def test_causal_full_layers_and_a_last_layer_feature_are_refused_for_vllm(tmp_path, qwen3_target, capsys):
    drafter = _init(qwen3_target, tmp_path / "d", "--target-layer-ids", "1,5")  # 5 = the last of 6
    argv = ["export", str(drafter), "--to", "vllm", "--out", str(tmp_path / "o"), "--target", qwen3_target]
    assert "last layer 5" in _one_line_error(capsys, argv)
    other = _init(qwen3_target, tmp_path / "e")
    _edit_config(other, is_causal=True)
    argv = ["export", str(other), "--to", "sglang", "--out", str(tmp_path / "o")]
    assert "causal full-attention" in _one_line_error(capsys, argv)
    # the same drafter is faithful in z-lab's own code, which reads is_causal
    assert main(["export", str(other), "--to", "zlab", "--out", str(tmp_path / "z")]) == 0


def test_sliding_window_drafter_exports_to_vllm_when_allowed(tmp_path, qwen3_target):
    drafter = _init(qwen3_target, tmp_path / "d", "--sliding-window", "4", "--sliding-layers", "1")
    out = tmp_path / "v"
    argv = ["export", str(drafter), "--to", "vllm", "--out", str(out), "--target", qwen3_target]
    assert main([*argv, "--allow-sliding-window"]) == 0
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention", "full_attention"] and layer["sliding_window"] == 4

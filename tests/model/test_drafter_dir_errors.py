"""Bad drafter directories and init arguments give one-line errors that name the field or tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft.cli import main
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter_dir import load_drafter
from flashdraft.model.target import load_target_config


@pytest.fixture()
def drafter_dir(tmp_path, qwen3_target) -> Path:
    out = tmp_path / "d"
    assert (
        main(
            [
                "init",
                "--target",
                qwen3_target,
                "--out",
                str(out),
                "--num-layers",
                "2",
                "--block-size",
                "4",
                "--mask-token-id",
                "300",
            ]
        )
        == 0
    )
    return out


def _edit(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("dflash_config."):
            config["dflash_config"][key.split(".", 1)[1]] = value
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def _error(path, **kwargs) -> str:
    with pytest.raises(FlashdraftError) as info:
        load_drafter(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_fc_width_mismatch_names_fc(drafter_dir):
    _edit(drafter_dir, **{"dflash_config.target_layer_ids": [1, 2, 3]})
    assert "fc.weight" in _error(drafter_dir) and "target_layer_ids" in _error(drafter_dir)


def test_layer_id_beyond_target_depth(drafter_dir, qwen3_target):
    _edit(drafter_dir, **{"dflash_config.target_layer_ids": [1, 9]})
    assert "target_layer_ids" in _error(drafter_dir) and "[9]" in _error(drafter_dir)


def test_num_target_layers_must_match_target(drafter_dir, qwen3_target):
    _edit(drafter_dir, num_target_layers=36, **{"dflash_config.target_layer_ids": [1, 3]})
    message = _error(drafter_dir, target=load_target_config(qwen3_target))
    assert "num_target_layers" in message and "6 layers" in message


def test_mask_id_outside_vocabulary(drafter_dir):
    _edit(drafter_dir, **{"dflash_config.mask_token_id": 5000})
    assert "mask_token_id" in _error(drafter_dir)


def test_missing_mask_id(drafter_dir):
    config = json.loads((drafter_dir / "config.json").read_text())
    del config["dflash_config"]["mask_token_id"]
    (drafter_dir / "config.json").write_text(json.dumps(config))
    assert "mask_token_id" in _error(drafter_dir)


def test_hidden_size_mismatch_with_target(drafter_dir, target_dirs):
    from flashdraft.model.tiny import save_tiny_target

    wide = save_tiny_target(drafter_dir.parent / "wide", "qwen3", hidden_size=128)
    assert "hidden_size" in _error(drafter_dir, target=load_target_config(wide))


def test_missing_and_unexpected_tensors(drafter_dir):
    weights = drafter_dir / "model.safetensors"
    state = load_file(weights)
    state.pop("norm.weight")
    state["lm_head.weight"] = torch.zeros(2, 2)
    save_file(state, weights)
    assert "missing tensors ['norm.weight']" in _error(drafter_dir)


def test_wrong_architecture_and_bad_json(drafter_dir):
    _edit(drafter_dir, architectures=["LlamaForCausalLM"])
    assert "architectures" in _error(drafter_dir)
    (drafter_dir / "config.json").write_text('{\n  "hidden_size": 64,\n')
    assert "line" in _error(drafter_dir) and "config.json" in _error(drafter_dir)


def test_sliding_layer_without_window(drafter_dir):
    _edit(drafter_dir, layer_types=["sliding_attention", "full_attention"], sliding_window=None)
    assert "sliding_window" in _error(drafter_dir)


def test_unsupported_dflash2_field(drafter_dir):
    _edit(drafter_dir, **{"dflash_config.conv_kernel_size": 2})
    assert "conv_kernel_size" in _error(drafter_dir)


def test_not_a_drafter_directory(tmp_path):
    assert "no config.json" in _error(tmp_path)


def test_init_errors_are_one_line(tmp_path, qwen3_target, capsys):
    # No tokenizer next to the tiny target: the mask id cannot be chosen automatically.
    assert main(["init", "--target", qwen3_target, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--mask-token-id" in err
    assert (
        main(["init", "--target", qwen3_target, "--out", str(tmp_path / "x"), "--mask-token-id", "999"]) == 2
    )
    assert "outside the target vocabulary" in capsys.readouterr().err
    assert (
        main(
            [
                "init",
                "--target",
                qwen3_target,
                "--out",
                str(tmp_path / "x"),
                "--mask-token-id",
                "1",
                "--target-layer-ids",
                "1,7",
            ]
        )
        == 2
    )
    assert "target_layer_ids" in capsys.readouterr().err
    assert main(["init", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_init_defaults_follow_the_paper(tmp_path):
    """36-layer Qwen3-8B shape -> ids [1, 9, 17, 25, 33]; mask id = first row past the tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from flashdraft.model.tiny import save_tiny_target

    vocab = {f"t{i}": i for i in range(290)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), unk_token="t0"
    )
    target = save_tiny_target(tmp_path / "t36", "qwen3", num_layers=36, hidden_size=32, tokenizer=tok)
    assert main(["init", "--target", str(target), "--out", str(tmp_path / "d")]) == 0
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": 290, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert (
        config["architectures"] == ["DFlashDraftModel"]
        and config["auto_map"]["AutoModel"] == "dflash.DFlashDraftModel"
    )
    assert (
        config["block_size"] == 16 and config["num_target_layers"] == 36 and config["num_hidden_layers"] == 5
    )
    assert config["model_type"] == "qwen3" and config["dtype"] == "bfloat16"
    names = set(load_file(tmp_path / "d" / "model.safetensors"))
    assert len(names) == 5 * 11 + 3 and {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names


# ---------------------------------------------------------------- init never destroys the user's files


@pytest.fixture()
def own_target(tmp_path) -> Path:
    """A private target: these tests try to overwrite it, so never the shared one."""
    from flashdraft.model.tiny import save_tiny_target

    return save_tiny_target(tmp_path / "target", "qwen3", num_layers=2, hidden_size=32)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _init(target, out, *extra) -> list[str]:
    return [
        "init",
        "--target",
        str(target),
        "--out",
        str(out),
        "--mask-token-id",
        "3",
        "--num-layers",
        "1",
        *extra,
    ]


def _init_error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashdraft: error: ") and "\n" not in err
    return err


def test_init_with_out_equal_to_the_target_never_touches_it(own_target, capsys):
    before = _tree(own_target)
    for extra in ([], ["--force"]):
        assert "same path as --target" in _init_error(capsys, _init(own_target, own_target, *extra))
        assert _tree(own_target) == before
    assert "lies inside --target" in _init_error(capsys, _init(own_target, own_target / "d", "--force"))
    assert "contains --target" in _init_error(capsys, _init(own_target, own_target.parent, "--force"))
    assert _tree(own_target) == before


def test_init_refuses_an_existing_output_unless_forced(own_target, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    err = _init_error(capsys, _init(own_target, mine))
    assert "already exists and it is not empty; pass --force" in err and (mine / "notes.txt").exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert "is a file, not a directory" in _init_error(capsys, _init(own_target, a_file, "--force"))
    assert a_file.read_text() == "x"
    link = tmp_path / "link"
    link.symlink_to(mine)
    assert "symbolic link" in _init_error(capsys, _init(own_target, link, "--force"))
    assert main(_init(own_target, mine, "--force")) == 0  # the user asked for it
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "link", "mine", "target"]  # no temporary


def test_save_drafter_replaces_a_drafter_but_never_a_directory_it_did_not_write(own_target, tmp_path):
    from flashdraft.model.drafter_dir import save_drafter

    out = tmp_path / "best"
    assert main(_init(own_target, out)) == 0
    model = load_drafter(out)
    save_drafter(model, out)  # the trainer's best/: its own drafter directory is replaced
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.bin").write_bytes(b"x")
    with pytest.raises(FlashdraftError, match="holds files that are not a drafter's"):
        save_drafter(model, other)
    assert (other / "data.bin").read_bytes() == b"x"


@pytest.mark.parametrize(
    "config,needle",
    [
        ([1, 2], "expected a JSON object, found list"),
        ({"hidden_size": "64"}, "field 'hidden_size' is missing or not an integer"),
        ({"dflash_config": [1]}, "field 'dflash_config' must be an object"),
        (
            {"dflash_config": {"mask_token_id": "7", "target_layer_ids": [1]}},
            "'dflash_config.mask_token_id' must be an integer",
        ),
        (
            {"dflash_config": {"mask_token_id": 7, "target_layer_ids": ["1"]}},
            "'dflash_config.target_layer_ids' must be a list of integers",
        ),
        ({"rope_parameters": [10000]}, "field 'rope_parameters' must be an object or null"),
        ({"layer_types": "full_attention"}, "field 'layer_types' must be a list"),
        ({"num_key_value_heads": 2.5}, "field 'num_key_value_heads' must be an integer"),
    ],
)
def test_malformed_config_json_is_one_line_naming_the_field(drafter_dir, config, needle):
    if isinstance(config, dict):
        data = json.loads((drafter_dir / "config.json").read_text())
        data.update(config)
        config = data
    (drafter_dir / "config.json").write_text(json.dumps(config))
    message = _error(drafter_dir)
    assert needle in message and "config.json" in message


def test_mask_id_errors_name_the_setting_the_user_used(qwen3_target):
    from flashdraft.model.drafter_dir import resolve_mask_token_id

    target = load_target_config(qwen3_target)
    with pytest.raises(FlashdraftError, match=r"^model\.mask_token_id 99999 is outside"):
        resolve_mask_token_id(qwen3_target, target, 99999)
    with pytest.raises(FlashdraftError, match=r"set model\.mask_token_id"):
        resolve_mask_token_id(qwen3_target, target, None)  # no tokenizer to choose one
    with pytest.raises(FlashdraftError, match=r"^--mask-token-id 99999"):
        resolve_mask_token_id(qwen3_target, target, 99999, label="--mask-token-id")


def test_unknown_rope_type_names_the_field(drafter_dir):
    config = json.loads((drafter_dir / "config.json").read_text())
    _edit(drafter_dir, rope_parameters={**(config.get("rope_parameters") or {}), "rope_type": "bogus"})
    message = _error(drafter_dir)
    assert "rope_parameters.rope_type" in message and "'bogus'" in message and "config.json" in message

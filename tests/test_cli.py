"""The command line: zero or negative numbers are refused naming the flag; a config path is a path even
when it holds an '='."""

from __future__ import annotations

import pytest

from flashdraft.cli import _split_config, main


@pytest.mark.parametrize(
    "command,flag,value",
    [
        ("prepare", "--batch-size", "0"),
        ("prepare", "--chunk", "0"),
        ("prepare", "--render-workers", "0"),
        ("prepare", "--concurrency", "-3"),
        ("prepare", "--max-length", "0"),
        ("prepare", "--limit", "-1"),
        ("prepare", "--max-new-tokens", "-1"),
        ("prepare", "--top-p", "0"),
        ("prepare", "--temperature", "-0.5"),
        ("prepare", "--top-k", "-1"),
        ("prepare", "--batch-size", "many"),
        ("init", "--block-size", "1"),
        ("init", "--num-layers", "0"),
        ("init", "--mask-token-id", "-4"),
        ("init", "--sliding-window", "0"),
        ("eval", "--max-prompts", "-1"),
        ("eval", "--max-new-tokens", "-1"),
        ("eval", "--block-size", "0"),
    ],
)
def test_bad_numbers_are_refused_naming_the_flag(capsys, command, flag, value):
    required = {
        "prepare": ["in.jsonl", "--target", "t", "--out", "o"],
        "init": ["--target", "t", "--out", "o"],
        "eval": ["--target", "t", "--drafter", "d", "--prompts", "p"],
    }[command]
    with pytest.raises(SystemExit) as info:
        main([command, *required, flag, value])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}:" in last and value in last


def test_sliding_layers_beyond_the_layer_count_is_one_line(capsys, tmp_path):
    argv = ["init", "--target", str(tmp_path / "t"), "--out", str(tmp_path / "d"), "--num-layers", "2"]
    assert main([*argv, "--sliding-window", "8", "--sliding-layers", "3", "--mask-token-id", "1"]) == 2
    assert "--sliding-layers 3 is more than --num-layers 2" in capsys.readouterr().err
    assert main([*argv, "--sliding-layers", "1"]) == 2
    assert "--sliding-layers needs --sliding-window" in capsys.readouterr().err


def test_a_config_path_with_an_equals_sign_is_the_config(tmp_path):
    config = tmp_path / "lr=3e-4.yaml"
    config.write_text("train: {}\n")
    assert _split_config(str(config), ["train.lr=1"]) == (str(config), ["train.lr=1"])
    assert _split_config("train.lr=1", ["x=2"]) == (None, ["train.lr=1", "x=2"])  # no file: an override


def _parsed(argv: list[str]):
    from flashdraft.cli import build_parser

    return build_parser().parse_args(argv)


def test_flags_are_made_from_the_settings_dataclasses():
    """With no flags given, each command's settings are the dataclass's own defaults (declared once);
    a flag given reaches its field, nested sampling knobs included."""
    from flashdraft.cli.flags import settings_from
    from flashdraft.config import EVAL_MAX_NEW_TOKENS, EvalSettings, InitSettings, PrepareSettings, Sampling

    prepare = settings_from(_parsed(["prepare", "in.jsonl", "--target", "t", "--out", "o"]), PrepareSettings)
    assert prepare == PrepareSettings(sampling=Sampling())
    evaluation = _parsed(["eval", "--target", "t", "--drafter", "d", "--prompts", "p"])
    assert settings_from(evaluation, EvalSettings) == EvalSettings()
    assert EvalSettings().sampling.max_new_tokens == EVAL_MAX_NEW_TOKENS
    assert settings_from(_parsed(["init", "--target", "t", "--out", "o"]), InitSettings) == InitSettings()
    argv = ["prepare", "in.jsonl", "--target", "t", "--out", "o", "--max-new-tokens", "7", "--cut-answers"]
    given = settings_from(_parsed([*argv, "drop", "--skip-bad-records", "--top-p", "0.5"]), PrepareSettings)
    assert (given.sampling.max_new_tokens, given.sampling.top_p) == (7, 0.5)
    assert given.cut_answers == "drop" and given.skip_bad_records
    ids = _parsed(["init", "--target", "t", "--out", "o", "--target-layer-ids", "1,3,5"]).target_layer_ids
    assert ids == [1, 3, 5]


def test_no_module_outside_the_cli_imports_it():
    """The CLI is the top of the import graph (bench/quality.py and cli.py once imported each other)."""
    import ast
    from pathlib import Path

    import flashdraft

    package = Path(flashdraft.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        if path.parent.name == "cli" or path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            if any(n == "flashdraft.cli" or n.startswith("flashdraft.cli.") for n in names):
                offenders.append(str(path.relative_to(package)))
    assert offenders == []

"""Argument and path errors come back before the heavy stack loads (issue 29: 7-70 s of torch and
transformers imports before `export --to vllm` said it needed --target). Checked without a clock: in a
fresh interpreter, each bad invocation exits with its error and torch/transformers were never imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from flashdraft.cli import main
    argv = json.loads(sys.argv[1])
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    heavy = [m for m in ("torch", "transformers") if m in sys.modules]
    print(json.dumps({"code": code, "err": err.getvalue(), "out": out.getvalue(), "heavy": heavy}))
    """
)


def _run(argv: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cases(tmp) -> list[tuple[list[str], str]]:
    missing = str(tmp / "missing")
    model = tmp / "model"  # a directory that passes the target check
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    prompts = tmp / "p.jsonl"
    prompts.write_text("{}\n")
    bad_config = tmp / "bad.yaml"
    bad_config.write_text("train:\n  lrr: 1\n")
    return [
        (["quickstart", "--steps", "0"], "argument --steps: must be at least 1"),
        (["convert", missing + ".gguf", "--out", str(tmp / "o")], "no such file"),
        (["convert", "--out", str(tmp / "o")], "give either GGUF_FILE or --from-package"),
        (["prepare", missing, "--target", str(model), "--out", str(tmp / "o")], "no such file or directory"),
        (["prepare", str(prompts), "--target", missing, "--out", str(tmp / "o")], "no config.json there"),
        (
            ["prepare", str(prompts), "--target", str(model), "--out", "o", "--batch-size", "0"],
            "--batch-size",
        ),
        (
            ["prepare", str(prompts), "--target", str(model), "--out", "o", "--max-lenght", "9"],
            "--max-length?",
        ),
        (
            ["prepare", str(prompts), "--target", str(model), "--out", "o", "--device", "tpu"],
            "'tpu': expected",
        ),
        (["inspect", missing], "not a directory"),
        (["convert-shards", missing, str(tmp / "new")], "not a shard directory"),
        (["config", "--target", missing], "no config.json there"),
        (["init", "--target", missing, "--out", str(tmp / "d")], "no config.json there"),
        (["init", "--target", str(model), "--out", "d", "--block-size", "1"], "must be at least 2"),
        (["train", str(bad_config)], "did you mean 'train.lr'"),
        (["train", f"model.target={missing}"], "no config.json there"),
        (["train", f"model.target={model}", f"data.train=[{missing}]"], f"data {missing}: no such file"),
        (["status", "nope", "--runs-dir", str(tmp / "runs")], "nope"),
        (["logs", "nope", "--runs-dir", str(tmp / "runs")], "nope"),
        (["stop", "nope", "--runs-dir", str(tmp / "runs")], "nope"),
        (["doctor", str(bad_config)], "did you mean 'train.lr'"),
        (
            ["eval", "--target", str(model), "--drafter", missing, "--prompts", str(prompts)],
            "no such directory",
        ),
        (["eval", "--target", str(model), "--drafter", str(model), "--prompts", missing], "no such file"),
        (
            [
                "eval",
                "--target",
                str(model),
                "--drafter",
                str(model),
                "--prompts",
                str(prompts),
                "--device",
                "gpu0",
            ],
            "not a device",
        ),
        (
            ["eval", "--target", "t", "--drafter", "d", "--prompts", "p", "--max-prompts", "-1"],
            "--max-prompts",
        ),
        (["export", missing, "--to", "vllm", "--out", str(tmp / "e")], "--to vllm needs --target"),
        (["export", missing, "--to", "zlab", "--out", str(tmp / "e")], "no such directory"),
        (["bench", "nope"], "invalid choice"),
        (["--threads", "2", "status"], "runs no model"),
    ]


def test_bad_invocations_fail_before_torch_is_imported(tmp_path):
    for argv, needle in _cases(tmp_path):
        result = _run(argv)
        assert result["code"] == 2, (argv, result)
        last = result["err"].strip().splitlines()[-1]  # the error is one line (argparse prints usage above)
        assert needle in last and last.startswith("flashdraft"), (argv, result["err"])
        assert result["heavy"] == [], (argv, result["heavy"])


def test_launch_records_a_bad_config_before_torch_is_imported(tmp_path):
    """launch keeps its way of answering (a failed run whose diagnosis is the config error), fast."""
    bad_config = tmp_path / "bad.yaml"
    bad_config.write_text("train:\n  lrr: 1\n")
    result = _run(["launch", str(bad_config), "--runs-dir", str(tmp_path / "runs")])
    assert result["code"] == 1 and "did you mean 'train.lr'" in result["out"]
    assert result["heavy"] == []


@pytest.mark.parametrize("command", ["prepare", "eval", "init", "config", "export", "train"])
def test_help_imports_nothing_heavy(command):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([command, "--help"])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0 and result["heavy"] == []

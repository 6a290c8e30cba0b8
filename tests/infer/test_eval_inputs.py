"""`flashdraft eval` checks its outputs, device and prompts before any model loads, writes the report
atomically, and overwrites only what it wrote itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashdraft.cli import main
from flashdraft.model.tiny import save_tiny_target

VOCAB = 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval-inputs")
    target = save_tiny_target(root / "target", "qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=4)
    drafter = root / "drafter"
    init = ["init", "--target", str(target), "--out", str(drafter), "--num-layers", "1"]
    assert main([*init, "--block-size", "4", "--mask-token-id", str(VOCAB - 1)]) == 0
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    return {"target": target, "drafter": drafter, "prompts": prompts}


def _eval(pair, *extra: str, prompts: Path | None = None) -> list[str]:
    return [
        "eval",
        "--target",
        str(pair["target"]),
        "--drafter",
        str(pair["drafter"]),
        "--prompts",
        str(prompts or pair["prompts"]),
        "--max-new-tokens",
        "3",
        "--device",
        "cpu",
        *extra,
    ]


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashdraft: error: ") and "\n" not in err and "Traceback" not in err
    return err


@pytest.fixture()
def no_model_load(monkeypatch):
    """Fail the test if eval gets as far as loading a model: the checks must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr("flashdraft.infer.evaluate.load_drafter", refuse)
    monkeypatch.setattr("flashdraft.infer.evaluate.TargetModel.load", refuse)


def test_out_that_is_a_directory_is_refused_before_any_model_loads(pair, tmp_path, capsys, no_model_load):
    err = _one_line_error(capsys, _eval(pair, "--out", str(tmp_path)))
    assert f"--out {tmp_path} is a directory" in err
    assert list(tmp_path.iterdir()) == []


def test_plot_that_is_a_directory_or_an_unknown_format_is_refused(pair, tmp_path, capsys, no_model_load):
    assert "--plot" in _one_line_error(capsys, _eval(pair, "--plot", str(tmp_path)))
    assert "unknown image format" in _one_line_error(capsys, _eval(pair, "--plot", str(tmp_path / "a.xyz")))


def test_out_in_a_read_only_directory_is_refused_up_front(pair, tmp_path, capsys, no_model_load):
    from tests.filesystems import tmpfs

    with tmpfs(tmp_path / "ro", "64k", read_only=True) as ro:
        err = _one_line_error(capsys, _eval(pair, "--out", str(ro / "report.json")))
    assert "cannot write in" in err and "Read-only file system" in err


def test_out_never_overwrites_an_input_or_a_foreign_file(pair, tmp_path, capsys, no_model_load):
    err = _one_line_error(capsys, _eval(pair, "--out", str(pair["prompts"])))
    assert "same path as --prompts" in err
    theirs = tmp_path / "notes.json"
    theirs.write_text('{"mine": true}\n')
    err = _one_line_error(capsys, _eval(pair, "--out", str(theirs)))
    assert "pass --force" in err and theirs.read_text() == '{"mine": true}\n'


def test_report_and_plot_are_written_atomically_and_a_rerun_overwrites_its_own(pair, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    for _ in range(2):  # the second run replaces what the first wrote, without --force
        assert main(_eval(pair, "--out", str(out), "--plot", str(png))) == 0
    assert json.loads(out.read_text())["producer"] == "flashdraft eval"
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png"]  # no temporary left


def test_device_cuda_without_a_gpu_is_one_line(pair, capsys, no_model_load):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    args = _eval(pair)
    args[args.index("--device") + 1] = "cuda"
    assert "--device cuda: no CUDA GPU is visible" in _one_line_error(capsys, args)
    args[args.index("--device") + 1] = "gpu0"
    assert "--device gpu0: not a device" in _one_line_error(capsys, args)


@pytest.mark.parametrize(
    "record,needle",
    [
        (
            {"input_ids": [1, VOCAB]},
            f"line 2: token id {VOCAB} is outside the target vocabulary (0..{VOCAB - 1})",
        ),
        ({"input_ids": []}, "line 2: 'input_ids' must be a non-empty list"),
        ({"input_ids": [-1, 2]}, "line 2: 'input_ids' must be a non-empty list of non-negative integers"),
    ],
)
def test_bad_prompt_ids_name_the_prompt_file_and_line(pair, tmp_path, capsys, no_model_load, record, needle):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + json.dumps(record) + "\n")
    err = _one_line_error(capsys, _eval(pair, prompts=prompts))
    assert f"{prompts} {needle}" in err


def test_a_prompt_that_renders_to_no_tokens_is_named(pair, tmp_path):
    from flashdraft.errors import FlashdraftError
    from flashdraft.infer.evaluate import encode_prompts

    class Empty:  # a chat template that renders nothing
        chat_template = "{{ '' }}"

        def apply_chat_template(self, messages, **kwargs):
            return []

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(FlashdraftError, match=r"p.jsonl line 1: the prompt has no tokens"):
        encode_prompts(str(prompts), Empty(), None, VOCAB)


@pytest.mark.parametrize(
    "flag,value",
    [("--max-new-tokens", "-1"), ("--max-new-tokens", "0"), ("--max-prompts", "-2"), ("--block-size", "0")],
)
def test_bad_numeric_flags_name_the_flag(pair, capsys, flag, value):
    args = _eval(pair)
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_the_report_is_rewritten_after_every_prompt_until_complete(pair, tmp_path, monkeypatch, capsys):
    """A killed eval keeps the prompts it measured: --out holds them, marked incomplete, after each one."""
    import flashdraft.infer.evaluate as evaluate

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [1, 2, n]}) + "\n" for n in (3, 4, 5)))
    out, seen = tmp_path / "r.json", []
    real_write = evaluate.write_json

    def write_and_read_back(report, path):
        real_write(report, path)
        seen.append(json.loads(Path(path).read_text()))

    monkeypatch.setattr(evaluate, "write_json", write_and_read_back)
    monkeypatch.setattr("flashdraft.progress.DEFAULT_INTERVAL_S", 0)  # a progress line per prompt
    assert main(_eval(pair, "--out", str(out), prompts=prompts)) == 0
    assert [(r["complete"], r["prompts"]) for r in seen] == [(False, 1), (False, 2), (False, 3), (True, 3)]
    assert seen[0]["prompts_total"] == 3 and seen[0]["producer"] == "flashdraft eval"
    assert json.loads(out.read_text())["complete"] is True
    err = capsys.readouterr().err
    assert "evaluating: 3/3 prompts (100%)" in err and "tau=" in err

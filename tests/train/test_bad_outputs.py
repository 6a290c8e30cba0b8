"""Bad output paths and a garbage trainer state are one-line errors naming the path and what to do (issue 28)."""

from __future__ import annotations

import random

import pytest

from flashdraft.config import load_config
from flashdraft.errors import FlashdraftError
from flashdraft.quickstart.flow import quickstart
from flashdraft.train.checkpoint import find_resume, list_checkpoints
from flashdraft.train.trainer import train
from tests.filesystems import tmpfs

from .test_trainer import _overrides, train_file  # noqa: F401 - train_file is a fixture


def _one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message
    return message


def test_an_out_dir_that_is_a_file_is_named(tmp_path, qwen3_target, train_file):  # noqa: F811
    out = tmp_path / "run"
    out.write_text("not a directory")
    with pytest.raises(FlashdraftError) as info:
        train(load_config(None, _overrides(qwen3_target, train_file, out)))
    message = _one_line(info)
    assert f"train.out_dir {out} is a file" in message and "choose another train.out_dir" in message
    assert out.read_text() == "not a directory"  # untouched


def test_quickstart_out_that_is_a_file_is_named(tmp_path):
    out = tmp_path / "qs"
    out.write_text("mine")
    with pytest.raises(FlashdraftError) as info:
        quickstart(out, steps=1)
    assert f"--out {out} is a file" in _one_line(info)


def test_an_out_dir_in_a_read_only_directory_is_named(tmp_path, qwen3_target, train_file):  # noqa: F811
    # A read-only mount: refused to root too (root ignores permission bits, not a read-only filesystem).
    with tmpfs(tmp_path / "ro", "64k", read_only=True) as read_only:
        out = read_only / "run"
        with pytest.raises(FlashdraftError) as info:
            train(load_config(None, _overrides(qwen3_target, train_file, out)))
        message = _one_line(info)
        assert f"train.out_dir {out}: cannot write in {read_only}" in message and "writable" in message
        with pytest.raises(FlashdraftError) as info:
            quickstart(read_only / "qs", steps=1)
        assert f"--out {read_only / 'qs'}: cannot write in {read_only}" in _one_line(info)


def test_a_garbage_trainer_state_is_named_and_auto_resume_takes_the_one_before(
    tmp_path,
    qwen3_target,
    train_file,  # noqa: F811
    capsys,
):
    out = tmp_path / "run"
    train(
        load_config(
            None, _overrides(qwen3_target, train_file, out, **{"train.max_steps": 4, "train.save_every": 2})
        )
    )
    step2, step4 = list_checkpoints(out)
    garbage = step4 / "trainer_state.pt"
    # Random bytes: these make torch's unpickler pop from an empty stack (IndexError), those name an opcode
    for data in (random.Random(2).randbytes(4096), random.Random(1).randbytes(4096)):
        garbage.write_bytes(data)
        with pytest.raises(FlashdraftError) as info:
            find_resume(str(step4), out)
        assert str(info.value).startswith(f"{garbage}: cannot read") and "damaged" in _one_line(info)
    capsys.readouterr()
    point = find_resume("auto", out)
    assert point.path == step2
    printed = capsys.readouterr().out
    assert "resume: skipping checkpoint step-00000004: " in printed and "trainer_state.pt" in printed
    assert (out / "checkpoints" / "step-00000004.damaged").is_dir()

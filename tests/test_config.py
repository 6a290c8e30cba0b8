from __future__ import annotations

import pytest

from flashdraft.config import describe, load_config
from flashdraft.errors import FlashdraftError


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  target: /t\ntrain:\n  lr: 1e-4\n  epochs: 2\n")
    config = load_config(
        path, ["train.lr=3e-4", "data.train=[a.jsonl, b.jsonl]", "model.target_layer_ids=[1,2]"]
    )
    assert config.model.target == "/t" and config.train.lr == 3e-4 and config.train.epochs == 2
    assert config.data.train == ["a.jsonl", "b.jsonl"] and config.model.target_layer_ids == [1, 2]


@pytest.mark.parametrize(
    "text,overrides,needle",
    [
        ("train:\n  lrr: 1\n", [], "unknown config key 'train.lrr' (did you mean 'train.lr'?)"),
        ("trian:\n  lr: 1\n", [], "unknown config key 'trian'"),
        ("train:\n  epochs: two\n", [], "'train.epochs': expected an integer"),
        ("train: [1]\n", [], "'train' is a section"),
        ("train:\n  lr: [\n", [], "line"),
        ("", ["train.compile=maybe"], "'train.compile': expected true or false"),
        ("", ["train.dtype=fp8"], "train.dtype must be"),
        ("", ["nokey"], "expected key=value"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path, text, overrides, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(FlashdraftError) as info:
        load_config(path, overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_every_field_is_documented():
    rows = describe()
    assert rows and all(help_text for _, _, help_text in rows)

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


@pytest.mark.parametrize(
    "override,field",
    [
        ("train.lr=.inf", "train.lr"),
        ("train.lr=nan", "train.lr"),
        ("train.weight_decay=.nan", "train.weight_decay"),
        ("train.gamma=-.inf", "train.gamma"),
        ("train.grad_clip=inf", "train.grad_clip"),
        ("train.warmup_ratio=.nan", "train.warmup_ratio"),
    ],
)
def test_a_non_finite_number_is_refused_naming_the_field(override, field):
    with pytest.raises(FlashdraftError, match=rf"^config: {field} must be a finite number"):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.epochs=0", "train.epochs must be at least 1, got 0"),
        ("train.max_steps=-5", "train.max_steps must be >= 0"),
        ("train.grad_clip=-1", "train.grad_clip must be positive"),
        ("train.grad_clip=0", "train.grad_clip must be positive"),
        ("train.lr=0", "train.lr must be positive"),
        ("train.weight_decay=-0.1", "train.weight_decay must be >= 0"),
        ("train.weight_decay=2000", "train.lr * train.weight_decay must be below 1"),
        ("train.warmup_ratio=1", "train.warmup_ratio must be in [0, 1)"),
        ("train.min_lr_ratio=1.5", "train.min_lr_ratio must be in [0, 1]"),
        ("train.lr_schedule=linear", "train.lr_schedule must be cosine or wsd, got 'linear'"),
        ("train.decay_ratio=0", "train.decay_ratio must be in (0, 1], got 0.0"),
        ("train.gamma=0", "train.gamma must be positive"),
        ("train.batch_size=0", "train.batch_size must be at least 1"),
        ("train.grad_accum=0", "train.grad_accum must be at least 1"),
        ("train.num_anchors=0", "train.num_anchors must be at least 1"),
        ("train.keep_last=0", "train.keep_last must be at least 1"),
        ("train.eval_every=-1", "train.eval_every must be >= 0"),
        ("train.max_bad_steps=0", "train.max_bad_steps must be at least 1"),
        ("train.seed=-1", "train.seed must be >= 0"),
        ("train.device=gpu", "train.device must be auto, cpu, cuda or cuda:N"),
        ("train.loss_chunk=0", "train.loss_chunk must be at least 1"),
        ("model.block_size=1", "model.block_size must be at least 2"),
        ("model.num_layers=0", "model.num_layers must be at least 1"),
        ("model.target_layer_ids=[]", "model.target_layer_ids must be a non-empty list"),
        ("model.mask_token_id=-1", "model.mask_token_id must be >= 0"),
        ("data.max_length=16", "data.max_length must be at least 2 * model.block_size (32)"),
        ("distributed.bucket_mb=0", "distributed.bucket_mb must be a positive number of MB"),
    ],
)
def test_an_out_of_range_value_is_refused_naming_the_field(override, needle):
    with pytest.raises(FlashdraftError) as info:
        load_config(None, [override])
    assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "text,line,key",
    [
        ("train:\n  lr: 1e-4\n  epochs: 2\n  lr: 3e-4\n", 4, "lr"),
        ("train:\n  lr: 1e-4\nmodel:\n  target: /t\ntrain:\n  epochs: 2\n", 5, "train"),
        ("data:\n  train: [a]\n  eval: {x: 1, x: 2}\n", 3, "x"),
    ],
)
def test_a_duplicate_yaml_key_is_refused_with_its_line(tmp_path, text, line, key):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(FlashdraftError, match=rf"^config file {path} line {line}: duplicate key '{key}'"):
        load_config(path)


def test_yaml_merge_keys_still_work():
    """`<<: *anchor` then a key of the same name overrides by design: not a duplicate."""
    from flashdraft.config import _load_yaml

    text = "a: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n"
    assert _load_yaml(text)["c"] == {"x": 3, "y": 2}


def test_drafter_fields_that_disagree_with_the_drafter_are_refused_and_defaults_resolve(tmp_path):
    from flashdraft.config import resolve_drafter_fields

    actual = {"num_layers": 5, "block_size": 16, "target_layer_ids": [1, 9, 17], "mask_token_id": 7}
    config = load_config(None, ["model.drafter=/d", "model.block_size=8"])
    with pytest.raises(
        FlashdraftError, match=r"^model.block_size=8 disagrees with model.drafter=/d \(/d/config.json: 16\)"
    ):
        resolve_drafter_fields(config, actual, "/d/config.json")
    agreeing = load_config(None, ["model.drafter=/d", "model.block_size=16"])
    resolved = resolve_drafter_fields(agreeing, actual, "/d/config.json")
    assert (resolved.model.num_layers, resolved.model.target_layer_ids) == (5, [1, 9, 17])
    assert agreeing.model.num_layers is None  # the loaded config is not changed in place
    short = load_config(None, ["model.drafter=/d", "data.max_length=20"])
    with pytest.raises(
        FlashdraftError, match=r"data.max_length must be at least 2 \* model.block_size \(32\)"
    ):
        resolve_drafter_fields(short, actual, "/d/config.json")


def test_a_wsd_schedule_needs_room_for_its_warm_up_and_its_decay():
    with pytest.raises(FlashdraftError, match=r"train.warmup_ratio \+ train.decay_ratio must be at most 1"):
        load_config(None, ["train.lr_schedule=wsd", "train.warmup_ratio=0.5", "train.decay_ratio=0.6"])
    load_config(None, ["train.warmup_ratio=0.5", "train.decay_ratio=0.6"])  # the cosine ignores decay_ratio

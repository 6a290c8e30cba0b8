"""`flashdraft bench data --train` on the CPU with a small synthetic set: the data path's timings, and the
train command started twice (cold, then with torch's caches as a second launch finds them)."""

from __future__ import annotations

import json

import pytest

from flashdraft.cli import main


@pytest.mark.slow
def test_bench_data_times_the_data_path_and_two_train_starts(tmp_path, capsys):
    out = tmp_path / "data.json"
    argv = ["--samples", "600", "--mean-length", "96", "--max-length", "256", "--calls", "50"]
    argv += ["--train", "--dir", str(tmp_path / "set"), "--out", str(out)]
    argv += ["--train-override", "train.loss_chunk=128"]
    assert main(["bench", "data", *argv]) == 0
    result = json.loads(out.read_text())
    assert result["set"]["samples"] == 600 and result["set"]["tokens"] > 600 * 24
    measured = result["measured"]
    assert measured["samples_usable"] == 600 and 0 < measured["to_first_batch_s"] < 60
    trained = result["train"]
    # the override replaces the bench's own loss_chunk=256 in the command and reaches the run's config
    assert " train.loss_chunk=128 " in trained["command"] and "loss_chunk=256" not in trained["command"]
    assert "loss_chunk: 128" in (tmp_path / "set" / "run" / "config.yaml").read_text()
    for start in (trained, trained["second_start"]):
        assert start["to_first_step_s"] > 0 and start["peak_rss_GB"] > 0
        # the start-up line names where the time before the first step went
        (line,) = start["log_head"]
        assert line.startswith("training ") and "set up in " in line and "target " in line
        # where it went: before the set-up (interpreter, imports), the set-up, the first step
        assert all(start[part] > 0 for part in ("before_set_up_s", "set_up_s", "first_step_s"))
    assert result["meets_targets"] is (
        measured["to_first_batch_s"] <= 30
        and measured["peak_rss_GB"] <= 4
        and trained["to_first_step_s"] <= 30
        and trained["peak_rss_GB"] <= 4
    )


def test_train_overrides_are_pairs_and_leave_the_bench_keys_alone():
    from flashdraft.bench.data_bench import _train_overrides

    assert _train_overrides(["train.precision=fp8", "train.fp8_head=true"]) == {
        "train.precision": "fp8",
        "train.fp8_head": "true",
    }
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        _train_overrides(["train.precision"])
    with pytest.raises(SystemExit, match=r"train\.max_steps: the bench sets it"):
        _train_overrides(["train.max_steps=50"])
    # refused before anything is written
    with pytest.raises(SystemExit):
        main(["bench", "data", "--train", "--train-override", "data.train=[x]", "--samples", "10"])


def test_target_layers_without_a_target_shape_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "data", "--train", "--target-layers", "8", "--samples", "10"])
    assert "--target-layers cuts the target of --train-target-shape" in capsys.readouterr().err


def test_the_shapes_bench_data_names_are_the_benchmarks_targets():
    from flashdraft.bench.data_bench import TARGET_SHAPES
    from flashdraft.bench.shapes import TARGETS

    assert tuple(sorted(TARGETS)) == TARGET_SHAPES


def test_train_target_shape_writes_that_shape_with_fewer_layers(tmp_path, monkeypatch):
    """--train-target-shape qwen3-8b --target-layers N: a random target with the model's config but N
    layers, written once and reused (the real widths need a GPU-sized disk; a narrowed copy of the shape
    stands in for it here)."""
    import argparse

    from transformers import AutoConfig

    from flashdraft.bench import data_bench, shapes

    small = {**shapes.QWEN3_8B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    small.update(num_key_value_heads=2, head_dim=16, vocab_size=data_bench.VOCAB)
    monkeypatch.setitem(shapes.TARGETS, "qwen3-8b", small)
    args = argparse.Namespace(train_target_shape="qwen3-8b", target_layers=3, drafter_layers=1)
    target = data_bench._random_target(tmp_path, args)
    config = AutoConfig.from_pretrained(target)
    assert target.name == "target-qwen3-8b-3-layers"
    assert config.num_hidden_layers == 3 and config.hidden_size == 64 and config.num_key_value_heads == 2
    written = (target / "config.json").stat().st_mtime_ns
    assert data_bench._random_target(tmp_path, args) == target
    assert (target / "config.json").stat().st_mtime_ns == written  # reused, not written again

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
    assert main(["bench", "data", *argv]) == 0
    result = json.loads(out.read_text())
    assert result["set"]["samples"] == 600 and result["set"]["tokens"] > 600 * 24
    measured = result["measured"]
    assert measured["samples_usable"] == 600 and 0 < measured["to_first_batch_s"] < 60
    trained = result["train"]
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

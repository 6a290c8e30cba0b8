"""`flashdraft bench regen` on the CPU with the tiny target: the prepare path and the plain baseline, one JSON."""

from __future__ import annotations

import json

import pytest

from flashdraft.cli import main


@pytest.mark.slow
def test_bench_regen_times_prepare_and_plain_generate_on_8_prompts(tmp_path, target, capsys):
    prompts = tmp_path / "prompts.jsonl"
    words = ["hi", "why", "2+2", "thanks", "hi there", "be brief", "ok", "sure"]
    prompts.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": w}]}) + "\n" for w in words)
    )
    out = tmp_path / "regen.json"
    argv = [
        "--target",
        str(target),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "4",
        "--baseline-batch",
        "500",
    ]
    assert main(["bench", "regen", *argv, "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "flashdraft bench regen" and result["git_commit"]
    assert result["prompts"] == 8
    # timed as a user runs it: the CLI command in its own interpreter
    assert (
        " -m flashdraft prepare " in result["prepare_command"] and "--regenerate" in result["prepare_command"]
    )
    assert result["prepare"]["new_tokens"] == result["baseline"]["new_tokens"] == 8 * 4
    # the baseline is a plain script in its own interpreter too: generate alone, and the whole process
    baseline = result["baseline"]
    assert " -m flashdraft.bench.plain_generate " in baseline["command"]
    assert list(baseline["phases"]) == ["start-up", "prompts", "load", "generate"]
    assert 0 < baseline["seconds"] <= baseline["phases"]["generate"] < baseline["process_seconds"]
    assert result["speedup_end_to_end"] == float(
        f"{baseline['process_seconds'] / result['prepare']['seconds']:.4g}"
    )
    assert result["prepare"]["regeneration"]["engine"] == "hf"
    # its own process: start-up (interpreter and imports) is the first phase, and all but the exit is booked
    phases = result["prepare"]["phases"]
    assert list(phases) == ["start-up", "checks", "tokenizer", "read_and_check", "regenerate", "render"]
    assert phases["start-up"] > 0  # booked (how long the imports take depends on the machine)
    assert 0 <= result["prepare"]["after_phases_s"] < result["prepare"]["seconds"]
    assert sum(result["prepare"]["phases"].values()) < result["prepare"]["seconds"]
    assert result["prepare"]["regeneration"]["devices"] == ["cpu"]
    assert result["baseline"]["batch"] == 500
    assert result["speedup"] == pytest.approx(
        result["baseline"]["seconds"] / result["prepare"]["seconds"], rel=0.05
    )
    # the static engine through the same path: the same greedy answers, so the same new-token count;
    # cut answers are kept (the random target ends none within 4 tokens)
    static = tmp_path / "static.json"
    argv += ["--device", "cpu", "--engine", "static", "--skip-baseline", "--out", str(static)]
    assert main(["bench", "regen", *argv]) == 0
    result = json.loads(static.read_text())
    assert result["prepare"]["new_tokens"] == 8 * 4 and result["prepare"]["samples_kept"] == 8
    (details,) = result["prepare"]["regeneration"]["engine_details"]
    assert details["engine"] == "static" and details["cuda_graphs"] is False

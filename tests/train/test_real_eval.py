"""Real τ during training (issue 31 item 5): at each held-out evaluation a few held-out prompts are decoded
for real; the τ logged is `flashdraft eval`'s on the same checkpoint and prompts, best/ can follow it
(train.best_by), a stop request during the decode is honoured after the prompt in flight, and the
settings are checked before any long work."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from flashdraft.config import Sampling, load_config
from flashdraft.errors import FlashdraftError
from flashdraft.generate.fast import FastEngine
from flashdraft.infer.evaluate import EvalSettings, run_eval
from flashdraft.infer.report import simulated_tau
from flashdraft.model.locate import find_drafter
from flashdraft.train.state import TrainState
from flashdraft.train.trainer import train
from tests.bench.test_quality import chain_samples, save_chain_target

from .test_validation import RecordingHeartbeat

NEW_TOKENS = 16
PROMPTS = 3


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Path]:
    """The chain target (every answer is one fixed line, then the end of turn) and samples of its answers:
    a drafter learns them within a few dozen CPU steps, so real τ moves."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chain")
    target = save_chain_target(root / "target")
    tokenizer = AutoTokenizer.from_pretrained(target)
    (root / "train.jsonl").write_text(chain_samples(tokenizer, 64, 0))
    (root / "eval.jsonl").write_text(chain_samples(tokenizer, 8, 1))
    return {"target": target, "train": root / "train.jsonl", "eval": root / "eval.jsonl"}


def _config(chain: dict[str, Path], out: Path, **extra):
    settings = {
        "model.target": chain["target"],
        "model.num_layers": 1,
        "model.block_size": 4,
        "data.max_length": 64,
        "data.train": f"[{chain['train']}]",
        "data.eval": f"[{chain['eval']}]",
        "train.out_dir": out,
        "train.max_steps": 24,
        "train.log_every": 8,
        "train.num_anchors": 4,
        "train.batch_size": 4,
        "train.save_every": 8,
        "train.keep_last": 5,
        "train.eval_every": 8,
        "train.lr": 3e-3,
        "train.device": "cpu",
        "train.real_eval_prompts": PROMPTS,
        "train.real_eval_new_tokens": NEW_TOKENS,
        **extra,
    }
    return load_config(None, [f"{k}={v}" for k, v in settings.items()])


def _evals(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "eval"}


@pytest.fixture(scope="module")
def real_run(chain, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("real") / "run"
    return out, train(_config(chain, out, **{"train.best_by": "real_tau"}))


def test_the_real_tau_logged_is_flashdraft_evals_tau_of_that_checkpoint_on_those_prompts(
    real_run, chain, tmp_path
):
    """fp32 on the CPU: the τ training logs at step N equals `flashdraft eval`'s (its eager loop, its τ) on
    checkpoints/step-N with the prompt part of the first held-out samples, at every evaluation."""
    out, _ = real_run
    prompts = tmp_path / "prompts.jsonl"
    lines = []
    for line in chain["eval"].read_text().splitlines()[:PROMPTS]:
        sample = json.loads(line)
        lines.append(json.dumps({"input_ids": sample["input_ids"][: sample["loss_mask"].index(1)]}))
    prompts.write_text("\n".join(lines) + "\n")
    evals = _evals(out)
    assert sorted(evals) == [8, 16, 24]
    settings = EvalSettings(sampling=Sampling(max_new_tokens=NEW_TOKENS), dtype="fp32")
    for step, row in evals.items():
        assert row["real_prompts"] == PROMPTS and row["real_engine"] == "fast"
        assert PROMPTS <= row["real_tokens"] <= PROMPTS * NEW_TOKENS
        report = run_eval(
            str(chain["target"]),
            str(out / "checkpoints" / f"step-{step:08d}" / "drafter"),
            str(prompts),
            settings,
            device="cpu",
            console=Console(quiet=True),
        )
        assert report["tau"] == row["real_tau"], step
        assert report["output_tokens"] == row["real_tokens"], step
    assert max(r["real_tau"] for r in evals.values()) > 1.2  # the drafter learned: a τ that can differ


def test_best_follows_real_tau_where_it_disagrees_with_simulated_tau(real_run):
    out, result = real_run
    evals = _evals(out)
    real = {s: r["real_tau"] for s, r in evals.items()}
    simulated = {s: r["tau"] for s, r in evals.items()}
    by_real, by_simulated = max(real, key=real.get), max(simulated, key=simulated.get)
    assert by_real != by_simulated, (real, simulated)  # this run is a case where the two disagree
    best = load_file(out / "best" / "model.safetensors")
    chosen = load_file(out / "checkpoints" / f"step-{by_real:08d}" / "drafter" / "model.safetensors")
    assert best.keys() == chosen.keys()
    # best/ is written in bf16: the checkpoint's fp32 weights rounded
    assert all(torch.equal(best[k], chosen[k].to(torch.bfloat16)) for k in best)
    marked, top = [], -math.inf
    for step in sorted(evals):  # best/ is rewritten on each strict improvement of real τ
        if real[step] > top:
            marked.append(step)
            top = real[step]
    assert [s for s in sorted(evals) if evals[s].get("best")] == marked
    assert result["best_by"] == "real_tau" and result["best"] == real[by_real]
    # `flashdraft eval` of best/ shows the simulated τ of the evaluation that wrote it, and of the run says
    # what best/ is best by
    assert simulated_tau(out / "best")["step"] == by_real
    assert find_drafter(out) == (out / "best", f"the run's best checkpoint by real τ ({out / 'best'})")


def test_a_kl_loss_run_decodes_with_the_drafters_own_feature_layers(chain, tmp_path):
    """train.loss=kl captures the target's last layer too (train/objective.py); the real decode feeds the
    drafter only its own layers (the H200 run of this with dflash2 failed on the fc's width)."""
    out = tmp_path / "run"
    train(_config(chain, out, **{"train.loss": "kl", "train.max_steps": 8, "train.save_every": 8}))
    assert _evals(out)[8]["real_tau"] >= 1.0


def test_best_by_loss_keeps_the_lowest_held_out_loss(chain, tmp_path):
    out = tmp_path / "run"
    result = train(_config(chain, out, **{"train.best_by": "loss", "train.real_eval_prompts": 0}))
    evals = _evals(out)
    assert not any("real_tau" in r for r in evals.values())  # the real decode is off
    losses = {s: r["loss"] for s, r in evals.items()}
    lowest = min(losses, key=losses.get)
    assert result["best"] == losses[lowest] and simulated_tau(out / "best")["step"] == lowest
    best = load_file(out / "best" / "model.safetensors")
    chosen = load_file(out / "checkpoints" / f"step-{lowest:08d}" / "drafter" / "model.safetensors")
    assert all(torch.equal(best[k], chosen[k].to(torch.bfloat16)) for k in best)


def test_a_stop_during_the_real_decode_stops_after_the_prompt_in_flight(chain, tmp_path, monkeypatch, capsys):
    """SIGTERM while the second of four prompts decodes: no third prompt, no eval row, a checkpoint of the
    step, the run stopped; the heartbeat beat and progress lines came while it decoded."""
    import flashdraft.progress as progress

    monkeypatch.setattr(progress, "DEFAULT_INTERVAL_S", 0.0)  # a progress line at every prompt
    monkeypatch.setenv("FLASHDRAFT_PROGRESS", "plain")
    monkeypatch.delenv("FLASHDRAFT_RUN_DIR", raising=False)
    real_generate = FastEngine.generate
    calls = {"n": 0}

    def generate(self, prompts, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler only sets its stop flag
        return real_generate(self, prompts, **kwargs)

    monkeypatch.setattr(FastEngine, "generate", generate)
    heartbeat = RecordingHeartbeat()
    out = tmp_path / "run"
    settings = {"train.real_eval_prompts": 4, "train.eval_every": 4, "train.save_every": 100}
    result = train(_config(chain, out, **settings), heartbeat)
    assert calls["n"] == 2
    assert result["outcome"] == "stopped" and result["steps"] == 4
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000004"]
    assert not _evals(out)
    captured = capsys.readouterr()
    assert "step 4: evaluation abandoned for the stop request" in captured.out
    assert "step 4: real τ: 1/4 prompts (25%)" in captured.err
    assert "step 4: real τ: 2/4 prompts (50%)" in captured.err
    beats = [
        f["progress"] for _, f in heartbeat.beats if f.get("progress", {}).get("label") == "step 4: real τ"
    ]
    assert [b["done"] for b in beats if b["done"]][:2] == [1, 2] and all(b["total"] == 4 for b in beats)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["train.best_by=tau"], "train.best_by must be simulated_tau, real_tau or loss, got 'tau'"),
        (["train.real_eval_prompts=-1"], "train.real_eval_prompts must be >= 0"),
        (["train.real_eval_new_tokens=0"], "train.real_eval_new_tokens must be at least 1"),
        (
            ["train.best_by=real_tau", "data.eval=[e]"],
            "train.best_by=real_tau needs the real decode at each evaluation: train.eval_every > 0",
        ),
        (
            ["train.best_by=real_tau", "train.eval_every=10"],
            "train.best_by=real_tau needs the real decode at each evaluation",
        ),
        (
            ["train.best_by=real_tau", "train.eval_every=10", "data.eval=[e]", "train.real_eval_prompts=0"],
            "real_eval_prompts=0)",
        ),
        (
            ["train.real_eval_prompts=4", "distributed.target_parallel=2"],
            "train.real_eval_prompts=4 with distributed.target_parallel=2: the real decode of a "
            "tensor-parallel target is not available yet",
        ),
    ],
)
def test_bad_real_eval_settings_are_one_line_naming_the_field(overrides, needle):
    with pytest.raises(FlashdraftError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert message.startswith("config: ") and needle in message and "\n" not in message


def test_best_by_real_tau_on_the_cpu_default_is_refused_before_the_target_loads(chain, tmp_path, monkeypatch):
    import flashdraft.train.build as build

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(build, "load_rank_target", no_target)
    config = _config(chain, tmp_path / "run", **{"train.best_by": "real_tau"})
    config.train.real_eval_prompts = None  # the default: off on the CPU
    with pytest.raises(FlashdraftError, match=r"^train.best_by=real_tau: the real decode is off on cpu"):
        train(config)


def test_the_trainer_state_keeps_best_by_its_metric_and_old_checkpoints_load():
    state = TrainState(best_by="loss")
    assert state.improves(2.0) and not state.improves(math.nan) and not state.improves(None)
    state.best = 2.0
    assert state.improves(1.5) and not state.improves(2.0) and not state.improves(2.5)
    saved = state.state_dict()
    assert saved["best_by"] == "loss" and saved["best_value"] == 2.0 and saved["best_tau"] == -math.inf
    again = TrainState()
    again.load_state_dict(saved)
    assert (again.best_by, again.best) == ("loss", 2.0)
    # a checkpoint from before train.best_by: best/ was the best simulated τ
    old = {k: v for k, v in saved.items() if k not in ("best_by", "best_value")}
    again.load_state_dict({**old, "best_tau": 1.7})
    assert (again.best_by, again.best) == ("simulated_tau", 1.7)
    assert again.choose_best_by("simulated_tau") is None and again.best == 1.7
    line = again.choose_best_by("real_tau")  # a resume with another metric forgets the old best
    assert again.best is None and "simulated_tau -> real_tau" in line


@pytest.mark.gpu
def test_on_a_gpu_a_compiled_run_decodes_8_prompts_on_the_fast_engine_as_eval_does(chain, tmp_path):
    """The GPU default: 8 held-out prompts at each evaluation of a compiled (flex attention) run, on the fast
    engine with CUDA graphs, in bf16; the τ logged is `flashdraft eval --engine fast`'s of the checkpoint
    (its bf16 weights are the trained ones). The decode never calls the compiled layers: the run's compile
    guards (recompile limit, eager flex) would fail it."""
    out = tmp_path / "run"
    config = _config(chain, out, **{"train.device": "cuda", "train.best_by": "real_tau"})
    config.train.real_eval_prompts = None  # the default
    train(config)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"input_ids": s["input_ids"][: s["loss_mask"].index(1)]}) + "\n"
            for s in map(json.loads, chain["eval"].read_text().splitlines()[:8])
        )
    )
    # training's real τ runs the step's model code eagerly inside the CUDA graphs (real_eval.py); eval's
    # default compiles it, whose bf16 kernels round otherwise: --no-compile is the same computation
    settings = EvalSettings(sampling=Sampling(max_new_tokens=NEW_TOKENS), engine="fast", no_compile=True)
    for step, row in _evals(out).items():
        assert row["real_prompts"] == 8 and row["real_engine"] == "fast"
        report = run_eval(
            str(chain["target"]),
            str(out / "checkpoints" / f"step-{step:08d}" / "drafter"),
            str(prompts),
            settings,
            device="cuda",
            console=Console(quiet=True),
        )
        assert report["decoder"]["speculative"]["cuda_graphs"]
        assert report["tau"] == row["real_tau"], step

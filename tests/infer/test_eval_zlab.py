"""`flashdraft eval --engine zlab` runs z-lab's own loop (dflash==0.1.0) beside ours: in fp32 both give
the same acceptance length at every step, with a drafter whose drafts are really accepted."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from flashdraft.cli import main
from flashdraft.generate.speculative import generate
from flashdraft.infer.evaluate import steps_within, tau_on_shared_text
from flashdraft.model.drafter_dir import load_drafter
from flashdraft.model.target import TargetModel


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_zlab_engine_agrees_with_ours_step_by_step(trained, tmp_path, capsys, arch):
    """dflash2: the trained drafter grafted onto DFlash2 (identity convolutions, a zero selector term: the
    same drafts), which z-lab's loop must load as its DFlash2DraftModel and decode step for step alike."""
    pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    drafter_dir = trained["drafter"]
    if arch == "dflash2":
        drafter_dir = tmp_path / "grafted"
        init = ["init", "--target", str(trained["target"]), "--from", str(trained["drafter"])]
        assert main([*init, "--arch", "dflash2", "--out", str(drafter_dir)]) == 0
        assert json.loads((drafter_dir / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    drafter = load_drafter(trained["drafter"])
    target = TargetModel.load(trained["target"], drafter.spec.target_layer_ids)
    # Prompts from the drafter's training data (prompt + 8 answer tokens), where it has learnt to draft.
    records = [json.loads(line) for line in (trained["target"].parent / "train.jsonl").open()][:12]
    candidates = [
        torch.tensor([r["input_ids"][: r["loss_mask"].index(1) + 8]]) for r in records if 1 in r["loss_mask"]
    ]
    # Keep the prompts on which the drafter drafts best, so that equal steps mean equal multi-token accepts.
    runs = sorted(((generate(target, drafter, p, 40), p) for p in candidates), key=lambda r: -r[0].tau)[:3]
    ours = [run for run, _ in runs]
    assert sum(r.tau for r in ours) / 3 > 1.5 and max(max(r.accepted) for r in ours) >= 3
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p[0].tolist()}) + "\n" for _, p in runs))
    out = tmp_path / "r.json"
    argv = ["eval", "--target", str(trained["target"]), "--drafter", str(drafter_dir)]
    argv += ["--prompts", str(prompts), "--max-new-tokens", "40", "--engine", "zlab", "--out", str(out)]
    assert main([*argv, "--device", "cpu"]) == 0
    report = json.loads(out.read_text())
    z = report["zlab"]
    assert z["drafter_class"] == {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[arch]
    assert z["acceptance_lengths"] == [r.accepted for r in ours]
    assert z["identical_steps"] == z["identical_tokens"] == 3 and z["first_step_differences"] == []
    assert z["tau"] == report["tau"] and z["tau_pooled"] == report["tau_pooled"]
    shared = z["shared_text"]  # identical texts: the shared-text τ is the pooled τ of both loops
    assert shared["tau_flashdraft"] == shared["tau_zlab"] == pytest.approx(report["tau_pooled"], rel=0.1)
    assert "τ of z-lab's dflash_generate" in capsys.readouterr().out


def test_zlab_engine_without_the_package_is_one_line(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "dflash" else real(name, *a)
    )

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr("flashdraft.infer.evaluate.load_drafter", refuse)
    argv = ["eval", "--target", str(tmp_path), "--drafter", str(tmp_path), "--prompts", str(tmp_path / "p")]
    assert main([*argv, "--engine", "zlab"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashdraft: error: --engine zlab") and "pip install" in err and "\n" not in err


def brute_force_shared_tau(tokens_a, accepted_a, tokens_b, accepted_b):
    """Token by token: a step counts while every token it committed equals the other output's token."""
    same = [x == y for x, y in zip(tokens_a, tokens_b, strict=False)] + [False]
    shared_len = same.index(False)

    def steps(accepted):
        out, end = [], 1  # token 0 is the prefill's
        for a in accepted:
            if end + a > shared_len:
                break
            out.append(a)
            end += a
        return out

    return steps(accepted_a), steps(accepted_b)


def test_tau_on_shared_text_counts_only_steps_inside_the_common_prefix():
    # Outputs part at token 6: ours commits 1+3+2 (tokens 1-3, 4-5), then a step ending at 7 is excluded.
    a_tokens, a_steps = [5, 1, 2, 3, 4, 6, 7, 8, 9], [3, 2, 3]
    b_tokens, b_steps = [5, 1, 2, 3, 4, 6, 0, 0, 0], [1, 1, 1, 1, 1, 1, 2]
    result = tau_on_shared_text([(a_tokens, a_steps, b_tokens, b_steps)])
    want_a, want_b = brute_force_shared_tau(a_tokens, a_steps, b_tokens, b_steps)
    assert result["shared_tokens"] == 6
    assert (result["steps_a"], result["steps_b"]) == (len(want_a), len(want_b)) == (2, 5)
    assert result["tau_a"] == sum(want_a) / len(want_a) == 2.5
    assert result["tau_b"] == sum(want_b) / len(want_b) == 1.0
    assert steps_within([3, 2, 3], 9) == [3, 2, 3] and steps_within([3], 3) == []

"""The lossless check tells a numerical tie (the two tokens' target logits within a few ulp of the
target's dtype) apart from a real divergence, and `--check-lossless fp32` lets an fp32 rerun decide."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flashdraft.cli import main
from flashdraft.generate.speculative import generate
from flashdraft.infer import evaluate
from flashdraft.infer.evaluate import tie_tolerance, ulp
from flashdraft.model.target import TargetModel
from flashdraft.model.tiny import save_tiny_target

VOCAB = 64
PROMPT = [5, 9, 17, 33]
FLIP_AT = 0  # the generated token the fake speculative run changes (the first: nothing before it moves)


def test_ulp_and_tie_tolerance_follow_the_dtype():
    assert ulp(16.0, torch.bfloat16) == 0.125 and ulp(31.9, torch.bfloat16) == 0.125
    assert ulp(-0.3, torch.bfloat16) == 2**-9 and ulp(1.0, torch.float32) == 2**-23
    assert tie_tolerance(16.0, 15.75, torch.bfloat16) == 0.5  # 4 ulp at 16
    assert tie_tolerance(16.0, 15.75, torch.float32) == 4 * 2**-19


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> dict[str, object]:
    """A tiny target whose LM-head rows `a` and `b` are equal: at the flip point, swapping a for b is an
    exact tie; swapping a for the least likely token is a real divergence."""
    root = tmp_path_factory.mktemp("tied")
    path = save_tiny_target(root / "t0", "qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=4, seed=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    target = TargetModel(model, [1, 2])
    a = generate(target, None, torch.tensor([PROMPT]), 6).tokens[FLIP_AT]
    b = VOCAB - 2 if a != VOCAB - 2 else VOCAB - 3
    with torch.no_grad():
        model.get_output_embeddings().weight[b] = model.get_output_embeddings().weight[a]
    model.save_pretrained(root / "t")
    target = TargetModel(model, [1, 2])
    plain = generate(target, None, torch.tensor([PROMPT]), 6).tokens
    assert plain[FLIP_AT] == min(a, b)  # argmax takes the first of equal logits
    b = max(a, b)  # the speculative run's flip: the other of the two
    with torch.no_grad():
        ids = torch.tensor([PROMPT + plain[:FLIP_AT]])
        worst = int(model(ids).logits[0, -1].argmin())
    drafter = root / "d"
    init = ["init", "--target", str(root / "t"), "--out", str(drafter), "--num-layers", "1"]
    assert main([*init, "--block-size", "3", "--mask-token-id", str(VOCAB - 1)]) == 0
    prompts = root / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": PROMPT}) + "\n")
    return {"target": root / "t", "drafter": drafter, "prompts": prompts, "b": b, "worst": worst}


def _flip_speculative(monkeypatch, token: int, only_bf16: bool) -> None:
    """Make the speculative run emit `token` at FLIP_AT, as a bf16 near-tie flip would."""

    def fake(target, drafter, *args, **kwargs):
        out = generate(target, drafter, *args, **kwargs)
        if drafter is not None and (target.dtype == torch.bfloat16 or not only_bf16):
            out.tokens[FLIP_AT] = token
        return out

    monkeypatch.setattr(evaluate, "generate", fake)


def _eval(tied, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "r.json"
    argv = ["eval", "--target", str(tied["target"]), "--drafter", str(tied["drafter"])]
    argv += ["--prompts", str(tied["prompts"]), "--max-new-tokens", "6", "--device", "cpu", "--out", str(out)]
    assert main([*argv, *extra]) == 0
    return json.loads(out.read_text())["lossless"]


def test_a_flip_between_equal_logits_is_a_numerical_tie(tied, tmp_path, monkeypatch, capsys):
    _flip_speculative(monkeypatch, tied["b"], only_bf16=False)
    lossless = _eval(tied, tmp_path, "--check-lossless")
    assert lossless["identical"] == 0 and lossless["diverged"] == []
    [tie] = lossless["numerical_ties"]
    assert tie["position"] == FLIP_AT and tie["speculative_token"] == tied["b"] and tie["logit_gap"] == 0
    assert "0 / 1 / 0" in capsys.readouterr().out  # identical / ties / real in the printed table


def test_a_flip_to_an_unlikely_token_is_a_real_divergence(tied, tmp_path, monkeypatch, capsys):
    _flip_speculative(monkeypatch, tied["worst"], only_bf16=False)
    lossless = _eval(tied, tmp_path, "--check-lossless")
    assert lossless["numerical_ties"] == []
    [real] = lossless["diverged"]
    assert real["logit_gap"] > real["tie_tolerance"] and not real["tie"]
    assert "DIVERGED: prompt 0 at token 0" in capsys.readouterr().out
    # an fp32 rerun that still diverges keeps it real
    lossless = _eval(tied, tmp_path, "--check-lossless", "fp32", "--dtype", "bf16")
    [real] = lossless["diverged"]
    assert real["fp32"]["identical"] is False and real["fp32"]["divergence"]["position"] == FLIP_AT


def test_fp32_rerun_decides_a_divergence_seen_only_in_bf16(tied, tmp_path, monkeypatch, capsys):
    _flip_speculative(monkeypatch, tied["worst"], only_bf16=True)
    lossless = _eval(tied, tmp_path, "--check-lossless", "--dtype", "bf16")
    assert len(lossless["diverged"]) == 1  # judged at bf16 alone: a large gap, so real
    lossless = _eval(tied, tmp_path, "--check-lossless", "fp32", "--dtype", "bf16", "--force")
    assert lossless["diverged"] == []
    [tie] = lossless["numerical_ties"]
    assert tie["dtype"] == "bfloat16" and tie["fp32"] == {"identical": True, "divergence": None}
    assert "fp32 rerun: identical outputs" in capsys.readouterr().out


def test_check_lossless_takes_only_fp32(tied, capsys):
    argv = ["eval", "--target", str(tied["target"]), "--drafter", str(tied["drafter"])]
    with pytest.raises(SystemExit):
        main([*argv, "--prompts", str(tied["prompts"]), "--check-lossless", "fp16"])
    assert "the only value is fp32" in capsys.readouterr().err

"""`flashdraft doctor` warns when a hybrid (linear-attention) target would run on transformers' slow
torch fallback because flash-linear-attention or causal-conv1d cannot be imported."""

from __future__ import annotations

import sys
import types

from flashdraft.config import load_config
from flashdraft.run.doctor import _hybrid_kernels


def _config(target: str, tmp_path):
    return load_config(None, [f"model.target={target}", f"train.out_dir={tmp_path}"])


def _fake_kernels(monkeypatch, *, conv: bool) -> None:
    """Importable stand-ins for the two kernel packages (neither has a CPU build to install here)."""
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    delta = types.ModuleType("fla.ops.gated_delta_rule")
    delta.chunk_gated_delta_rule = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", delta)
    conv1d = types.ModuleType("causal_conv1d")
    if conv:
        conv1d.causal_conv1d_fn = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "causal_conv1d", conv1d)


def test_hybrid_target_without_kernels_is_warned_about(target_dirs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` raises ImportError
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    check = _hybrid_kernels(_config(target_dirs["qwen3_5"], tmp_path))
    assert check.ok is None  # a warning: shown, not a failure
    assert "4/6 target layers are linear attention" in check.detail
    assert "flash-linear-attention and causal-conv1d are not importable" in check.detail
    assert "slow torch fallback" in check.detail and "flashdraft[hybrid]" in check.detail


def test_hybrid_target_with_one_kernel_missing_names_it(target_dirs, tmp_path, monkeypatch):
    _fake_kernels(monkeypatch, conv=False)
    check = _hybrid_kernels(_config(target_dirs["qwen3_5"], tmp_path))
    assert check.ok is None and "and causal-conv1d is not importable" in check.detail
    assert "flash-linear-attention" not in check.detail


def test_hybrid_target_with_both_kernels_passes(target_dirs, tmp_path, monkeypatch):
    _fake_kernels(monkeypatch, conv=True)
    check = _hybrid_kernels(_config(target_dirs["qwen3_5"], tmp_path))
    assert check.ok is True and "fast kernels" in check.detail


def test_attention_only_target_needs_no_kernels(qwen3_target, tmp_path):
    check = _hybrid_kernels(_config(qwen3_target, tmp_path))
    assert check.ok is None and "no linear-attention layers" in check.detail

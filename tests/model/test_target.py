"""The target wrapper captures exactly HF's hidden_states[id + 1] and stops after the last needed layer."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from flashdraft.cli import main
from flashdraft.errors import FlashdraftError
from flashdraft.model.target import TargetModel


def test_features_equal_hf_hidden_states_including_last_layer(target_dirs):
    for kind, path in target_dirs.items():
        target = TargetModel.load(path, [0, 3, 5])
        ids = torch.randint(0, 300, (2, 13))
        with torch.no_grad():
            hs = target.model(ids, output_hidden_states=True).hidden_states
        expected = torch.cat([hs[1], hs[4], hs[6]], dim=-1)
        assert torch.allclose(target.features(ids), expected, atol=1e-6), kind
        assert target.hidden_size == 64 and target.num_layers == 6
        assert not any(p.requires_grad for p in target.model.parameters())


def test_forward_stops_after_last_needed_layer(qwen3_target):
    target = TargetModel.load(qwen3_target, [1, 2])
    ran = []
    handles = [
        layer.register_forward_hook(lambda m, i, o, n=n: ran.append(n))
        for n, layer in enumerate(target.layers)
    ]
    calls = []
    head = target.model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    target.features(torch.randint(0, 300, (1, 7)))
    for h in [*handles, head]:
        h.remove()
    assert ran == [0, 1, 2] and calls == []


def test_embed_and_head_are_the_targets(qwen3_target):
    target = TargetModel.load(qwen3_target, [1])
    ids = torch.tensor([[3, 4]])
    assert torch.equal(target.embed(ids), target.model.get_input_embeddings()(ids))
    assert target.lm_head_weight is target.model.get_output_embeddings().weight


def _pickled_only_target(tmp_path, qwen3_target) -> str:
    """A copy of the tiny target whose weights are only a pickled pytorch_model.bin."""
    copy = tmp_path / "bin-target"
    shutil.copytree(qwen3_target, copy)
    torch.save(load_file(str(copy / "model.safetensors")), copy / "pytorch_model.bin")
    (copy / "model.safetensors").unlink()
    return str(copy)


def test_a_target_with_only_pytorch_model_bin_is_refused_with_how_to_convert(tmp_path, qwen3_target):
    target = _pickled_only_target(tmp_path, qwen3_target)
    with pytest.raises(FlashdraftError) as info:
        TargetModel.load(target, [1])
    message = str(info.value)
    assert "\n" not in message and "pytorch_model.bin" in message and target in message
    assert "save_pretrained" in message and "safetensors" in message


def test_prepare_regenerating_in_process_refuses_a_pickled_target_before_any_work(
    tmp_path, qwen3_target, capsys
):
    target = _pickled_only_target(tmp_path, qwen3_target)
    (tmp_path / "in.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    args = ["prepare", str(tmp_path / "in.jsonl"), "--target", target, "--out", str(tmp_path / "s")]
    assert main([*args, "--regenerate", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pytorch_model.bin (a pickle" in err

"""Warm start (issue 33 item 3): `init --from DRAFTER` checks the drafter against the target and copies it,
or grafts a DFlash drafter onto DFlash2 whose step 0 is the old drafter exactly; `model.drafter` fine-tunes
it with a fresh optimizer and a re-warmed lr, recorded in warm_start.json."""

from __future__ import annotations

import json

import pytest
import torch

from flashdraft.cli import main
from flashdraft.config import load_config
from flashdraft.errors import FlashdraftError
from flashdraft.model.attention import dense_mask
from flashdraft.model.dflash2 import DFlash2DraftModel, graft_dflash2
from flashdraft.model.drafter_dir import load_drafter, save_drafter
from flashdraft.model.target import TargetModel
from flashdraft.model.tiny import save_tiny_target
from flashdraft.train.trainer import train
from tests.train.helpers import tiny_pair

CTX = 9


def _random_drafter(target_dir: str, seed: int = 0, **shape):
    """A DFlash drafter with random weights everywhere (norms too: every parameter matters)."""
    drafter, target = tiny_pair(target_dir, seed=seed, **shape)
    return drafter, target


def _logits(model, target: TargetModel, seed: int = 0) -> torch.Tensor:
    """Logits of two blocks after a random context, with the masks of every layer kind."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 299, (1, CTX + 1), generator=g)
    block = torch.tensor([[int(ids[0, CTX])] + [300] * (model.block_size - 1)])
    features, noise = target.features(ids[:, :CTX]), target.embed(block)
    pos = torch.arange(CTX + model.block_size)[None]
    masks = {
        k.key: dense_mask(torch.tensor([[CTX]]), torch.tensor([[True]]), pos[:, :CTX], model.block_size, k)
        for k in model.layer_kinds()
    }
    with torch.no_grad():
        hidden = model(noise, features, pos[:, :CTX], pos[:, CTX:], masks)
        return model.compute_logits(hidden[:, 1:], target.lm_head_weight), hidden[:, 1:]


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_graft_starts_as_the_old_drafter_exactly(qwen3_target, layer_types):
    shape = {"layer_types": layer_types, "sliding_window": 4 if layer_types else None}
    old, target = _random_drafter(qwen3_target, **shape)
    new = graft_dflash2(old, generator=torch.Generator().manual_seed(1))
    assert isinstance(new, DFlash2DraftModel) and new.spec.arch == "dflash2"
    before, _ = _logits(old, target)
    after, hidden = _logits(new, target)
    assert torch.equal(before, after)  # fp32, bit for bit
    # the selector's bilinear term starts at zero: its greedy path is the head's argmax, as DFlash drafts
    path, _, _ = new.propose(hidden, torch.tensor([7]), target.lm_head_weight, 0.0)
    assert torch.equal(path, before.argmax(-1))
    # and it can learn: the selector's gradient is not zero
    scores = new.candidate_selector.scores(
        hidden[0],
        before[0, :, :4],
        torch.arange(4).repeat(hidden.shape[1], 1),
        torch.zeros(3, dtype=torch.long),
    )
    scores.sum().backward()
    assert new.candidate_selector.hidden_projection.weight.grad.abs().sum() > 0


def test_init_from_copies_or_grafts_with_equal_logits(tmp_path, qwen3_target):
    old, target = _random_drafter(qwen3_target, seed=3)
    source = save_drafter(old, tmp_path / "source", dtype=torch.float32)
    assert (
        main(["init", "--target", qwen3_target, "--from", str(source), "--out", str(tmp_path / "copy")]) == 0
    )
    copy = load_drafter(tmp_path / "copy")
    assert torch.equal(_logits(copy, target)[0], _logits(old, target)[0])  # fp32 kept: no rounding
    argv = ["init", "--target", qwen3_target, "--from", str(source), "--out", str(tmp_path / "v2")]
    assert main([*argv, "--arch", "dflash2"]) == 0
    grafted = load_drafter(tmp_path / "v2")
    assert isinstance(grafted, DFlash2DraftModel)
    assert json.loads((tmp_path / "v2" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert torch.equal(_logits(grafted, target)[0], _logits(old, target)[0])
    with pytest.raises(
        FlashdraftError, match=r"--arch dflash: --from .* is a dflash2 drafter; only dflash -> dflash2"
    ):
        from flashdraft.model.drafter_dir import init_from_drafter

        init_from_drafter(qwen3_target, tmp_path / "v2", tmp_path / "back", arch="dflash")


def test_init_from_refuses_shape_flags_and_a_drafter_of_another_target(tmp_path, qwen3_target, capsys):
    old, _ = _random_drafter(qwen3_target)
    source = save_drafter(old, tmp_path / "source")

    def error(target, *flags) -> str:
        argv = ["init", "--target", str(target), "--from", str(source), "--out", str(tmp_path / "o"), *flags]
        assert main(argv) != 0
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("flashdraft: error:")]
        assert len(lines) == 1, lines  # one line, naming the field
        return lines[0]

    assert "--num-layers, --block-size describe a new drafter" in error(
        qwen3_target, "--num-layers", "3", "--block-size", "8"
    )
    wide = save_tiny_target(tmp_path / "wide", hidden_size=96)
    assert "config.json: 'hidden_size'=64 but the target's hidden size is 96" in error(wide)
    vocab = save_tiny_target(tmp_path / "vocab", vocab_size=352)
    assert "'vocab_size'=320 but the target's vocabulary has 352 rows" in error(vocab)
    deep = save_tiny_target(tmp_path / "deep", num_layers=8)
    assert "'num_target_layers'=6 but the target has 8 layers" in error(deep)
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    lines = []
    for i in range(8):  # period-3 sequences: learnable from the context within a few steps
        n, p = 30 + 3 * i, 4 + i % 5
        cycle = [(11 * i) % 290, (11 * i + 97) % 290, (11 * i + 181) % 290]
        lines.append(
            json.dumps({"input_ids": [cycle[j % 3] for j in range(n)], "loss_mask": [0] * p + [1] * (n - p)})
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(target, data, out, **extra):
    base = {
        "model.target": target,
        "data.train": f"[{data}]",
        "train.out_dir": str(out),
        "train.max_steps": 6,
        "train.log_every": 1,
        "train.num_anchors": 6,
        "train.batch_size": 2,
        "train.save_every": 6,
        "train.lr": 3e-3,
        "train.warmup_ratio": 0.5,
        "train.position_weight": "decay",
        "train.device": "cpu",
    }
    base.update(extra)
    train(load_config(None, [f"{k}={v}" for k, v in base.items()]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def test_warm_start_fine_tunes_with_a_fresh_optimizer_and_records_it(tmp_path, qwen3_target, train_file):
    shape = {"model.mask_token_id": 300, "model.num_layers": 2, "model.block_size": 4}
    fresh = _run(qwen3_target, train_file, tmp_path / "fresh", **shape)
    source = tmp_path / "fresh" / "checkpoints" / "step-00000006" / "drafter"
    warm = _run(qwen3_target, train_file, tmp_path / "warm", **{"model.drafter": source})
    assert warm[1]["lr"] == fresh[1]["lr"] < fresh[3]["lr"]  # the schedule re-warms from step 0
    assert warm[1]["loss"] < fresh[1]["loss"]  # it starts from the trained weights
    record = json.loads((tmp_path / "warm" / "warm_start.json").read_text())
    assert record["drafter"] == str(source.resolve()) and len(record["weights_sha256"]) == 64
    assert (record["source_arch"], record["arch"], record["grafted"], record["optimizer"]) == (
        "dflash",
        "dflash",
        False,
        "fresh",
    )
    grafted = _run(
        qwen3_target, train_file, tmp_path / "graft", **{"model.drafter": source, "model.arch": "dflash2"}
    )
    record = json.loads((tmp_path / "graft" / "warm_start.json").read_text())
    assert (record["source_arch"], record["arch"], record["grafted"]) == ("dflash", "dflash2", True)
    assert isinstance(
        load_drafter(tmp_path / "graft" / "checkpoints" / "step-00000006" / "drafter"), DFlash2DraftModel
    )
    assert len(grafted) == 6
    assert not (tmp_path / "fresh" / "warm_start.json").exists()


def test_weights_sha256_names_the_tensors_not_the_files_bytes(tmp_path):
    """The same tensors written in another order, under metadata in another order (safetensors writes its
    header in an order that changes from process to process), give the same digest; one changed value does
    not."""
    from safetensors.torch import save_file

    from flashdraft.model.drafter_dir import WEIGHTS_NAME, weights_sha256

    tensors = {"b.weight": torch.randn(3, 4).to(torch.bfloat16), "a.weight": torch.arange(5.0)}
    for name, order, metadata in (("one", ["a.weight", "b.weight"], {"format": "pt", "producer": "x"}),
                                  ("two", ["b.weight", "a.weight"], {"producer": "x", "format": "pt"})):  # fmt: skip
        (tmp_path / name).mkdir()
        save_file({k: tensors[k] for k in order}, tmp_path / name / WEIGHTS_NAME, metadata=metadata)
    assert weights_sha256(tmp_path / "one") == weights_sha256(tmp_path / "two")
    changed = {**tensors, "a.weight": torch.arange(5.0) + torch.tensor([0, 0, 0, 0, 1.0])}
    (tmp_path / "three").mkdir()
    save_file(changed, tmp_path / "three" / WEIGHTS_NAME)
    assert weights_sha256(tmp_path / "three") != weights_sha256(tmp_path / "one")

"""The memory-mapped shard format: the same samples as the JSONL they came from, at most 8 bytes a token,
old JSONL sets refused with the way to convert them (and the converter), `inspect`, and a sampler whose
order is today's, computed once per epoch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from flashdraft.cli import main
from flashdraft.config import load_config
from flashdraft.data.shards import JOURNAL, manifest_files, read_manifest, write_shards
from flashdraft.data.tokens import EpochSampler, collate, load_token_dataset
from flashdraft.errors import FlashdraftError
from flashdraft.model.tiny import save_tiny_target
from flashdraft.run.doctor import _data

from .helpers import make_tokenizer


def _random_samples(n: int, seed: int = 0, longest: int = 60) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(1, longest)
        split = rng.randint(0, length)  # a prompt, then an answer with a few unsupervised tokens
        mask = [0] * split + [int(rng.random() < 0.8) for _ in range(length - split)]
        samples.append(([rng.randrange(70_000) for _ in range(length)], mask))
    return samples


def _jsonl(path: Path, samples) -> Path:
    path.write_text("".join(json.dumps({"input_ids": i, "loss_mask": m}) + "\n" for i, m in samples))
    return path


def _old_format_set(directory: Path, samples, per_shard: int = 7, **manifest) -> Path:
    """A shard set as flashdraft wrote it before the memory-mapped format: JSONL shards."""
    directory.mkdir()
    names = []
    for n, start in enumerate(range(0, len(samples), per_shard)):
        names.append(f"shard-{n:05d}.jsonl")
        _jsonl(directory / names[-1], samples[start : start + per_shard])
    record = {"producer": "flashdraft prepare", "tokenizer_sha256": "abc", "samples": len(samples)}
    (directory / "manifest.json").write_text(json.dumps({**record, **manifest, "shards": names}))
    return directory


def _all(data) -> list[tuple[list[int], list[int]]]:
    return [(data[i].input_ids.tolist(), data[i].loss_mask.tolist()) for i in range(len(data))]


def _one_line_error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashdraft: error: ") and "\n" not in err
    return err


def test_the_memory_mapped_set_equals_the_in_memory_jsonl_sample_for_sample(tmp_path):
    samples = _random_samples(101)
    write_shards(tmp_path / "shards", samples, {}, shard_size=10)  # 11 shards, the last one short
    assert len(read_manifest(tmp_path / "shards")["shards"]) == 11
    jsonl = _jsonl(tmp_path / "data.jsonl", samples)
    for max_length, block_size in [(4096, 2), (25, 4)]:  # truncation and dropped samples too
        mapped = load_token_dataset([str(tmp_path / "shards")], max_length=max_length, block_size=block_size)
        memory = load_token_dataset([str(jsonl)], max_length=max_length, block_size=block_size)
        assert _all(mapped) == _all(memory) and mapped.dropped == memory.dropped
        kept = [(i[:max_length], m[:max_length]) for i, m in samples]
        kept = [(i, m) for i, m in kept if any(m[: max(len(i) - block_size + 1, 0)])]
        assert _all(mapped) == kept  # the oracle: today's rule, sample by sample
        batch_a, batch_b = collate(mapped, 1, [3, 0, 7], 5, 8), collate(memory, 1, [3, 0, 7], 5, 8)
        assert torch.equal(batch_a.input_ids, batch_b.input_ids) and batch_a.input_ids.dtype == torch.long
        assert torch.equal(batch_a.loss_mask, batch_b.loss_mask) and batch_a.seeds == batch_b.seeds


def test_a_set_of_many_samples_is_two_sets_read_together(tmp_path):
    a, b = _random_samples(15, seed=1), _random_samples(9, seed=2)
    write_shards(tmp_path / "a", a, {}, shard_size=4)
    write_shards(tmp_path / "b", b, {}, shard_size=4)
    data = load_token_dataset([str(tmp_path / "a"), str(tmp_path / "b")], max_length=4096, block_size=1)
    assert _all(data) == [s for s in a + b if any(s[1])]


def test_at_most_8_bytes_a_token_on_disk(tmp_path):
    samples = _random_samples(300, longest=400)
    manifest = write_shards(tmp_path / "shards", samples, {"tokenizer_name": "x"}, shard_size=64)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "shards").iterdir())
    tokens = sum(len(i) for i, _ in samples)
    assert manifest["tokens"] == tokens
    assert on_disk / tokens <= 8, on_disk / tokens
    files = {p.name for p in (tmp_path / "shards").iterdir()}
    assert files == {"manifest.json", *manifest_files(manifest)}


@pytest.mark.parametrize(
    "ids,mask,needle",
    [
        ([1, 2], [0, 2], "loss_mask must be 0/1"),
        ([1, 2], [0.5, 1], "loss_mask must be 0/1"),
        ([1, 2], [1], "same length"),
        ([1, -2], [0, 1], "token ids must lie in"),
        ([1, 2**32], [0, 1], "token ids must lie in"),
    ],
)
def test_the_writer_refuses_a_bad_sample_and_leaves_nothing(tmp_path, ids, mask, needle):
    with pytest.raises(ValueError, match=f"sample 1: .*{needle}"):
        write_shards(tmp_path / "s", [([1, 2], [0, 1]), (ids, mask)], {})
    assert list(tmp_path.iterdir()) == []


def test_token_ids_beyond_the_vocabulary_name_the_shard_without_reading_it(tmp_path):
    write_shards(tmp_path / "s", [([1, 2, 64], [0, 1, 1]), ([1, 2, 3], [0, 1, 1])], {}, shard_size=1)
    with pytest.raises(
        FlashdraftError, match=r"shard-00000.ids.u32: token id 64 >= the target vocabulary \(64\)"
    ):
        load_token_dataset([str(tmp_path / "s")], max_length=64, block_size=2, vocab_size=64)
    load_token_dataset([str(tmp_path / "s")], max_length=64, block_size=2, vocab_size=65)


def test_old_jsonl_shard_dirs_get_one_line_naming_the_converter(tmp_path, capsys):
    old = _old_format_set(tmp_path / "old", _random_samples(5))
    with pytest.raises(FlashdraftError, match=rf"{old}: shards in the old JSONL format") as caught:
        load_token_dataset([str(old)], max_length=64, block_size=2)
    assert f"flashdraft convert-shards {old} NEW_DIR" in str(caught.value)
    assert "convert-shards" in _one_line_error(capsys, ["inspect", str(old)])
    check = _data(load_config(None, [f"data.train=[{old}]"]))
    assert check.ok is False and "convert-shards" in check.detail


def test_train_refuses_an_old_set_before_loading_the_target(tmp_path, qwen3_target, monkeypatch):
    from flashdraft.train import trainer

    old = _old_format_set(tmp_path / "old", _random_samples(5))

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the data was checked")

    monkeypatch.setattr(trainer.TargetModel, "load", refuse)
    config = load_config(
        None,
        [
            f"model.target={qwen3_target}",
            "model.mask_token_id=300",
            f"data.train=[{old}]",
            "train.device=cpu",
            f"train.out_dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(FlashdraftError, match="convert-shards"):
        trainer.train(config)


def test_the_converter_round_trips_and_keeps_the_manifest_and_journal(tmp_path, capsys):
    samples = _random_samples(23)
    old = _old_format_set(tmp_path / "old", samples, dropped={"no supervised tokens": 3})
    (old / JOURNAL).write_text('{"key": "k"}\n')
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    new = tmp_path / "new"
    assert main(["convert-shards", str(old), str(new)]) == 0
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before  # the old set is untouched
    converted = load_token_dataset([str(new)], max_length=4096, block_size=1)
    assert _all(converted) == [s for s in samples if any(s[1])]
    manifest = read_manifest(new)
    assert manifest["tokenizer_sha256"] == "abc" and manifest["dropped"] == {"no supervised tokens": 3}
    assert manifest["samples"] == 23 and manifest["converted_from"] == str(old)
    assert (new / JOURNAL).read_text() == '{"key": "k"}\n'
    assert "already in the current format" in _one_line_error(
        capsys, ["convert-shards", str(new), str(tmp_path / "x")]
    )


def test_the_converter_refuses_a_truncated_old_set_and_writes_nothing(tmp_path, capsys):
    old = _old_format_set(tmp_path / "old", _random_samples(10), per_shard=5)
    shard = old / "shard-00001.jsonl"
    shard.write_text("".join(shard.read_text().splitlines(keepends=True)[:3]))
    err = _one_line_error(capsys, ["convert-shards", str(old), str(tmp_path / "new")])
    assert "8 samples in its shards but its manifest.json says 10" in err
    assert not (tmp_path / "new").exists() and [p.name for p in tmp_path.iterdir()] == ["old"]


def test_inspect_prints_the_summary_and_marks_the_supervised_spans(tmp_path, capsys):
    target = save_tiny_target(
        tmp_path / "target",
        "qwen3",
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        tokenizer=make_tokenizer("qwen"),
    )
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi there"}]
    (tmp_path / "in.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    out = tmp_path / "shards"
    assert main(["prepare", str(tmp_path / "in.jsonl"), "--target", str(target), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--decode", "1"]) == 0
    report = capsys.readouterr().out
    manifest = read_manifest(out)
    assert f"samples                  {manifest['samples']}" in report
    assert (
        f"{manifest['supervised_tokens']} ({manifest['supervised_tokens'] / manifest['tokens']:.1%})"
        in report
    )
    text = report.split("⟦supervised⟧)\n", 1)[1]  # the decoded sample (the word-level decoder adds spaces)
    prompt, answer = text.split("⟦")
    assert prompt.split() == ["<|im_start|>", "user", "hi", "<|im_end|>", "<|im_start|>", "assistant"]
    assert answer.split() == ["hi", "there", "<|im_end|>⟧"]  # the answer, and only it, is supervised
    assert main(["inspect", str(out)]) == 0 and "⟦" not in capsys.readouterr().out  # no --decode: no text
    other = tmp_path / "other"
    save_tiny_target(
        other, "qwen3", vocab_size=64, hidden_size=32, num_layers=2, tokenizer=make_tokenizer("llama")
    )
    err = _one_line_error(capsys, ["inspect", str(out), "--decode", "1", "--target", str(other)])
    assert "is not the one" in err


# ---------------------------------------------------------------- the sampler


def _old_order(n: int, batch_size: int, seed: int, calls: int) -> list[tuple[int, list[int]]]:
    """The sampler before caching: a fresh permutation on every call."""
    epoch, position, out = 0, 0, []
    for _ in range(calls):
        if position >= n:
            epoch, position = epoch + 1, 0
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        out.append((epoch, order[position : position + batch_size]))
        position += len(out[-1][1])
    return out


def test_the_sampler_order_is_unchanged_and_each_permutation_is_computed_once_per_epoch(monkeypatch):
    computed = []
    real = EpochSampler._order
    monkeypatch.setattr(
        EpochSampler, "_order", lambda self, epoch: computed.append(epoch) or real(self, epoch)
    )
    sampler = EpochSampler(23, 5, seed=7)  # 5 batches an epoch, the last one of 3
    draws = [sampler.next_batch() for _ in range(16)]
    assert draws == _old_order(23, 5, 7, 16)
    assert computed == [0, 1, 2, 3]  # once per epoch, not once per batch
    resumed = EpochSampler(23, 5, seed=7)
    resumed.load_state_dict(sampler.state_dict())
    assert [resumed.next_batch() for _ in range(6)] == _old_order(23, 5, 7, 22)[16:]


# ---------------------------------------------------------------- training on shards


@pytest.mark.slow
def test_training_on_shards_is_bit_identical_to_the_same_data_as_jsonl(tmp_path, qwen3_target):
    from safetensors.torch import load_file

    from flashdraft.train.trainer import train

    samples = []
    for i in range(10):  # learnable period-3 sequences, as in tests/train/test_trainer.py
        n, p = 20 + 3 * i, 3 + i % 4
        cycle = [(11 * i) % 290, (11 * i + 97) % 290, (11 * i + 181) % 290]
        samples.append(([cycle[j % 3] for j in range(n)], [0] * p + [1] * (n - p)))
    jsonl = _jsonl(tmp_path / "train.jsonl", samples)
    write_shards(tmp_path / "shards", samples, {}, shard_size=3)

    def run(data: Path, out: Path) -> tuple[list[float], dict]:
        overrides = {
            "model.target": qwen3_target,
            "model.mask_token_id": 300,
            "model.num_layers": 1,
            "model.block_size": 4,
            "data.train": f"[{data}]",
            "train.out_dir": str(out),
            "train.max_steps": 4,
            "train.log_every": 1,
            "train.num_anchors": 4,
            "train.batch_size": 2,
            "train.grad_accum": 2,
            "train.save_every": 4,
            "train.device": "cpu",
        }
        train(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        weights = load_file(str(out / "checkpoints" / "step-00000004" / "drafter" / "model.safetensors"))
        return [r["loss"] for r in rows if r["kind"] == "train"], weights

    losses_a, weights_a = run(jsonl, tmp_path / "a")
    losses_b, weights_b = run(tmp_path / "shards", tmp_path / "b")
    assert len(losses_a) == 4 and losses_a == losses_b
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


# ---------------------------------------------------------------- damaged or incomplete sets (#28)


def _anchored_samples(n: int) -> list[tuple[list[int], list[int]]]:
    """Samples that all have an anchor for block size 2, each of its own length."""
    return [(list(range(i, i + 6 + i)), [0, 0] + [1] * (4 + i)) for i in range(n)]


def test_a_set_without_its_manifest_names_the_manifest_and_the_files_found(tmp_path, capsys):
    shards = tmp_path / "s"
    write_shards(shards, _anchored_samples(4), {"tokenizer_sha256": "x"}, shard_size=2)
    (shards / "manifest.json").unlink()  # what a copy interrupted before its last file leaves
    with pytest.raises(FlashdraftError) as caught:
        load_token_dataset([str(shards)], max_length=64, block_size=2)
    message = str(caught.value)
    assert f"data {shards}: no manifest.json, but it holds shard files (shard-00000.ids.u32" in message
    assert "and 3 more" in message and "\n" not in message
    assert "no manifest.json, but it holds shard files" in _one_line_error(capsys, ["inspect", str(shards)])


def test_train_refuses_a_set_without_its_manifest_before_loading_the_target(
    tmp_path, qwen3_target, monkeypatch
):
    from flashdraft.train import trainer

    shards = tmp_path / "s"
    write_shards(shards, _anchored_samples(2), {})
    (shards / "manifest.json").unlink()

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the data was checked")

    monkeypatch.setattr(trainer.TargetModel, "load", refuse)
    overrides = [f"model.target={qwen3_target}", "model.mask_token_id=300", f"data.train=[{shards}]"]
    config = load_config(None, [*overrides, "train.device=cpu", f"train.out_dir={tmp_path / 'run'}"])
    with pytest.raises(FlashdraftError, match=r"no manifest\.json, but it holds shard files"):
        trainer.train(config)


@pytest.mark.parametrize(
    "row,column,value",
    [(3, 1, 10**12), (3, 1, 5), (3, 0, 2), (3, 2, -7), (3, 2, 99), (5, 1, 4), (0, 0, 1)],
    ids=["huge-length", "short-length", "start", "negative-first", "first-past-end", "last-row", "first-row"],
)
def test_one_damaged_index_row_is_named_and_counted_as_damaged(tmp_path, capsys, row, column, value):
    samples = _anchored_samples(6)
    shards = tmp_path / "s"
    write_shards(shards, samples, {}, shard_size=6)
    index_path = shards / "shard-00000.index.i64"
    index = np.fromfile(index_path, dtype="<i8").reshape(-1, 3)
    assert index[row, column] != value
    index[row, column] = value
    index.tofile(index_path)
    data = load_token_dataset([str(shards)], max_length=64, block_size=2)
    assert data.dropped == {"no_anchor": 0, "damaged": 1}
    assert _all(data) == [s for i, s in enumerate(samples) if i != row]  # the others read as written
    err = capsys.readouterr().err
    assert f"{index_path}: damaged index row {row} " in err
    assert data.dropped_summary() == "0 dropped: no anchor; 1 damaged index row left out"

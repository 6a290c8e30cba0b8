"""Tokenized training samples ({input_ids, loss_mask}), the deterministic epoch sampler and collation.

Reads shard directories made by `flashdraft prepare` (their manifest is checked against the target's
tokenizer and their sample count against the shards), JSONL files (one sample per line, gzipped or
not), or directories of them; data whose tokenizer cannot be verified gets a warning. Every malformed line is an error that
names the file and line; nothing is skipped silently (samples that cannot hold one block are counted
and reported).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from flashdraft.data.chat import parse_json_object
from flashdraft.data.shards import check_manifest, read_manifest, warn
from flashdraft.data.sources import decode_line, text_lines
from flashdraft.errors import FlashdraftError


@dataclass
class TokenBatch:
    input_ids: Tensor  # [b, S] right-padded
    loss_mask: Tensor  # [b, S] 1 on supervised (assistant) tokens
    lengths: Tensor  # [b] real lengths
    seeds: list[int]  # per-row anchor seeds, derived from (seed, epoch, sample index)

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(
            self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device), self.seeds
        )


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class TokenDataset:
    samples: list[Sample]
    dropped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)


def _files(paths: list[str], fingerprint: dict[str, str] | None, target: str) -> list[tuple[Path, int]]:
    """(file, index of the data path it came from) for every data file, manifests checked."""
    files: list[tuple[Path, int]] = []
    for source, raw in enumerate(paths):
        path = Path(raw)
        manifest = read_manifest(path) if path.is_dir() else None
        if manifest is not None:
            check_manifest(path, fingerprint, target)
            files.extend((path / name, source) for name in manifest["shards"])
        elif path.is_dir():
            found = sorted(
                p for p in path.iterdir() if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz"))
            )
            if not found:
                raise FlashdraftError(f"data {path}: directory holds no .jsonl files")
            warn(f"data {path} has no flashdraft manifest.json")
            files.extend((f, source) for f in found)
        elif path.is_file():
            warn(f"data {path} is a file without a flashdraft manifest")
            files.append((path, source))
        else:
            raise FlashdraftError(f"data {path}: no such file or directory")
    return files


def _parse(line: str, where: str) -> Sample:
    record = parse_json_object(line, where)
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise FlashdraftError(f"{where}: 'input_ids' must be a list of non-negative integers")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
        raise FlashdraftError(
            f"{where}: 'loss_mask' must be a list of 0/1 of the same length as input_ids ({len(ids)})"
        )
    return Sample(ids, mask)


def load_token_dataset(
    paths: list[str],
    *,
    max_length: int,
    block_size: int,
    vocab_size: int | None = None,
    fingerprint: dict[str, str] | None = None,
    target: str = "the target",
) -> TokenDataset:
    """Samples truncated to `max_length`; those without one anchor (a supervised token with a whole block
    after it) are dropped and counted in `dropped`."""
    if not paths:
        raise FlashdraftError("data.train: no training data given (set data.train=[file.jsonl, ...])")
    samples: list[Sample] = []
    dropped = {"no_anchor": 0}
    read_from: dict[int, int] = {}
    for file, source in _files(paths, fingerprint, target):
        for number, raw in text_lines(file):
            if not raw.strip():
                continue
            where = f"{file} line {number}"
            sample = _parse(decode_line(raw, where), where)
            read_from[source] = read_from.get(source, 0) + 1
            if vocab_size is not None and sample.input_ids and max(sample.input_ids) >= vocab_size:
                raise FlashdraftError(
                    f"{where}: token id {max(sample.input_ids)} >= the target vocabulary ({vocab_size})"
                )
            ids, mask = sample.input_ids[:max_length], sample.loss_mask[:max_length]
            if not any(mask[: max(len(ids) - block_size + 1, 0)]):
                dropped["no_anchor"] += 1
                continue
            samples.append(Sample(ids, mask))
    _check_counts(paths, read_from)
    if not samples:
        raise FlashdraftError(
            f"data {paths}: no usable samples ({dropped['no_anchor']} had no supervised token with room for a block)"
        )
    return TokenDataset(samples, dropped)


def _check_counts(paths: list[str], read_from: dict[int, int]) -> None:
    """A shard set must hold as many samples as its manifest says: a shard truncated by a full disk or an
    interrupted copy would otherwise train on part of the data without a word."""
    for source, raw in enumerate(paths):
        manifest = read_manifest(Path(raw)) if Path(raw).is_dir() else None
        expected = None if manifest is None else manifest.get("samples")
        if isinstance(expected, int) and read_from.get(source, 0) != expected:
            raise FlashdraftError(
                f"data {raw}: {read_from.get(source, 0)} samples in its shards but its manifest.json says "
                f"{expected} (incomplete shards); run flashdraft prepare again"
            )


def anchor_seed(seed: int, epoch: int, index: int) -> int:
    """Anchors depend only on (seed, epoch, sample): fresh each epoch, reproducible on resume."""
    return (seed * 1_000_003 + epoch * 7_919 + index * 104_729) % (2**62)


class EpochSampler:
    """Deterministic shuffled order per epoch; its position is part of the training checkpoint."""

    def __init__(self, num_samples: int, batch_size: int, seed: int):
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def next_batch(self) -> tuple[int, list[int]]:
        """(epoch, sample indices); an epoch ends with a possibly smaller batch."""
        if self.position >= self.num_samples:
            self.epoch += 1
            self.position = 0
        order = self._order(self.epoch)
        indices = order[self.position : self.position + self.batch_size]
        self.position += len(indices)
        return self.epoch, indices

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_samples": self.num_samples,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise FlashdraftError(
                f"resume: the checkpoint was made with {state['num_samples']} samples and seed {state['seed']}, "
                f"this run has {self.num_samples} and {self.seed}; start over in a new train.out_dir"
            )
        self.epoch, self.position = state["epoch"], state["position"]


def collate(
    dataset: TokenDataset, epoch: int, indices: list[int], seed: int, pad_multiple: int = 1
) -> TokenBatch:
    """Right-padded batch; the length is rounded up to `pad_multiple` so compiled shapes repeat."""
    samples = [dataset.samples[i] for i in indices]
    longest = max(len(s.input_ids) for s in samples)
    length = -(-longest // pad_multiple) * pad_multiple
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids)
        mask[row, : len(s.loss_mask)] = torch.tensor(s.loss_mask)
    lengths = torch.tensor([len(s.input_ids) for s in samples])
    return TokenBatch(ids, mask, lengths, [anchor_seed(seed, epoch, i) for i in indices])


def iterate_batches(
    dataset: TokenDataset, batch_size: int, seed: int, pad_multiple: int = 1
) -> Iterator[TokenBatch]:
    """Every sample once, in file order (held-out evaluation)."""
    for start in range(0, len(dataset), batch_size):
        yield collate(
            dataset, 0, list(range(start, min(start + batch_size, len(dataset)))), seed, pad_multiple
        )

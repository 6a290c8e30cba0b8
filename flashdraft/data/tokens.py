"""Tokenized training samples ({input_ids, loss_mask}), the deterministic epoch sampler and collation.

Reads shard directories made by `flashdraft prepare` (memory-mapped, docs/shards.md: their manifest is
checked against the target's tokenizer and their file sizes against the manifest), JSONL files (one
sample per line, gzipped or not, read into memory: small data), or directories of them; data whose
tokenizer cannot be verified gets a warning (a shard set against a target without tokenizer files is
refused unless data.allow_unverified_tokenizer). Every malformed line is an error that names the file and
line; nothing is skipped silently (samples that cannot hold one block are counted and reported).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from flashdraft.data.chat import parse_json_object
from flashdraft.data.shards import (
    Shard,
    ShardSet,
    check_manifest,
    damaged_rows,
    in_memory_shard,
    index_file,
    missing_manifest,
    open_shards,
    read_manifest,
    warn,
)
from flashdraft.data.sources import decode_line, text_lines
from flashdraft.errors import FlashdraftError


@dataclass
class TokenBatch:
    input_ids: Tensor  # [b, S] right-padded
    loss_mask: Tensor  # [b, S] 1 on supervised (assistant) tokens
    lengths: Tensor  # [b] real lengths (of a packed row: its samples' lengths added)
    seeds: list[int]  # anchor seeds, one per sample (row by row), derived from (seed, epoch, sample index)
    # Packed rows only (docs/packing.md): each token's position within its own sample, and the lengths of
    # the samples each row holds, in order. None: one sample a row, positions 0..length-1.
    position_ids: Tensor | None = None  # [b, S]
    doc_lengths: list[list[int]] | None = None

    @property
    def packed(self) -> bool:
        return self.doc_lengths is not None

    def to(self, device: torch.device) -> TokenBatch:
        """On CUDA through pinned memory, without waiting: the copy overlaps the GPU's current work."""
        return TokenBatch(
            to_device(self.input_ids, device),
            to_device(self.loss_mask, device),
            to_device(self.lengths, device),
            self.seeds,
            None if self.position_ids is None else to_device(self.position_ids, device),
            self.doc_lengths,
        )


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device`: pinned and non-blocking for CUDA (the caching host allocator keeps the
    pinned buffer alive until the copy has run), a plain move otherwise."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class Sample:
    input_ids: np.ndarray  # [n] uint32, a view of the shard (do not write)
    loss_mask: np.ndarray  # [n] uint8


class TokenDataset:
    """The usable samples (truncated to `max_length`, those without an anchor left out) of a ShardSet.

    Indexing reads one sample from its shard; nothing else is held per sample but its number (8 bytes),
    so 800K samples cost a few MB of host memory whatever their tokens."""

    def __init__(self, shards: ShardSet, keep: np.ndarray, max_length: int, dropped: dict[str, int]):
        self.shards = shards
        self.keep = keep  # [len] sample numbers in the ShardSet, in data order
        self.max_length = max_length
        self.dropped = dropped

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, i: int) -> Sample:
        return Sample(*self.shards.sample(int(self.keep[i]), self.max_length))

    def first(self, count: int) -> TokenDataset:
        """The first `count` usable samples (all when there are fewer); those cut are counted in `dropped`."""
        if count >= len(self):
            return self
        dropped = {**self.dropped, "over_max_samples": len(self) - count}
        return TokenDataset(self.shards, self.keep[:count], self.max_length, dropped)

    def dropped_summary(self) -> str:
        """What was left out, for the run's summary line: short samples and damaged index rows apart."""
        text = f"{self.dropped['no_anchor']} dropped: no anchor"
        damaged = self.dropped.get("damaged", 0)
        over = self.dropped.get("over_max_samples", 0)
        return (
            text
            + (f"; {damaged} damaged index row{'s' if damaged != 1 else ''} left out" if damaged else "")
            + (f"; {over} past data.max_samples left out" if over else "")
        )

    def lengths(self) -> np.ndarray:
        """Every usable sample's length after truncation, from the index files (no token is read)."""
        return np.minimum(self.shards.column(1)[self.keep], self.max_length)


def _sources(
    paths: list[str], fingerprint: dict[str, str] | None, target: str, allow_unverified: bool
) -> Iterator[Path | ShardSet]:
    """Per data path: its opened shard set (manifest checked), or the JSONL files to read into memory."""
    for raw in paths:
        path = Path(raw)
        manifest = read_manifest(path) if path.is_dir() else None
        if manifest is not None:
            _, shards = open_shards(path)  # refuses old JSONL sets before anything else is said
            check_manifest(path, fingerprint, target, allow_unverified)
            yield shards
        elif path.is_dir():
            if (error := missing_manifest(path)) is not None:
                raise error
            found = sorted(
                p for p in path.iterdir() if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz"))
            )
            if not found:
                raise FlashdraftError(f"data {path}: directory holds no .jsonl files")
            warn(f"data {path} has no flashdraft manifest.json")
            yield from found
        elif path.is_file():
            warn(f"data {path} is a file without a flashdraft manifest")
            yield path
        else:
            raise FlashdraftError(f"data {path}: no such file or directory")


def check_shard_sets(paths: list[str]) -> None:
    """Open every shard set among `paths` (cheap: the manifest and file sizes), so an old-format or
    truncated set is refused before the target loads, not after."""
    for raw in paths:
        path = Path(raw)
        if path.is_dir() and read_manifest(path) is not None:
            open_shards(path)
        elif path.is_dir() and (error := missing_manifest(path)) is not None:
            raise error


def parse_sample(line: str, where: str) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one {input_ids, loss_mask} JSON line, checked."""
    record = parse_json_object(line, where)
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < 2**32 for t in ids):
        raise FlashdraftError(f"{where}: 'input_ids' must be a list of non-negative integers")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
        raise FlashdraftError(
            f"{where}: 'loss_mask' must be a list of 0/1 of the same length as input_ids ({len(ids)})"
        )
    return ids, mask


def _read_jsonl(file: Path, vocab_size: int | None) -> Shard:
    """A JSONL file of tokenized samples, read into memory (small data; large data goes through shards)."""
    samples = []
    for number, raw in text_lines(file):
        if not raw.strip():
            continue
        where = f"{file} line {number}"
        ids, mask = parse_sample(decode_line(raw, where), where)
        if vocab_size is not None and ids and max(ids) >= vocab_size:
            raise FlashdraftError(f"{where}: token id {max(ids)} >= the target vocabulary ({vocab_size})")
        samples.append((ids, mask))
    return in_memory_shard(samples, str(file))


def _check_vocabulary(shards: ShardSet, vocab_size: int | None) -> None:
    """Every id inside the target's vocabulary, from each shard's recorded largest id (no token is read)."""
    for shard in shards.shards:
        if vocab_size is not None and shard.max_token_id >= vocab_size:
            raise FlashdraftError(
                f"{shard.where}: token id {shard.max_token_id} >= the target vocabulary ({vocab_size}); "
                "these shards were made for another target"
            )


def load_token_dataset(
    paths: list[str],
    *,
    max_length: int,
    block_size: int,
    vocab_size: int | None = None,
    fingerprint: dict[str, str] | None = None,
    target: str = "the target",
    allow_unverified_tokenizer: bool = True,
) -> TokenDataset:
    """Samples truncated to `max_length`; those without one anchor (a supervised token with a whole block
    after it) are left out and counted in `dropped`. Shard sets are opened lazily (memory maps); plain
    JSONL files are read into memory. `fingerprint` None means the target has no tokenizer to check shard
    manifests against: refused unless `allow_unverified_tokenizer` (train passes data.allow_unverified_tokenizer,
    default false; library callers that check nothing keep the default)."""
    if not paths:
        raise FlashdraftError("data.train: no training data given (set data.train=[file.jsonl, ...])")
    parts: list[Shard] = []
    for source in _sources(paths, fingerprint, target, allow_unverified_tokenizer):
        if isinstance(source, ShardSet):
            _check_vocabulary(source, vocab_size)
            parts.extend(source.shards)
        else:
            parts.append(_read_jsonl(source, vocab_size))
    shards = ShardSet(parts)
    damaged = _damaged(shards)
    # An anchor needs a supervised token p with p + block_size <= the truncated length.
    room = np.minimum(shards.column(1), max_length)
    usable = shards.column(2) + block_size <= room
    usable[damaged] = False
    keep = np.flatnonzero(usable)
    dropped = {"no_anchor": int(len(usable) - len(keep) - len(damaged)), "damaged": len(damaged)}
    if not len(keep):
        raise FlashdraftError(
            f"data {paths}: no usable samples ({dropped['no_anchor']} had no supervised token with room for a "
            f"block, {dropped['damaged']} damaged)"
        )
    return TokenDataset(shards, keep, max_length, dropped)


def _damaged(shards: ShardSet) -> np.ndarray:
    """Global numbers of the samples whose index rows are damaged, each shard's named in a warning: they
    are left out and counted apart from samples without an anchor (which are fine, only short)."""
    found = []
    for number, shard in enumerate(shards.shards):
        rows = damaged_rows(shard)
        if not len(rows):
            continue
        shown = ", ".join(map(str, rows[:5].tolist())) + (
            f" and {len(rows) - 5} more" if len(rows) > 5 else ""
        )
        print(
            f"warning: {index_file(shard)}: damaged index row{'s' if len(rows) > 1 else ''} {shown} "
            "(start, length, first supervised position do not fit the shard); those samples are left out; "
            "run flashdraft prepare again to repair the set",
            file=sys.stderr,
        )
        found.append(rows + shards.starts[number])
    return np.concatenate(found) if found else np.zeros(0, np.int64)


def anchor_seed(seed: int, epoch: int, index: int) -> int:
    """Anchors depend only on (seed, epoch, sample): fresh each epoch, reproducible on resume."""
    return (seed * 1_000_003 + epoch * 7_919 + index * 104_729) % (2**62)


class EpochSampler:
    """Deterministic shuffled order per epoch; its position is part of the training checkpoint.

    The epoch's permutation is computed once and kept (a permutation of 800K samples costs tens of
    milliseconds: once per epoch, not per micro-batch); the order is torch.randperm seeded with
    seed + epoch, unchanged since the first version so old checkpoints resume on the same samples."""

    packed = False  # batch items are samples (flashdraft/data/packing.py: packed rows)

    def __init__(self, num_samples: int, batch_size: int, seed: int):
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order_epoch: int | None = None
        self._order_cache: Tensor | None = None

    def _order(self, epoch: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def order(self, epoch: int) -> Tensor:
        """The epoch's permutation (cached: the sampler only moves forward, one epoch at a time)."""
        if self._order_epoch != epoch:
            self._order_cache, self._order_epoch = self._order(epoch), epoch
        return self._order_cache

    def items(self, epoch: int) -> int:
        """Batch items (samples here, packed rows in flashdraft/data/packing.py) in the epoch."""
        return self.num_samples

    def next_batch(self) -> tuple[int, list[int]]:
        """(epoch, sample indices); an epoch ends with a possibly smaller batch."""
        if self.position >= self.num_samples:
            self.epoch += 1
            self.position = 0
        indices = self.order(self.epoch)[self.position : self.position + self.batch_size].tolist()
        self.position += len(indices)
        return self.epoch, indices

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "packed": self.packed,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("packed", False) != self.packed:
            raise FlashdraftError(
                f"resume: the checkpoint was trained with data.packing={str(state.get('packed', False)).lower()} "
                "(its data position counts packed rows or samples accordingly); resume with that setting or "
                "start over in a new train.out_dir"
            )
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
    samples = [dataset[i] for i in indices]
    lengths = [len(s.input_ids) for s in samples]
    length = -(-max(lengths) // pad_multiple) * pad_multiple
    ids = np.zeros((len(samples), length), dtype=np.int64)
    mask = np.zeros((len(samples), length), dtype=np.int64)
    for row, s in enumerate(samples):  # reads each sample's tokens from its shard (the page cache or disk)
        ids[row, : lengths[row]] = s.input_ids
        mask[row, : lengths[row]] = s.loss_mask
    return TokenBatch(
        torch.from_numpy(ids),
        torch.from_numpy(mask),
        torch.tensor(lengths, dtype=torch.long),
        [anchor_seed(seed, epoch, i) for i in indices],
    )


def collate_packed(
    dataset: TokenDataset, epoch: int, rows: list[list[int]], seed: int, pad_multiple: int = 1
) -> TokenBatch:
    """Packed rows (docs/packing.md): each row's samples back to back, right-padded; positions restart at
    0 with every sample, the padding counts on from 0 as a sequence of its own. A sample gets the same
    anchor seed as unpacked, so the same anchors."""
    samples = [[dataset[i] for i in row] for row in rows]
    doc_lengths = [[len(s.input_ids) for s in row] for row in samples]
    lengths = [sum(row) for row in doc_lengths]
    length = -(-max(lengths) // pad_multiple) * pad_multiple
    ids = np.zeros((len(rows), length), dtype=np.int64)
    mask = np.zeros((len(rows), length), dtype=np.int64)
    positions = np.zeros((len(rows), length), dtype=np.int64)
    for r, row in enumerate(samples):
        start = 0
        for s in row:
            n = len(s.input_ids)
            ids[r, start : start + n] = s.input_ids
            mask[r, start : start + n] = s.loss_mask
            positions[r, start : start + n] = np.arange(n)
            start += n
        positions[r, start:] = np.arange(length - start)
    return TokenBatch(
        torch.from_numpy(ids),
        torch.from_numpy(mask),
        torch.tensor(lengths, dtype=torch.long),
        [anchor_seed(seed, epoch, i) for row in rows for i in row],
        torch.from_numpy(positions),
        doc_lengths,
    )


def iterate_batches(
    dataset: TokenDataset, batch_size: int, seed: int, pad_multiple: int = 1
) -> Iterator[TokenBatch]:
    """Every sample once, in file order (held-out evaluation)."""
    for start in range(0, len(dataset), batch_size):
        yield collate(
            dataset, 0, list(range(start, min(start + batch_size, len(dataset)))), seed, pad_multiple
        )

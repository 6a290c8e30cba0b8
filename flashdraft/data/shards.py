"""Tokenized shards and their manifest: flat, memory-mapped arrays (the format is docs/shards.md).

A shard set is a directory: `manifest.json` plus, per shard `shard-NNNNN`, three little-endian arrays:
`.ids.u32` (token ids, uint32), `.mask.u8` (loss mask, one byte a token) and `.index.i64` ((start,
length, first supervised position) per sample, int64). That is 5 bytes a token plus 24 a sample. The
manifest records the format version, each shard's sample and token counts and its largest token id, the
tokenizer and chat-template hashes, the drop counts and the command that made the set.

Training opens the arrays with `numpy.memmap`: opening reads only the manifest and the small index
files, and a sample's tokens are read from disk when a rank first touches them, so each rank reads only
the samples it trains on. A new shard set is built in a temporary directory beside `<out>` and swapped
in only once complete (durable.atomic_directory): a failed or interrupted `prepare` leaves the previous
set as it was. The regeneration journal (`regenerated.jsonl`) is carried over into the new set, so
reruns stay resumable. Training checks the manifest against the target it is given
(docs/inputs-and-outputs.md). Directories in the JSONL format of earlier versions are refused with the
command that converts them (`flashdraft convert-shards`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flashdraft.durable import atomic_directory, atomic_write_json
from flashdraft.errors import FlashdraftError

MANIFEST = "manifest.json"
JOURNAL = "regenerated.jsonl"
PRODUCER = "flashdraft prepare"
FORMAT = "flashdraft-shards"
FORMAT_VERSION = 2  # version 1 (no `format_version` key) was one JSONL file per shard
IDS_DTYPE = np.dtype("<u4")
MASK_DTYPE = np.dtype("u1")
INDEX_DTYPE = np.dtype("<i8")
INDEX_COLUMNS = 3  # start, length, first supervised position (= length when none)
SUFFIXES = {"ids": ".ids.u32", "mask": ".mask.u8", "index": ".index.i64"}


def shard_files(name: str) -> list[str]:
    """The file names of one shard."""
    return [name + suffix for suffix in SUFFIXES.values()]


def convert_command(directory: Path | str) -> str:
    return f"flashdraft convert-shards {directory} NEW_DIR"


# ---------------------------------------------------------------- writing


class _ShardBuffer:
    """The samples of the shard being built, as arrays ready to write."""

    def __init__(self):
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.rows: list[tuple[int, int, int]] = []
        self.tokens = 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        supervised = np.flatnonzero(mask)
        first = int(supervised[0]) if supervised.size else len(ids)
        self.rows.append((self.tokens, len(ids), first))
        self.ids.append(ids)
        self.masks.append(mask)
        self.tokens += len(ids)

    def write(self, directory: Path, name: str) -> dict[str, int]:
        ids = np.concatenate(self.ids).astype(IDS_DTYPE, copy=False) if self.ids else np.zeros(0, IDS_DTYPE)
        masks = np.concatenate(self.masks).astype(MASK_DTYPE, copy=False)
        index = np.asarray(self.rows, dtype=INDEX_DTYPE).reshape(-1, INDEX_COLUMNS)
        for suffix, array in zip(SUFFIXES.values(), (ids, masks, index), strict=True):
            # plain writes: the whole directory is fsynced before atomic_directory swaps it in
            with (directory / (name + suffix)).open("wb") as handle:
                array.tofile(handle)
        return {
            "name": name,
            "samples": len(self.rows),
            "tokens": self.tokens,
            "supervised_tokens": int(masks.sum(dtype=np.int64)),
            "max_token_id": int(ids.max()) if ids.size else -1,
        }


def _as_arrays(ids: Sequence[int] | np.ndarray, mask: Sequence[int] | np.ndarray, n: int) -> tuple:
    """Checked arrays of one sample (`n`: its number, for the message)."""
    ids_array, mask_array = np.asarray(ids), np.asarray(mask)
    if ids_array.ndim != 1 or (ids_array.size and ids_array.dtype.kind not in "iu"):
        raise ValueError(f"sample {n}: input_ids must be a flat list of integers")
    if ids_array.size and (ids_array.min() < 0 or ids_array.max() > np.iinfo(IDS_DTYPE).max):
        raise ValueError(f"sample {n}: token ids must lie in [0, 2**32)")
    if mask_array.shape != ids_array.shape or (
        mask_array.size
        and (mask_array.dtype.kind not in "iub" or mask_array.min() < 0 or mask_array.max() > 1)
    ):
        raise ValueError(f"sample {n}: loss_mask must be 0/1 of the same length as input_ids")
    return ids_array, mask_array


def write_shards(
    out: Path,
    samples: Iterable[tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray]],
    manifest: dict[str, Any],
    shard_size: int = 10_000,
    journal: Path | None = None,
) -> dict[str, Any]:
    """Build the shard set beside `out`, then replace `out` with it (the caller has checked that `out` is
    absent, empty, a previous shard set, or that the user passed --force). `samples` is consumed once, a
    shard at a time, so a converter can stream millions of samples. The regeneration journal is carried
    over from `journal` (default: `out`'s own). Returns the manifest written."""
    out = Path(out)
    journal = out / JOURNAL if journal is None else Path(journal)
    with atomic_directory(out, replace=True) as tmp:
        shards: list[dict[str, int]] = []
        buffer = _ShardBuffer()
        for n, (ids, mask) in enumerate(samples):
            buffer.add(*_as_arrays(ids, mask, n))
            if len(buffer.rows) == shard_size:
                shards.append(buffer.write(tmp, f"shard-{len(shards):05d}"))
                buffer = _ShardBuffer()
        if buffer.rows:
            shards.append(buffer.write(tmp, f"shard-{len(shards):05d}"))
        if journal.is_file():
            try:  # a hard link costs no space; a copy where links are not supported
                os.link(journal, tmp / JOURNAL)
            except OSError:
                shutil.copyfile(journal, tmp / JOURNAL)
        record = {
            "command": " ".join(sys.argv),
            **manifest,
            "producer": PRODUCER,
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "samples": sum(s["samples"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "supervised_tokens": sum(s["supervised_tokens"] for s in shards),
            "shards": shards,
            "created": time.time(),
        }
        atomic_write_json(tmp / MANIFEST, record)
    return record


# ---------------------------------------------------------------- the manifest


def is_old_format(manifest: dict[str, Any]) -> bool:
    """A manifest of the JSONL shard format (version 1, no `format_version`)."""
    return "format_version" not in manifest


def manifest_files(manifest: dict[str, Any]) -> list[str]:
    """Every file the manifest's shards consist of."""
    if is_old_format(manifest):
        return list(manifest["shards"])
    return [file for shard in manifest["shards"] for file in shard_files(shard["name"])]


def _check_new_shards(path: Path, manifest: dict[str, Any]) -> None:
    version = manifest["format_version"]
    if version != FORMAT_VERSION:
        raise FlashdraftError(
            f"{path}: format_version {version!r}, this flashdraft reads version {FORMAT_VERSION} "
            "(made by another flashdraft version? run flashdraft prepare again)"
        )
    shards = manifest.get("shards")
    keys = ("name", "samples", "tokens", "max_token_id")
    if not isinstance(shards, list) or not all(
        isinstance(s, dict)
        and isinstance(s.get("name"), str)
        and all(isinstance(s.get(k), int) for k in keys[1:])
        for s in shards
    ):
        raise FlashdraftError(
            f"{path}: 'shards' must be a list of {{name, samples, tokens, max_token_id}} objects "
            "(a damaged manifest? run flashdraft prepare again)"
        )
    for shard in shards:
        name = shard["name"]
        missing = [f for f in shard_files(name) if Path(name).name != name or not (path.parent / f).is_file()]
        if missing:
            raise FlashdraftError(
                f"{path}: lists shard {name!r}, but {missing[0]} is not a file in {path.parent} "
                "(an incomplete copy? run flashdraft prepare again)"
            )


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a shard directory (None when it has none); a manifest that is not an object,
    lacks its `shards` list, or lists a shard whose files are not there is an error naming the manifest.
    Manifests of the old JSONL format are returned too (`is_old_format`): `prepare` may replace such a
    directory, and the converter reads it; `open_shards` refuses it."""
    path = directory / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise FlashdraftError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise FlashdraftError(f"{path} line {exc.lineno}: invalid JSON ({exc.msg})") from None
    except RecursionError:
        raise FlashdraftError(f"{path}: JSON nested too deeply to read (a damaged manifest?)") from None
    except OSError as exc:
        raise FlashdraftError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(manifest, dict):
        raise FlashdraftError(f"{path}: expected a JSON object, found {type(manifest).__name__}")
    if not is_old_format(manifest):
        _check_new_shards(path, manifest)
        return manifest
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
        raise FlashdraftError(f"{path}: no 'shards' list of file names (not a flashdraft shard manifest)")
    for name in shards:
        if Path(name).name != name or not (directory / name).is_file():
            raise FlashdraftError(
                f"{path}: lists shard {name!r}, which is not a file in {directory} "
                "(an incomplete copy? run flashdraft prepare again)"
            )
    return manifest


def missing_manifest(directory: Path) -> FlashdraftError | None:
    """The error for a directory that holds shard arrays but no manifest.json (what an interrupted copy
    leaves: the manifest is written last), naming the files found; None when it holds no shard arrays."""
    found = sorted(p.name for p in directory.iterdir() if p.name.endswith(tuple(SUFFIXES.values())))
    if not found:
        return None
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return FlashdraftError(
        f"data {directory}: no {MANIFEST}, but it holds shard files ({shown}); an interrupted copy? copy the "
        f"set again including its {MANIFEST}, or run flashdraft prepare again"
    )


def not_a_shard_dir(directory: Path) -> str | None:
    """None when `directory` is one `prepare` made (a flashdraft manifest, its shards and the journal, or
    only the journal of an interrupted first run) and may be replaced; else why not."""
    try:
        manifest = read_manifest(directory)
    except FlashdraftError as exc:
        return f"its manifest is not flashdraft's ({exc})"
    ours = {JOURNAL}
    if manifest is not None:
        if manifest.get("producer") != PRODUCER and "tokenizer_sha256" not in manifest:
            return "its manifest.json was not written by flashdraft prepare"
        ours |= {MANIFEST, *manifest_files(manifest)}
    elif not (directory / JOURNAL).is_file():
        return "it has no flashdraft manifest.json"
    # a parallel regeneration killed before it folded its workers' journal parts into the journal
    extra = sorted(
        p.name
        for p in directory.iterdir()
        if p.name not in ours and not p.name.startswith(JOURNAL + ".part-")
    )
    if extra:
        shown = ", ".join(extra[:4]) + (" …" if len(extra) > 4 else "")
        return f"holds files flashdraft prepare did not write ({shown})"
    return None


def check_manifest(
    directory: Path, fingerprint: dict[str, str] | None, target: str, allow_unverified: bool = True
) -> None:
    """Shards must come from the target's own tokenizer (and template): else every id means something else.
    A target without tokenizer files (`fingerprint` None) cannot be compared with: refused unless
    `allow_unverified` (data.allow_unverified_tokenizer), then a loud warning; no manifest: a warning."""
    manifest = read_manifest(directory)
    if manifest is None:
        warn(f"{directory} has no flashdraft manifest")
        return
    if fingerprint is None:
        # prepare records its tokenizer's hash; a set without one (written by a benchmark) was never checkable
        if not allow_unverified and "tokenizer_sha256" in manifest:
            raise FlashdraftError(
                f"data {directory}: made with tokenizer {manifest.get('tokenizer_name', '?')!r}, but the target "
                f"{target} ships no tokenizer files to check that against, and ids of another tokenizer mean "
                "other words; copy the target's tokenizer files (tokenizer.json, tokenizer_config.json) into "
                f"{target}, or set data.allow_unverified_tokenizer=true if these shards were made with its tokenizer"
            )
        warn(f"{directory}: no tokenizer files next to {target} to compare its manifest with")
        return
    if manifest.get("tokenizer_sha256") != fingerprint.get("tokenizer_sha256"):
        raise FlashdraftError(
            f"{directory}: these shards were made with another tokenizer ({manifest.get('tokenizer_name', '?')}) than the "
            f"target {target}; run flashdraft prepare again with --target {target}"
        )
    if manifest.get("chat_template_sha256") != fingerprint.get("chat_template_sha256"):
        print(
            f"warning: {directory} was rendered with a different chat template than {target}'s; "
            "acceptance suffers if training and serving render differently",
            file=sys.stderr,
        )


def warn(reason: str) -> None:
    """The tokenizer of some data cannot be verified: only the vocabulary-size check protects it."""
    print(
        f"warning: {reason}: cannot verify its token ids come from the target's tokenizer "
        "(only that every id is inside the target's vocabulary)",
        file=sys.stderr,
    )


# ---------------------------------------------------------------- reading


@dataclass
class Shard:
    """One shard's arrays (memory-mapped from disk, or in memory for data read from JSONL)."""

    ids: np.ndarray  # [tokens] uint32
    mask: np.ndarray  # [tokens] uint8
    index: np.ndarray  # [samples, 3] int64: start, length, first supervised position
    where: str  # for messages: the shard's ids file, or the JSONL file
    max_token_id: int  # -1 when empty


class ShardSet:
    """Samples of several shards addressed by one global number; reads a sample's tokens only when asked."""

    def __init__(self, shards: list[Shard]):
        self.shards = shards
        counts = [len(s.index) for s in shards]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def column(self, k: int) -> np.ndarray:
        """Column `k` of every sample's index row (1: lengths, 2: first supervised positions)."""
        parts = [np.asarray(s.index[:, k]) for s in self.shards]
        return np.concatenate(parts) if parts else np.zeros(0, INDEX_DTYPE)

    def sample(self, number: int, max_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) of sample `number`, truncated to `max_length`; views of the memory map."""
        s = int(np.searchsorted(self.starts, number, side="right")) - 1
        shard = self.shards[s]
        start, length, _ = (int(v) for v in shard.index[number - self.starts[s]])
        if max_length is not None:
            length = min(length, max_length)
        return shard.ids[start : start + length], shard.mask[start : start + length]


def damaged_rows(shard: Shard) -> np.ndarray:
    """Rows of the shard's index that cannot be what `prepare` wrote, in order. Rows tile the ids array:
    row i is [start_i, start_i + length_i) and the next row starts where it ends (the last ends at the
    shard's token count), and 0 <= first supervised position <= length. A damaged length breaks the
    boundary after its row only; a damaged start breaks both boundaries of its row: so one damaged row is
    named as that row, not its neighbours. Reads only the index (24 bytes a sample)."""
    index = np.asarray(shard.index)
    if not len(index):
        return np.zeros(0, np.int64)
    start, length, first = index[:, 0], index[:, 1], index[:, 2]
    tokens = len(shard.ids)
    impossible = (
        (start < 0) | (start > tokens) | (length < 0) | (length > tokens) | (first < 0) | (first > length)
    )
    with np.errstate(over="ignore"):  # garbage values may overflow; such rows are `impossible` already
        ends = start + length
    next_start = np.append(start[1:], tokens)
    right = ends == next_start  # the boundary after each row holds
    left = np.insert(right[:-1], 0, start[0] == 0)  # the boundary before it
    right_after = np.append(right[1:], True)
    damaged = impossible | (~left & ~right) | (~right & left & right_after)
    # a broken boundary neither neighbour explains: both sides are suspect
    unexplained = ~right & ~damaged & ~np.append(damaged[1:], False)
    damaged |= unexplained | np.insert(unexplained[:-1], 0, False)
    return np.flatnonzero(damaged)


def index_file(shard: Shard) -> str:
    """The index file of a shard on disk (its `where` names the ids file), for messages."""
    suffix = SUFFIXES["ids"]
    return shard.where[: -len(suffix)] + SUFFIXES["index"] if shard.where.endswith(suffix) else shard.where


def _map(path: Path, dtype: np.dtype, count: int, shape: tuple[int, ...]) -> np.ndarray:
    expected = count * dtype.itemsize
    size = path.stat().st_size
    if size != expected:
        raise FlashdraftError(
            f"{path}: {size} bytes, its manifest.json says {expected} (a truncated or incomplete copy); "
            "run flashdraft prepare again"
        )
    if expected == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def open_shards(directory: Path) -> tuple[dict[str, Any], ShardSet]:
    """The manifest and lazily opened shards of a shard directory made by `prepare` (old JSONL sets are
    refused with the command that converts them; files whose sizes disagree with the manifest too)."""
    manifest = read_manifest(directory)
    if manifest is None:
        raise missing_manifest(directory) or FlashdraftError(
            f"{directory}: no flashdraft manifest.json (not a shard directory)"
        )
    if is_old_format(manifest):
        raise FlashdraftError(
            f"{directory}: shards in the old JSONL format (manifest.json has no format_version); "
            f"convert them once with: {convert_command(directory)}"
        )
    shards = []
    for entry in manifest["shards"]:
        base = directory / entry["name"]
        ids_path = base.with_name(entry["name"] + SUFFIXES["ids"])
        shards.append(
            Shard(
                ids=_map(ids_path, IDS_DTYPE, entry["tokens"], (entry["tokens"],)),
                mask=_map(
                    base.with_name(entry["name"] + SUFFIXES["mask"]),
                    MASK_DTYPE,
                    entry["tokens"],
                    (entry["tokens"],),
                ),
                index=_map(
                    base.with_name(entry["name"] + SUFFIXES["index"]),
                    INDEX_DTYPE,
                    entry["samples"] * INDEX_COLUMNS,
                    (entry["samples"], INDEX_COLUMNS),
                ),
                where=str(ids_path),
                max_token_id=entry["max_token_id"],
            )
        )
    found = sum(e["samples"] for e in manifest["shards"])
    if isinstance(manifest.get("samples"), int) and found != manifest["samples"]:
        raise FlashdraftError(
            f"data {directory}: {found} samples in its shards but its manifest.json says "
            f"{manifest['samples']} (incomplete shards); run flashdraft prepare again"
        )
    return manifest, ShardSet(shards)


def in_memory_shard(samples: list[tuple[list[int], list[int]]], where: str) -> Shard:
    """A shard held in memory (small data given as JSONL), with the same layout as one on disk."""
    lengths = np.fromiter((len(ids) for ids, _ in samples), dtype=np.int64, count=len(samples))
    starts = np.concatenate([[0], np.cumsum(lengths)])[:-1] if len(samples) else lengths
    ids = np.fromiter((t for s, _ in samples for t in s), dtype=IDS_DTYPE)
    mask = np.fromiter((m for _, s in samples for m in s), dtype=MASK_DTYPE)
    first = np.array([next((i for i, m in enumerate(s) if m), len(s)) for _, s in samples], dtype=np.int64)
    index = np.stack([starts, lengths, first], axis=1) if len(samples) else np.zeros((0, 3), INDEX_DTYPE)
    return Shard(ids, mask, index.astype(INDEX_DTYPE), where, int(ids.max()) if ids.size else -1)

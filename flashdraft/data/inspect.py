"""`flashdraft inspect SHARDS [--decode N] [--target DIR]`: what a shard set holds, and what it trains on.

Prints the manifest's summary (samples, tokens, supervised fraction, drop counts, tokenizer, rendering
and regeneration settings, bytes a token on disk) and decodes the first N samples with the target's
tokenizer, the supervised spans (loss mask 1) between ⟦ and ⟧. Reads only the manifest and the N samples
asked for (docs/shards.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from flashdraft.data.shards import manifest_files, open_shards
from flashdraft.errors import FlashdraftError

OPEN, CLOSE = "⟦", "⟧"


def spans(ids: np.ndarray, mask: np.ndarray) -> list[tuple[bool, list[int]]]:
    """Runs of consecutive tokens with the same mask value: (supervised, ids)."""
    runs: list[tuple[bool, list[int]]] = []
    for token, supervised in zip(ids.tolist(), mask.tolist(), strict=True):
        if runs and runs[-1][0] == bool(supervised):
            runs[-1][1].append(token)
        else:
            runs.append((bool(supervised), [token]))
    return runs


def marked_text(ids: np.ndarray, mask: np.ndarray, decode: Callable[[list[int]], str]) -> str:
    """The sample's text with each supervised span wrapped in ⟦ ⟧."""
    return "".join(f"{OPEN}{decode(run)}{CLOSE}" if sup else decode(run) for sup, run in spans(ids, mask))


def summary(directory: Path, manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows describing the set."""
    tokens = int(manifest.get("tokens") or 0)
    supervised = int(manifest.get("supervised_tokens") or 0)
    on_disk = sum((directory / f).stat().st_size for f in manifest_files(manifest))
    regeneration = manifest.get("regeneration")
    rows = [
        ("directory", str(directory)),
        ("format", f"{manifest.get('format')} version {manifest.get('format_version')}"),
        ("shards", str(len(manifest["shards"]))),
        ("samples", f"{int(manifest.get('samples') or 0):,}"),
        ("tokens", f"{tokens:,}"),
        ("supervised tokens", f"{supervised:,} ({supervised / max(tokens, 1):.1%})"),
        ("bytes per token on disk", f"{on_disk / max(tokens, 1):.2f} ({on_disk / 2**20:,.1f} MiB)"),
    ]
    for reason, count in sorted((manifest.get("dropped") or {}).items()):
        rows.append((f"dropped: {reason}", f"{count:,}"))
    rows += [
        ("tokenizer", str(manifest.get("tokenizer_name", "?"))),
        ("tokenizer sha256", str(manifest.get("tokenizer_sha256", "?"))[:16]),
        ("target", str(manifest.get("target", "?"))),
        ("thinking", str(manifest.get("thinking"))),
        ("max length", str(manifest.get("max_length", "?"))),
        ("regenerated", json.dumps(regeneration, sort_keys=True) if regeneration else "no"),
        ("command", str(manifest.get("command", "?"))),
    ]
    if manifest.get("converted_from"):
        rows.append(("converted from", str(manifest["converted_from"])))
    return rows


def _tokenizer(manifest: dict[str, Any], target: str | None, directory: Path):
    from flashdraft.data.render import tokenizer_fingerprint
    from flashdraft.model.target import load_target_tokenizer

    source = target or manifest.get("target")
    flag = "--target" if target else f"the manifest's target ({source})"
    if not source or not Path(source).is_dir():
        raise FlashdraftError(
            f"--decode: {flag} is not a model directory here; pass --target DIR (the target these shards were made for)"
        )
    tokenizer = load_target_tokenizer(source)
    if tokenizer is None:
        raise FlashdraftError(
            f"--decode: {flag} ships no tokenizer files; pass --target DIR with its tokenizer"
        )
    if tokenizer_fingerprint(tokenizer)["tokenizer_sha256"] != manifest.get("tokenizer_sha256"):
        raise FlashdraftError(
            f"--target {source}: its tokenizer is not the one {directory} was made with "
            f"({manifest.get('tokenizer_name', '?')}); the decoded text would be wrong"
        )
    return tokenizer


def inspect_shards(directory: str | Path, decode: int = 0, target: str | None = None) -> str:
    """The report `flashdraft inspect` prints."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FlashdraftError(
            f"SHARDS {directory}: not a directory (give a shard directory made by flashdraft prepare)"
        )
    manifest, shards = open_shards(directory)
    width = max(len(label) for label, _ in summary(directory, manifest))
    lines = [f"{label:<{width}}  {value}" for label, value in summary(directory, manifest)]
    if decode:
        tokenizer = _tokenizer(manifest, target, directory)

        def text(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=False)

        for number in range(min(decode, len(shards))):
            ids, mask = shards.sample(number)
            lines += [
                "",
                f"── sample {number} ({len(ids)} tokens, {int(mask.sum())} supervised, {OPEN}supervised{CLOSE})",
            ]
            lines.append(marked_text(np.asarray(ids), np.asarray(mask), text))
    return "\n".join(lines)

"""`flashdraft convert-shards OLD NEW`: a shard set of the old JSONL format -> the memory-mapped format.

Streams the old shards a sample at a time (never all in memory), checks every line as the loader did,
and writes NEW with the same writer `prepare` uses (built beside NEW and swapped in complete). The old
manifest's fields (tokenizer hashes, drop counts, regeneration settings) are kept, so the new set passes
the same tokenizer checks; OLD is left as it was. See docs/shards.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flashdraft.data.shards import JOURNAL, is_old_format, not_a_shard_dir, read_manifest, write_shards
from flashdraft.data.sources import decode_line, text_lines
from flashdraft.data.tokens import parse_sample
from flashdraft.durable import disk_full_reason
from flashdraft.errors import FlashdraftError
from flashdraft.outputs import check_output_dir

# Written by the new writer itself, or describing the old files: not carried over.
_NOT_CARRIED = {"shards", "producer", "format", "format_version", "created", "samples", "tokens"}


def convert_shards(old: str | Path, new: str | Path, *, force: bool = False) -> dict[str, Any]:
    """Convert the old-format set `old` into `new`; returns the new manifest."""
    old, new = Path(old), Path(new)
    manifest = read_manifest(old) if old.is_dir() else None
    if manifest is None:
        raise FlashdraftError(f"OLD {old}: not a shard directory (no manifest.json)")
    if not is_old_format(manifest):
        raise FlashdraftError(
            f"OLD {old}: already in the current format (format_version {manifest['format_version']})"
        )
    check_output_dir(new, "NEW", force=force, inputs={"OLD": old}, ours=not_a_shard_dir)

    def samples() -> Iterator[tuple[list[int], list[int]]]:
        for name in manifest["shards"]:
            for number, raw in text_lines(old / name):
                if raw.strip():
                    where = f"{old / name} line {number}"
                    yield parse_sample(decode_line(raw, where), where)

    carried = {k: v for k, v in manifest.items() if k not in _NOT_CARRIED}
    carried["converted_from"] = str(old)
    try:
        written = write_shards(new, _checked_count(samples(), manifest, old), carried, journal=old / JOURNAL)
    except OSError as exc:
        reason = disk_full_reason(exc, new) or exc.strerror or str(exc)
        raise FlashdraftError(
            f"NEW {new}: writing the shards failed: {reason}; nothing was replaced"
        ) from None
    return written


def _checked_count(samples: Iterator, manifest: dict[str, Any], old: Path) -> Iterator:
    """Pass the samples through; at the end, their number must be what the old manifest says (a
    truncated old shard must not become a complete-looking new set)."""
    count = 0
    for sample in samples:
        count += 1
        yield sample
    expected = manifest.get("samples")
    if isinstance(expected, int) and count != expected:
        raise FlashdraftError(
            f"OLD {old}: {count} samples in its shards but its manifest.json says {expected} "
            "(incomplete shards); nothing was written"
        )

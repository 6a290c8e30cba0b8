"""Tokenized shards and their manifest.

`<out>/shard-00000.jsonl …` hold {input_ids, loss_mask} lines; `<out>/manifest.json` records the
tokenizer and chat-template hashes, counts, token totals, sampling settings and the command that made
them. Every file is written under a temporary name and renamed, the manifest last: a directory with a
manifest is complete. Training checks the manifest against the target it is given.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from flashdraft.errors import FlashdraftError

MANIFEST = "manifest.json"


def write_shards(
    out: Path, samples: list[tuple[list[int], list[int]]], manifest: dict[str, Any], shard_size: int = 10_000
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # the directory is incomplete until the new manifest lands
    for old in out.glob("shard-*.jsonl"):
        old.unlink()
    names = []
    for n, start in enumerate(range(0, len(samples), shard_size)):
        name = f"shard-{n:05d}.jsonl"
        tmp = out / f".{name}.tmp"
        with tmp.open("w") as handle:
            for ids, mask in samples[start : start + shard_size]:
                handle.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, out / name)
        names.append(name)
    manifest = {"command": " ".join(sys.argv), **manifest, "shards": names, "created": time.time()}
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise FlashdraftError(f"{path} line {exc.lineno}: invalid JSON ({exc.msg})") from None


def check_manifest(directory: Path, fingerprint: dict[str, str], target: str) -> None:
    """Shards must come from the target's own tokenizer (and template): else every id means something else."""
    manifest = read_manifest(directory)
    if manifest is None:
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

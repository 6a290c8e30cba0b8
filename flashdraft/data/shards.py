"""Tokenized shards and their manifest.

`<out>/shard-00000.jsonl …` hold {input_ids, loss_mask} lines; `<out>/manifest.json` records the
tokenizer and chat-template hashes, counts, token totals, sampling settings and the command that made
them. A new shard set is built in a temporary directory beside `<out>` and swapped in only once complete
(durable.atomic_directory): a failed or interrupted `prepare` leaves the previous set as it was. The
regeneration journal (`regenerated.jsonl`) is carried over into the new set, so reruns stay resumable.
Training checks the manifest against the target it is given (docs/inputs-and-outputs.md).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from flashdraft.durable import atomic_directory, atomic_write_json
from flashdraft.errors import FlashdraftError

MANIFEST = "manifest.json"
JOURNAL = "regenerated.jsonl"
PRODUCER = "flashdraft prepare"


def write_shards(
    out: Path, samples: list[tuple[list[int], list[int]]], manifest: dict[str, Any], shard_size: int = 10_000
) -> None:
    """Build the shard set beside `out`, then replace `out` with it (the caller has checked that `out` is
    absent, empty, a previous shard set, or that the user passed --force)."""
    with atomic_directory(out, replace=True) as tmp:
        names = []
        for n, start in enumerate(range(0, len(samples), shard_size)):
            name = f"shard-{n:05d}.jsonl"
            with (tmp / name).open("w") as handle:  # the whole directory is fsynced before the swap
                for ids, mask in samples[start : start + shard_size]:
                    handle.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
            names.append(name)
        journal = out / JOURNAL
        if journal.is_file():
            try:  # a hard link costs no space; a copy where links are not supported
                os.link(journal, tmp / JOURNAL)
            except OSError:
                shutil.copyfile(journal, tmp / JOURNAL)
        record = {"command": " ".join(sys.argv), **manifest, "producer": PRODUCER, "shards": names}
        atomic_write_json(tmp / MANIFEST, {**record, "created": time.time()})


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a shard directory (None when it has none); a manifest that is not an object,
    lacks its `shards` list, or lists a shard that is not there is an error naming the manifest."""
    path = directory / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise FlashdraftError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise FlashdraftError(f"{path} line {exc.lineno}: invalid JSON ({exc.msg})") from None
    except OSError as exc:
        raise FlashdraftError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(manifest, dict):
        raise FlashdraftError(f"{path}: expected a JSON object, found {type(manifest).__name__}")
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
        ours |= {MANIFEST, *manifest["shards"]}
    elif not (directory / JOURNAL).is_file():
        return "it has no flashdraft manifest.json"
    extra = sorted(p.name for p in directory.iterdir() if p.name not in ours)
    if extra:
        shown = ", ".join(extra[:4]) + (" …" if len(extra) > 4 else "")
        return f"holds files flashdraft prepare did not write ({shown})"
    return None


def check_manifest(directory: Path, fingerprint: dict[str, str] | None, target: str) -> None:
    """Shards must come from the target's own tokenizer (and template): else every id means something else.
    When that cannot be verified (no manifest, or a target without tokenizer files) say so, loudly."""
    manifest = read_manifest(directory)
    if manifest is None:
        warn(f"{directory} has no flashdraft manifest")
        return
    if fingerprint is None:
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

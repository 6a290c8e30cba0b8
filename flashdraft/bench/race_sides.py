"""The race one side per call (`bench quality --against specforge --race-side S --race-with EARLIER.json`).

Two 15-minute budgets, with the regeneration, compiles and decodes around them, outlast one lent device
session (30 minutes of device time). So a race may run its sides apart: one call trains and decodes one
side and writes its result; a later call, on the same prepared shards (`--reuse-data`, the shards carried
over), trains the other side and merges the earlier side's record into a whole race. What makes the two
halves one race is checked before any work (docs/quality-benchmark.md, "The race"): the same race settings,
the same shards byte for byte, and, once it exists, the same initial drafter.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from flashdraft.bench.provenance import machine_name
from flashdraft.errors import FlashdraftError

RACE_SIDES = ("flashdraft", "specforge")
# the flags both sides of one race must share: the budget, the drafter, the data and the evaluation
SHARED_FLAGS = (
    "target_name",
    "gpu_minutes",
    "curve_points",
    "drafter_layers",
    "block_size",
    "mask_token_id",
    "lr",
    "num_anchors",
    "max_length",
    "batch_size",
    "seed",
    "eval_every",
    "max_new_tokens",
    "select_prompts",
    "race_arch",
)
# a shared flag's value in results written before the flag existed
SHARED_FLAG_BEFORE = {"race_arch": "dflash"}


def sides_to_run(side: str) -> tuple[str, ...]:
    """The sides a call trains: `--race-side both` (the default) trains both."""
    return RACE_SIDES if side == "both" else (side,)


def other_side(side: str) -> str:
    """The side an earlier call trained, for a call that trains `side`."""
    return next(other for other in RACE_SIDES if other != side)


def race_inputs(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """What both sides of one race share: SHARED_FLAGS and the sha256 of the prepared shards' manifests
    (each names its shards' sizes and the time they were made, so equal manifests mean the same
    preparation). The initial drafter's sha256 is added once it is written."""
    flags = {**vars(args), "target_name": Path(args.target).name}
    data = {
        split: hashlib.sha256((work / "data" / split / "manifest.json").read_bytes()).hexdigest()
        for split in ("train", "eval")
    }
    select = work / "prompts" / "select.jsonl"  # both sides' checkpoints are chosen on the same prompts
    if flags.get("select_prompts") and select.is_file():
        data["select_prompts"] = hashlib.sha256(select.read_bytes()).hexdigest()
    return {
        "settings": {flag: flags[flag] for flag in SHARED_FLAGS},
        "data_manifest_sha256": data,
        # equal GPU-minutes are equal budgets only on the same kind of GPU
        "device": machine_name(),
    }


def earlier_side(path: Path, wanted_side: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The record of `wanted_side` from an earlier `--race-side` result at `path`, checked to be complete
    and from the same race (`inputs`, without the initial drafter: `check_initial_drafter` checks that)."""
    where = f"--race-with {path}"
    try:
        earlier = json.loads(path.read_bytes())
    except OSError as exc:
        raise FlashdraftError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise FlashdraftError(f"{where}: not a JSON result: {exc}") from None
    if not isinstance(earlier, dict) or not isinstance(earlier.get("race_inputs"), dict):
        raise FlashdraftError(f"{where}: not the result of a bench quality --against run (no race_inputs)")
    record = (earlier.get("variants") or {}).get(wanted_side)
    if not record:
        raise FlashdraftError(f"{where}: holds no {wanted_side} side (its --race-side trained another)")
    if not record.get("complete") or not record.get("final"):
        raise FlashdraftError(f"{where}: its {wanted_side} side did not finish (complete is false)")
    theirs = earlier["race_inputs"]
    their_settings, their_data = theirs.get("settings", {}), theirs.get("data_manifest_sha256", {})
    their_device = theirs.get("device") or earlier.get("device")
    if their_device != inputs["device"]:
        raise FlashdraftError(
            f"{where}: its {wanted_side} side trained on {their_device}, this call runs on {inputs['device']}: "
            "the same GPU-minutes on another kind of GPU are another budget; train both sides on one kind"
        )
    for flag, value in inputs["settings"].items():
        theirs_value = their_settings.get(flag, SHARED_FLAG_BEFORE.get(flag))
        if theirs_value != value:
            raise FlashdraftError(
                f"{where}: another race: --{flag.replace('_', '-')} was {theirs_value!r} "
                f"there, {value!r} here"
            )
    for split, digest in inputs["data_manifest_sha256"].items():
        if split == "select_prompts" and their_data.get(split) != digest:
            raise FlashdraftError(
                f"{where}: another race: its selection prompts are not these (WORK/prompts/select.jsonl "
                "differs; carry WORK/prompts of the earlier side too)"
            )
        if their_data.get(split) != digest:
            raise FlashdraftError(
                f"{where}: another race: its {split} shards are not these (WORK/data/{split}/manifest.json "
                "differs; carry the shards the earlier side trained on and give --reuse-data)"
            )
    return {
        "record": record,
        "initial_drafter_sha256": theirs.get("initial_drafter_sha256"),
        "from": {
            "path": str(path),
            **{k: earlier.get(k) for k in ("device", "git_commit", "date", "command")},
        },
    }


def check_initial_drafter(earlier: dict[str, Any], digest: str, path: Path) -> None:
    """Both sides started from the same weights, or the halves are not one race."""
    if earlier["initial_drafter_sha256"] != digest:
        raise FlashdraftError(
            f"--race-with {path}: another race: its initial drafter's weights (sha256 "
            f"{earlier['initial_drafter_sha256']}) are not this one's ({digest}); --seed and the drafter's "
            "shape make it"
        )

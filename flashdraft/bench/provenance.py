"""Where a benchmark result comes from, kept inside the result: command, machine, software, commit, date."""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from flashdraft.durable import atomic_write_json
from flashdraft.provenance import git_commit, python_bytecode


def machine_name() -> str:
    """The GPU's name, or the CPU's architecture without one: what a timing was measured on."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()})"


def provenance(benchmark: str, argv: list[str] | None) -> dict[str, Any]:
    """`benchmark` is the subcommand ('train', 'eval', 'regen'); `argv` its arguments as given."""
    return {
        "benchmark": f"flashdraft bench {benchmark}",
        "command": " ".join(["flashdraft", "bench", benchmark, *(argv or [])]),
        "device": machine_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(Path(__file__).parent),  # flashdraft's commit, whatever the cwd
        "date": time.strftime("%Y-%m-%d"),
        "python_bytecode": python_bytecode(),  # start-up times depend on it (docs/shards.md)
    }


def write_result(out: str | Path | None, result: dict[str, Any]) -> None:
    """A benchmark's result JSON at `out` (indented, replaced atomically); nothing when `out` is None."""
    if out:
        atomic_write_json(out, result, indent=2)

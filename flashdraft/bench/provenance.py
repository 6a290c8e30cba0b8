"""Where a benchmark result comes from, kept inside the result: command, machine, software, commit, date."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from typing import Any

import torch
import transformers


def git_commit() -> str | None:
    """FLASHDRAFT_GIT_COMMIT when set (the device machine's copy of the tree has no .git), else HEAD."""
    if os.environ.get("FLASHDRAFT_GIT_COMMIT"):
        return os.environ["FLASHDRAFT_GIT_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() or None


def provenance(benchmark: str, argv: list[str] | None) -> dict[str, Any]:
    """`benchmark` is the subcommand ('train', 'eval', 'regen'); `argv` its arguments as given."""
    return {
        "benchmark": f"flashdraft bench {benchmark}",
        "command": " ".join(["flashdraft", "bench", benchmark, *(argv or [])]),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"),
    }

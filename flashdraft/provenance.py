"""The git commit a run or a result comes from (no torch import: `launch` stays light)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

COMMIT_ENV = "FLASHDRAFT_GIT_COMMIT"


def git_commit(cwd: str | Path | None = None) -> str | None:
    """$FLASHDRAFT_GIT_COMMIT when set (a copy of the tree without .git, e.g. on a lent GPU machine), else
    the HEAD of the repository around `cwd`, else None."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--verify", "-q", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() or None

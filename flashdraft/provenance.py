"""Where a run or a result comes from: its git commit, and whether this Python caches its bytecode (no
torch import: `launch` stays light)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
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


def python_bytecode() -> dict[str, object]:
    """Whether this interpreter finds cached bytecode for torch (where it looks: `__pycache__` beside the
    source, or under $PYTHONPYCACHEPREFIX), and whether it may write it. Without it every process compiles
    each Python file it imports: on the lent H200 host, whose image ships no bytecode and sets
    PYTHONDONTWRITEBYTECODE, that was 15 s of `flashdraft train`'s 34 s to its first step
    (docs/shards.md, "The first step")."""
    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec is not None else None
    cached = bool(origin) and os.path.exists(importlib.util.cache_from_source(origin))
    return {
        "torch_cached": cached,
        "writes_bytecode": not sys.dont_write_bytecode,
        "pycache_prefix": sys.pycache_prefix,
    }

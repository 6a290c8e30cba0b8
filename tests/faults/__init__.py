"""Fault injection, on the test side only: flashdraft itself carries no hooks.

A process started with `fault_env(spec)` in its environment imports this folder's sitecustomize.py, which
installs the fault `spec` (flashdraft_test_faults.py lists them) by wrapping flashdraft functions."""

from __future__ import annotations

import os
from pathlib import Path

FAULTS_DIR = Path(__file__).parent


def fault_env(spec: str) -> dict[str, str]:
    """The environment variables that inject fault `spec` into every Python process started with them."""
    path = os.pathsep.join(p for p in (str(FAULTS_DIR), os.environ.get("PYTHONPATH")) if p)
    return {"FLASHDRAFT_TEST_FAULT": spec, "PYTHONPATH": path}

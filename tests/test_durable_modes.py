"""A directory written through `atomic_directory` gets the umask's read bits on every file, even files a
writer made through its own private temporary (safetensors' save_file leaves them 0600)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashdraft.durable import atomic_directory


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_safetensors_files_come_out_readable_like_the_rest(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        with atomic_directory(tmp_path / "model") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
            (tmp / "config.json").write_text("{}")
            (tmp / "run.sh").write_text("#!/bin/sh\n")
            (tmp / "run.sh").chmod(0o700)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "model" / "model.safetensors") == 0o644
    assert _mode(tmp_path / "model" / "config.json") == 0o644
    assert _mode(tmp_path / "model" / "run.sh") == 0o744  # read bits added, nothing else changed


def test_a_strict_umask_is_respected(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        with atomic_directory(tmp_path / "model") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
    finally:
        os.umask(old)
    assert _mode(tmp_path / "model" / "model.safetensors") == 0o600

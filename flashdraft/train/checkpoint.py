"""Training checkpoints: the drafter in the export format plus everything `resume` needs.

`<out_dir>/checkpoints/step-00000100/` holds `drafter/` (config.json + model.safetensors in the weights'
dtype) and `trainer_state.pt` (optimizer, with the fp32 master weights when the drafter trains in bf16;
scheduler, sampler position, RNG states, step). It is
written under a temporary name and renamed into place, so a crash at any moment leaves either the
previous checkpoints or a complete new one; keep the last K.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashdraft.errors import FlashdraftError
from flashdraft.model.checkpoint import save_drafter
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.run_protocol import FAULT_ENV

_STEP_DIR = re.compile(r"^step-(\d{8})$")
STATE_NAME = "trainer_state.pt"


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_NAME).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    drafter: DFlashDraftModel,
    trainer_state: dict[str, Any],
    keep_last: int,
) -> Path:
    root = checkpoint_root(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        # In the weights' own dtype: with bf16 weights the fp32 masters are in the optimizer state, and an
        # fp32 copy of bf16 values would only add 2 bytes per parameter to every write.
        save_drafter(drafter, tmp / "drafter", dtype=next(drafter.parameters()).dtype)
        if os.environ.get(FAULT_ENV) == f"diskfull@{step}":  # the supervision tests' simulated full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        torch.save({**trainer_state, "rng": rng_state()}, tmp / STATE_NAME)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FlashdraftError(f"checkpoint step {step}: cannot write {root}: {exc.strerror or exc}") from exc
    for old in list_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_resume(resume: str, out_dir: str | Path) -> Path | None:
    """'auto': the latest complete checkpoint in out_dir, if any; 'never': none; else a checkpoint path.

    'never' into an out_dir that holds another run's checkpoints is an error: the two runs' step
    directories would interleave, and a later `resume=auto` could pick the older run's latest step."""
    if resume == "never":
        found = list_checkpoints(out_dir)
        if found:
            raise FlashdraftError(
                f"train.resume=never, but train.out_dir={out_dir} already holds checkpoints of a run "
                f"({found[0].name} .. {found[-1].name}); continue it with train.resume=auto, or start over in "
                f"another train.out_dir (or delete {checkpoint_root(out_dir)})"
            )
        return None
    if resume == "auto":
        found = list_checkpoints(out_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_NAME).is_file():
        raise FlashdraftError(f"train.resume={resume}: not a checkpoint directory (no {STATE_NAME})")
    return path


def load_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / STATE_NAME, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as exc:
        raise FlashdraftError(f"checkpoint {path}: cannot read {STATE_NAME} ({exc})") from None

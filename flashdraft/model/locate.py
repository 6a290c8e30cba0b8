"""Where a drafter is: a drafter directory itself, or a training run's output directory, whose `best/`
(the checkpoint with the best held-out evaluation, by train.best_by) or else newest
`checkpoints/step-N/drafter/` holds one.

Imports nothing heavy, so that `flashdraft export RUN` and `eval --drafter RUN` answer a wrong path at
once. The names follow flashdraft/model/drafter_dir.py (config.json + model.safetensors) and
flashdraft/train/checkpoint.py (checkpoints/step-%08d/drafter), which import torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from flashdraft.errors import FlashdraftError

DRAFTER_CONFIG = "config.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


# train.best_by -> what best/ is best by, in words
_BEST_BY = {"simulated_tau": "simulated τ", "real_tau": "real τ", "loss": "held-out loss"}


def _best_by(run: Path) -> str:
    """What the run's best/ was chosen by, from its config.yaml (simulated τ when it does not say)."""
    import yaml

    try:
        chosen = yaml.safe_load((run / "config.yaml").read_text())["train"]["best_by"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        chosen = "simulated_tau"
    return _BEST_BY.get(chosen, _BEST_BY["simulated_tau"])


def _is_drafter(path: Path) -> bool:
    return (path / DRAFTER_CONFIG).is_file()


def newest_checkpoint_drafter(run: Path) -> Path | None:
    root = run / "checkpoints"
    if not root.is_dir():
        return None
    steps = sorted(
        (int(m.group(1)), p / "drafter")
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and _is_drafter(p / "drafter")
    )
    return steps[-1][1] if steps else None


def find_drafter(path: str | Path, label: str = "drafter") -> tuple[Path, str | None]:
    """(drafter directory, why it was chosen: None when `path` is one itself). A run directory gives
    its `best/`, else its newest checkpoint's `drafter/`; anything else is an error saying what to give."""
    path = Path(path)
    if not path.exists():
        raise FlashdraftError(f"{label} {path}: no such directory")
    if _is_drafter(path):
        return path, None
    if _is_drafter(path / "best"):
        return path / "best", f"the run's best checkpoint by {_best_by(path)} ({path / 'best'})"
    newest = newest_checkpoint_drafter(path)
    if newest is not None:
        return newest, f"the run's newest checkpoint ({newest}; it has no best/: no held-out evaluation ran)"
    raise FlashdraftError(
        f"{label} {path}: no {DRAFTER_CONFIG} (not a drafter directory) and no best/ or "
        "checkpoints/step-N/drafter/ in it (not a training run's directory)"
    )

"""Device names as users write them (`auto`, `cpu`, `cuda`, `cuda:N`), resolved in one place for every
command: `train.device`, `eval --device`, `prepare --device` (one device, or one per worker)."""

from __future__ import annotations

import torch

from flashdraft.errors import FlashdraftError


def _named(setting: str, name: str) -> str:
    """How an error names the setting: `--device cuda` for a flag, `train.device=cuda` for a config key."""
    return f"{setting} {name}" if setting.startswith("-") else f"{setting}={name}"


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str, setting: str = "--device") -> torch.device:
    """auto (a GPU when there is one), cpu, cuda or cuda:N; anything else, a missing GPU or a GPU index past
    the visible ones is a one-line error naming `setting` (a flag such as `--device`, or a config key)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = _named(setting, name)
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise FlashdraftError(f"{where}: not a device (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        count = _gpu_count()
        if device.index is not None and device.index >= count:
            raise FlashdraftError(f"{where}: this machine has {count} visible CUDA GPU(s)")
        if not count:
            raise FlashdraftError(f"{where}: no CUDA GPU is visible (CUDA_VISIBLE_DEVICES, driver?)")
    elif device.type != "cpu":
        raise FlashdraftError(f"{where}: flashdraft runs on cpu or cuda")
    return device


def resolve_devices(name: str, workers: int, setting: str = "--device") -> list[str]:
    """One device per worker (regeneration): `auto` is every local GPU (else the CPU), `cuda` every GPU,
    `cuda:N` that one, `cpu` the CPU `workers` times (--workers is for the CPU; on GPUs one worker runs per
    GPU)."""
    if name == "cpu":
        return ["cpu"] * workers
    if workers != 1:
        raise FlashdraftError(
            f"--workers {workers}: only with {setting} cpu (on GPUs one worker runs per GPU)"
        )
    if name == "auto":
        return [f"cuda:{i}" for i in range(_gpu_count())] or ["cpu"]
    if name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise FlashdraftError(f"{_named(setting, repr(name))}: expected auto, cpu, cuda or cuda:N")
    device = resolve_device(name, setting)
    return [f"cuda:{i}" for i in range(_gpu_count())] if device.index is None else [str(device)]

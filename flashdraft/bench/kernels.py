"""Where device time goes, from a torch.profiler run: the kernels on a GPU (aten operators on the CPU) with
the most self time, per repeat. Shared by `bench regen --step-time --profile` and `bench train --kernels`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def _self_us(event, on_gpu: bool) -> float:
    if on_gpu:  # the device's own time (named cuda_* in older releases)
        return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))
    return event.self_cpu_time_total


def profile_kernels(
    run: Callable[[], object], repeats: int, device: torch.device
) -> tuple[list[dict], float]:
    """`run()` `repeats` times under torch.profiler: every kernel on `device` (aten operators on the CPU),
    each with its calls and microseconds per repeat and its share of all recorded self time, largest first;
    and that total in microseconds per repeat (set against a step's wall time, the rest is the device idle)."""
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            run()
        if on_gpu:
            torch.cuda.synchronize(device)
    # On a GPU the device's own rows alone: a CPU operator (aten::mm) or a compiled kernel's launcher reports
    # the device time of the kernels it launched too, and counted beside them it doubled the total.
    events = [
        e
        for e in prof.key_averages()
        if _self_us(e, on_gpu) > 0 and (not on_gpu or getattr(e, "device_type", None) == DeviceType.CUDA)
    ]
    total = sum(_self_us(e, on_gpu) for e in events) or 1.0
    rows = [
        {
            "name": e.key[:120],
            "calls_per_step": round(e.count / repeats, 2),
            "us_per_step": round(_self_us(e, on_gpu) / repeats, 1),
            "share": round(_self_us(e, on_gpu) / total, 4),
        }
        for e in sorted(events, key=lambda e: _self_us(e, on_gpu), reverse=True)
    ]
    return rows, total / repeats


def top_kernels(run: Callable[[], object], repeats: int, device: torch.device, count: int = 12) -> list[dict]:
    """The `count` kernels of `profile_kernels` with the most self time, largest first."""
    return profile_kernels(run, repeats, device)[0][:count]

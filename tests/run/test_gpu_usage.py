"""NVML readout on a GPU machine (marker `gpu`; needs the `gpu` extra, nvidia-ml-py)."""

import pytest
import torch

from flashdraft.run.monitor import gpu_usage


@pytest.mark.gpu
def test_nvml_reports_every_visible_gpu():
    import pynvml  # noqa: F401  (the gpu extra; its absence is a failure here, not a skip)

    gpus = gpu_usage()
    assert len(gpus) >= torch.cuda.device_count() >= 1
    for gpu in gpus:
        assert gpu["memory_total_GiB"] > 1 and 0 <= gpu["util_percent"] <= 100
        assert 0 <= gpu["memory_used_GiB"] <= gpu["memory_total_GiB"]

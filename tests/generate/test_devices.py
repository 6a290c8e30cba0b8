"""One device resolver (flashdraft/devices.py) for train.device, eval --device and prepare --device."""

from __future__ import annotations

import pytest
import torch

from flashdraft.devices import resolve_device, resolve_devices
from flashdraft.distributed.topology import resolve_device as train_device
from flashdraft.errors import FlashdraftError


def test_auto_and_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_devices("cpu", 2) == ["cpu", "cpu"]


@pytest.mark.parametrize(
    ("name", "message"),
    [("gpu0", "--device gpu0: not a device"), ("meta", "--device meta: flashdraft runs on cpu or cuda")],
)
def test_bad_names_are_one_line_errors(name, message):
    with pytest.raises(FlashdraftError, match=message):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a machine without a GPU")
def test_a_missing_gpu_names_the_setting_it_came_from():
    with pytest.raises(FlashdraftError, match=r"^--device cuda: no CUDA GPU is visible"):
        resolve_device("cuda")
    with pytest.raises(FlashdraftError, match=r"^train.device=cuda: no CUDA GPU is visible"):
        train_device("cuda")
    with pytest.raises(FlashdraftError, match=r"^--device cuda:3: this machine has 0 visible CUDA GPU"):
        resolve_devices("cuda:3", 1)
    with pytest.raises(FlashdraftError, match="--workers 2: only with --device cpu"):
        resolve_devices("auto", 2)

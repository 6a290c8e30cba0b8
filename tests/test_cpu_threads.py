"""CPU thread choice: cores from affinity and cgroup quota, free cores from /proc/stat, the override."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashdraft import cpu_threads
from flashdraft.cpu_threads import available_cpus, choose_threads, configure_threads, idle_between
from flashdraft.errors import FlashdraftError

AFFINITY = len(os.sched_getaffinity(0))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc_cgroup(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


def test_cgroup_v2_quota_of_own_cgroup_caps_the_affinity(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root / "job" / "cpu.max", "150000 100000\n")  # 1.5 cores: rounded down to 1
    _write(root / "cpu.max", "max 100000\n")
    assert available_cpus(root, _proc_cgroup(tmp_path, "0::/job\n")) == 1


def test_cgroup_v2_root_without_quota_leaves_the_affinity(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root / "cpu.max", "max 100000\n")
    assert available_cpus(root, _proc_cgroup(tmp_path, "0::/\n")) == AFFINITY


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root / "cpu" / "cpu.cfs_quota_us", "100000\n")
    _write(root / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert available_cpus(root, _proc_cgroup(tmp_path, "2:cpuacct:/\n1:cpu:/\n")) == 1
    _write(root / "cpu" / "cpu.cfs_quota_us", "-1\n")
    assert available_cpus(root, _proc_cgroup(tmp_path, "1:cpu:/\n")) == AFFINITY


def test_no_cgroup_files_means_the_affinity(tmp_path: Path) -> None:
    assert available_cpus(tmp_path / "none", tmp_path / "missing") == AFFINITY


STAT_BEFORE = """cpu  300 0 300 400 0 0 0 0 0 0
cpu0 100 0 100 200 0 0 0 0 0 0
cpu1 200 0 200 200 0 0 0 0 0 0
intr 1 2 3
"""
# over the window: cpu0 all idle (100 jiffies), cpu1 all busy (100 jiffies of user time)
STAT_AFTER = """cpu  400 0 300 500 0 0 0 0 0 0
cpu0 100 0 100 300 0 0 0 0 0 0
cpu1 300 0 200 200 0 0 0 0 0 0
intr 1 2 3
"""


def test_idle_cores_between_two_readings() -> None:
    assert idle_between(STAT_BEFORE, STAT_AFTER) == pytest.approx(1.0)
    assert idle_between(STAT_BEFORE, STAT_AFTER, {0}) == pytest.approx(1.0)
    assert idle_between(STAT_BEFORE, STAT_AFTER, {1}) == pytest.approx(0.0)
    assert idle_between(STAT_AFTER, STAT_AFTER) is None


def test_a_thread_only_per_core_that_is_nearly_all_free() -> None:
    assert choose_threads(2, 0.0) == 1  # busy machine: one thread, never zero
    assert choose_threads(2, 1.0) == 1  # the other core is busy: no second thread
    assert choose_threads(2, 1.6) == 1  # a partly busy second core still costs more than it gives
    assert choose_threads(2, 1.8) == 2  # idle machine: both
    assert choose_threads(2, None) == 2  # unknown load: the cores available
    assert choose_threads(8, 5.0) == 5


def test_configure_threads_sets_torch_and_children(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "idle_cpus", lambda: 0.0)
    try:
        assert configure_threads(None, "cpu") == 1
        assert torch.get_num_threads() == 1
        assert configure_threads(2, "cpu") == 2  # requested overrides the choice
        assert torch.get_num_threads() == 2
        assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "2"
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert child.stdout.strip() == "2"
        torch.set_num_threads(3)
        assert configure_threads(None, "cuda:0") == 3  # a GPU run keeps torch's count unless asked
    finally:
        torch.set_num_threads(before)


def test_requested_below_one_is_a_one_line_error() -> None:
    with pytest.raises(FlashdraftError, match=r"--threads 0: expected a whole number of at least 1"):
        configure_threads(0, "cpu")


def test_import_does_not_load_torch() -> None:
    code = "import sys, flashdraft.cpu_threads as c; c.available_cpus(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"

"""Shared fixtures: tiny random targets saved to temporary directories (no model hub is reachable)."""

from __future__ import annotations

import os

import pytest
import torch

from flashdraft.model.tiny import save_tiny_target

# Tiny models: one intra-op thread is several times faster than two on the 2-core CI machine (thread
# wake-up per op dominates), here and in every subprocess a test starts (they inherit the variable).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# benchmarks/gpu_session.sh sets this: a device call's time limit can cut pytest before its summary, which is
# where a failure's traceback would appear, so each one is written out the moment the test fails.
FAILURES_NOW = "FLASHDRAFT_FAILURES_NOW"
_config: pytest.Config | None = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    if not (report.failed and os.environ.get(FAILURES_NOW) and _config is not None):
        return
    terminal = _config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:  # an xdist worker has none: its reports reach the controller, which writes them
        terminal.write_line(f"\n{'=' * 20} FAILED {report.nodeid} ({report.when})\n{report.longreprtext}")
        terminal.flush()


@pytest.fixture
def fresh_compile_cache():
    """dynamo's caches and counters empty before and after a test, so graph counts are the test's own.
    Use it with `pytestmark = pytest.mark.usefixtures("fresh_compile_cache")`."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests, restored after it (a test elsewhere may have changed the
    count): tiny models run many times faster on one thread than on CPU cores shared with other processes.
    Use it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def target_dirs(tmp_path_factory) -> dict[str, str]:
    """One tiny target per supported family: Qwen3, Llama, Qwen3.5 hybrid (multimodal wrapper)."""
    root = tmp_path_factory.mktemp("targets")
    return {
        kind: str(save_tiny_target(root / kind, kind, num_layers=6)) for kind in ("qwen3", "llama", "qwen3_5")
    }


@pytest.fixture(scope="session")
def qwen3_target(target_dirs) -> str:
    return target_dirs["qwen3"]

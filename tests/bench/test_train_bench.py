"""`flashdraft bench train`'s random target: refused before writing when its disk cannot hold it."""

import pytest
import torch

from flashdraft.bench import train_bench
from flashdraft.errors import FlashdraftError


def test_a_random_target_that_does_not_fit_the_disk_is_refused_before_writing(tmp_path, monkeypatch):
    tiny = torch.nn.Linear(1000, 1000, dtype=torch.bfloat16)  # 2.0 MB of bf16 weights
    monkeypatch.setattr(train_bench, "build_random_target", lambda *a, **k: tiny)
    monkeypatch.setattr(train_bench, "free_bytes", lambda path: 2**20)
    out = tmp_path / "workdir" / "target-qwen3.6-27b-all"
    with pytest.raises(
        FlashdraftError, match=r"needs 0\.0 GB in .*workdir, which has 0\.0 GB free: .*--workdir"
    ):
        train_bench.save_random_target(out, "qwen3.6-27b")
    assert not out.exists()
    assert not list(tmp_path.rglob("*.safetensors"))


def test_a_random_target_that_fits_is_saved_whole(tmp_path, monkeypatch):
    saved = []

    class Model(torch.nn.Linear):
        def save_pretrained(self, directory):
            saved.append(directory)
            torch.save(self.state_dict(), f"{directory}/weights.pt")

    monkeypatch.setattr(train_bench, "build_random_target", lambda *a, **k: Model(4, 4))
    out = tmp_path / "target"
    train_bench.save_random_target(out, "qwen3-8b")
    assert (out / "weights.pt").is_file() and saved

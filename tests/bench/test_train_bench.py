"""`flashdraft bench train`'s random target: refused before writing when its disk cannot hold it."""

import json

import pytest
import torch

from flashdraft.bench import train_bench
from flashdraft.errors import FlashdraftError
from flashdraft.run_protocol import read_metrics


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


class Run:
    """A torchrun job seen from the bench: it logs one step per poll, then exits (after `exit_after` polls)."""

    def __init__(self, metrics, steps: int, exit_after: int, code: int = 0):
        self.metrics, self.steps, self.exit_after, self.code, self.polls = metrics, steps, exit_after, code, 0

    def poll(self):
        self.polls += 1
        if self.polls <= self.steps:
            with self.metrics.open("a") as f:
                f.write(json.dumps({"kind": "train", "step": self.polls, "time": float(self.polls)}) + "\n")
                if self.polls % 2:
                    f.write(json.dumps({"kind": "eval", "step": self.polls}) + "\n")
        return self.code if self.polls > self.exit_after else None


def test_the_result_is_taken_at_the_last_step_while_the_run_still_writes_its_checkpoint(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    run = Run(metrics, steps=5, exit_after=1000)  # the final checkpoint would take "forever"
    rows, code = train_bench.last_step_rows(run, metrics, 5, poll_seconds=0)
    assert code is None and [r["step"] for r in rows] == [1, 2, 3, 4, 5] and run.polls == 5


def test_a_run_that_dies_before_its_last_step_gives_its_exit_code(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows, code = train_bench.last_step_rows(Run(metrics, steps=3, exit_after=3, code=7), metrics, 5, 0)
    assert rows is None and code == 7


def test_a_half_written_last_line_is_left_out(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "train", "step": 1}) + '\n{"kind": "train", "st')
    assert read_metrics(metrics, "train") == [{"kind": "train", "step": 1}]
    assert read_metrics(tmp_path / "absent.jsonl", "train") == []


def test_the_phase_timer_wraps_the_objectives_own_calls_and_restores_them(qwen3_target):
    """`bench train`'s breakdown times the objective's real block-mask, drafter and head-loss calls;
    afterwards the objective is exactly as before (its methods, not the timing wrappers)."""
    from flashdraft.train.loss import WeightedHeadLoss
    from flashdraft.train.objective import Objective

    from ..train.helpers import tiny_pair, token_batch

    drafter, target = tiny_pair(qwen3_target, block_size=4)
    objective = Objective(drafter, target, num_anchors=4, gamma=3.0, loss=WeightedHeadLoss(chunk=7))
    batch = token_batch([23, 15], prompt_lengths=[5, 9], seq_len=26)
    opened, closed = [], []

    class RecordingTimer:
        def span(self, name):
            class Span:
                def __enter__(self):
                    opened.append(name)

                def __exit__(self, *exc):
                    closed.append(name)

            return Span()

    with train_bench.timed_phases(objective, RecordingTimer()):
        out = objective(batch)
    phases = {"block_mask", "drafter_forward", "lm_head_loss_fwd_and_grad"}
    assert set(opened) == phases and sorted(opened) == sorted(closed)
    assert torch.isfinite(out.loss_sum)
    assert "masks" not in vars(objective) and "rows" not in vars(objective.loss)
    spans = len(opened)
    objective(batch)  # the restored objective runs untimed
    assert len(opened) == spans


def test_step_kernels_profile_the_whole_drafter_step_largest_first(qwen3_target):
    """`bench train --kernels N`: the N operators with the most self time over whole drafter steps
    (forward, loss, backward, optimizer; the target's features made before): on the CPU aten operators,
    with a matmul among them, sorted by time per step, shares of the total, and the total itself; the step
    trained (the weights moved)."""
    from flashdraft.train.loss import WeightedHeadLoss
    from flashdraft.train.objective import Objective
    from flashdraft.train.optim import make_optimizer

    from ..train.helpers import tiny_pair, token_batch

    drafter, target = tiny_pair(qwen3_target, block_size=4)
    objective = Objective(drafter, target, num_anchors=4, gamma=3.0, loss=WeightedHeadLoss(chunk=7))
    trained = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = make_optimizer(trained, lr=1e-3, weight_decay=0.0)
    batch = token_batch([23, 15], prompt_lengths=[5, 9], seq_len=26)
    before = [p.detach().clone() for p in trained]
    assert train_bench.step_kernels(objective, optimizer, batch, 0) == ([], 0.0)
    calls = []
    features = target.features
    target.features = lambda *args, **kwargs: calls.append(1) or features(*args, **kwargs)
    top, total_ms = train_bench.step_kernels(objective, optimizer, batch, 8)
    del target.features
    assert len(calls) == 1  # the target's forward once, before the profiled steps, not in each of them
    assert len(top) == 8
    # the total is every operator's time, of which the listed ones are their shares
    assert total_ms > 0 and abs(top[0]["us_per_step"] / 1000 - top[0]["share"] * total_ms) <= 0.01 * total_ms
    times = [k["us_per_step"] for k in top]
    assert times == sorted(times, reverse=True) and times[0] > 0
    assert all(0 < k["share"] <= 1 and k["calls_per_step"] > 0 for k in top)
    assert sum(k["share"] for k in top) <= 1.0001
    assert any("mm" in k["name"] or "linear" in k["name"] for k in top), [k["name"] for k in top]
    assert any(not torch.equal(a, b) for a, b in zip(before, trained, strict=True))


def test_forward_kernels_profile_the_drafters_forward_alone(qwen3_target):
    """`--kernels` also lists the drafter's forward and loss alone (the target's features made before): its
    GEMMs apart from the target's; no backward and no update (the weights stay)."""
    from flashdraft.train.loss import WeightedHeadLoss
    from flashdraft.train.objective import Objective

    from ..train.helpers import tiny_pair, token_batch

    drafter, target = tiny_pair(qwen3_target, block_size=4)
    objective = Objective(drafter, target, num_anchors=4, gamma=3.0, loss=WeightedHeadLoss(chunk=7))
    batch = token_batch([23, 15], prompt_lengths=[5, 9], seq_len=26)
    before = [p.detach().clone() for p in drafter.parameters()]
    assert train_bench.forward_kernels(objective, batch, 0) == ([], 0.0)
    top, total_ms = train_bench.forward_kernels(objective, batch, 6)
    assert total_ms >= sum(k["us_per_step"] for k in top) / 1000 * 0.999
    times = [k["us_per_step"] for k in top]
    assert len(top) == 6 and times == sorted(times, reverse=True) and times[0] > 0
    assert any("mm" in k["name"] or "linear" in k["name"] for k in top), [k["name"] for k in top]
    assert not any("backward" in k["name"].lower() for k in top)
    assert all(torch.equal(a, b) for a, b in zip(before, drafter.parameters(), strict=True))


@pytest.mark.slow
def test_checkpoint_every_reports_a_checkpointing_step_against_a_plain_one(tmp_path, qwen3_target):
    """`bench train --checkpoint-every K` on the CPU (the real trainer and its background writer, one
    process under torchrun, a tiny target): the step time with and without a save, and each write."""
    out = tmp_path / "ck.json"
    code = train_bench.main(
        [
            *("--nproc-per-node", "1", "--target-dir", qwen3_target, "--mask-token-id", "300"),
            *("--shape", "tiny", "--drafter-layers", "1", "--steps", "6", "--warmup", "1"),
            *("--checkpoint-every", "2", "--workdir", str(tmp_path / "work"), "--out", str(out)),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())["checkpoint"]
    assert report["every"] == 2 and report["checkpoint_steps_measured"] == 3  # saves at 2, 4, 6 (of 7)
    assert [w["step"] for w in report["writes"]] == [2, 4, 6, 7]  # and the last step's
    for key in ("plain_step_seconds_median", "checkpoint_step_seconds_median", "write_seconds_median"):
        assert report[key] > 0, (key, report)
    extra = report["checkpoint_step_seconds_median"] - report["plain_step_seconds_median"]
    assert report["checkpoint_step_extra_seconds"] == pytest.approx(extra, abs=1e-3)
    assert report["bytes"] > 0 and all(w["copy_s"] >= 0 for w in report["writes"])


def test_checkpoint_report_names_what_it_lacks():
    with pytest.raises(FlashdraftError, match="--checkpoint-every 5: no checkpointing step was measured"):
        train_bench.checkpoint_report([], {2: 0.1}, [], 5)
    line = "checkpoint step 4: 12.5 MB written in 1.25 s in the background (the step paid 0.50 s for the copy) -> x"
    report = train_bench.checkpoint_report([line], {2: 0.1, 3: 0.3}, [0.9], 4)
    assert report["writes"] == [{"step": 4, "bytes": 12_500_000, "write_s": 1.25, "copy_s": 0.5}]
    assert report["plain_step_seconds_median"] == 0.2 and report["checkpoint_step_extra_seconds"] == 0.7


def test_the_precision_variants_each_once_with_the_fp8_head_after_each_fp8_recipe():
    parse = train_bench._parser().parse_args
    args = parse(["--precision", "bf16", "--precision", "fp8", "--fp8-recipe", "tensorwise"])
    assert train_bench._variants(args) == [("bf16", "tensorwise", False), ("fp8", "tensorwise", False)]
    precisions = ["--precision", "bf16", "--precision", "fp8", "--precision", "fp8"]
    args = parse([*precisions, "--fp8-recipe", "tensorwise", "--fp8-recipe", "rowwise", "--fp8-head"])
    variants = train_bench._variants(args)
    assert variants == [
        ("bf16", "tensorwise", False),
        ("fp8", "tensorwise", False),
        ("fp8", "tensorwise", True),
        ("fp8", "rowwise", False),
        ("fp8", "rowwise", True),
    ]
    names = [train_bench.variant_name(*v) for v in variants]
    assert names == ["bf16", "fp8-tensorwise", "fp8-tensorwise+head", "fp8-rowwise", "fp8-rowwise+head"]
    # `--fp8-head only`: each fp8 recipe with the FP8 head alone
    args = parse([*precisions, "--fp8-recipe", "tensorwise", "--fp8-recipe", "rowwise", "--fp8-head", "only"])
    assert train_bench._variants(args) == [
        ("bf16", "tensorwise", False),
        ("fp8", "tensorwise", True),
        ("fp8", "rowwise", True),
    ]
    with pytest.raises(SystemExit):
        parse(["--precision", "fp8", "--fp8-head", "sometimes"])


def test_each_variant_is_set_against_bf16_with_its_optimizer_and_against_adamw_at_its_precision():
    def result(precision, optimizer, ms, rate, gib):
        return {
            "shape": "a",
            "precision": precision,
            "optimizer": optimizer,
            "drafter_step_ms": ms,
            "samples_per_s_end_to_end": rate,
            "peak_memory_GiB": gib,
        }

    results = [
        result("bf16", "adamw", 100.0, 10.0, 40.0),
        result("fp8-tensorwise", "adamw", 80.0, 12.0, 38.0),
    ]
    muon = result("bf16", "muon", 150.0, 8.0, 36.0)
    train_bench._against_baselines(muon, results)
    assert "vs_bf16" not in muon  # it is its optimizer's bf16
    assert muon["vs_adamw"] == {
        "drafter_step_ms": 1.5,
        "samples_per_s_end_to_end": 0.8,
        "peak_memory_GiB": 0.9,
    }
    results.append(muon)
    fp8_muon = result("fp8-tensorwise", "muon", 120.0, 9.0, 34.0)
    train_bench._against_baselines(fp8_muon, results)
    assert fp8_muon["vs_bf16"]["drafter_step_ms"] == 0.8  # against bf16 with Muon, not with AdamW
    assert fp8_muon["vs_adamw"]["drafter_step_ms"] == 1.5  # against fp8 with AdamW
    assert train_bench._parser().parse_args(["--optimizer", "adamw", "--optimizer", "muon"]).optimizer == [
        "adamw",
        "muon",
    ]
    assert train_bench._variant_label(fp8_muon) == "fp8-tensorwise muon"

"""`flashdraft bench quality --against specforge` (issue 33 item 1): one initial drafter, trained for the
same budget on the same shards by flashdraft's trainer and by SpecForge's own training code (its drafter
module, objective and BF16 optimizer, flashdraft/bench/race.py), both scored by the same evaluators; one
JSON with both curves, τ and acceptance by position (docs/quality-benchmark.md, "The race")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashdraft.bench.race import SPECFORGE_INSTALL, specforge_missing
from tests.bench.test_quality import save_chain_target, tiny_quality_argv

needs_specforge = pytest.mark.skipif(
    specforge_missing() is not None, reason=specforge_missing() or SPECFORGE_INSTALL
)


@pytest.mark.slow
@needs_specforge
def test_the_race_trains_both_from_the_same_weights_and_scores_both_alike(tmp_path):
    _race_on_a_tiny_target(tmp_path, "cpu")


@pytest.mark.gpu
@needs_specforge
def test_the_race_on_a_gpu(tmp_path):
    """The GPU path of both sides: SpecForge's flex attention and bf16, flashdraft's compiled step, the
    fast engine for the curve's first point (the race had never run on a GPU before a device session)."""
    _race_on_a_tiny_target(tmp_path, "cuda")


def _race_on_a_tiny_target(tmp_path: Path, device: str) -> None:
    from flashdraft.cli import main
    from flashdraft.model.drafter_dir import load_drafter, weights_sha256

    target = save_chain_target(tmp_path / "target")
    work, out = tmp_path / "work", tmp_path / "race.json"
    argv = tiny_quality_argv(target, work, out, 16, 2, "0.03", 12)
    argv[argv.index("--device") + 1] = device
    assert main(["bench", "quality", *argv, "--against", "specforge"]) == 0
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["flashdraft", "specforge"]
    init = work / "race" / "initial-drafter"
    warm = json.loads((work / "variants" / "flashdraft" / "run" / "warm_start.json").read_text())
    assert warm["weights_sha256"] == weights_sha256(init)  # flashdraft started from it
    theirs = result["variants"]["specforge"]
    assert theirs["training"]["trainer"] == "specforge" and theirs["training"]["steps"] >= 2
    assert theirs["training"]["train_minutes"] >= 0.03 and theirs["training"]["budget_spent"]
    assert "specforge.optimizer.BF16Optimizer" in theirs["training"]["settings"]["calls"]
    ours = result["variants"]["flashdraft"]["training"]["settings"]  # its recipe, as config.yaml resolved it
    assert ours["optimizer"] == "muon" and ours["muon_lr"] == pytest.approx(
        4 * ours["lr"]
    )  # a narrow drafter
    for name, variant in result["variants"].items():
        assert variant["complete"] and len(variant["curve"]) >= 2, name
        minutes = [p["gpu_minutes"] for p in variant["curve"]]
        assert minutes == sorted(minutes) and minutes[-1] >= 0.03, (name, minutes)
        for point in variant["curve"]:
            assert 1 <= point["tau"] <= 4 and len(point["acceptance_by_position"]) == 3
            drafter = load_drafter(point["drafter"])  # a flashdraft drafter directory, the shape of the start
            assert drafter.config.num_hidden_layers == 1 and drafter.block_size == 4
        assert ("zlab_tau" in variant["final"]) == result["zlab_available"]
    race = result["race"]
    a, b = result["variants"]["flashdraft"]["final"], theirs["final"]
    assert race["tau"] == {"flashdraft": a["tau"], "specforge": b["tau"]}
    assert race["tau_ratio"] == pytest.approx(a["tau"] / b["tau"])
    assert race["acceptance_by_position"]["specforge"] == b["acceptance_by_position"]
    if result["zlab_available"]:
        assert race["zlab_tau_ratio"] == pytest.approx(a["zlab_tau"] / b["zlab_tau"])
    # SpecForge's side moved away from the start: its last checkpoint is not the initial weights
    assert weights_sha256(theirs["curve"][-1]["drafter"]) != weights_sha256(init)


def test_the_race_refuses_variants_and_a_missing_specforge(tmp_path, monkeypatch):
    from flashdraft.bench import race
    from flashdraft.bench.quality import build_parser, run_quality
    from flashdraft.errors import FlashdraftError

    argv = ["--target", str(tmp_path), "--work", str(tmp_path / "w"), "--against", "specforge"]
    with pytest.raises(FlashdraftError, match="--against and --variant"):
        run_quality(build_parser().parse_args([*argv, "--variant", "dflash2"]), [])
    with pytest.raises(
        FlashdraftError, match="--race-arch is the race's flashdraft side: it needs --against"
    ):
        run_quality(build_parser().parse_args([*argv[:4], "--race-arch", "dflash2"]), [])
    monkeypatch.setattr(race, "specforge_missing", lambda: "the specforge package is not installed: pip ...")
    with pytest.raises(
        FlashdraftError, match=r"^--against specforge: the specforge package is not installed"
    ):
        run_quality(build_parser().parse_args(argv), [])


def test_specforge_steps_that_compile_are_booked_apart_as_flashdrafts_are(tmp_path, monkeypatch):
    """Both sides' budgets count the same thing: a SpecForge step during which torch.compile built a graph
    (flex attention for a new padded width) is compile time, as flashdraft's own are (train/budget.py)."""
    import time
    from types import SimpleNamespace

    from flashdraft.bench import race
    from flashdraft.train.budget import TrainingClock

    graphs, seconds = [0], []

    class Side:
        drafter = config = None

        def objective(self, model):
            return None

        def synchronize(self):
            pass

        def step(self, wrapped, optimizer, source=None):
            recompiles = len(seconds) == 3  # the fourth step meets a new padded width
            graphs[0] += recompiles
            started = time.perf_counter()
            time.sleep(0.12 if recompiles else 0.01)
            seconds.append(time.perf_counter() - started)
            return 1.0, 0.5

    saved = []
    monkeypatch.setattr(race, "_save_as_flashdraft", lambda model, config, path: saved.append(path))
    monkeypatch.setattr(race, "_resized_schedule", lambda optimizer, total, done: None)
    progress = race._Progress(total_steps=10, clock=TrainingClock(graphs=lambda: graphs[0]))
    race._train_for_budget(
        Side(), SimpleNamespace(optimizer=None), progress, 0.1 / 60, 2, tmp_path, lambda line: None
    )
    assert progress.compile_steps == 1 and progress.compile_seconds >= 0.12
    assert progress.steps == len(seconds) and progress.steps >= 9  # 0.1 s of 0.01 s steps, and the compile
    assert 0.1 <= progress.spent < sum(seconds) - 0.1  # the compile step is not in the budget
    assert len(saved) == 2 and progress.checkpoints[-1][1] == round(progress.spent / 60, 4)


@pytest.mark.slow
@needs_specforge
def test_a_race_split_over_two_calls_is_one_race_and_refuses_halves_of_another(tmp_path):
    """--race-side flashdraft, then --race-side specforge --race-with the first result on the same shards
    (--reuse-data): one result with both sides and the race's verdict; a half from other settings, other
    shards or the same side is refused before any training, naming what differs."""
    from flashdraft.bench.quality import build_parser, run_quality
    from flashdraft.cli import main
    from flashdraft.errors import FlashdraftError
    from flashdraft.model.drafter_dir import load_drafter

    target = save_chain_target(tmp_path / "target")
    work, first, second = tmp_path / "work", tmp_path / "flashdraft.json", tmp_path / "race.json"
    # flashdraft's side as DFlash2, grafted onto the initial DFlash drafter (--race-arch)
    argv = [*tiny_quality_argv(target, work, first, 16, 2, "0.03", 12, select=2), "--race-arch", "dflash2"]
    assert main(["bench", "quality", *argv, "--against", "specforge", "--race-side", "flashdraft"]) == 0
    half = json.loads(first.read_text())
    assert list(half["variants"]) == ["flashdraft"] and half["race"] is None
    assert half["race_inputs"]["settings"]["gpu_minutes"] == 0.03
    assert half["race_inputs"]["settings"]["race_arch"] == "dflash2"
    assert not (work / "variants" / "specforge").exists()  # SpecForge did not train
    for point in half["variants"]["flashdraft"]["curve"]:
        assert load_drafter(point["drafter"]).spec.arch == "dflash2"
    if half["zlab_available"]:  # z-lab's loop decoded it as its DFlash2DraftModel
        assert half["variants"]["flashdraft"]["final"]["zlab_class"] == "DFlash2DraftModel"

    rest = [*argv, "--against", "specforge", "--race-side", "specforge", "--reuse-data"]
    rest[rest.index("--out") + 1] = str(second)

    def refused(extra: list[str], match: str) -> None:
        with pytest.raises(FlashdraftError, match=match):
            run_quality(build_parser().parse_args([*rest, *extra]), [])
        assert not second.exists()

    refused(
        ["--race-with", str(first), "--gpu-minutes", "0.05"], r"another race: --gpu-minutes was 0.03 there"
    )
    refused(["--race-with", str(tmp_path / "none.json")], r"--race-with .*none.json: cannot read it")
    no_reuse = [a for a in rest if a != "--reuse-data"]
    with pytest.raises(FlashdraftError, match=r"--race-with: both sides must train on the same shards"):
        run_quality(build_parser().parse_args([*no_reuse, "--race-with", str(first)]), [])
    flipped = [*rest, "--race-with", str(first)]
    flipped[flipped.index("--race-side") + 1] = "flashdraft"  # the file holds flashdraft's side only
    with pytest.raises(FlashdraftError, match=r"holds no specforge side"):
        run_quality(build_parser().parse_args(flipped), [])
    other_data = json.loads(first.read_text())
    other_data["race_inputs"]["data_manifest_sha256"]["train"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other_data))
    refused(["--race-with", str(tmp_path / "other.json")], r"its train shards are not these")
    other_select = json.loads(first.read_text())
    other_select["race_inputs"]["data_manifest_sha256"]["select_prompts"] = "0" * 64
    (tmp_path / "other-select.json").write_text(json.dumps(other_select))
    refused(["--race-with", str(tmp_path / "other-select.json")], r"its selection prompts are not these")
    elsewhere = json.loads(first.read_text())
    elsewhere["race_inputs"]["device"] = "NVIDIA H100 80GB HBM3"
    (tmp_path / "elsewhere.json").write_text(json.dumps(elsewhere))
    refused(
        ["--race-with", str(tmp_path / "elsewhere.json")],
        r"its flashdraft side trained on NVIDIA H100 80GB HBM3, this call runs on cpu .*train both sides on one kind",
    )
    dflash_half = [*rest, "--race-with", str(first)]
    dflash_half[dflash_half.index("--race-arch") + 1] = "dflash"
    with pytest.raises(
        FlashdraftError, match=r"another race: --race-arch was 'dflash2' there, 'dflash' here"
    ):
        run_quality(build_parser().parse_args(dflash_half), [])
    # a half written before --race-arch existed: its flashdraft side was DFlash
    older = json.loads(first.read_text())
    del older["race_inputs"]["settings"]["race_arch"]
    (tmp_path / "older.json").write_text(json.dumps(older))
    refused(["--race-with", str(tmp_path / "older.json")], r"--race-arch was 'dflash' there, 'dflash2' here")

    assert main(["bench", "quality", *rest, "--race-with", str(first)]) == 0
    result = json.loads(second.read_text())
    assert list(result["variants"]) == ["flashdraft", "specforge"] and result["complete"]
    ours = result["variants"]["flashdraft"]
    assert ours["final"] == half["variants"]["flashdraft"]["final"]  # taken as measured, not retrained
    assert ours["measured_in"]["path"] == str(first)
    race = result["race"]
    assert race["flashdraft_arch"] == "dflash2"
    assert race["tau"]["flashdraft"] == ours["final"]["tau"]
    assert race["tau_ratio"] == pytest.approx(
        ours["final"]["tau"] / result["variants"]["specforge"]["final"]["tau"]
    )
    assert result["race_inputs"]["initial_drafter_sha256"] == half["race_inputs"]["initial_drafter_sha256"]
    # each side's checkpoint chosen by the same rule, on the selection prompts, scored on the held-out ones
    for name, variant in result["variants"].items():
        ranks = [p["select_tau"] for p in variant["curve"]]
        assert variant["selected"] == variant["curve"][ranks.index(max(ranks))], name
    samples = result["data"]["train"]["samples"]  # the epochs each side trained, at 4 sequences a step
    assert race["epochs"] == pytest.approx({s: steps * 4 / samples for s, steps in race["steps"].items()})
    chosen = race["selected"]
    assert chosen["tau"] == {s: result["variants"][s]["selected"]["tau"] for s in ("flashdraft", "specforge")}
    assert chosen["tau_ratio"] == pytest.approx(chosen["tau"]["flashdraft"] / chosen["tau"]["specforge"])

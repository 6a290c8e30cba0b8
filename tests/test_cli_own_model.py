"""One's own model, first (issue 29): `flashdraft config --target DIR` writes a commented starter config
that `train` accepts as it is; `export` and `eval` take the run directory and say which drafter they
picked; `--help-config` prints the documented config tree; `--threads` reaches torch."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from flashdraft.cli import build_parser, main
from flashdraft.config import describe, load_config
from flashdraft.errors import FlashdraftError
from flashdraft.model.locate import find_drafter
from flashdraft.model.spec import build_target_layer_ids
from flashdraft.model.tiny import save_tiny_target
from flashdraft.train.checkpoint import DRAFTER_DIR, list_checkpoints

TARGET_LAYERS = 8


@pytest.fixture(scope="module")
def own_target(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("own") / "my-model", num_layers=TARGET_LAYERS)


def _token_file(path, vocab=320):
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(8):
            ids = [rng.randrange(4, vocab) for _ in range(96)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 16 + [1] * 80}) + "\n")
    return path


@pytest.mark.parametrize("machine,layers,max_length", [("cpu", 2, 1024), ("gpu", 5, 3072)])
def test_starter_config_is_sized_for_the_machine_and_loads(
    own_target, tmp_path, capsys, machine, layers, max_length
):
    out = tmp_path / "my.yaml"
    argv = [
        "config",
        "--target",
        str(own_target),
        "--machine",
        machine,
        "--mask-token-id",
        "3",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert f"flashdraft launch {out}" in capsys.readouterr().out
    config = load_config(out)  # the loader's every check, as train and launch run it
    assert config.model.target == str(own_target) and config.model.num_layers == layers
    assert config.model.target_layer_ids == build_target_layer_ids(TARGET_LAYERS, layers)
    assert config.model.mask_token_id == 3 and config.data.max_length == max_length
    assert config.data.train == ["data/my-model-shards"] and config.train.out_dir == "runs/my-model"
    helps = {key: help_text for key, _, help_text in describe()}
    section, comment, keys = "", [], 0
    for line in out.read_text().splitlines():  # every key carries its own config help as its comment
        if line.endswith(":") and not line.startswith(" "):
            section = line[:-1]
        elif line.startswith("  #"):
            comment.append(line.strip()[2:])
        elif line.startswith("  "):
            key = f"{section}.{line.split(':')[0].strip()}"
            assert " ".join(comment).replace("- ", "-") == " ".join(helps[key].split()).replace("- ", "-"), (
                key
            )
            comment, keys = [], keys + 1
    assert keys >= 10
    assert main(argv) == 2  # an existing file is not replaced without --force
    assert "already exists" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0


def test_starter_config_trains_then_exports_from_the_run_directory(own_target, tmp_path, capfd):
    run = tmp_path / "run"
    config = tmp_path / "my.yaml"
    data = _token_file(tmp_path / "tokens.jsonl")
    argv = ["config", "--target", str(own_target), "--machine", "cpu", "--mask-token-id", "3"]
    assert main([*argv, "--data", str(data), "--out-dir", str(run), "--out", str(config)]) == 0
    previous = torch.get_num_threads()
    try:
        assert main(["train", str(config), "train.max_steps=2", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)
    newest = list_checkpoints(run)[-1] / DRAFTER_DIR
    capfd.readouterr()

    assert main(["export", str(run), "--to", "zlab", "--out", str(tmp_path / "e1")]) == 0
    said = capfd.readouterr().out
    assert f"using the run's newest checkpoint ({newest}" in said
    assert (tmp_path / "e1" / "model.safetensors").read_bytes() == (newest / "model.safetensors").read_bytes()

    shutil.copytree(newest, run / "best")  # as the trainer writes it after a better held-out τ
    assert find_drafter(run) == (run / "best", f"the run's best checkpoint by simulated τ ({run / 'best'})")
    assert main(["export", str(run), "--to", "zlab", "--out", str(tmp_path / "e2")]) == 0
    assert f"using the run's best checkpoint by simulated τ ({run / 'best'})" in capfd.readouterr().out


def test_find_drafter_names_what_a_directory_lacks(tmp_path):
    with pytest.raises(FlashdraftError, match=r"no config.json \(not a drafter directory\) and no best/"):
        find_drafter(tmp_path, "DRAFTER")
    older, newer = (tmp_path / "checkpoints" / f"step-{n:08d}" / DRAFTER_DIR for n in (9, 10))
    for drafter in (older, newer):
        drafter.mkdir(parents=True)
        (drafter / "config.json").write_text("{}")
    assert find_drafter(tmp_path)[0] == newer == list_checkpoints(tmp_path)[-1] / DRAFTER_DIR


def test_help_config_prints_every_documented_key(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help-config"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for key, default, help_text in describe():
        assert f"  {key} = {default}\n" in text and help_text.split()[0] in text
    assert main(["config", "--describe"]) == 0
    assert capsys.readouterr().out.strip() == text.strip()


def test_a_mistyped_flag_is_named_with_its_close_match(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--target", "t", "--drafter", "d", "--prompts", "p", "--max-promts", "3"])
    assert "unrecognized arguments: --max-promts 3 (did you mean --max-prompts?)" in capsys.readouterr().err


def test_launch_hands_threads_to_its_job(monkeypatch, tmp_path, capsys):
    """The job is `flashdraft train` in another process: --threads reaches it through its environment,
    where train's own thread choice reads it."""
    import flashdraft.run.launcher as launcher
    from flashdraft.cli.flags import THREADS_ENV, threads_of

    seen = {}

    def launch(path, overrides, **options):
        seen.update(options["env"])
        return {"run": "r", "state": "running", "run_dir": str(tmp_path)}

    monkeypatch.setattr(launcher, "launch", launch)
    assert main(["launch", "train.max_steps=1", "--threads", "3", "--env", "OMP_NUM_THREADS=2"]) == 0
    assert seen[THREADS_ENV] == "3" and seen["OMP_NUM_THREADS"] == "2"  # the user's own --env wins
    monkeypatch.setenv(THREADS_ENV, "3")
    parsed = build_parser().parse_args(["train", "c.yaml"])
    assert threads_of(parsed) == 3
    assert threads_of(build_parser().parse_args(["train", "c.yaml", "--threads", "1"])) == 1
    monkeypatch.setenv(THREADS_ENV, "zero")
    with pytest.raises(FlashdraftError, match="FLASHDRAFT_THREADS=zero: expected an integer"):
        threads_of(parsed)

"""`flashdraft doctor`'s tally counts skipped checks apart, and its sizes carry their unit."""

from __future__ import annotations

import re

from flashdraft.config import load_config
from flashdraft.run import doctor
from flashdraft.run.doctor import Check, print_checks


def test_skipped_checks_are_counted_as_skipped_not_ok(capsys) -> None:
    checks = [Check("a", True, "fine"), Check("b", None, "skipped: no GPU"), Check("c", None, "skipped: x")]
    assert print_checks(checks) == 0  # nothing failed
    assert capsys.readouterr().out.strip().splitlines()[-1] == "1 ok, 0 failed, 2 skipped"
    assert print_checks([Check("a", True, "fine"), Check("b", False, "broken", "fix it")]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == "1 ok, 1 failed"


def test_the_space_checkpoints_need_has_its_unit(tmp_path, qwen3_target) -> None:
    config = load_config(None, [f"model.target={qwen3_target}", f"train.out_dir={tmp_path / 'run'}"])
    check = doctor._output(config)
    assert check.ok is True
    assert re.search(r"\(checkpoints need ~\d+\.\d GiB\)$", check.detail), check.detail

"""A run whose held-out metric stops improving says so (it is memorising its data), and
`train.early_stop_evals` ends it as finished, with a final checkpoint and best/ at its best step
(docs/training-loop.md, "When held-out τ stops rising")."""

from __future__ import annotations

import pytest

from flashdraft.config import load_config
from flashdraft.errors import FlashdraftError
from flashdraft.train.state import TrainState
from flashdraft.train.trainer import train
from tests.train.test_real_eval import _config, _evals, chain  # noqa: F401 - chain is a fixture

# held-out simulated τ at the evaluations of steps 8, 16, 24, ...: best at step 16, then falling
SCRIPTED_TAU = [1.5, 1.6, 1.55, 1.5, 1.45, 1.4, 1.35, 1.3]


@pytest.fixture
def scripted_evaluations(monkeypatch):
    """The held-out pass replaced by a script of τ values, one per evaluation, in order."""
    import flashdraft.train.trainer as trainer

    taus = iter(SCRIPTED_TAU)

    def held_out(objective, data, batch_size, seed, pad_multiple, device, *, after_batch=None):
        return {"loss": 1.0, "tau": next(taus)}

    monkeypatch.setattr(trainer, "held_out_acceptance", held_out)


def _run(chain, out, **extra):  # noqa: F811 - the fixture's value
    settings = {"train.max_steps": 64, "train.real_eval_prompts": 0, "train.save_every": 1000, **extra}
    return train(_config(chain, out, **settings))


def test_early_stop_ends_the_run_as_finished_after_that_many_evaluations_without_a_better_best(
    chain,  # noqa: F811
    tmp_path,
    scripted_evaluations,
    capsys,
):
    out = tmp_path / "run"
    result = _run(chain, out, **{"train.early_stop_evals": 2})
    # evaluations at 8 (best), 16 (best), 24 and 32 (no better): the run ends after the second of those
    assert result["steps"] == 32 and result["outcome"] == "finished" and result["early_stopped"]
    assert result["best_step"] == 16 and result["best"] == 1.6 and not result["budget_spent"]
    assert (out / "checkpoints" / "step-00000032").is_dir()  # the final checkpoint
    evals = _evals(out)
    assert [evals[s]["evals_since_best"] for s in sorted(evals)] == [0, 0, 1, 2]
    assert evals[16]["best"] and "best" not in evals[32]
    printed = capsys.readouterr().out
    assert (
        "step 32: held-out simulated tau has not improved for 2 evaluations (best 1.6 at step 16" in printed
    )
    assert (
        "train.early_stop_evals=2: stopped at step 32 with a final checkpoint; best/ holds step 16" in printed
    )


def test_without_early_stop_the_run_goes_on_and_says_once_that_it_is_memorising(
    chain,  # noqa: F811
    tmp_path,
    scripted_evaluations,
    capsys,
):
    out = tmp_path / "run"
    result = _run(chain, out)
    assert result["steps"] == 64 and result["outcome"] == "finished" and not result["early_stopped"]
    assert result["best_step"] == 16
    printed = capsys.readouterr().out
    line = (
        "step 40: held-out simulated tau has not improved for 3 evaluations (best 1.6 at step 16, now 1.45)"
    )
    assert line in printed and printed.count("has not improved") == 1
    assert (
        "likely memorising its training data" in printed
        and "train.early_stop_evals=N ends such a run" in printed
    )


def test_the_streak_survives_a_checkpoint_and_old_checkpoints_start_it_anew():
    state = TrainState()
    state.step = 8
    assert state.record_evaluation(1.5) and (state.best_step, state.evals_since_best) == (8, 0)
    state.step = 16
    assert not state.record_evaluation(1.4) and not state.record_evaluation(None)  # no value: no count
    assert not state.record_evaluation(float("nan")) and state.evals_since_best == 1
    again = TrainState()
    again.load_state_dict(state.state_dict())
    assert (again.best, again.best_step, again.evals_since_best) == (1.5, 8, 1)
    old = {k: v for k, v in state.state_dict().items() if k not in ("best_step", "evals_since_best")}
    again.load_state_dict(old)
    assert (again.best, again.best_step, again.evals_since_best) == (1.5, None, 0)
    assert again.choose_best_by("loss") and (again.best_step, again.evals_since_best) == (None, 0)


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.early_stop_evals=-1"],
        ["train.early_stop_evals=3"],
        ["train.early_stop_evals=3", "data.eval=[e]"],
    ],
)
def test_early_stop_needs_evaluations_and_says_which_setting_is_missing(overrides):
    with pytest.raises(FlashdraftError, match=r"train.early_stop_evals=(-1|3): give 0 \(never\) or a count"):
        load_config(None, overrides)

"""What a study writes: the rows of its table, ``trials.csv``, ``best.toml`` (a ``--config`` file of the
best trial's settings) and ``best-preset.toml``, the progress line, and the plots."""

from __future__ import annotations

import csv
import tomllib
from pathlib import Path

import optuna
import pytest

from oakemu_core.config import load_config
from oakemu_core.tuning.outputs import (
    DEAD_WORKER,
    best_settings,
    best_trial,
    progress_line,
    trial_rows,
    write_best_files,
    write_plots,
    write_trials_csv,
)
from oakemu_core.tuning.study import StudySpec

pytestmark = pytest.mark.usefixtures("no_oakemu_variables")


def _study() -> optuna.Study:
    """Four trials: complete 1.0 and 3.0, a dead worker's FAIL (no error recorded), a pruned one."""
    study = optuna.create_study(direction="maximize")
    for value, lr in ((1.0, 1e-3), (3.0, 2e-3)):
        study.enqueue_trial({"learning_rate": lr})
        trial = study.ask(
            {"learning_rate": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)}
        )
        trial.set_user_attr("run_dir", f"runs/trial-{trial.number}")
        trial.report(value / 2, step=500)
        study.tell(trial, value)
    failed = study.ask()
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    pruned = study.ask()
    pruned.report(0.25, step=500)
    study.tell(pruned, state=optuna.trial.TrialState.PRUNED)
    return study


def test_rows_name_each_trials_outcome_and_the_best_is_the_highest_complete_one(
    tmp_path: Path,
) -> None:
    study = _study()
    rows = trial_rows(study.get_trials())
    assert [(row.number, row.state) for row in rows] == [
        (0, "COMPLETE"),
        (1, "COMPLETE"),
        (2, "FAIL"),
        (3, "PRUNED"),
    ]
    assert (
        rows[2].error == DEAD_WORKER and rows[3].value == 0.25
    )  # a pruned trial: its last evaluation
    assert best_trial(study.get_trials()).number == 1
    write_trials_csv(rows, tmp_path / "trials.csv")
    table = list(csv.DictReader((tmp_path / "trials.csv").open()))
    assert [row["state"] for row in table] == ["COMPLETE", "COMPLETE", "FAIL", "PRUNED"]
    assert table[1]["objective"] == "3.0" and table[1]["learning_rate"] == "0.002"
    assert table[0]["run_dir"] == "runs/trial-0" and table[2]["error"] == DEAD_WORKER
    line = progress_line(rows[1], study.get_trials(), total=6, jobs=2, elapsed_s=10.0)
    assert line.startswith("trial 1: objective 3 ") and "4/6 done, best 3 (trial 1)" in line


def test_best_toml_holds_the_studys_settings_and_the_best_ones_and_trains_as_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OAKEMU_GAE_LAMBDA", "0.9")
    spec = StudySpec(
        study_name="s",
        storage="sqlite://",
        study_dir=str(tmp_path),
        preset="cartpole",
        settings={"total_env_steps": 5000, "runs_dir": str(tmp_path / "runs")},
        fixed_names=["env_id", "num_envs", "gamma", "gae_lambda", "total_env_steps", "runs_dir"],
        space_path="space.toml",
        trials=2,
    )
    best = best_trial(_study().get_trials())
    settings = best_settings(spec, best)
    assert "runs_dir" not in settings and settings["gae_lambda"] == 0.9
    config_path, preset_path = write_best_files(tmp_path, spec, best, settings)
    monkeypatch.delenv("OAKEMU_GAE_LAMBDA")
    config = load_config(["--config", str(config_path)])
    assert (
        config.learning_rate == 2e-3 and config.total_env_steps == 5000 and config.gae_lambda == 0.9
    )
    assert config.env_id == "CartPole-v1" and config.gamma == 0.98 and config.num_envs == 8
    preset = tomllib.loads(preset_path.read_text())
    assert set(preset) == {"preset", "settings"} and preset["settings"] == tomllib.loads(
        config_path.read_text()
    )
    assert (
        "trial 1" in preset["preset"]["description"]
        and "5000 env steps" in preset["preset"]["expect"]
    )


def test_plots_are_html_files_and_importance_needs_two_complete_trials(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    written, notes = write_plots(_study(), tmp_path / "plots")
    assert {path.name for path in written} == {
        "history.html",
        "intermediate.html",
        "importance.html",
    }
    assert (tmp_path / "plots" / "plotly.min.js").is_file() and notes == []
    one = optuna.create_study(direction="maximize")
    one.add_trial(optuna.trial.create_trial(value=1.0))
    written, notes = write_plots(one, tmp_path / "one")
    assert "importance.html" not in {path.name for path in written}
    assert notes == ["importance plot: needs 2 complete trials, the study has 1"]

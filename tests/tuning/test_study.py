"""The study of ``oakemu tune`` without training: its storage, the objective's pruning and failures,
stale trials of dead workers, and the worker's trial count. A fake ``train`` stands for the Python API's."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pytest

from oakemu_core.errors import ConfigError
from oakemu_core.run.callbacks import EvaluationInfo
from oakemu_core.tuning.study import (
    PruningCallback,
    StudySpec,
    make_objective,
    open_storage,
    open_study,
    run_worker,
    sqlite_url,
)


class FakeTrainingFailed(RuntimeError):
    """Stands for ``oakemu_services.api.TrainingFailed``."""


@dataclass
class FakeRun:
    final_evaluation: float | None
    episodic_return: float | None = 10.0
    global_step: int = 1000
    stopped_by_callback: bool = False


def _evaluation(step: int, value: float) -> EvaluationInfo:
    return EvaluationInfo(
        policy_version=step // 100,
        global_step=step,
        return_mean=value,
        return_std=0.0,
        length_mean=None,
        best_return=value,
        is_best=True,
        metrics={},
    )


class FakeTrain:
    """``train(preset, callbacks, verbose, **settings)``: reports evaluations 1..4 of ``value(settings)``
    to the callbacks (stopping when one returns False) and returns a :class:`FakeRun`; raises
    :class:`FakeTrainingFailed` for the trial numbers in ``crash``."""

    def __init__(self, crash: tuple[int, ...] = ()) -> None:
        self.crash = crash
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self, preset: str | None, callbacks: list[Any], verbose: int, **settings: Any
    ) -> FakeRun:
        self.calls.append(settings)
        number = int(settings["run_name"].removeprefix("trial-"))
        if number in self.crash:
            raise FakeTrainingFailed("oakemu train exited with status 1 after 0 updates")
        value = 1000.0 * settings["learning_rate"]
        for step in (1000, 2000, 3000, 4000):
            if any(
                callback.on_evaluation(_evaluation(step, value * step / 4000)) is False
                for callback in callbacks
            ):
                return FakeRun(value * step / 4000, global_step=step, stopped_by_callback=True)
        return FakeRun(value, global_step=4000)


def _spec(tmp_path: Path, trials: int, **extra: Any) -> StudySpec:
    space = tmp_path / "space.toml"
    space.write_text("[space.learning_rate]\nlow = 1e-4\nhigh = 1e-2\nlog = true\n")
    fields: dict[str, Any] = {
        "study_name": "s",
        "storage": sqlite_url(tmp_path),
        "study_dir": str(tmp_path),
        "preset": "cartpole",
        "settings": {"runs_dir": str(tmp_path / "runs")},
        "fixed_names": [],
        "space_path": str(space),
        "trials": trials,
        "pruner": "none",
        "heartbeat_s": 1,
        "sampler_seed": 0,
    }
    return StudySpec(**{**fields, **extra})


def _states(spec: StudySpec) -> list[str]:
    study = optuna.load_study(study_name=spec.study_name, storage=spec.storage)
    return [trial.state.name for trial in study.get_trials()]


def test_a_worker_runs_the_study_to_its_trial_count_and_a_crashing_trial_is_fail(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path, trials=3)
    train = FakeTrain(crash=(1,))
    run_worker(spec, train, (FakeTrainingFailed,))
    study = optuna.load_study(study_name="s", storage=spec.storage)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert trials[1].user_attrs["error"] == (
        "FakeTrainingFailed: oakemu train exited with status 1 after 0 updates"
    )
    assert trials[0].value == pytest.approx(1000.0 * trials[0].params["learning_rate"])
    assert [call["run_name"] for call in train.calls] == ["trial-0", "trial-1", "trial-2"]
    assert trials[2].user_attrs["run_dir"] == str(tmp_path / "runs" / "trial-2")
    run_worker(spec, train, (FakeTrainingFailed,))  # the study has its 3 trials: nothing more runs
    assert len(train.calls) == 3
    run_worker(_spec(tmp_path, trials=4), train, (FakeTrainingFailed,))  # a larger count goes on
    assert _states(spec) == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]


def test_a_worker_starts_no_trial_after_its_timeout(tmp_path: Path) -> None:
    train = FakeTrain()

    def slow_train(**arguments: Any) -> FakeRun:
        time.sleep(0.5)
        return train(**arguments)

    run_worker(_spec(tmp_path, trials=10, timeout_s=0.2), slow_train, ())
    assert _states(_spec(tmp_path, trials=10)) == [
        "COMPLETE"
    ]  # the one started in time ran to its end


def test_an_unexpected_error_of_a_trial_stops_the_worker_and_the_trial_is_fail(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path, trials=3)
    with pytest.raises(FakeTrainingFailed):
        run_worker(spec, FakeTrain(crash=(0,)), ())
    assert _states(spec) == ["FAIL"]


def test_the_objective_train_uses_the_training_return_and_a_run_without_one_fails(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path, trials=1, objective="train")
    run_worker(spec, lambda preset, callbacks, verbose, **settings: FakeRun(None, 42.0), ())
    trial = optuna.load_study(study_name="s", storage=spec.storage).get_trials()[0]
    assert trial.state.name == "COMPLETE" and trial.value == 42.0
    (tmp_path / "b").mkdir()
    other = _spec(tmp_path / "b", trials=1)
    run_worker(other, lambda preset, callbacks, verbose, **settings: FakeRun(None), ())
    trial = optuna.load_study(study_name="s", storage=other.storage).get_trials()[0]
    assert trial.state.name == "FAIL" and "no evaluation" in trial.user_attrs["error"]


class AlwaysPrune(optuna.pruners.BasePruner):
    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return True


def test_the_pruning_callback_reports_each_evaluation_and_stops_a_run_the_pruner_prunes() -> None:
    study = optuna.create_study(direction="maximize", pruner=AlwaysPrune())
    trial = study.ask()
    callback = PruningCallback(trial)
    assert callback.on_evaluation(_evaluation(1000, 5.0)) is False
    assert callback.pruned_at == 1000
    assert callback.on_evaluation(_evaluation(1000, 7.0)) is None  # a step reported once only
    keep = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner()).ask()
    going = PruningCallback(keep)
    assert going.on_evaluation(_evaluation(500, 1.0)) is None
    assert going.on_evaluation(_evaluation(900, 2.0)) is None and going.pruned_at is None
    assert study.trials[0].intermediate_values == {1000: 5.0}


def test_a_run_the_pruner_stops_only_as_it_ends_counts_as_complete(tmp_path: Path) -> None:
    """A pruner that says "prune" at a run's last evaluation stops nothing: the run trained its budget."""
    spec = _spec(tmp_path, trials=2)
    spec.settings["total_env_steps"] = 4000

    def train(preset: str | None, callbacks: list[Any], verbose: int, **settings: Any) -> FakeRun:
        last = 1000 if settings["run_name"] == "trial-0" else 4000  # where the pruner's stop lands
        stopped = callbacks[0].on_evaluation(_evaluation(last, 3.0)) is False
        return FakeRun(3.0, global_step=last, stopped_by_callback=stopped)

    study = optuna.create_study(direction="maximize", pruner=AlwaysPrune())
    study.optimize(make_objective(spec, train, ()), n_trials=2)
    assert [trial.state.name for trial in study.trials] == ["PRUNED", "COMPLETE"]
    assert study.trials[1].value == 3.0


def test_a_trial_whose_run_the_pruner_stopped_is_pruned(tmp_path: Path) -> None:
    spec = _spec(tmp_path, trials=7, pruner="median", warmup_env_steps=0)
    run_worker(spec, FakeTrain(), ())
    study = optuna.load_study(study_name="s", storage=spec.storage)
    states = [trial.state.name for trial in study.get_trials()]
    assert states[:5] == ["COMPLETE"] * 5  # the median pruner's startup trials
    assert len(states) == 7 and set(states) == {"COMPLETE", "PRUNED"}  # seed 0: trial 5 is pruned
    for trial in study.get_trials():
        if trial.state.name == "PRUNED":  # stopped at its evaluation below the others' median
            assert list(trial.intermediate_values) == [1000]
            assert trial.user_attrs["env_steps"] == 1000 and trial.value is not None


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")
def test_a_dead_workers_trial_is_failed_after_its_heartbeats_stop_and_the_study_goes_on(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path, trials=2)
    study = open_study(spec)
    stale = study.ask()  # a trial whose worker sent one heartbeat, then died
    study._storage.record_heartbeat(stale._trial_id)
    started = time.monotonic()
    run_worker(spec, FakeTrain(), ())
    assert _states(spec) == ["FAIL", "COMPLETE"]
    assert time.monotonic() - started >= 2.0  # it waited for the grace period (3 heartbeats of 1 s)


def test_a_study_keeps_its_objective(tmp_path: Path) -> None:
    open_study(_spec(tmp_path, trials=1))
    with pytest.raises(ConfigError, match="study 's' measures 'eval'.*received 'train'"):
        open_study(_spec(tmp_path, trials=1, objective="train"))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("notaurl", "storage: cannot open notaurl: Could not parse"),
        ("nosuchdb://host/db", "storage: cannot open nosuchdb://host/db: Can't load plugin"),
        ("sqlite:////nonexistent-folder/study.db", "unable to open database file"),
        ("mysql://user:secret@127.0.0.1:1/db", "pip install 'mysqlclient'"),
        (
            "postgresql+psycopg://user:secret@127.0.0.1:1/db",
            "postgresql+psycopg://user:***@127.0.0.1:1/db",
        ),
    ],
)
def test_a_bad_storage_is_one_line_without_the_password(url: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        open_storage(url)
    text = str(raised.value)
    assert message in text and "\n" not in text and "secret" not in text

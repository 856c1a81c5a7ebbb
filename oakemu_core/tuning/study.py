"""An Optuna study of training runs: its storage, its trials' objective, and the loop of one worker.

A study lives in a database (Optuna's ``RDBStorage``): by default a SQLite file in the study folder
(:func:`sqlite_url`), or any SQLAlchemy URL (PostgreSQL, MySQL) shared by workers on several machines.
Every worker runs :func:`run_worker` on the same :class:`StudySpec`: it takes the next trial of the study,
trains one run with the trial's settings (an ordinary run folder, ``<study folder>/runs/trial-<n>``) and
records its objective, until the study holds ``trials`` finished trials. A trial that crashes (the run did
not train its budget, its settings are refused) is FAIL and the worker goes on; a pruned trial (its
evaluations fall below the other trials', :func:`make_pruner`) is PRUNED.

A worker's trial sends heartbeats to the storage every ``heartbeat_s`` seconds (a thread of Optuna's); a
trial whose heartbeat is :data:`GRACE_HEARTBEATS` heartbeats late (its worker was killed) is set to FAIL
by the next worker that looks, so that no trial stays RUNNING for good.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy.exc
from sqlalchemy.engine import make_url

from oakemu_core.config import make_config
from oakemu_core.errors import ConfigError
from oakemu_core.presets import load_preset
from oakemu_core.run.callbacks import Callback, EvaluationInfo
from oakemu_core.tuning.search_space import load_space

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "OBJECTIVES",
    "PRUNERS",
    "PruningCallback",
    "StudySpec",
    "TrialError",
    "make_objective",
    "make_pruner",
    "open_storage",
    "open_study",
    "redacted",
    "run_worker",
    "sqlite_url",
]

STUDY_DB = "study.db"
"""The default storage's file in the study folder."""
DEFAULT_HEARTBEAT_S = 10
"""Seconds between a running trial's heartbeats."""
GRACE_HEARTBEATS = 3
"""A running trial whose last heartbeat is this many heartbeats old is failed (its worker is gone)."""
STARTUP_TRIALS = 5
"""Trials sampled at random before TPE models the results, and before the median pruner prunes."""
OBJECTIVES = {
    "eval": "the final evaluation's mean return",
    "train": "the mean training return of the last 100 episodes",
}
"""``--objective`` -> what a trial's value is (:func:`objective_value`); the study maximises it."""
PRUNERS = ("median", "halving", "none")
SQLITE_TIMEOUT_S = 60
"""How long a SQLite connection waits for another worker's write to end."""
CONNECT_TIMEOUT_S = 10


class TrialError(RuntimeError):
    """A trial's run ended without a value for the objective (no evaluation, no finished episode)."""


@dataclass
class StudySpec:
    """What every worker of a study needs, the same for all of them (a JSON file for worker processes).

    Attributes:
        study_name: the study's name in the storage.
        storage: the storage's SQLAlchemy URL.
        study_dir: the study folder (outputs; the trials' run folders below ``runs/`` unless ``runs_dir``
            is among ``settings``).
        preset: the preset the trials start from, or None.
        settings: the settings every trial is given (field name -> value; JSON values), ``runs_dir``
            included.
        fixed_names: the settings of ``best.toml`` besides the space's: those the preset, ``--config``,
            ``OAKEMU_*`` variables and options gave.
        space_path: the search space's TOML file.
        trials: the study's trial count: finished trials (complete, pruned or failed) over every worker,
            earlier calls included.
        timeout_s: a worker starts no trial after this many seconds (None: no limit).
        objective: a key of :data:`OBJECTIVES`.
        pruner: one of :data:`PRUNERS`.
        warmup_env_steps: the median pruner prunes no trial before this many env steps.
        heartbeat_s: seconds between a running trial's heartbeats.
        sampler_seed: the TPE sampler's seed (None: from the OS).
        jobs: workers this machine runs.
    """

    study_name: str
    storage: str
    study_dir: str
    preset: str | None
    settings: dict[str, Any]
    fixed_names: list[str]
    space_path: str
    trials: int
    timeout_s: float | None = None
    objective: str = "eval"
    pruner: str = "median"
    warmup_env_steps: int = 0
    heartbeat_s: int = DEFAULT_HEARTBEAT_S
    sampler_seed: int | None = None
    jobs: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=str)

    @classmethod
    def from_json(cls, text: str) -> StudySpec:
        return cls(**json.loads(text))


def sqlite_url(study_dir: str | Path) -> str:
    """The default storage: ``sqlite:///<study_dir>/study.db`` (absolute)."""
    return f"sqlite:///{(Path(study_dir) / STUDY_DB).resolve()}"


def redacted(url: str) -> str:
    """``url`` with its password hidden (for messages); ``url`` itself when it does not parse."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return url


def open_storage(url: str, heartbeat_s: int = DEFAULT_HEARTBEAT_S) -> optuna.storages.RDBStorage:
    """The study database at ``url`` (created with its tables when new), with heartbeats every
    ``heartbeat_s`` seconds and a grace period of :data:`GRACE_HEARTBEATS` heartbeats.

    Raises:
        ConfigError: the URL does not parse, names an unknown database or one whose driver is not
            installed, or the database cannot be reached or opened (one line).
    """
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        engine_kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    elif url.startswith("postgresql"):
        engine_kwargs = {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    for attempt in range(3):
        try:
            with warnings.catch_warnings():  # heartbeat_interval is marked experimental
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    url,
                    engine_kwargs=engine_kwargs,
                    heartbeat_interval=int(heartbeat_s),
                    grace_period=GRACE_HEARTBEATS * int(heartbeat_s),
                )
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            if attempt == 2:  # workers creating the tables of a new database at once: try again
                raise
            time.sleep(1.0)
        except ImportError as error:
            raise ConfigError(_missing_driver(url, error)) from None
        except (sqlalchemy.exc.SQLAlchemyError, ValueError) as error:
            reason = str(getattr(error, "orig", None) or error).strip().splitlines()
            raise ConfigError(
                f"storage: cannot open {redacted(url)}: {reason[0] if reason else type(error).__name__}"
            ) from None
    raise AssertionError("unreachable")


DRIVERS = {
    "psycopg": "psycopg[binary]",
    "psycopg2": "psycopg2-binary",
    "MySQLdb": "mysqlclient",
    "pymysql": "pymysql",
}
"""The pip package of a database driver SQLAlchemy imports (the module it names -> the package)."""


def _missing_driver(url: str, error: ImportError) -> str:
    """The error for a storage whose driver is not installed, naming the package to install."""
    cause = error.__cause__ if isinstance(error.__cause__, ImportError) else error
    module = (getattr(cause, "name", None) or "").split(".")[0]
    package = DRIVERS.get(module, module or "its driver")
    return (
        f"storage: the database driver of {redacted(url)} is not installed ({cause}): pip install "
        f"'{package}' (PostgreSQL: postgresql+psycopg:// URLs with pip install 'psycopg[binary]')"
    )


def make_pruner(kind: str, warmup_env_steps: int = 0) -> optuna.pruners.BasePruner:
    """``median``: prune a trial whose evaluation is below the median of the other trials' at the same
    env step, after :data:`STARTUP_TRIALS` trials and ``warmup_env_steps`` env steps; ``halving``:
    asynchronous successive halving (rungs from the first trial's env steps); ``none``: never."""
    if kind == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=STARTUP_TRIALS, n_warmup_steps=warmup_env_steps
        )
    if kind == "halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    if kind == "none":
        return optuna.pruners.NopPruner()
    raise ConfigError(f"pruner: expected one of {', '.join(PRUNERS)}, received {kind!r}")


def open_study(spec: StudySpec, storage: optuna.storages.BaseStorage | None = None) -> optuna.Study:
    """The study ``spec`` names, created when the storage holds none of that name (maximised; TPE
    sampler; :func:`make_pruner`). Optuna's own log lines are turned off (errors only): the study's
    processes print a line per trial of their own.

    Raises:
        ConfigError: the storage cannot be opened (:func:`open_storage`), or the study measures
            another objective than ``spec.objective``.
    """
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = storage or open_storage(spec.storage, spec.heartbeat_s)
    study = optuna.create_study(
        storage=storage,
        study_name=spec.study_name,
        direction="maximize",
        sampler=optuna.samplers.TPESampler(n_startup_trials=STARTUP_TRIALS, seed=spec.sampler_seed),
        pruner=make_pruner(spec.pruner, spec.warmup_env_steps),
        load_if_exists=True,
    )
    recorded = study.user_attrs.get("objective")
    if recorded is None:
        study.set_user_attr("objective", spec.objective)
    elif recorded != spec.objective:
        raise ConfigError(
            f"objective: study {spec.study_name!r} measures {recorded!r} ({OBJECTIVES.get(recorded, '?')}); "
            f"received {spec.objective!r} (give --objective {recorded}, or another --study)"
        )
    return study


class PruningCallback(Callback):
    """A ``train`` callback that reports each evaluation's mean return to an Optuna trial
    (``trial.report(value, step=global_step)``) and stops the run when the trial's pruner says so.

    Attributes:
        pruned_at: the env step of the evaluation after which the pruner stopped the run (None: not
            pruned).
    """

    def __init__(self, trial: optuna.Trial) -> None:
        self.trial = trial
        self.pruned_at: int | None = None
        self._last_step = -1

    def on_evaluation(self, info: EvaluationInfo) -> bool | None:
        if info.global_step <= self._last_step:  # one value per step (Optuna keeps the first)
            return None
        self._last_step = info.global_step
        self.trial.report(info.return_mean, step=info.global_step)
        if self.pruned_at is None and self.trial.should_prune():
            self.pruned_at = info.global_step
            return False
        return None


def objective_value(run: Any, objective: str) -> float | None:
    """A finished run's value of ``objective`` (:data:`OBJECTIVES`): ``eval``: its final evaluation's mean
    return (``Run.final_evaluation``); ``train``: its last update's mean training return over the last 100
    episodes (``Run.episodic_return``). None when the run has none."""
    return run.final_evaluation if objective == "eval" else run.episodic_return


def _one_line(error: BaseException) -> str:
    text = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def make_objective(
    spec: StudySpec, train: Callable[..., Any], failures: tuple[type[Exception], ...]
) -> Callable[[optuna.Trial], float]:
    """The study's objective: sample the trial's settings from the space, train a run with them
    (``train(preset=..., callbacks=[PruningCallback], verbose=0, **settings)``: the Python API's
    ``oakemu_core.train``) in ``<runs_dir>/trial-<number>`` and return :func:`objective_value`.

    The trial's user attributes record ``run_dir``, ``worker`` (``host:pid``), ``env_steps`` and, for a
    failed trial, ``error`` (one line). ``failures`` (and :class:`TrialError`) are re-raised after being
    recorded (the worker's ``study.optimize`` catches them: FAIL). A run the pruner stopped before its
    budget raises ``optuna.TrialPruned``; one whose stop came as it ended (its last evaluation) trained
    its whole budget and is scored as complete."""
    space = load_space(spec.space_path)
    runs_dir = Path(spec.settings["runs_dir"])
    base = load_preset(spec.preset).settings if spec.preset is not None else {}

    def objective(trial: optuna.Trial) -> float:
        params = space.suggest(trial)
        run_name = f"trial-{trial.number}"
        trial.set_user_attr("run_dir", str(runs_dir / run_name))
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        pruning = PruningCallback(trial)
        settings = {**spec.settings, "run_name": run_name, **params}
        try:
            run = train(preset=spec.preset, callbacks=[pruning], verbose=0, **settings)
        except (*failures, TrialError) as error:
            trial.set_user_attr("error", _one_line(error))
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("error", "stopped by a signal")
            raise
        trial.set_user_attr("env_steps", run.global_step)
        stopped_early = run.global_step < make_config(base, **settings).total_env_steps
        if run.stopped_by_callback and pruning.pruned_at is not None and stopped_early:
            raise optuna.TrialPruned(f"pruned after {pruning.pruned_at} env steps")
        value = objective_value(run, spec.objective)
        if value is None:
            why = "no evaluation" if spec.objective == "eval" else "no finished episode"
            message = f"the run recorded {why}: no value for the objective {spec.objective!r}"
            trial.set_user_attr("error", message)
            raise TrialError(message)
        return float(value)

    return objective


def claimed(trials: Iterable[optuna.trial.FrozenTrial]) -> int:
    """Trials running or finished (a waiting, enqueued trial is not taken yet)."""
    return sum(trial.state != optuna.trial.TrialState.WAITING for trial in trials)


def finished(trials: Iterable[optuna.trial.FrozenTrial]) -> int:
    """Trials complete, pruned or failed."""
    return sum(trial.state.is_finished() for trial in trials)


def run_worker(
    spec: StudySpec,
    train: Callable[..., Any],
    failures: tuple[type[Exception], ...],
    *,
    on_progress: Callable[[list[optuna.trial.FrozenTrial]], None] | None = None,
) -> None:
    """Run trials of the study until it holds ``spec.trials`` finished trials or ``spec.timeout_s`` has
    passed (a trial started before then runs to its end).

    Before each trial the worker fails the stale trials of dead workers; while every remaining trial is
    running elsewhere it waits (a heartbeat at a time) for them to finish or go stale. ``on_progress``
    is called with the study's trials before each step (progress lines).

    Raises:
        ConfigError: the storage or the study cannot be opened (:func:`open_study`).
        KeyboardInterrupt: a signal stopped the worker (its trial is FAIL).
    """
    study = open_study(spec)
    objective = make_objective(spec, train, failures)
    deadline = None if spec.timeout_s is None else time.monotonic() + spec.timeout_s
    while True:
        with warnings.catch_warnings():  # marked experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        trials = study.get_trials(deepcopy=False)
        if on_progress is not None:
            on_progress(trials)
        if finished(trials) >= spec.trials:
            return
        if deadline is not None and time.monotonic() >= deadline:
            return
        if (
            claimed(trials) >= spec.trials
        ):  # the rest run elsewhere: wait for them to end or go stale
            time.sleep(spec.heartbeat_s)
            continue
        study.optimize(objective, n_trials=1, catch=(*failures, TrialError), gc_after_trial=False)

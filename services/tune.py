"""``oakemu tune``: a hyperparameter study of training runs on Optuna (the Python API's ``oakemu_core.tune``).

    oakemu tune --preset cartpole --trials 20
    oakemu tune --preset cartpole --storage postgresql+psycopg://user:password@db/optuna --study cartpole
        # the same command on each machine; PostgreSQL's driver: pip install 'psycopg[binary]'

Three phases, one function each:

1. :func:`plan_study` checks everything that can refuse the study (the preset, the settings every trial
   gets, the env, the search space against those settings, the storage) before any trial runs, then
   creates the study in its storage (or loads it: several commands on one storage share one study);
2. :func:`run_here` runs the trials in this process (``--jobs 1``), or :func:`run_workers` starts
   ``--jobs`` worker processes (``python -m oakemu_services.tune SPEC``), each running the same loop
   (:func:`oakemu_core.tuning.study.run_worker`) on the same storage as workers on other machines do,
   each on its own share of the CPUs, and prints a progress line as each trial ends. Each trial is an
   ordinary run (:func:`oakemu_services.api.train`) in ``<study folder>/runs/trial-<n>``;
3. :func:`finish` prints the table of trials and writes the study folder's outputs: ``trials.csv``,
   ``best.toml`` (``oakemu train --config``), ``best-preset.toml`` and ``plots/``.

A worker dies with the process that started it (Linux parent-death signal): its trial's run stops as
after Ctrl-C and the trial is FAIL. A worker killed outright (``kill -9``) leaves its trial RUNNING
until its heartbeats are missed: another worker then fails it, and the trial's learner and actors,
which die with their launcher (the worker), stop with a final checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from oakemu_services import api
from oakemu_services import train as launcher
from oakemu_services.train_view import print_line
from pydantic_settings import EnvSettingsSource
from rich.console import Console
from rich.table import Table

from oakemu_core.actor.fitting import available_cpus
from oakemu_core.config import CONFIG_FILE_ENV_VAR, OakEmuConfig, make_config
from oakemu_core.errors import ConfigError, UserError
from oakemu_core.presets import load_preset
from oakemu_core.tuning.outputs import (
    PLOTS_DIR,
    TRIALS_CSV,
    TrialRow,
    best_settings,
    best_trial,
    describe_params,
    progress_line,
    trial_rows,
    write_best_files,
    write_plots,
    write_trials_csv,
)
from oakemu_core.tuning.search_space import default_space_path, load_space
from oakemu_core.tuning.study import (
    DEFAULT_HEARTBEAT_S,
    OBJECTIVES,
    PRUNERS,
    StudySpec,
    open_storage,
    open_study,
    redacted,
    run_worker,
    sqlite_url,
)

__all__ = ["TuneResult", "fit_jobs", "main", "plan_study", "tune"]

DEFAULT_TRIALS = 20
STUDIES_DIR = Path("studies")
SPEC_FILE = "study.json"
"""The study folder's record of what its trials run with (and what worker processes read)."""
MIN_CPUS_PER_TRIAL = 2
"""CPUs a trial needs at least: its learner and one actor."""
POLL_S = 2.0
"""Seconds between two looks at the storage while worker processes run."""
WORKER_STOP_S = 90.0
"""How long stopped workers may take: their trial's learner writes its final checkpoint."""
TRIAL_FAILURES: tuple[type[Exception], ...] = (api.TrainingFailed, UserError)
"""What a trial's run may raise that fails the trial, not the worker: a run that did not train its
budget, settings the run refused."""


@dataclass(frozen=True)
class TuneResult:
    """A study's outcome, as its folder records it.

    Attributes:
        study_name, storage, study_dir: the study's name, its storage URL and folder.
        trials: every trial of the study, by number.
        best_trial, best_value, best_params: the complete trial of the highest objective, its value and
            sampled settings (None, None, {} without a complete trial).
        best_settings: the best trial's settings as ``best.toml`` holds them.
        best_config, best_preset: ``best.toml`` and ``best-preset.toml`` (None without a complete trial).
        plots: the plot files written.
    """

    study_name: str
    storage: str
    study_dir: Path
    trials: list[TrialRow]
    best_trial: int | None = None
    best_value: float | None = None
    best_params: dict[str, Any] = field(default_factory=dict)
    best_settings: dict[str, Any] = field(default_factory=dict)
    best_config: Path | None = None
    best_preset: Path | None = None
    plots: list[Path] = field(default_factory=list)

    def load_study(self) -> optuna.Study:
        """The Optuna study itself (``study.trials_dataframe()``, ``optuna.visualization``)."""
        return optuna.load_study(study_name=self.study_name, storage=self.storage)


def fit_jobs(cpus: int, trials: int) -> int:
    """Trials run at once on ``cpus`` CPUs (``--jobs auto``): one per :data:`MIN_CPUS_PER_TRIAL` CPUs (a
    learner and at least one actor each; each worker's trials fit their actors to its share), at least
    1, at most ``trials``. 2 CPUs: 1; 8: 4; 16: 8."""
    return max(1, min(trials, cpus // MIN_CPUS_PER_TRIAL))


def _folder_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "study"


def _given_names(preset_settings: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """The settings the preset, the TOML file (``config_file`` or ``$OAKEMU_CONFIG_FILE``), the
    ``OAKEMU_*`` variables and ``settings`` give, in that order (``best.toml`` writes them)."""
    names = dict.fromkeys(preset_settings)
    config_file = settings.get("config_file") or os.environ.get(CONFIG_FILE_ENV_VAR)
    if config_file:
        with open(config_file, "rb") as file:
            names.update(dict.fromkeys(tomllib.load(file)))
    names.update(dict.fromkeys(EnvSettingsSource(OakEmuConfig)()))
    names.update(dict.fromkeys(settings))
    return [name for name in names if name in OakEmuConfig.model_fields]


def _check_choices(
    trials: int, timeout_s: float | None, objective: str, pruner: str, heartbeat_s: int
) -> None:
    if trials < 1:
        raise ConfigError(f"trials: expected an integer >= 1, received {trials!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(f"timeout: expected a number of seconds > 0, received {timeout_s!r}")
    if objective not in OBJECTIVES:
        raise ConfigError(
            f"objective: expected one of {', '.join(OBJECTIVES)}, received {objective!r}"
        )
    if pruner not in PRUNERS:
        raise ConfigError(f"pruner: expected one of {', '.join(PRUNERS)}, received {pruner!r}")
    if int(heartbeat_s) < 1:
        raise ConfigError(f"heartbeat: expected seconds >= 1, received {heartbeat_s!r}")


def _create(spec: StudySpec, folder: Path, *, own_database: bool) -> None:
    """Create the study in its storage (the database's tables too, once, before any worker) or load it,
    and write ``study.json``. A continued study's seeded sampler starts past the trials it holds, so it
    does not draw the first trials' settings again."""
    if own_database:
        folder.mkdir(parents=True, exist_ok=True)
    existing = len(open_study(spec).trials)
    if spec.sampler_seed is not None:
        spec.sampler_seed += existing
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SPEC_FILE).write_text(spec.to_json(), encoding="utf-8")


def plan_study(
    preset: str | None = None,
    settings: dict[str, Any] | None = None,
    *,
    space: str | Path | None = None,
    trials: int = DEFAULT_TRIALS,
    timeout_s: float | None = None,
    storage: str | None = None,
    study: str | None = None,
    study_dir: str | Path | None = None,
    objective: str = "eval",
    pruner: str = "median",
    jobs: int | str = 1,
    heartbeat_s: int = DEFAULT_HEARTBEAT_S,
) -> StudySpec:
    """Check the study and create it in its storage (or load it); nothing runs yet. See :func:`tune`
    for the arguments.

    Raises:
        UserError (a subclass, one line): an unknown preset, a setting refused (``run_name`` among
            them: each trial names its run folder), an env that cannot start, a bad search space file, an
            objective without evaluations (``eval_every_updates`` 0), a bad storage URL or a database that
            cannot be reached, a study of that name measuring another objective.
    """
    _check_choices(trials, timeout_s, objective, pruner, heartbeat_s)
    settings = {
        key: str(value) if isinstance(value, Path) else value
        for key, value in (settings or {}).items()
    }
    if settings.get("run_name") is not None:
        raise ConfigError(
            f"run_name: each trial names its own run folder (trial-<n>), received {settings['run_name']!r}"
        )
    settings.pop("run_name", None)
    base = load_preset(preset).settings if preset is not None else {}
    config = make_config(base, **settings)
    if objective == "eval" and config.eval_every_updates == 0:
        raise ConfigError(
            "objective: 'eval' needs periodic evaluations, received eval_every_updates=0 (use --objective "
            "train, or --eval-every-updates N)"
        )
    launcher.check_can_start(config)
    name = study or (preset if preset is not None else _folder_name(config.env_id))
    folder = Path(study_dir) if study_dir is not None else STUDIES_DIR / _folder_name(name)
    settings.setdefault("runs_dir", str((folder / "runs").resolve()))
    space_path = Path(space) if space is not None else default_space_path(config.env_id)
    load_space(space_path).check(lambda **params: make_config(base, **{**settings, **params}))
    cpus = available_cpus()
    count = fit_jobs(cpus, trials) if jobs == "auto" else int(jobs)
    if count < 1:
        raise ConfigError(f"jobs: expected 'auto' or an integer >= 1, received {jobs!r}")
    spec = StudySpec(
        study_name=name,
        storage=storage or sqlite_url(folder),
        study_dir=str(folder.resolve()),
        preset=preset,
        settings=settings,
        fixed_names=_given_names(base, settings),
        space_path=str(space_path.resolve()),
        trials=int(trials),
        timeout_s=None if timeout_s is None else float(timeout_s),
        objective=objective,
        pruner=pruner,
        warmup_env_steps=config.total_env_steps // 3,
        heartbeat_s=int(heartbeat_s),
        sampler_seed=config.seed if count == 1 and storage is None else None,
        jobs=count,
    )
    _create(spec, folder, own_database=storage is None)
    return spec


class ProgressLines:
    """Prints :func:`~oakemu_core.tuning.outputs.progress_line` once for each trial that ends, but those
    of ``finished_before`` (the trials that had ended when the study started here)."""

    def __init__(self, console: Console, spec: StudySpec, finished_before: set[int]) -> None:
        self.console = console
        self.spec = spec
        self.started = time.monotonic()
        self.seen = set(finished_before)

    def __call__(self, trials: Sequence[optuna.trial.FrozenTrial]) -> None:
        ended = [t for t in trials if t.state.is_finished() and t.number not in self.seen]
        for row in trial_rows(ended):
            self.seen.add(row.number)
            elapsed = time.monotonic() - self.started
            line = progress_line(row, trials, self.spec.trials, self.spec.jobs, elapsed)
            print_line(self.console, line, "red" if row.state == "FAIL" else None)


def _load(spec: StudySpec) -> optuna.Study:
    """The study, for reading (progress lines, outputs)."""
    storage = open_storage(spec.storage, spec.heartbeat_s)
    return optuna.load_study(study_name=spec.study_name, storage=storage)


def _progress(spec: StudySpec, console: Console, verbose: int) -> ProgressLines | None:
    if verbose <= 0:
        return None
    done = {t.number for t in _load(spec).get_trials(deepcopy=False) if t.state.is_finished()}
    return ProgressLines(console, spec, done)


def announce(spec: StudySpec, console: Console) -> None:
    """The study's first lines: what it runs, where, and the space it samples."""
    space = load_space(spec.space_path)
    budget = make_config(
        load_preset(spec.preset).settings if spec.preset else {}, **spec.settings
    ).total_env_steps
    jobs = f"{spec.jobs} worker processes" if spec.jobs > 1 else "one trial at a time"
    print_line(
        console,
        f"oakemu tune: study {spec.study_name!r} in {redacted(spec.storage)}: {spec.trials} trials of "
        f"{budget} env steps, objective {spec.objective} ({OBJECTIVES[spec.objective]}), pruner "
        f"{spec.pruner}, {jobs} -> {spec.study_dir}",
    )
    print_line(
        console,
        f"space {space.source}: "
        + "; ".join(parameter.describe() for parameter in space.parameters),
    )


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_here(spec: StudySpec, console: Console, verbose: int = 1) -> None:
    """Run the study's trials in this process (``--jobs 1``), a progress line after each.

    Raises:
        KeyboardInterrupt: Ctrl-C or SIGTERM stopped the study (the running trial is FAIL).
    """
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        run_worker(spec, api.train, TRIAL_FAILURES, on_progress=_progress(spec, console, verbose))
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cpu_shares(jobs: int) -> list[list[int]] | None:
    """The CPUs of each of ``jobs`` workers: contiguous equal shares of this process's CPUs (None: fewer
    CPUs than workers, no pinning)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < jobs:
        return None
    size = len(cpus) // jobs
    return [cpus[index * size : (index + 1) * size] for index in range(jobs)]


def _start_worker(spec: StudySpec, cpus: list[int] | None) -> subprocess.Popen[bytes]:
    """A worker process of the study (:func:`worker_main`), in a session of its own (a Ctrl-C reaches
    only this process, which stops the workers), dying with this process."""
    spec_file = Path(spec.study_dir) / SPEC_FILE
    command = [sys.executable, "-m", "oakemu_services.tune", str(spec_file)]
    command += ["--parent", str(os.getpid())] + (
        ["--cpus", ",".join(map(str, cpus))] if cpus else []
    )
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)


def run_workers(spec: StudySpec, console: Console, verbose: int = 1) -> bool:
    """Run ``spec.jobs`` worker processes on the study until they all exit, each on its share of the
    CPUs (:func:`_cpu_shares`); a progress line as each trial ends (read from the storage every
    :data:`POLL_S`). Ctrl-C or SIGTERM stops the workers (each trial's run stops with a final
    checkpoint; the trials are FAIL). Returns True when a signal stopped the study."""
    stopped: list[int] = []
    handlers = {
        signum: signal.signal(signum, lambda signum, _frame: stopped.append(signum))
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    workers: list[subprocess.Popen[bytes]] = []
    try:
        study, progress = _load(spec), _progress(spec, console, verbose)
        shares = _cpu_shares(spec.jobs)
        workers = [_start_worker(spec, shares[i] if shares else None) for i in range(spec.jobs)]
        deadline = None
        while any(worker.poll() is None for worker in workers):
            if stopped and deadline is None:
                print_line(console, "stopping: the workers' runs write their final checkpoints ...")
                for worker in workers:
                    with contextlib.suppress(ProcessLookupError):
                        worker.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + WORKER_STOP_S
            if deadline is not None and time.monotonic() > deadline:
                break
            if progress is not None:
                progress(study.get_trials(deepcopy=False))
            time.sleep(POLL_S)
        if progress is not None:
            progress(study.get_trials(deepcopy=False))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return bool(stopped)


def print_table(console: Console, rows: Sequence[TrialRow]) -> None:
    """The trials as a table: number, state, objective, wall time, settings (or why it failed)."""
    table = Table(title="trials", show_lines=False, highlight=False)
    for column in ("trial", "state", "objective", "wall", "settings"):
        table.add_column(column, overflow="fold")
    for row in rows:
        value = "" if row.value is None else f"{row.value:.4g}"
        wall = "" if row.wall_s is None else f"{row.wall_s:.0f} s"
        what = describe_params(row.params) + (f" | {row.error}" if row.error else "")
        table.add_row(str(row.number), row.state, value, wall, what)
    console.print(table)


def finish(spec: StudySpec, console: Console) -> TuneResult:
    """Print the table of trials and write the study folder's outputs (``trials.csv``; with a complete
    trial ``best.toml`` and ``best-preset.toml``; ``plots/``); returns the :class:`TuneResult`."""
    study = _load(spec)
    trials = study.get_trials(deepcopy=False)
    rows = trial_rows(trials)
    folder = Path(spec.study_dir)
    write_trials_csv(rows, folder / TRIALS_CSV)
    print_table(console, rows)
    best = best_trial(trials)
    result = TuneResult(spec.study_name, spec.storage, folder, rows)
    print_line(console, f"trials: {folder / TRIALS_CSV}")
    if best is not None:
        settings = best_settings(spec, best)
        config_path, preset_path = write_best_files(folder, spec, best, settings)
        print_line(
            console,
            f"best: trial {best.number}, objective {best.value:.6g} ({describe_params(best.params)})",
        )
        print_line(
            console,
            f"best settings: {config_path} (oakemu train --config {config_path}); "
            f"as a preset: {preset_path}",
        )
        result = dataclasses.replace(
            result,
            best_trial=best.number,
            best_value=best.value,
            best_params=dict(best.params),
            best_settings=settings,
            best_config=config_path,
            best_preset=preset_path,
        )
    else:
        print_line(console, "no trial completed: no best settings", "red")
    plots, notes = write_plots(study, folder / PLOTS_DIR)
    if plots:
        print_line(console, "plots: " + ", ".join(str(path) for path in plots))
    for note in notes:
        print_line(console, note)
    return dataclasses.replace(result, plots=plots)


def tune(
    preset: str | None = None,
    *,
    space: str | Path | None = None,
    trials: int = DEFAULT_TRIALS,
    timeout_s: float | None = None,
    storage: str | None = None,
    study: str | None = None,
    study_dir: str | Path | None = None,
    objective: str = "eval",
    pruner: str = "median",
    jobs: int | str = 1,
    heartbeat_s: int = DEFAULT_HEARTBEAT_S,
    verbose: int = 1,
    **settings: Any,
) -> TuneResult:
    """Run a hyperparameter study: ``trials`` training runs with settings sampled from ``space`` by
    Optuna's TPE sampler, each scored by ``objective`` and maximised; returns the :class:`TuneResult`.

    Args:
        preset: the preset every trial starts from (its budget is each trial's unless
            ``total_env_steps`` is given).
        space: a search space TOML file (:mod:`oakemu_core.tuning.search_space`); None: the default
            space for the env (rl-baselines3-zoo's PPO ranges).
        trials: the study's trial count: trials that ended (complete, pruned or failed), over every
            worker and machine, those of earlier calls on the same study included.
        timeout_s: start no trial after this many seconds (a running one ends first).
        storage: a SQLAlchemy database URL shared by workers on several machines (PostgreSQL:
            ``postgresql+psycopg://user:password@host/db``); None: ``<study_dir>/study.db`` (SQLite).
        study: the study's name (default: the preset's, else the env id's).
        study_dir: the study folder (default ``studies/<study>``).
        objective: ``eval``: the final evaluation's mean return; ``train``: the mean training return of
            the last 100 episodes.
        pruner: ``median`` (stop a trial whose evaluation is below the median of earlier trials' at the
            same env step, after 5 trials and a third of the budget), ``halving`` (asynchronous
            successive halving) or ``none``.
        jobs: trials run at once on this machine, each in a worker process of its own; ``"auto"``: one per
            2 CPUs (:func:`fit_jobs`).
        heartbeat_s: seconds between a running trial's heartbeats; a trial silent for 3 of them (its
            worker was killed) is failed by another worker.
        verbose: 1: a progress line per trial and the table of trials (stderr); 0: errors only.
        settings: settings every trial gets (``total_env_steps=50_000``, ``config_file=...``); the
            space's settings override them.

    Raises:
        UserError (a subclass, one line): see :func:`plan_study`; nothing ran.
        KeyboardInterrupt: Ctrl-C stopped the study, after its outputs were written.
    """
    spec = plan_study(
        preset, settings, space=space, trials=trials, timeout_s=timeout_s, storage=storage,
        study=study, study_dir=study_dir, objective=objective, pruner=pruner, jobs=jobs,
        heartbeat_s=heartbeat_s,
    )  # fmt: skip
    console = Console(stderr=True, quiet=verbose <= 0)
    announce(spec, console)
    interrupted = False
    try:
        if spec.jobs == 1:
            run_here(spec, console, verbose)
        else:
            interrupted = run_workers(spec, console, verbose)
    except KeyboardInterrupt:
        interrupted = True
    result = finish(spec, console)
    if interrupted:
        raise KeyboardInterrupt(f"the study was stopped; its folder is {spec.study_dir}")
    return result


def main(options: dict[str, Any], settings: dict[str, Any]) -> int:
    """``oakemu tune``: :func:`tune` with the command's ``options`` (its keyword arguments) and the
    training ``settings`` given. Exit status: 0 when a trial completed, 1 when none did, 130 after
    Ctrl-C (the outputs written first)."""
    try:
        result = tune(**options, **settings)
    except KeyboardInterrupt:
        return 130
    return 0 if result.best_trial is not None else 1


def _die_with(parent: int) -> None:
    """Ask Linux to send this process SIGTERM when ``parent`` (the ``oakemu tune`` that started it) dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def worker_main(argv: Sequence[str]) -> int:
    """A worker process: ``python -m oakemu_services.tune SPEC [--parent PID] [--cpus 0,1]`` runs the
    study of the :class:`StudySpec` file SPEC on those CPUs (:func:`run_worker`), quietly. Exit status 0,
    2 for a study it cannot open (one line), 130 when a signal stopped it."""
    import argparse

    parser = argparse.ArgumentParser(prog="oakemu tune worker")
    parser.add_argument("spec", type=Path)
    parser.add_argument("--parent", type=int, default=None)
    parser.add_argument("--cpus", default=None)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if args.parent is not None:
        _die_with(args.parent)
    if args.cpus:
        os.sched_setaffinity(0, [int(cpu) for cpu in args.cpus.split(",")])
    spec = StudySpec.from_json(args.spec.read_text(encoding="utf-8"))
    try:
        run_worker(spec, api.train, TRIAL_FAILURES)
    except UserError as error:
        print(f"oakemu tune worker: error: {error}", file=sys.stderr)
        return error.exit_status
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))

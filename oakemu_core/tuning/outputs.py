"""What a study writes into its folder, and the lines it prints: the table of trials (``trials.csv``),
the best settings as a ``--config`` file (``best.toml``) and as a preset file (``best-preset.toml``),
Optuna's plots (``plots/*.html``, plotly) and the progress line after each trial.

Every file is written atomically (workers on several machines may write the same study's outputs).
"""

from __future__ import annotations

import csv
import io
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from oakemu_core.config import (
    _toml_scalar as toml_value,  # the writer of config.toml: best.toml reads back the same way
)
from oakemu_core.config import make_config
from oakemu_core.presets import load_preset
from oakemu_core.run.run_folder import write_text_atomic
from oakemu_core.tuning.search_space import UNTUNABLE
from oakemu_core.tuning.study import OBJECTIVES, StudySpec

__all__ = [
    "TrialRow",
    "best_settings",
    "best_trial",
    "progress_line",
    "trial_rows",
    "write_best_files",
    "write_plots",
    "write_trials_csv",
]

TRIALS_CSV = "trials.csv"
BEST_TOML = "best.toml"
BEST_PRESET_TOML = "best-preset.toml"
PLOTS_DIR = "plots"
NOT_IN_BEST = UNTUNABLE
"""Settings ``best.toml`` leaves out: the trial's run folder is not the next run's."""
DEAD_WORKER = "no heartbeat: its worker stopped"
"""The reason shown for a FAIL trial that recorded none (a stale trial failed by another worker)."""


@dataclass(frozen=True)
class TrialRow:
    """One trial as the table shows it.

    Attributes:
        number: the trial's number in the study (0, 1, ...).
        state: ``COMPLETE``, ``PRUNED``, ``FAIL``, ``RUNNING`` or ``WAITING``.
        value: its objective (a pruned trial: its last evaluation's), None without one.
        params: the sampled settings.
        wall_s: seconds from its start to its end (None while running).
        env_steps: env steps its run trained (None when not recorded).
        run_dir: its run folder (on the machine of ``worker``).
        worker: ``host:pid`` of the worker that ran it.
        error: why it failed, one line ('' otherwise).
    """

    number: int
    state: str
    value: float | None
    params: dict[str, Any] = field(default_factory=dict)
    wall_s: float | None = None
    env_steps: int | None = None
    run_dir: str = ""
    worker: str = ""
    error: str = ""


def trial_rows(trials: Sequence[FrozenTrial]) -> list[TrialRow]:
    """The rows of ``trials``, by number."""
    rows = []
    for trial in sorted(trials, key=lambda item: item.number):
        attrs = trial.user_attrs
        error = str(attrs.get("error", ""))
        if trial.state == TrialState.FAIL and not error:
            error = DEAD_WORKER
        rows.append(
            TrialRow(
                number=trial.number,
                state=trial.state.name,
                value=trial.value if trial.value is not None else _last_report(trial),
                params=dict(trial.params),
                wall_s=_wall_s(trial),
                env_steps=attrs.get("env_steps"),
                run_dir=str(attrs.get("run_dir", "")),
                worker=str(attrs.get("worker", "")),
                error=error,
            )
        )
    return rows


def _last_report(trial: FrozenTrial) -> float | None:
    """A pruned trial's last evaluation (Optuna keeps no value for it when none was reported)."""
    if trial.state != TrialState.PRUNED or not trial.intermediate_values:
        return None
    return trial.intermediate_values[max(trial.intermediate_values)]


def _wall_s(trial: FrozenTrial) -> float | None:
    if trial.datetime_start is None or trial.datetime_complete is None:
        return None
    return (trial.datetime_complete - trial.datetime_start).total_seconds()


def best_trial(trials: Sequence[FrozenTrial]) -> FrozenTrial | None:
    """The complete trial of the highest value (the first of equals), None without one."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    return max(complete, key=lambda t: (t.value, -t.number)) if complete else None


def write_trials_csv(rows: Sequence[TrialRow], path: Path) -> None:
    """``trials.csv``: number, state, objective, wall_s, env_steps, one column per setting sampled,
    run_dir, worker, error."""
    names = sorted({name for row in rows for name in row.params})
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(
        [
            "number",
            "state",
            "objective",
            "wall_s",
            "env_steps",
            *names,
            "run_dir",
            "worker",
            "error",
        ]
    )
    for row in rows:
        writer.writerow(
            [
                row.number,
                row.state,
                "" if row.value is None else row.value,
                "" if row.wall_s is None else round(row.wall_s, 1),
                "" if row.env_steps is None else row.env_steps,
                *(row.params.get(name, "") for name in names),
                row.run_dir,
                row.worker,
                row.error,
            ]
        )
    write_text_atomic(path, out.getvalue())


def best_settings(spec: StudySpec, trial: FrozenTrial) -> dict[str, Any]:
    """The settings of ``trial`` as ``oakemu train --config`` takes them: those the study fixed
    (:attr:`StudySpec.fixed_names`, resolved as the trial's run resolved them) and the sampled ones,
    without the run folder's name and place (:data:`NOT_IN_BEST`) and unset (None) ones."""
    base = load_preset(spec.preset).settings if spec.preset is not None else {}
    config = make_config(base, **{**spec.settings, **trial.params})
    names = [*spec.fixed_names, *(name for name in trial.params if name not in spec.fixed_names)]
    return {
        name: getattr(config, name)
        for name in names
        if name not in NOT_IN_BEST and getattr(config, name) is not None
    }


def _flat_toml(settings: Mapping[str, Any]) -> str:
    return "".join(f"{name} = {toml_value(value)}\n" for name, value in settings.items())


def write_best_files(
    study_dir: Path, spec: StudySpec, trial: FrozenTrial, settings: Mapping[str, Any]
) -> tuple[Path, Path]:
    """Write ``best.toml`` (flat settings: ``oakemu train --config best.toml``) and ``best-preset.toml``
    (a ``[preset]`` and a ``[settings]`` table, the shape of ``oakemu_core/presets/*.toml``) for ``trial``;
    returns their paths."""
    measure = f"{spec.objective} ({OBJECTIVES[spec.objective]}) {trial.value:.6g}"
    budget = settings.get("total_env_steps")
    header = (
        f"# oakemu tune, study {spec.study_name!r}: its best trial, {trial.number}: {measure}\n"
        f"# oakemu train --config {study_dir / BEST_TOML}\n"
    )
    config_path, preset_path = study_dir / BEST_TOML, study_dir / BEST_PRESET_TOML
    write_text_atomic(config_path, header + _flat_toml(settings))
    env_id = settings.get("env_id", "the default env")
    description = (
        f"{env_id}, settings of oakemu tune (study {spec.study_name}, trial {trial.number})"
    )
    preset = (
        "# A preset of the best settings found (copy it to oakemu_core/presets/<name>.toml)\n"
        "[preset]\n"
        f"description = {toml_value(description)}\n"
        f"expect = {toml_value(f'{measure} after {budget} env steps in the study')}\n\n"
        "[settings]\n" + _flat_toml(settings)
    )
    write_text_atomic(preset_path, header + preset)
    return config_path, preset_path


def write_plots(study: optuna.Study, plots_dir: Path) -> tuple[list[Path], list[str]]:
    """Optuna's plots as HTML (plotly; ``plotly.min.js`` once beside them, no network needed):
    ``history.html`` (each trial's objective and the best so far), ``intermediate.html`` (the
    evaluations each trial reported, pruned ones cut short) and ``importance.html`` (PED-ANOVA importance
    of each setting; from 2 complete trials). Returns the files written and a note per plot left out."""
    try:
        import optuna.visualization as plots
        import plotly  # noqa: F401 - the plots' own dependency
    except ImportError:
        return [], ["plots: plotly is not installed (pip install 'oakemu-rl[tune]')"]
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    wanted: dict[str, Any] = {
        "history.html": lambda: plots.plot_optimization_history(study),
        "intermediate.html": lambda: plots.plot_intermediate_values(study),
    }
    notes = []
    if len(complete) >= 2:
        evaluator = optuna.importance.PedAnovaImportanceEvaluator()
        wanted["importance.html"] = lambda: plots.plot_param_importances(study, evaluator=evaluator)
    else:
        notes.append(f"importance plot: needs 2 complete trials, the study has {len(complete)}")
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in wanted.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                figure = draw()
            html = figure.to_html(include_plotlyjs="directory")
        except (ValueError, RuntimeError, ZeroDivisionError) as error:
            notes.append(f"{name}: not drawn ({error})")
            continue
        write_text_atomic(plots_dir / name, html)
        written.append(plots_dir / name)
    if written and not (plots_dir / "plotly.min.js").exists():
        from plotly.offline import get_plotlyjs

        write_text_atomic(plots_dir / "plotly.min.js", get_plotlyjs())
    return written, notes


def _duration(seconds: float) -> str:
    """``42 s``, ``7 min``, ``2.5 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _value(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4g}"


def describe_params(params: Mapping[str, Any]) -> str:
    """``learning_rate=0.00123, gamma=0.98`` (floats to 3 significant digits)."""
    return ", ".join(
        f"{name}={value:.3g}" if isinstance(value, float) else f"{name}={value}"
        for name, value in params.items()
    )


def progress_line(
    row: TrialRow, trials: Sequence[FrozenTrial], total: int, jobs: int, elapsed_s: float
) -> str:
    """The line after trial ``row`` ended: its state, objective, wall time and settings; trials done of
    ``total``, the best so far and an estimate of the time left with ``jobs`` workers (the mean wall time
    of the trials done, ``elapsed_s``: this process's time so far as a floor)."""
    done = [trial for trial in trials if trial.state.is_finished()]
    best = best_trial(trials)
    walls = [wall for wall in (_wall_s(trial) for trial in done) if wall is not None]
    left = max(0, total - len(done))
    eta = ""
    if left and walls:
        eta = f", about {_duration(sum(walls) / len(walls) * math.ceil(left / max(1, jobs)))} left"
    best_text = f"best {_value(best.value)} (trial {best.number})" if best else "no complete trial"
    outcome = row.state if row.state != "COMPLETE" else f"objective {_value(row.value)}"
    if row.state == "PRUNED":
        outcome = f"pruned at {_value(row.value)}"
    elif row.state == "FAIL":
        outcome = f"failed: {row.error}"
    wall = f" in {_duration(row.wall_s)}" if row.wall_s is not None else ""
    return (
        f"trial {row.number}: {outcome}{wall} ({describe_params(row.params)}); "
        f"{len(done)}/{total} done, {best_text}{eta}; elapsed {_duration(elapsed_s)}"
    )

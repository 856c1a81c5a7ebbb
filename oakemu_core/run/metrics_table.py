"""The learner's metrics, declared once: one :class:`Metric` row per figure in :data:`METRICS`.

Every sink reads this table:

* the learner's per-update record (:func:`record`), written by
  :class:`~oakemu_core.run.metrics.MetricsLogger` to TensorBoard, ``metrics.jsonl`` and the tracker
  (:mod:`oakemu_core.run.tracking`) under the row's ``tag``;
* the telemetry snapshot (:class:`~oakemu_core.run.telemetry.TelemetrySnapshot`): one field per row
  with a ``snapshot`` name, of the row's ``value_type`` (it is also the monitor's ``--json`` key);
* Prometheus (:mod:`oakemu_core.run.prometheus`): a gauge or counter per row with a ``prometheus``
  name (its ``doc`` is the HELP text), or one sample of a labelled family of :data:`FAMILIES`;
* the monitor's view (``oakemu monitor``): a line per row with a :class:`MonitorLine`.

Adding a metric: compute it where its source object is built (an update statistic: a field of
``PPOUpdateStats`` in ``oakemu_core/algo/update_stats.py``) and add its row here.

A row's ``source`` is ``"<object>.<field>"``; the objects are

* ``stats``: the update's ``PPOUpdateStats`` (None when no row was trainable);
* ``result``: the trainer's ``TrainResult``; ``lag``: its ``lag`` mapping (policy lag in versions:
  ``min`` / ``mean`` / ``max``, in SGD steps: ``sgd_min`` / ``sgd_mean`` / ``sgd_max``,
  ``newest_version``);
* ``window``: the learner's :class:`~oakemu_core.run.metrics.EpisodeWindow` (None while empty);
* ``learner``: figures the learner keeps itself (``sps``, ``sps_recent``, ``actors``);
* ``report``: a tester's :class:`~oakemu_core.run.tester.EvaluationReport`;
* ``snapshot``: passed to the snapshot by the learner (counters, history, buffer fill, ...).
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pydantic

__all__ = [
    "EPISODIC_LENGTH",
    "EPISODIC_RETURN",
    "EVAL_EPISODIC_LENGTH",
    "EVAL_EPISODIC_RETURN",
    "EVAL_EPISODIC_RETURN_STD",
    "FAMILIES",
    "LEARNING_RATE",
    "METRICS",
    "REQUIRED",
    "SPS",
    "SPS_RECENT",
    "Metric",
    "MonitorLine",
    "format_line",
    "record",
    "snapshot_fields",
    "snapshot_values",
]

EPISODIC_RETURN = "charts/episodic_return"
EPISODIC_LENGTH = "charts/episodic_length"
LEARNING_RATE = "charts/learning_rate"
SPS = "charts/SPS"
SPS_RECENT = "charts/SPS_recent"
EVAL_EPISODIC_RETURN = "eval/episodic_return"
EVAL_EPISODIC_RETURN_STD = "eval/episodic_return_std"
EVAL_EPISODIC_LENGTH = "eval/episodic_length"

REQUIRED: Any = ...
"""A snapshot field's ``default`` when every snapshot must carry it."""

Count = Annotated[int, pydantic.Field(ge=0)]
Rate = Annotated[float, pydantic.Field(ge=0)]
Share = Annotated[float, pydantic.Field(ge=0.0, le=1.0)]

TRAINING = "Training"
LAST_UPDATE = "Last update"
SECTIONS = (TRAINING, LAST_UPDATE)
"""The monitor's sections of figures, left to right."""


@dataclass(frozen=True)
class MonitorLine:
    """How a figure shows in the monitor's view.

    Attributes:
        section: one of :data:`SECTIONS`.
        label: the line's label.
        template: :meth:`str.format` template over snapshot fields (:func:`format_line`).
        blank_without: the whole value reads ``-`` while the row's own field is None.
        hide_without: the line is left out while the row's own field is None.
        style: rich style of the line for a snapshot (None: plain).
    """

    section: str
    label: str
    template: str
    blank_without: bool = False
    hide_without: bool = False
    style: Callable[[Any], str | None] | None = None


@dataclass(frozen=True)
class Metric:
    """One figure of the learner and where it shows (module docstring).

    Attributes:
        source: ``"<object>.<field>"`` the value is read from.
        doc: meaning and unit; the Prometheus HELP text of an unlabelled ``prometheus`` name.
        tag: TensorBoard tag, ``metrics.jsonl`` key and tracker key (None: not recorded).
        missing: the recorded value when the source object is None (None: left out).
        snapshot: field of the telemetry snapshot (None: not in telemetry).
        value_type: the snapshot field's type (pydantic constraints included).
        default: the snapshot field's default (:data:`REQUIRED`: none).
        finite_only: a non-finite value goes into the snapshot as None.
        prometheus: Prometheus name (``oakemu_*``; a counter gets ``_total``), read from the
            snapshot field (None: not exported).
        prometheus_type: ``"gauge"`` or ``"counter"``.
        label: the label value of this row's sample in the labelled family ``prometheus`` of
            :data:`FAMILIES` (None: an unlabelled metric of its own).
        monitor: its line in the monitor's view (None: not shown).
    """

    source: str
    doc: str
    tag: str | None = None
    missing: float | None = None
    snapshot: str | None = None
    value_type: Any = float | None
    default: Any = None
    finite_only: bool = False
    prometheus: str | None = None
    prometheus_type: Literal["gauge", "counter"] = "gauge"
    label: str | None = None
    monitor: MonitorLine | None = None

    @property
    def source_object(self) -> str:
        return self.source.partition(".")[0]

    @property
    def source_field(self) -> str:
        return self.source.partition(".")[2]


FAMILIES: dict[str, tuple[str, str]] = {
    "oakemu_loss": ("kind", "PPO losses of the last update"),
    "oakemu_policy_lag": ("stat", "Policy lag (versions) of the last rollout's rows"),
}
"""Labelled Prometheus families: name -> (label name, HELP text); their rows give the label value."""


def _columns_style(snapshot: Any) -> str | None:
    return "yellow" if snapshot.rollout_columns != snapshot.planned_columns else None


def _training(label: str, template: str, **options: Any) -> MonitorLine:
    return MonitorLine(TRAINING, label, template, **options)


def _last_update(label: str, template: str, **options: Any) -> MonitorLine:
    return MonitorLine(LAST_UPDATE, label, template, **options)


def _lag_rows(stat: str, line: MonitorLine | None) -> tuple[Metric, ...]:
    """Policy lag ``stat`` of the newest update's rows, in versions and in SGD steps."""
    return (
        Metric(
            f"lag.{stat}",
            f"{stat.capitalize()} policy lag (versions) of the newest update's rows",
            tag=f"charts/policy_lag_{stat}",
            snapshot=f"policy_lag_{stat}",
            prometheus="oakemu_policy_lag",
            label=stat,
            monitor=line,
        ),
        Metric(
            f"lag.sgd_{stat}",
            f"{stat.capitalize()} policy lag of the newest update's rows in SGD steps (revisions "
            "published within an update count)",
            tag=f"charts/policy_lag_sgd_steps_{stat}",
        ),
    )


def _loss_row(field: str, tag: str, label: str, spec: str, kind: str | None = None) -> Metric:
    """A statistic of the last PPO update (CleanRL's ``losses/*``)."""
    return Metric(
        f"stats.{field}",
        _LOSS_DOCS[field],
        tag=tag,
        snapshot=field,
        prometheus="oakemu_loss" if kind else f"oakemu_{field}",
        label=kind,
        finite_only=field == "explained_variance",
        monitor=_last_update(label, f"{{{field}:{spec}}}"),
    )


_LOSS_DOCS = {
    "policy_loss": "PPO clipped policy loss of the last update (mean over its minibatches)",
    "value_loss": "Value loss of the last update (mean over its minibatches)",
    "entropy": "Policy entropy of the last update (nats, mean over its minibatches)",
    "approx_kl": "Approximate KL(old || new) of the last update",
    "clip_fraction": "Fraction of samples clipped in the last update",
    "explained_variance": "Explained variance of the value function",
}

METRICS: tuple[Metric, ...] = (
    # -- progress
    Metric(
        "snapshot.global_step",
        "Env steps written to rollout buffers (all envs)",
        snapshot="global_step",
        value_type=Count,
        default=REQUIRED,
        prometheus="oakemu_env_steps",
        prometheus_type="counter",
        monitor=_training("env steps", "{global_step:,}"),
    ),
    Metric(
        "learner.sps",
        "Env steps per second, wall clock since the learner started",
        tag=SPS,
        snapshot="sps",
        value_type=Rate,
        default=REQUIRED,
        prometheus="oakemu_sps",
        monitor=_training("SPS (since start)", "{sps:.0f}"),
    ),
    Metric(
        "learner.sps_recent",
        "Env steps per second over the last ~10 s",
        tag=SPS_RECENT,
        snapshot="sps_recent",
        value_type=Rate,
        default=0.0,
        prometheus="oakemu_sps_recent",
        monitor=_training("SPS (last 10 s)", "{sps_recent:.0f}"),
    ),
    Metric("learner.actors", "Connected actors", tag="charts/actors"),
    Metric(
        "result.policy_version",
        "Version of the newest published weights",
        tag="charts/policy_version",
        snapshot="policy_version",
        value_type=Count,
        default=REQUIRED,
        prometheus="oakemu_policy_version",
        monitor=_training("policy version", "{policy_version}"),
    ),
    Metric(
        "result.iterations",
        "PPO updates completed",
        tag="charts/update",
        snapshot="iterations",
        value_type=Count,
        default=REQUIRED,
        prometheus="oakemu_updates",
        prometheus_type="counter",
        monitor=_training("updates", "{iterations}"),
    ),
    Metric(
        "snapshot.trained_env_steps",
        "Env steps of the rollouts PPO trained on (the count the budget total_env_steps is spent "
        "by; rows discarded or too stale never count)",
        snapshot="trained_env_steps",
        value_type=Count,
        default=0,
    ),
    Metric(
        "snapshot.episodes",
        "Episodes finished (all actors)",
        snapshot="episodes",
        value_type=Count,
        default=REQUIRED,
        prometheus="oakemu_episodes",
        prometheus_type="counter",
        monitor=_training("episodes", "{episodes:,}"),
    ),
    # -- the episode window
    Metric(
        "window.mean",
        "Mean raw episodic return, recent window",
        tag=EPISODIC_RETURN,
        snapshot="episodic_return_mean",
        prometheus="oakemu_episodic_return_mean",
        monitor=_training("return mean", "{episodic_return_mean:.2f}"),
    ),
    Metric(
        "window.min",
        "Min raw episodic return, recent window",
        snapshot="episodic_return_min",
        prometheus="oakemu_episodic_return_min",
        monitor=_training(
            "return min / max", "{episodic_return_min:.2f} / {episodic_return_max:.2f}"
        ),
    ),
    Metric(
        "window.max",
        "Max raw episodic return, recent window",
        snapshot="episodic_return_max",
        prometheus="oakemu_episodic_return_max",
    ),
    Metric(
        "window.mean_length",
        "Mean episode length (env steps), recent window",
        tag=EPISODIC_LENGTH,
        snapshot="episodic_length_mean",
        prometheus="oakemu_episodic_length_mean",
        monitor=_training("episode length", "{episodic_length_mean:.1f}"),
    ),
    # -- the last PPO update
    _loss_row("policy_loss", "losses/policy_loss", "policy loss", ".4f", kind="policy"),
    _loss_row("value_loss", "losses/value_loss", "value loss", ".4f", kind="value"),
    _loss_row("entropy", "losses/entropy", "entropy", ".4f", kind="entropy"),
    _loss_row("approx_kl", "losses/approx_kl", "approx KL", ".5f"),
    _loss_row("clip_fraction", "losses/clipfrac", "clip fraction", ".3f"),
    _loss_row("explained_variance", "losses/explained_variance", "explained var", ".3f"),
    Metric(
        "stats.learning_rate",
        "Current learning rate",
        tag=LEARNING_RATE,
        snapshot="learning_rate",
        prometheus="oakemu_learning_rate",
        monitor=_last_update("learning rate", "{learning_rate:.2e}"),
    ),
    Metric(
        "snapshot.buffer_fill",
        "Fraction (0..1) of the filling rollout buffer written",
        snapshot="buffer_fill",
        value_type=Share,
        default=0.0,
        prometheus="oakemu_buffer_fill",
        monitor=_training("buffer fill", "{buffer_fill:.0f%}"),
    ),
    Metric(
        "result.trainable_share",
        "Fraction (0..1) of the last rollout's rows trained on",
        tag="charts/trainable_share",
        snapshot="trainable_share",
        value_type=Share | None,
        prometheus="oakemu_trainable_share",
        monitor=_last_update("trainable rows", "{trainable_share:.1f%}"),
    ),
    Metric(
        "result.columns",
        "Columns that held rows in the newest update's rollout",
        tag="charts/rollout_columns",
        snapshot="rollout_columns",
        value_type=Count | None,
        monitor=_last_update(
            "rollout columns",
            "{rollout_columns} (planned {planned_columns})",
            hide_without=True,
            style=_columns_style,
        ),
    ),
    Metric(
        "result.planned_columns",
        "Columns the run's planned actors fill (fewer in a rollout: it trained with fewer rows)",
        snapshot="planned_columns",
        value_type=Count | None,
    ),
    Metric(
        "stats.trainable_rows",
        "Rows the newest update trained on",
        tag="charts/rollout_rows",
        missing=0,
    ),
    *_lag_rows(
        "min",
        _last_update(
            "policy lag",
            "{policy_lag_min:.0f} / {policy_lag_mean:.2f} / {policy_lag_max:.0f}  (min/mean/max)",
        ),
    ),
    *_lag_rows("mean", None),
    *_lag_rows("max", None),
    Metric(
        "lag.newest_version",
        "Newest policy version that acted in the newest update's rows",
        tag="charts/newest_acting_policy_version",
    ),
    Metric("result.stale_rows", "Rows dropped for policy lag", tag="charts/stale_rows"),
    Metric("result.rollbacks", "Rollbacks so far", tag="charts/rollbacks"),
    Metric(
        "stats.first_minibatch_ratio_max_abs_dev",
        "Max |ratio - 1| on the first minibatch before any gradient step (~0 when actor and "
        "learner agree on log-probs)",
        tag="diagnostics/first_minibatch_ratio_max_abs_dev",
    ),
    Metric(
        "stats.epochs_completed", "Epochs the update completed", tag="diagnostics/epochs_completed"
    ),
    Metric("stats.update_seconds", "Wall seconds of the update", tag="diagnostics/update_seconds"),
    Metric(
        "stats.nonfinite_minibatches",
        "Minibatches skipped for a non-finite gradient",
        tag="diagnostics/nonfinite_minibatches",
    ),
    Metric(
        "stats.importance_weight_mean",
        "Mean truncated importance weight of the decoupled objective (NaN without it)",
        tag="diagnostics/importance_weight_mean",
    ),
    # -- failures
    Metric(
        "snapshot.checkpoint_failures",
        "Checkpoint writes that failed (full disk, ...)",
        snapshot="checkpoint_failures",
        value_type=Count,
        default=0,
        prometheus="oakemu_checkpoint_failures",
        prometheus_type="counter",
    ),
    Metric(
        "snapshot.log_write_failures",
        "Metric/episode records dropped by failed writes",
        snapshot="log_write_failures",
        value_type=Count,
        default=0,
        prometheus="oakemu_log_write_failures",
        prometheus_type="counter",
    ),
    # -- evaluations (the tester's reports)
    Metric(
        "report.return_mean",
        "Mean raw episodic return of the latest evaluation",
        tag=EVAL_EPISODIC_RETURN,
        snapshot="eval_return_mean",
        prometheus="oakemu_eval_return_mean",
        monitor=_training(
            "eval return",
            "{eval_return_mean:.2f} ± {eval_return_std:.2f} (v{eval_policy_version})",
            blank_without=True,
        ),
    ),
    Metric(
        "report.return_std",
        "Std of the raw episodic return of the latest evaluation",
        tag=EVAL_EPISODIC_RETURN_STD,
        snapshot="eval_return_std",
        prometheus="oakemu_eval_return_std",
    ),
    Metric(
        "report.length_mean",
        "Mean episode length (agent steps) of the latest evaluation",
        tag=EVAL_EPISODIC_LENGTH,
        snapshot="eval_length_mean",
        prometheus="oakemu_eval_length_mean",
        monitor=_training("eval length", "{eval_length_mean:.1f}"),
    ),
    Metric(
        "report.policy_version",
        "Policy version of the latest evaluation",
        tag="eval/policy_version",
        snapshot="eval_policy_version",
        value_type=Count | None,
        prometheus="oakemu_eval_policy_version",
    ),
    Metric(
        "report.global_step",
        "Env steps of the run when the evaluated weights were submitted",
        tag="eval/weights_global_step",
    ),
    Metric(
        "snapshot.best_eval_return",
        "Best mean evaluation return so far (best.pt)",
        snapshot="best_eval_return",
        prometheus="oakemu_best_eval_return",
        monitor=_training("best eval", "{best_eval_return:.2f}"),
    ),
    Metric(
        "snapshot.eval_video",
        "Path (on the learner's machine) of the newest evaluation video",
        snapshot="eval_video",
        value_type=str | None,
        monitor=_training("eval video", "{eval_video}"),
    ),
)
"""Every figure of the learner, in the monitor's order within each of its sections."""

_MISSING = object()


def _read(source: Any, field: str) -> Any:
    """``source[field]`` of a mapping, else ``source.field``; :data:`_MISSING` when absent."""
    if isinstance(source, Mapping):
        return source.get(field, _MISSING)
    return getattr(source, field, _MISSING)


def _values(
    sources: Mapping[str, Any], rows: Iterable[Metric], use_missing: bool
) -> Iterable[tuple[Metric, Any]]:
    """``(row, value)`` for the rows whose source object is in ``sources``: rows whose object is
    None give ``row.missing`` (when ``use_missing`` and it is set), absent fields nothing."""
    for row in rows:
        if row.source_object not in sources:
            continue
        source = sources[row.source_object]
        if source is None:
            if use_missing and row.missing is not None:
                yield row, row.missing
            continue
        value = _read(source, row.source_field)
        if value is not _MISSING:
            yield row, value


def record(sources: Mapping[str, Any], rows: Iterable[Metric] | None = None) -> dict[str, float]:
    """The scalars (``tag -> float``) of the rows with a tag whose source object is in
    ``sources`` (``{"stats": stats, ...}``, module docstring), in table order."""
    rows = METRICS if rows is None else rows
    return {
        row.tag: float(value)
        for row, value in _values(sources, (r for r in rows if r.tag), use_missing=True)
    }


def snapshot_values(sources: Mapping[str, Any]) -> dict[str, Any]:
    """Snapshot fields (``name -> value``) of the rows with a snapshot name whose source object is
    in ``sources``; a ``finite_only`` row's non-finite value becomes None."""
    values: dict[str, Any] = {}
    for row, value in _values(sources, (r for r in METRICS if r.snapshot), use_missing=False):
        if row.finite_only and value is not None and not math.isfinite(value):
            value = None
        values[row.snapshot] = value  # type: ignore[index]
    return values


def snapshot_fields() -> dict[str, Any]:
    """The snapshot's figure fields, for ``pydantic.create_model``: name -> (type, default)."""
    return {row.snapshot: (row.value_type, row.default) for row in METRICS if row.snapshot}


class _LineFormatter(string.Formatter):
    """:meth:`str.format` for monitor lines: None (or an empty text) reads ``-``, a non-finite
    float its name (``nan``), and a spec ending in ``%`` shows a fraction in percent (``0.5`` with
    ``.0f%``: ``50 %``)."""

    def format_field(self, value: Any, format_spec: str) -> str:
        if value is None or value == "":
            return "-"
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if format_spec.endswith("%"):
            return format(100.0 * value, format_spec[:-1]) + " %"
        return format(value, format_spec)


_FORMATTER = _LineFormatter()


class _Fields(Mapping[str, Any]):
    """A snapshot's attributes as a mapping (for :meth:`string.Formatter.vformat`)."""

    def __init__(self, snapshot: Any) -> None:
        self._snapshot = snapshot

    def __getitem__(self, name: str) -> Any:
        return getattr(self._snapshot, name)

    def __iter__(self) -> Any:
        return iter(())

    def __len__(self) -> int:
        return 0


def format_line(row: Metric, snapshot: Any) -> str | None:
    """The value text of ``row``'s monitor line for ``snapshot`` (None: the line is left out).

    Raises:
        ValueError: ``row`` has no monitor line.
    """
    line = row.monitor
    if line is None or row.snapshot is None:
        raise ValueError(f"metric {row.source!r} has no monitor line")
    own = getattr(snapshot, row.snapshot)
    if own is None and line.hide_without:
        return None
    if own is None and line.blank_without:
        return "-"
    return _FORMATTER.vformat(line.template, (), _Fields(snapshot))

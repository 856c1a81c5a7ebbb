"""The learner's bounded history of training and evaluation figures, sent in every telemetry
snapshot so a monitor attached late still draws the whole run's curves.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pydantic

__all__ = [
    "HISTORY_MAX_POINTS",
    "EvaluationPoint",
    "TelemetryHistory",
    "TelemetryHistoryData",
    "TrainingPoint",
]

HISTORY_MAX_POINTS = 512
"""Most points each series of :class:`TelemetryHistoryData` holds (and a subscriber accepts)."""


class TrainingPoint(pydantic.BaseModel):
    """One PPO update in the learner's history.

    Attributes:
        global_step: env steps of the run at the update (all envs).
        time: unix time (s) of the update.
        episodic_return: mean raw episodic return of the recent episode window; None while empty.
        sps: env steps per second (recent window); None when unknown.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    global_step: int = pydantic.Field(ge=0)
    time: float
    episodic_return: float | None = None
    sps: float | None = None


class EvaluationPoint(pydantic.BaseModel):
    """One tester evaluation in the learner's history (see ``oakemu_core.run.tester``).

    Attributes:
        global_step: env steps of the run when the evaluated weights were submitted.
        time: unix time (s) at which the evaluation finished.
        policy_version: version of the evaluated weights.
        return_mean / return_std: mean and population std of the raw episodic return (None if
            not finite).
        length_mean: mean episode length (agent steps; None if not finite).
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    global_step: int = pydantic.Field(ge=0)
    time: float
    policy_version: int = pydantic.Field(ge=0)
    return_mean: float | None
    return_std: float | None
    length_mean: float | None


class TelemetryHistoryData(pydantic.BaseModel):
    """The learner's bounded history, sent in every snapshot so a late monitor sees whole curves.

    Each series holds at most :data:`HISTORY_MAX_POINTS` points, oldest first, in increasing
    ``global_step``; a long run is downsampled evenly (see :class:`TelemetryHistory`), the first
    and the newest point always kept.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    training: list[TrainingPoint] = pydantic.Field(
        default_factory=list, max_length=HISTORY_MAX_POINTS
    )
    evaluations: list[EvaluationPoint] = pydantic.Field(
        default_factory=list, max_length=HISTORY_MAX_POINTS
    )


class _DownsampledSeries:
    """At most ``capacity`` points of an unbounded stream, evenly spaced by arrival index.

    Point ``i`` (0-based arrival index) is kept while ``i % stride == 0``; the newest point is
    always kept as well. When the kept points exceed ``capacity`` the stride doubles (every other
    point goes), so a run of any length keeps its whole curve at a coarser resolution.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 2:
            raise ValueError(f"history capacity: expected >= 2, received {capacity}")
        self.capacity = capacity
        self.stride = 1
        self.count = 0
        self._items: list[tuple[int, Any]] = []

    def add(self, point: Any) -> None:
        index, self.count = self.count, self.count + 1
        if self._items and self._items[-1][0] % self.stride != 0:
            self._items.pop()  # the previous newest point was off the grid: it only stood for "newest"
        self._items.append((index, point))
        while len(self._items) > self.capacity:
            self.stride *= 2
            newest = self._items[-1]
            self._items = [item for item in self._items[:-1] if item[0] % self.stride == 0]
            self._items.append(newest)

    def points(self) -> list[Any]:
        return [point for _, point in self._items]

    def state(self) -> dict[str, Any]:
        return {
            "stride": self.stride,
            "count": self.count,
            "indexes": [index for index, _ in self._items],
        }


class TelemetryHistory:
    """The learner's history of training and evaluation figures, for :class:`TelemetrySnapshot`.

    The learner calls :meth:`record_update` after every PPO update and :meth:`record_evaluation`
    for every tester report, and passes :meth:`snapshot_fields` into every snapshot
    (``TelemetrySnapshot(..., **history.snapshot_fields())``): the latest evaluation figures,
    the best evaluation return, and :class:`TelemetryHistoryData` (bounded: at most
    ``max_points`` points per series, about 30 kB of msgpack at 512). Thread-safe.
    :meth:`state_dict` / :meth:`load_state_dict` carry it through a checkpoint (plain values),
    so a resumed run keeps its curves.

    Args:
        max_points: points kept per series (2..:data:`HISTORY_MAX_POINTS`).

    Raises:
        ValueError: ``max_points`` out of range.
    """

    def __init__(self, max_points: int = HISTORY_MAX_POINTS) -> None:
        if not 2 <= int(max_points) <= HISTORY_MAX_POINTS:
            raise ValueError(f"max_points: expected 2..{HISTORY_MAX_POINTS}, received {max_points}")
        self.max_points = int(max_points)
        self._lock = threading.Lock()
        self._training = _DownsampledSeries(self.max_points)
        self._evaluations = _DownsampledSeries(self.max_points)
        self._latest: EvaluationPoint | None = None
        self.best_eval_return: float | None = None
        """Highest mean evaluation return so far (None before the first evaluation)."""
        self.eval_video: str | None = None
        """Path of the newest evaluation video (None before the first)."""
        self._data: TelemetryHistoryData | None = None

    def record_update(
        self,
        global_step: int,
        episodic_return: float | None,
        sps: float | None,
        *,
        time_s: float | None = None,
    ) -> None:
        """Add one PPO update: env steps so far, mean raw return of the episode window (NaN or None
        while empty) and env steps per second; ``time_s`` defaults to now (unix s)."""
        point = TrainingPoint(
            global_step=int(global_step),
            time=time.time() if time_s is None else float(time_s),
            episodic_return=_finite(episodic_return),
            sps=_finite(sps),
        )
        with self._lock:
            self._training.add(point)
            self._data = None

    def record_evaluation(self, report: Any) -> None:
        """Add one evaluation: an :class:`oakemu_core.run.tester.EvaluationReport` (or any object with
        ``global_step``, ``policy_version``, ``return_mean``, ``return_std``, ``length_mean`` and
        ``finished_at``)."""
        point = EvaluationPoint(
            global_step=int(report.global_step),
            time=float(report.finished_at),
            policy_version=int(report.policy_version),
            return_mean=_finite(report.return_mean),
            return_std=_finite(report.return_std),
            length_mean=_finite(report.length_mean),
        )
        with self._lock:
            self._evaluations.add(point)
            self._latest = point
            self.eval_video = getattr(report, "video_path", None) or self.eval_video
            if point.return_mean is not None and (
                self.best_eval_return is None or point.return_mean > self.best_eval_return
            ):
                self.best_eval_return = point.return_mean
            self._data = None

    def data(self) -> TelemetryHistoryData:
        """The history as sent in snapshots (built once per change)."""
        with self._lock:
            if self._data is None:
                self._data = TelemetryHistoryData(
                    training=self._training.points(), evaluations=self._evaluations.points()
                )
            return self._data

    def snapshot_fields(self) -> dict[str, Any]:
        """Keyword arguments for :class:`TelemetrySnapshot`: ``eval_return_mean``,
        ``eval_return_std``, ``eval_length_mean``, ``eval_policy_version``, ``best_eval_return``,
        ``eval_video`` and ``history``."""
        history = self.data()
        with self._lock:
            latest, best, video = self._latest, self.best_eval_return, self.eval_video
        return {
            "eval_return_mean": None if latest is None else latest.return_mean,
            "eval_return_std": None if latest is None else latest.return_std,
            "eval_length_mean": None if latest is None else latest.length_mean,
            "eval_policy_version": None if latest is None else latest.policy_version,
            "best_eval_return": best,
            "eval_video": video,
            "history": history,
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain values (for a checkpoint) that :meth:`load_state_dict` restores."""
        with self._lock:
            return {
                "max_points": self.max_points,
                "training": [point.model_dump() for point in self._training.points()],
                "training_series": self._training.state(),
                "evaluations": [point.model_dump() for point in self._evaluations.points()],
                "evaluation_series": self._evaluations.state(),
                "best_eval_return": self.best_eval_return,
                "eval_video": self.eval_video,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values.

        Raises:
            ValueError: malformed state (a point fails validation, or counts disagree).
        """
        try:
            series = []
            for key, model in (("training", TrainingPoint), ("evaluations", EvaluationPoint)):
                points = [model.model_validate(item) for item in state[key]]
                meta = state["training_series" if key == "training" else "evaluation_series"]
                if len(meta["indexes"]) != len(points) or len(points) > self.max_points:
                    raise ValueError(
                        f"history {key}: {len(points)} points, {len(meta['indexes'])} indexes, "
                        f"capacity {self.max_points}"
                    )
                restored = _DownsampledSeries(self.max_points)
                restored.stride, restored.count = int(meta["stride"]), int(meta["count"])
                restored._items = list(zip((int(i) for i in meta["indexes"]), points))
                series.append(restored)
        except (KeyError, TypeError, pydantic.ValidationError) as exc:
            raise ValueError(f"telemetry history state: {type(exc).__name__}: {exc}") from exc
        best = state.get("best_eval_return")
        with self._lock:
            self._training, self._evaluations = series
            evaluations = self._evaluations.points()
            self._latest = evaluations[-1] if evaluations else None
            self.best_eval_return = None if best is None else float(best)
            self.eval_video = state.get("eval_video")
            self._data = None


def _finite(value: float | None) -> float | None:
    """``value`` as a float, or None for None / NaN / infinities."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None

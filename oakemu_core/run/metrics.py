"""Training metrics: a moving window of finished episodes, and a logger that writes every scalar
both to TensorBoard event files and to a JSON-lines file.

The scalars and their names are the rows of :data:`oakemu_core.run.metrics_table.METRICS`.
Names follow CleanRL (``ppo_atari.py``) so TensorBoard charts look familiar:
``charts/episodic_return``, ``charts/episodic_length``, ``charts/learning_rate``, ``charts/SPS``,
``losses/policy_loss``, ``losses/value_loss``, ``losses/entropy``, ``losses/approx_kl``,
``losses/clipfrac``, ``losses/explained_variance``. Periodic evaluations of the learner's tester add
``eval/episodic_return`` (mean raw return), ``eval/episodic_return_std``, ``eval/episodic_length``,
``eval/policy_version`` and ``eval/weights_global_step`` (:func:`evaluation_scalars`).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import numbers
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from oakemu_core.run.log_limits import RateLimitedLog
from oakemu_core.run.metrics_table import (
    EPISODIC_LENGTH,
    EPISODIC_RETURN,
    EVAL_EPISODIC_LENGTH,
    EVAL_EPISODIC_RETURN,
    EVAL_EPISODIC_RETURN_STD,
    LEARNING_RATE,
    SPS,
    SPS_RECENT,
    record,
)

if TYPE_CHECKING:
    from oakemu_core.algo.update_stats import PPOUpdateStats
    from oakemu_core.run.tester import EvaluationReport

__all__ = [
    "EPISODIC_LENGTH",
    "EPISODIC_RETURN",
    "EVAL_EPISODIC_LENGTH",
    "EVAL_EPISODIC_RETURN",
    "EVAL_EPISODIC_RETURN_STD",
    "LEARNING_RATE",
    "METRICS_FILE_NAME",
    "SPS",
    "SPS_RECENT",
    "EpisodeWindow",
    "JsonLinesWriter",
    "MetricsLogger",
    "RunStepRates",
    "episode_scalars",
    "evaluation_scalars",
    "record_number",
    "update_scalars",
]

METRICS_FILE_NAME = "metrics.jsonl"


def record_number(record: Mapping[str, Any], name: str) -> float | None:
    """``record[name]`` (a ``metrics.jsonl`` record's value) as a float; None when it is missing or not a
    number (a bool is not one)."""
    value = record.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def evaluation_scalars(report: EvaluationReport) -> dict[str, float]:
    """The scalars of one tester evaluation (:class:`oakemu_core.run.tester.EvaluationReport`): the
    rows of :data:`~oakemu_core.run.metrics_table.METRICS` read from ``report``.

    ``eval/episodic_return`` (mean raw, unclipped return), ``eval/episodic_return_std`` (population
    std), ``eval/episodic_length`` (mean, agent steps), ``eval/policy_version`` (the evaluated
    weights) and ``eval/weights_global_step`` (env steps when they were submitted). Log them at the
    learner's *current* global step (``logger.log(global_step, evaluation_scalars(report))``), so
    ``metrics.jsonl`` never goes back in ``global_step``; the evaluated step travels as a value.
    """
    return record({"report": report})


WRITE_FAILURE_LOG_PERIOD_S = 30.0
"""Shortest time (s) between two log lines about failed metric/episode writes (each is counted)."""
TENSORBOARD_RETRY_S = 30.0
"""After a TensorBoard write error, the events writer is reopened (a new file) at most this often (s)."""

log = logging.getLogger("oakemu.metrics")


class EpisodeWindow:
    """The returns and lengths of the last ``maxlen`` finished episodes.

    Returns are the raw game score (undiscounted sum of unclipped rewards); lengths are in env
    steps (agent steps, after frame skip). ``mean``/``min``/``max`` are over the window's returns
    and are NaN while it is empty; ``total_episodes`` counts every episode ever added.

    Raises:
        ValueError: ``maxlen`` < 1.
    """

    def __init__(self, maxlen: int = 100) -> None:
        if int(maxlen) < 1:
            raise ValueError(f"maxlen: expected >= 1, got {maxlen}")
        self.maxlen = int(maxlen)
        self._returns: deque[float] = deque(maxlen=self.maxlen)
        self._lengths: deque[int] = deque(maxlen=self.maxlen)
        self.total_episodes = 0

    def add(self, returns: Iterable[float] | float, lengths: Iterable[int] | int) -> None:
        """Add finished episodes: ``returns`` and ``lengths`` are scalars or equal-length 1-D
        sequences (for example float32/int arrays from one step message).

        Raises:
            ValueError: the two have different lengths.
        """
        returns_array = np.atleast_1d(np.asarray(returns, dtype=np.float64))
        lengths_array = np.atleast_1d(np.asarray(lengths, dtype=np.int64))
        if returns_array.shape != lengths_array.shape or returns_array.ndim != 1:
            raise ValueError(
                f"returns/lengths: expected equal-length 1-D sequences, got shapes {returns_array.shape} "
                f"and {lengths_array.shape}"
            )
        self._returns.extend(returns_array.tolist())
        self._lengths.extend(lengths_array.tolist())
        self.total_episodes += len(returns_array)

    @property
    def count(self) -> int:
        """Number of episodes in the window (at most ``maxlen``)."""
        return len(self._returns)

    @property
    def mean(self) -> float:
        """Mean return over the window (NaN if empty)."""
        return float(np.mean(self._returns)) if self._returns else math.nan

    @property
    def min(self) -> float:
        """Lowest return in the window (NaN if empty)."""
        return float(np.min(self._returns)) if self._returns else math.nan

    @property
    def max(self) -> float:
        """Highest return in the window (NaN if empty)."""
        return float(np.max(self._returns)) if self._returns else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation of the window's returns (NaN if empty)."""
        return float(np.std(self._returns)) if self._returns else math.nan

    @property
    def mean_length(self) -> float:
        """Mean episode length in env steps over the window (NaN if empty)."""
        return float(np.mean(self._lengths)) if self._lengths else math.nan

    def returns(self) -> list[float]:
        """The window's returns, oldest first."""
        return list(self._returns)


def episode_scalars(window: EpisodeWindow) -> dict[str, float]:
    """``charts/episodic_return`` and ``charts/episodic_length``: window means; {} while empty."""
    return record({"window": window}) if window.count else {}


def update_scalars(stats: PPOUpdateStats) -> dict[str, float]:
    """The scalars of one PPO update's statistics (the table's rows read from ``stats``): CleanRL's
    ``losses/*`` and ``charts/learning_rate``, plus our own ``diagnostics/*`` (first-minibatch ratio
    deviation, epochs completed, update seconds, skipped non-finite minibatches, importance weight)
    and ``charts/rollout_rows``."""
    return record({"stats": stats})


class StepRateMeter:
    """Env steps per second (SPS) over a sliding window of ``(time, total steps)`` samples.

    Call :meth:`sample` periodically with a monotonic time (s) and the running step count; :attr:`rate`
    is ``(steps_last - steps_first) / (time_last - time_first)`` over the window (0.0 until two
    samples span a positive time), never negative.
    """

    def __init__(self, window: int = 64) -> None:
        self._samples: deque[tuple[float, int]] = deque(maxlen=window)

    def sample(self, now: float, total_steps: int) -> None:
        """Record the running step count at time ``now`` (seconds, monotonic)."""
        self._samples.append((now, int(total_steps)))

    @property
    def rate(self) -> float:
        """Steps per second over the window."""
        if len(self._samples) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return max(0.0, (s1 - s0) / (t1 - t0)) if t1 > t0 else 0.0


class RunStepRates:
    """A run's env steps per second, two ways, from one running step count.

    :meth:`overall` is wall-clock SPS since ``started`` (the learner's start: start-up, joins and
    waits included, so ``overall * elapsed`` is the steps done), logged as ``charts/SPS``;
    :meth:`recent` is the rate over the samples of the last ``window_s`` seconds, logged as
    ``charts/SPS_recent`` (it equals :meth:`overall` until two samples exist).

    Args:
        started: monotonic time (s) the count starts from.
        start_steps: the step count at ``started`` (a resumed run's steps are not this run's work).
        window_s: span of the recent window (s), > 0.

    Raises:
        ValueError: ``window_s`` <= 0.
    """

    def __init__(self, started: float, start_steps: int = 0, *, window_s: float = 10.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s: expected > 0 seconds, got {window_s}")
        self.started = float(started)
        self.start_steps = int(start_steps)
        self.window_s = float(window_s)
        self._samples: deque[tuple[float, int]] = deque()
        self._last = (self.started, self.start_steps)

    def sample(self, now: float, total_steps: int) -> None:
        """Record the running step count at monotonic time ``now`` (s)."""
        self._last = (float(now), int(total_steps))
        self._samples.append(self._last)
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def overall(self) -> float:
        """Steps per second from ``started`` to the last sample (0.0 before any time passed)."""
        now, steps = self._last
        return (
            max(0.0, (steps - self.start_steps) / (now - self.started))
            if now > self.started
            else 0.0
        )

    def recent(self) -> float:
        """Steps per second over the last ``window_s`` seconds of samples (:meth:`overall` until
        two samples span a positive time)."""
        if len(self._samples) < 2 or self._samples[-1][0] <= self._samples[0][0]:
            return self.overall()
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return max(0.0, (s1 - s0) / (t1 - t0))


class JsonLinesWriter:
    """Appends JSON records to a file, one line each, written whole or not at all.

    Each record is one ``os.write`` of the complete line on an ``O_APPEND`` descriptor (no Python
    buffering). A short write (the disk filled up mid-record) is undone by truncating the file back to
    its size before the write, so a reader never sees half a record. A failed write (``ENOSPC`` or any
    other ``OSError``) drops the record, counts it in :attr:`failures` and is logged at most once per
    ``log_period_s`` (first failure of each kind in full, then a summary): the caller keeps going.
    One writer per file: the undo of a short write assumes no other process appends meanwhile.

    Args:
        path: the ``.jsonl`` file (created if missing, parent must exist).
        log_period_s: shortest time between two log lines about failures (seconds).

    Raises:
        OSError: the file cannot be opened at all (missing folder, permissions).
    """

    def __init__(self, path: Path, *, log_period_s: float = WRITE_FAILURE_LOG_PERIOD_S) -> None:
        self.path = Path(path)
        self._fd: int | None = os.open(
            self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
        )
        self._lock = threading.Lock()
        self._failure_log = RateLimitedLog(
            log,
            "records",
            verb="dropped",
            period_s=log_period_s,
            first_prefix=f"could not append to {self.path}, record dropped "
            "(training goes on; failures are counted as log_write_failures)",
        )
        self.failures = 0
        """Records dropped because the write failed."""
        self.records = 0
        """Records written."""

    def write(self, record: Mapping[str, Any]) -> bool:
        """Append ``record`` (a JSON-serialisable mapping) as one line.

        Returns:
            True when the whole line was written, False when it was dropped (write error, counted).

        Raises:
            TypeError / ValueError: ``record`` is not JSON-serialisable (a caller bug).
            RuntimeError: the writer is closed.
        """
        data = (json.dumps(record) + "\n").encode("utf-8")
        with self._lock:
            if self._fd is None:
                raise RuntimeError(f"JsonLinesWriter({self.path}): write() after close()")
            try:
                size_before = os.fstat(self._fd).st_size
                written = os.write(self._fd, data)
                if written != len(
                    data
                ):  # the disk filled up inside the record: undo the partial line
                    os.ftruncate(self._fd, size_before)
                    raise OSError(
                        errno.ENOSPC,
                        f"{os.strerror(errno.ENOSPC)}: short write ({written} of "
                        f"{len(data)} bytes), record undone",
                    )
            except OSError as error:
                self.failures += 1
                reason = errno.errorcode.get(error.errno or 0, type(error).__name__)
                self._failure_log.event(
                    reason, f"{error} ({len(data)} bytes needed, {_free_bytes(self.path)} free)"
                )
                return False
            self.records += 1
            return True

    def close(self) -> None:
        """Close the file (idempotent); a pending failure summary is logged first."""
        with self._lock:
            self._failure_log.flush(float("inf"))
            if self._fd is not None:
                fd, self._fd = self._fd, None
                try:
                    os.close(fd)
                except OSError as error:  # nothing is buffered: no record can be lost here
                    log.warning("closing %s: %s", self.path, error)


def _free_bytes(path: Path) -> str:
    """Free bytes of the file system holding ``path``, as text (``"unknown"`` when it cannot be read)."""
    import shutil

    try:
        return f"{shutil.disk_usage(Path(path).parent).free} bytes"
    except OSError:
        return "unknown"


def _swallow_tensorboard_thread_errors() -> None:
    """Keep a failed TensorBoard writer thread from printing a traceback into the log.

    TensorBoard writes events from a thread of its own; when that write fails (a full disk) the thread
    dies with the error, which the next ``add_summary``/``flush`` re-raises (and :class:`MetricsLogger`
    counts). Python would also print the thread's traceback: this hook drops exactly those OSErrors and
    hands every other thread exception to the previous hook. Installed once per process.
    """
    previous = threading.excepthook
    if getattr(previous, "_oakemu_tensorboard_filter", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        thread_type = type(args.thread).__name__ if args.thread is not None else ""
        if thread_type == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook._oakemu_tensorboard_filter = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class MetricsLogger:
    """Writes scalars to TensorBoard event files in ``run_dir`` and to ``run_dir/metrics.jsonl``.

    Each :meth:`log` call appends one JSON object per line:
    ``{"global_step": int, "wall_time": float (Unix seconds), "<name>": value, ...}``; NaN and
    infinities are written as ``null`` so every line is strict JSON. The file is opened in append
    mode, so a resumed run continues the same log. Usable as a context manager.

    A write that fails (full disk, any ``OSError``) never raises: the JSON line is dropped whole
    (:class:`JsonLinesWriter`), a TensorBoard error closes the events writer, which is reopened (a new
    events file) at most every :data:`TENSORBOARD_RETRY_S` seconds; both are counted in
    :attr:`write_failures` and logged at most every :data:`WRITE_FAILURE_LOG_PERIOD_S` seconds.

    ``tracker`` (:class:`oakemu_core.run.tracking.Tracker`, optional) receives every scalar and video
    as well; the logger owns it and closes it last (the tracker then uploads the final checkpoint).
    """

    def __init__(self, run_dir: Path, *, tracker: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self._tracker = tracker
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / METRICS_FILE_NAME
        _swallow_tensorboard_thread_errors()
        self._tb_failure_log = RateLimitedLog(
            log,
            "TensorBoard writes",
            verb="failed",
            period_s=WRITE_FAILURE_LOG_PERIOD_S,
            first_prefix=f"TensorBoard events in {self.run_dir} not written "
            "(training goes on; counted as log_write_failures)",
        )
        self.tensorboard_failures = 0
        """TensorBoard calls that failed (each drops what it carried)."""
        self._writer: Any = None
        self._tb_retry_at = 0.0
        self._open_tensorboard()
        self._jsonl = JsonLinesWriter(self.jsonl_path)
        self._closed = False

    @property
    def write_failures(self) -> int:
        """Records dropped by failed writes: JSON lines plus TensorBoard calls."""
        return self._jsonl.failures + self.tensorboard_failures

    def _open_tensorboard(self) -> None:
        from torch.utils.tensorboard.writer import (
            FileWriter,
        )  # imports tensorboard; only loggers need it

        try:
            self._writer = FileWriter(str(self.run_dir))
        except Exception as error:  # noqa: BLE001 - a full disk must not stop training
            self._tensorboard_failed(error)

    def _tensorboard_failed(self, error: BaseException) -> None:
        self.tensorboard_failures += 1
        self._tb_failure_log.event(type(error).__name__, f"{type(error).__name__}: {error}")
        writer, self._writer = self._writer, None
        self._tb_retry_at = time.monotonic() + TENSORBOARD_RETRY_S
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001, S110 - the writer is already broken; its error was counted
                pass

    def _tensorboard(self, call: Any) -> None:
        if self._writer is None:
            if time.monotonic() < self._tb_retry_at:
                self.tensorboard_failures += 1  # dropped while the writer is down
                return
            self._open_tensorboard()
            if self._writer is None:
                return
        try:
            call(self._writer)
        except Exception as error:  # noqa: BLE001 - OSError, or the writer thread's re-raised error
            self._tensorboard_failed(error)

    def log(self, global_step: int, scalars: Mapping[str, float]) -> None:
        """Record ``scalars`` at ``global_step`` (env steps so far). Write errors are counted, not raised.

        Raises:
            TypeError: a name is not a str or a value is not a real number (names the entry).
            RuntimeError: the logger is closed.
        """
        if self._closed:
            raise RuntimeError("MetricsLogger: log() after close()")
        record: dict[str, Any] = {"global_step": int(global_step), "wall_time": time.time()}
        values: dict[str, float] = {}
        for name, value in scalars.items():
            if not isinstance(name, str):
                raise TypeError(f"scalars: name {name!r} must be a str, got {type(name).__name__}")
            if not isinstance(value, numbers.Real) and not (
                isinstance(value, np.ndarray) and value.size == 1
            ):
                raise TypeError(
                    f"scalars[{name!r}]: expected a real number, got {type(value).__name__}"
                )
            values[name] = float(value)

        def add_all(writer: Any) -> None:
            # One event holding every scalar of the call: TensorBoard reads it as one point per tag,
            # and it costs the learner's main thread a fraction of one ``add_scalar`` event per tag.
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(
                value=[
                    Summary.Value(tag=name, simple_value=value) for name, value in values.items()
                ]
            )
            writer.add_summary(summary, int(global_step))

        self._tensorboard(add_all)
        if self._tracker is not None:
            self._tracker.log_scalars(int(global_step), values)
        for name, value in values.items():
            record[name] = value if math.isfinite(value) else None
        self._jsonl.write(record)

    def log_video(
        self, global_step: int, tag: str, path: Path | str | None, preview: Any = None
    ) -> None:
        """An evaluation video at ``path`` (MP4; None: nothing to log): its ``preview``
        (:class:`oakemu_core.run.video.VideoPreview`, or None) becomes an animated image under ``tag`` in
        TensorBoard, the MP4 goes to the tracker. Write errors are counted, not raised."""
        if path is None:
            return
        if self._tracker is not None:
            self._tracker.log_video(int(global_step), tag, Path(path))
        if preview is not None:
            from oakemu_core.run.video import preview_summary

            summary = preview_summary(tag, preview)
            self._tensorboard(lambda writer: writer.add_summary(summary, int(global_step)))

    def flush(self) -> None:
        """Push buffered TensorBoard events to disk (JSON lines are never buffered)."""
        self._tensorboard(lambda writer: writer.flush())

    def close(self) -> None:
        """Flush and close both outputs; calling it again does nothing. Never raises for write errors."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._tensorboard(lambda writer: writer.close())
        self._tb_failure_log.flush(float("inf"))
        self._jsonl.close()
        if self._tracker is not None:
            self._tracker.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

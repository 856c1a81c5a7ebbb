"""The hand-off between the learner's two threads: full rollouts from the ingest thread to
training, results (new weights, statistics, evaluations) back.

Everything that crosses between the threads goes through :class:`RolloutHandshake`: the rollout
with whether to re-evaluate it, the run's counters for checkpoints (:class:`RunProgress`), the
trainer's results (:class:`TrainResult`, :class:`WeightsRevision`, or the exception that ended
training) and, with each result, the trainer's own counters (:class:`TrainerCounters`: the ingest
thread reads the copy handed over, never the trainer's live state).
"""

from __future__ import annotations

import math
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from oakemu_core.algo.update_stats import PPOUpdateStats
    from oakemu_core.storage.buffer_ring import FullRollout

__all__ = [
    "PublishedRollout",
    "RolloutHandshake",
    "RunProgress",
    "TrainResult",
    "TrainerCounters",
    "WeightsRevision",
]


@dataclass(frozen=True)
class RunProgress:
    """The run's counters as the ingest thread last reported them (checkpoints record them).

    Attributes:
        global_step: env steps the learner received since the run started (all actors, trained
            or not; it never goes back).
        episodes: episodes finished since the run started.
    """

    global_step: int = 0
    episodes: int = 0


@dataclass(frozen=True)
class TrainerCounters:
    """The trainer's counters as its last handed-back result carried them (the trainer thread owns
    them; the ingest thread's telemetry reports this copy).

    Attributes:
        iterations: PPO updates completed.
        learning_rate: the learning rate of the next update (the schedule's value times the
            rollback scale); NaN before the trainer reported any.
        checkpoint_failures: failed checkpoint writes since the learner started.
    """

    iterations: int = 0
    learning_rate: float = math.nan
    checkpoint_failures: int = 0


@dataclass(frozen=True)
class PublishedRollout:
    """A full rollout handed to training.

    Attributes:
        rollout: the buffer's slot, the buffer and the GAE bootstrap data.
        reevaluate: re-evaluate every row with the current weights before GAE, even when all were
            acted by the current version (an actor acts with rounded, e.g. bfloat16, weights).
    """

    rollout: FullRollout
    reevaluate: bool = False


@dataclass
class WeightsRevision:
    """Weights an epoch left within an update (``publish_every_epoch``), for the ingest thread to
    publish: revision ``revision`` of ``policy_version`` (the version in training)."""

    policy_version: int
    revision: int
    weights: dict[str, np.ndarray]


@dataclass
class TrainResult:
    """What the trainer hands back after a rollout, a behaviour-cloning phase, or its stop.

    Attributes:
        slot: the rollout buffer's slot (to release), or None (a BC phase; the final result).
        policy_version: version of ``weights``. weights: the new weights.
        stats: the update's statistics (None when no row was trainable).
        stale_rows: rows dropped for policy lag. lag: lag ``min``/``mean``/``max``/``newest_version``.
        iterations: PPO updates so far. evaluations: tester reports that arrived meanwhile.
        events: human-readable notes (rollbacks, BC phases) to log.
        trainable_share: trainable rows / rows of the rollout. rollbacks: rollbacks so far.
        trained_env_steps: env steps of every rollout trained on so far (rows less stale rows).
        columns: the rollout's columns that held rows (0: not a rollout). planned_columns: the
            columns the run's planned actors fill (fewer columns: the rollout trained with fewer rows).
        learning_rate: the learning rate of the next update. checkpoint_failures: failed
            checkpoint writes so far (with ``iterations``, :class:`TrainerCounters`).
    """

    slot: int | None
    policy_version: int
    weights: dict[str, np.ndarray]
    stats: PPOUpdateStats | None
    stale_rows: int = 0
    lag: dict[str, float] = field(default_factory=dict)
    iterations: int = 0
    evaluations: list[Any] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    trainable_share: float = 1.0
    rollbacks: int = 0
    trained_env_steps: int = 0
    columns: int = 0
    planned_columns: int = 0
    learning_rate: float = math.nan
    checkpoint_failures: int = 0


class RolloutHandshake:
    """Synchronises the hand-off of full rollouts from the ingest thread to the trainer.

    At most one rollout is in training at a time: :attr:`busy` is True from :meth:`publish` until
    the ingest thread collects its result with :meth:`results`.

    :attr:`wake_fd` becomes readable when a result is handed back: the ingest thread polls it next
    to its sockets, so it collects a result (and releases its buffer, publishes its weights) at
    once instead of at its next poll timeout, when no step message would wake it. :meth:`close`
    releases it.
    """

    def __init__(self) -> None:
        self._inbox: queue.Queue[PublishedRollout] = queue.Queue(maxsize=1)
        self._outbox: queue.Queue[TrainResult | WeightsRevision | BaseException] = queue.Queue()
        self._busy = False
        self._progress = RunProgress()
        self._trainer = TrainerCounters()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    @property
    def wake_fd(self) -> int:
        """A file descriptor that is readable while a handed-back result waits (for a poller)."""
        return self._wake_read

    def close(self) -> None:
        """Release :attr:`wake_fd` (idempotent)."""
        for fd in (self._wake_read, self._wake_write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_read = self._wake_write = -1

    @property
    def busy(self) -> bool:
        """A rollout was published and its result not collected yet."""
        return self._busy

    @property
    def progress(self) -> RunProgress:
        """The run's counters as last reported by the ingest thread (:meth:`publish`, :meth:`report`)."""
        return self._progress

    def report(self, progress: RunProgress) -> None:
        """Ingest thread: the run's counters now (the next checkpoint records them; before the
        trainer stops, the final one)."""
        self._progress = progress  # replaced whole: a reader sees the old or the new counters

    @property
    def trainer_counters(self) -> TrainerCounters:
        """Ingest thread: the trainer's counters as of the last result collected by
        :meth:`results` (or as :meth:`report_trainer` set them before the trainer thread started)."""
        return self._trainer

    def report_trainer(self, counters: TrainerCounters) -> None:
        """The trainer's counters before its thread starts (afterwards each :class:`TrainResult`
        carries them)."""
        self._trainer = counters

    def publish(
        self, rollout: FullRollout, progress: RunProgress | None = None, *, reevaluate: bool = False
    ) -> None:
        """Ingest thread: hand a full rollout to training, with the run's counters as of its hand-off
        (kept when None) and whether to re-evaluate every row (:class:`PublishedRollout`).

        Raises:
            RuntimeError: the previous rollout is still in training.
        """
        if self._busy:
            raise RuntimeError(
                "RolloutHandshake.publish: the previous rollout is still in training"
            )
        if progress is not None:
            self.report(progress)
        self._busy = True
        self._inbox.put(PublishedRollout(rollout, reevaluate))

    def wait_for_rollout(
        self, stop_event: threading.Event, timeout_s: float = 0.1
    ) -> PublishedRollout | None:
        """Trainer: the next published rollout, or None once ``stop_event`` is set (polls every
        ``timeout_s`` seconds)."""
        while not stop_event.is_set():
            try:
                return self._inbox.get(timeout=timeout_s)
            except queue.Empty:
                continue
        return None

    def complete(self, result: TrainResult | WeightsRevision | BaseException) -> None:
        """Trainer: hand back a result (a rollout's, an unsolicited one such as BC pre-training or
        weights within an update, or the exception that ended training)."""
        self._outbox.put(result)
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):  # full: already readable; closed: nobody polls any more
            pass

    def results(self) -> list[TrainResult | WeightsRevision]:
        """Ingest thread: every result ready now (non-blocking), in order; a rollout's result clears
        :attr:`busy`. Re-raises an exception the trainer handed back."""
        try:  # drained before the queue is read: a result handed back meanwhile wakes the next poll
            while os.read(self._wake_read, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        ready = []
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return ready
            if isinstance(item, BaseException):
                raise RuntimeError("trainer thread failed") from item
            if isinstance(item, TrainResult):
                self._trainer = TrainerCounters(
                    item.iterations, item.learning_rate, item.checkpoint_failures
                )
                if item.slot is not None:
                    self._busy = False
            ready.append(item)

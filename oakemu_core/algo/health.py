"""The learner's health and checkpoints: the collapse detector, and the policy that decides when
to checkpoint and how to roll back to the last good checkpoint.

:class:`CheckpointPolicy` is the seam :func:`oakemu_core.algo.trainer_thread.run_trainer` drives
after every update, after every evaluation, and once at the end; it sees the learner through the
small :class:`JudgedLearner` protocol.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from oakemu_core.run.checkpoint import CheckpointWriteFailed, latest_checkpoint, load_checkpoint
from oakemu_core.run.tester import BestCheckpointTracker

if TYPE_CHECKING:
    from oakemu_core.algo.update_stats import PPOUpdateStats

__all__ = ["CheckpointPolicy", "HealthMonitor", "JudgedLearner", "RunCollapsedError"]

log = logging.getLogger("oakemu.learner")


class RunCollapsedError(RuntimeError):
    """The run kept collapsing after the configured number of rollbacks: training stops."""


class JudgedLearner(Protocol):
    """What :class:`CheckpointPolicy` reads and calls on the learner it judges
    (:class:`oakemu_core.algo.learner.PPOLearner` is one)."""

    @property
    def model(self) -> torch.nn.Module:
        """The trained model (its weights are checked for non-finite values)."""
        ...

    @property
    def iterations(self) -> int:
        """PPO updates completed (the checkpoint's number)."""
        ...

    @property
    def policy_version(self) -> int:
        """Version of the current weights."""
        ...

    @property
    def device(self) -> torch.device:
        """Where a restored checkpoint is loaded to."""
        ...

    @property
    def lr_scale(self) -> float:
        """The learning-rate factor left by rollbacks."""
        ...

    def restore_weights(self, state: dict[str, Any], *, lr_factor: float) -> None:
        """Roll back to a checkpoint's weights under a new policy version."""
        ...


@dataclass
class HealthMonitor:
    """Judges an update (and the evaluations) for signs of a collapsed run.

    A collapse is: a non-finite loss or weight; an approximate KL above ``max_approx_kl``; or the
    evaluation return below ``eval_fraction`` of the best evaluation (measured from the worst
    return seen, so negative-return games work) for ``eval_patience`` evaluations in a row.

    Args:
        max_approx_kl: KL threshold (None: not checked).
        eval_fraction: in (0, 1); None disables the evaluation check.
        eval_patience: consecutive low evaluations that make a collapse.
    """

    max_approx_kl: float | None = 1.0
    eval_fraction: float | None = 0.5
    eval_patience: int = 3
    best_eval: float = -math.inf
    worst_eval: float = math.inf
    low_evaluations: int = 0

    def check_update(self, stats: PPOUpdateStats | None, model: torch.nn.Module) -> str | None:
        """Why this update collapsed the run, or None."""
        if stats is not None:
            for name in ("policy_loss", "value_loss", "entropy", "approx_kl"):
                if not math.isfinite(getattr(stats, name)):
                    return f"non-finite {name} ({getattr(stats, name)})"
            if self.max_approx_kl is not None and stats.approx_kl > self.max_approx_kl:
                return f"approx_kl {stats.approx_kl:.3g} > {self.max_approx_kl:g}"
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return f"non-finite weights in {name}"
        return None

    def check_evaluation(self, mean_return: float) -> str | None:
        """Record an evaluation; why the run collapsed, or None."""
        self.worst_eval = min(self.worst_eval, mean_return)
        improved = mean_return > self.best_eval
        self.best_eval = max(self.best_eval, mean_return)
        if self.eval_fraction is None or improved or not math.isfinite(self.worst_eval):
            self.low_evaluations = 0
            return None
        floor = self.worst_eval + self.eval_fraction * (self.best_eval - self.worst_eval)
        self.low_evaluations = self.low_evaluations + 1 if mean_return < floor else 0
        if self.low_evaluations >= self.eval_patience:
            self.low_evaluations = 0
            return (
                f"evaluation return {mean_return:.2f} below {self.eval_fraction:g} of the best "
                f"({self.best_eval:.2f}) for {self.eval_patience} evaluations"
            )
        return None


class CheckpointPolicy:
    """When and where the learner checkpoints, and how it recovers from a collapse.

    Periodic checkpoints every ``every_updates`` updates and/or ``every_seconds`` of wall time,
    a final one, ``best.pt`` for the best evaluation, the newest ``keep_last`` numbered files
    kept. On a collapse (:class:`HealthMonitor`) the learner is restored from ``best.pt`` (or
    the latest checkpoint), its learning rate multiplied by ``lr_factor``, and its weights
    published under a new policy version; after ``max_rollbacks`` rollbacks
    :class:`RunCollapsedError` stops training.

    Args:
        run_dir: the run folder (``checkpoints/`` inside).
        state_fn: returns the complete checkpoint state (learner state plus the service's counters).
        save_fn: ``(run_dir, update, state, final) -> Path | None``: writes one numbered checkpoint and
            points ``latest.pt`` at it (None when the write failed and was reported); ``final`` is True
            only for the run's final checkpoint (:meth:`final`).
        health: the collapse detector, None: no rollback.
        every_updates, every_seconds: periodic checkpoints (0: off).
        lr_factor: learning-rate multiplier per rollback, in (0, 1].
        max_rollbacks: rollbacks before giving up.
        write_failures: ``() -> int``, the failed checkpoint writes so far as the writer behind
            ``save_fn`` counts them (read in the trainer thread, :attr:`checkpoint_failures`);
            None: 0.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        state_fn: Callable[[], dict[str, Any]],
        save_fn: Callable[[Path, int, dict[str, Any], bool], Path | None],
        health: HealthMonitor | None = None,
        every_updates: int = 50,
        every_seconds: float = 0.0,
        lr_factor: float = 0.5,
        max_rollbacks: int = 3,
        write_failures: Callable[[], int] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.state_fn = state_fn
        self.save_fn = save_fn
        self.health = health
        self.every_updates = int(every_updates)
        self.every_seconds = float(every_seconds)
        self.lr_factor = float(lr_factor)
        self.max_rollbacks = int(max_rollbacks)
        self.rollbacks = 0
        self._last_save = time.monotonic()
        self.best = BestCheckpointTracker(self.run_dir)
        self._write_failures = write_failures

    @property
    def checkpoint_failures(self) -> int:
        """Failed checkpoint writes so far (the writer's count; 0 without ``write_failures``)."""
        return 0 if self._write_failures is None else int(self._write_failures())

    @property
    def best_path(self) -> Path:
        return self.best.path

    def save(self, update: int, *, final: bool = False) -> Path | None:
        """Write a numbered checkpoint of the current state now (``final``: the run's final one)."""
        self._last_save = time.monotonic()
        return self.save_fn(self.run_dir, update, self.state_fn(), final)

    def after_update(self, learner: JudgedLearner, stats: PPOUpdateStats | None) -> list[str]:
        """Judge the update, roll back if it collapsed, checkpoint when due; returns notes to log.

        Raises:
            RunCollapsedError: a collapse after ``max_rollbacks`` rollbacks.
        """
        reason = self.health.check_update(stats, learner.model) if self.health is not None else None
        if reason is not None:
            return [self.roll_back(learner, reason)]
        due_updates = self.every_updates and learner.iterations % self.every_updates == 0
        due_time = self.every_seconds and time.monotonic() - self._last_save >= self.every_seconds
        if stats is not None and (due_updates or due_time):
            self.save(learner.iterations)
        return []

    def after_evaluation(self, learner: JudgedLearner, report: Any) -> list[str]:
        """Record a tester report (:class:`oakemu_core.run.tester.EvaluationReport`): keep ``best.pt``
        (the evaluated weights) when it is the best so far, roll back on an evaluation collapse."""
        mean = float(report.return_mean)
        if self.health is not None and (reason := self.health.check_evaluation(mean)) is not None:
            return [self.roll_back(learner, reason)]
        try:
            if self.best.consider(report, self.state_fn):
                return [
                    f"best.pt: evaluation return {mean:.2f} (policy version {report.policy_version})"
                ]
        except OSError as error:
            return [f"could not write {self.best.path}: {error}"]
        return []

    def roll_back(self, learner: JudgedLearner, reason: str) -> str:
        """Restore the last good checkpoint, lower the learning rate, bump the policy version.

        Raises:
            RunCollapsedError: after ``max_rollbacks`` rollbacks, or with no checkpoint to go back to.
        """
        if self.rollbacks >= self.max_rollbacks:
            raise RunCollapsedError(
                f"the run collapsed again ({reason}) after {self.rollbacks} rollbacks: stopping; "
                f"lower the learning rate or check the env's rewards"
            )
        path = self.best_path if self.best_path.is_file() else latest_checkpoint(self.run_dir)
        if path is None:
            raise RunCollapsedError(
                f"the run collapsed ({reason}) before any checkpoint was written: stopping"
            )
        learner.restore_weights(
            load_checkpoint(path, map_location=learner.device), lr_factor=self.lr_factor
        )
        self.rollbacks += 1
        if self.health is not None:
            self.health.low_evaluations = 0
        return (
            f"rollback {self.rollbacks}/{self.max_rollbacks}: {reason}; restored {path.name}, learning rate "
            f"x{learner.lr_scale:g}, policy version {learner.policy_version}"
        )

    def final(self, learner: JudgedLearner) -> Path | None:
        """Write the final checkpoint (at exit) and log where the run resumes from; None when it
        was not written (a failed write, logged, or :class:`CheckpointWriteFailed`: too many
        failures in a row)."""
        try:
            path = self.save(learner.iterations, final=True)
        except (
            CheckpointWriteFailed
        ) as error:  # already logged as the reason to stop, or the last straw
            log.error("final checkpoint not written: %s", error)
            path = None
        if path is not None:
            log.info("final checkpoint %s", path)
        else:
            log.warning(
                "final checkpoint not written; the run resumes from %s",
                latest_checkpoint(self.run_dir) or "its start (no checkpoint)",
            )
        return path

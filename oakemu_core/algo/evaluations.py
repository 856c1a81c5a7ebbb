"""When the learner's weights go to the tester, and what its reports mean for the run.

:class:`EvaluationSchedule` submits the weights every ``every_updates`` updates (and the first
ones of a run, kept), polls the tester's reports and hands them to the
:class:`~oakemu_core.algo.health.CheckpointPolicy` (``best.pt``, rollback on an evaluation
collapse), and evaluates the final weights when training stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from oakemu_core.algo.health import RunCollapsedError

if TYPE_CHECKING:
    from oakemu_core.algo.health import CheckpointPolicy, JudgedLearner

__all__ = ["FINAL_EVALUATION_TIMEOUT_S", "EvaluationSchedule"]

log = logging.getLogger("oakemu.learner")

FINAL_EVALUATION_TIMEOUT_S = 30.0
"""Longest wait (s) for the evaluation of the final weights when training stops: shutdown stays
prompt even when a greedy early Atari policy never loses a life (episodes then run to the
27,000-step limit)."""


class EvaluationSchedule:
    """The learner's side of periodic evaluation.

    Args:
        tester: :class:`oakemu_core.run.tester.Tester`-like (``submit(version, weights,
            global_step, keep=)``, ``poll()``, ``drain(timeout_s=)``, ``alive``), or None: no
            evaluation.
        every_updates: submit the weights every this many updates (0: only when forced).
    """

    def __init__(self, tester: Any = None, every_updates: int = 0) -> None:
        self.tester = tester
        self.every_updates = int(every_updates)
        self._submitted_version = -1  # the newest weights handed to the tester
        self._reported_versions: set[int] = set()  # the versions it reported on

    def submit(
        self,
        snapshot: Callable[[], tuple[int, Any]],
        *,
        iterations: int,
        global_step: int,
        force: bool = False,
    ) -> bool:
        """Hand the weights ``snapshot()`` gives (``(policy version, weights)``, taken only when
        they go) to the tester when ``iterations`` (updates so far) is a multiple of
        ``every_updates``, or now and kept with ``force`` (the first weights of a run, the
        behaviour-cloned ones: evaluated whatever follows). Returns whether they were submitted."""
        every = self.every_updates
        if self.tester is None or not (force or (every and iterations % every == 0)):
            return False
        version, weights = snapshot()
        self.tester.submit(version, weights, global_step, keep=force)
        self._submitted_version = version
        return True

    def poll(self, policy: CheckpointPolicy, learner: JudgedLearner) -> tuple[list[Any], list[str]]:
        """The reports that arrived, and the notes ``policy`` made of them (it may roll
        ``learner`` back: :class:`~oakemu_core.algo.health.RunCollapsedError` propagates)."""
        if self.tester is None:
            return [], []
        reports, notes = self.tester.poll(), []
        self._reported_versions.update(report.policy_version for report in reports)
        for report in reports:
            notes += policy.after_evaluation(learner, report)
        return reports, notes

    def final(
        self,
        version: int,
        weights: Any,
        *,
        global_step: int,
        policy: CheckpointPolicy,
        learner: JudgedLearner,
    ) -> tuple[list[Any], list[str]]:
        """Evaluate the final weights (training has stopped; at most
        :data:`FINAL_EVALUATION_TIMEOUT_S` seconds) and judge the reports (``best.pt``, rollback);
        returns the reports and the notes. A collapse is logged, not raised. Weights already
        submitted are not submitted twice."""
        tester = self.tester
        if tester is None or not tester.alive:
            return [], []
        if version != self._submitted_version:  # else its evaluation is done or on its way
            tester.submit(version, weights, global_step, keep=True)
        reports, notes = tester.drain(timeout_s=FINAL_EVALUATION_TIMEOUT_S), []
        try:
            for report in reports:
                notes += policy.after_evaluation(learner, report)
        except RunCollapsedError as error:
            log.error("%s", error)
        if version not in self._reported_versions | {report.policy_version for report in reports}:
            log.warning(
                "the evaluation of the final weights did not finish within %.0f s: skipped "
                "(oakemu evaluate plays the final checkpoint)",
                FINAL_EVALUATION_TIMEOUT_S,
            )
        return reports, notes

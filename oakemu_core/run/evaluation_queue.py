"""Which submitted weights the tester evaluates next, and when: newest-wins waiting, pacing, videos.

:class:`EvaluationQueue` is the tester's bookkeeping without its process: the weights waiting
(any number kept, at most one that a newer submission replaces), the one being evaluated, the pacing
(an evaluation that took ``s`` seconds from hand-off to report lets the next plain one start
``s / max_share`` seconds after it was handed off), which evaluations are recorded as video, and the
final video a drain asks for. It holds no lock and reads no clock: its owner
(:class:`oakemu_core.run.tester.Tester`) calls it under its lock with ``time.monotonic()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

__all__ = ["EvaluationJob", "EvaluationQueue"]


class EvaluationJob(NamedTuple):
    """One submitted set of weights."""

    policy_version: int
    global_step: int
    weights: Mapping[str, np.ndarray]
    keep: bool
    """Never replaced by a newer submission, and never paced (a run's first and final weights)."""


class EvaluationQueue:
    """The waiting and running evaluations of one tester, and what to hand its child next.

    Args:
        videos: evaluations are recorded as video (the tester has a video folder).
        video_every: record every this-many-th evaluation handed out, the first included (0: none
            but ``best.mp4`` and ``final.mp4``).
        max_share: the largest share of the wall time the tester is busy, in (0, 1].
    """

    def __init__(self, *, videos: bool, video_every: int, max_share: float) -> None:
        self.pending: list[EvaluationJob] = []
        """Waiting jobs, oldest first: any number of kept ones and at most one plain one, last."""
        self.in_flight: EvaluationJob | None = None
        """The job handed to the child and not reported yet."""
        self.draining = False
        """A drain runs: nothing waits for pacing, the last evaluation is the final one."""
        self.final_video_due = False
        """The drain wants ``final.mp4`` once nothing runs or waits."""
        self.final_video_asked = False
        """The child is making ``final.mp4``."""
        self._videos, self._video_every, self._max_share = videos, video_every, max_share
        self._handed_out = 0  # evaluations handed to the child (the video_every count)
        self._handed_at = 0.0  # clock time of the last hand-off
        self._next_start = 0.0  # clock time before which a plain job waits (pacing)

    @property
    def busy(self) -> bool:
        """True while an evaluation runs or a job waits."""
        return self.in_flight is not None or bool(self.pending)

    @property
    def unfinished(self) -> bool:
        """True while an evaluation runs, a job waits or a due final video is not made yet."""
        return self.busy or self.final_video_due

    def submit(self, job: EvaluationJob) -> bool:
        """Queue ``job``, replacing the newest waiting job unless that one is kept.

        Returns:
            True when a waiting job was replaced (superseded: it is never evaluated).
        """
        superseded = bool(self.pending) and not self.pending[-1].keep
        if superseded:
            self.pending.pop()
        self.pending.append(job)
        return superseded

    def start_drain(self) -> None:
        """Hand out what waits at once, and ask for ``final.mp4`` after it (with videos)."""
        self.draining, self.final_video_due = True, self._videos

    def end_drain(self) -> None:
        """Pace submissions again; a final video not made by now is not asked for any more."""
        self.draining = self.final_video_due = False

    def next_message(self, now: float) -> tuple[tuple[Any, ...] | None, float | None]:
        """What to send the idle child at clock time ``now``, and how long to wait at most before
        asking again (None: until something changes).

        Returns:
            ``(("evaluate", policy_version, global_step, weights dict, record), None)`` for the
            oldest waiting job when pacing allows it (``record``: ``"update"`` on every
            ``video_every``-th hand-off, ``"final"`` for the last job of a drain, else None);
            ``(("final_video",), None)`` when a drain wants the final video and nothing waits;
            ``(None, seconds)`` while pacing holds a plain job back; else ``(None, None)``.
        """
        if self.in_flight is not None or self.final_video_asked:
            return None, None
        if not self.pending:
            if self.final_video_due:
                self.final_video_asked = True
                return ("final_video",), None
            return None, None
        wait_s = self._next_start - now
        if wait_s > 0 and not self.pending[0].keep and not self.draining:
            return None, wait_s
        job = self.in_flight = self.pending.pop(0)
        due = self._videos and self._video_every > 0 and self._handed_out % self._video_every == 0
        last_of_drain = self._videos and self.draining and not self.pending
        record = "update" if due else "final" if last_of_drain else None
        self._handed_out += 1
        self._handed_at = now
        return ("evaluate", job.policy_version, job.global_step, dict(job.weights), record), None

    def finished(self, now: float) -> EvaluationJob | None:
        """The running evaluation ended at clock time ``now`` (reported or failed): pace the next
        one and return the job that ran (None if none was handed out)."""
        self._next_start = self._handed_at + (now - self._handed_at) / self._max_share
        job, self.in_flight = self.in_flight, None
        return job

    def final_video_made(self) -> None:
        """The child answered the final-video request."""
        self.final_video_asked = self.final_video_due = False

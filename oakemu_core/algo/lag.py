"""Policy lag of a rollout's rows: in policy versions (:func:`drop_stale_rows`, which also keeps
rows over ``max_policy_lag`` out of training) and in SGD steps (:class:`SgdStepLedger`).

The prepare path of the trainer (:meth:`oakemu_core.algo.learner.PPOLearner.prepare`) reads both;
the ingest side only writes the rows' ``policy_versions`` and ``policy_revisions``.
"""

from __future__ import annotations

import numpy as np

from oakemu_core.storage.rollout_buffer import RolloutBuffer

__all__ = ["SgdStepLedger", "drop_stale_rows"]


def drop_stale_rows(
    buffer: RolloutBuffer,
    *,
    current_policy_version: int,
    max_policy_lag: int,
    columns: np.ndarray | None = None,
) -> tuple[int, dict[str, float]]:
    """Exclude rows whose policy lag exceeds ``max_policy_lag`` from training.

    Policy lag of a row = ``current_policy_version - policy_versions[t, e]`` (updates between the
    policy that acted and the one about to be trained).

    Args:
        columns: ``(N,)`` bool, the columns that hold rows (the others are sealed and not looked
            at), or None: every column.

    Returns:
        ``(rows_dropped, stats)``: ``stats`` holds the lag ``min``/``mean``/``max`` over the rows
        of ``columns`` and ``newest_version``, the highest policy version that acted in them.
    """
    versions = buffer.policy_versions
    lag = current_policy_version - versions
    dropped = buffer.mark_untrainable(lag > max_policy_lag)
    if columns is not None:
        versions, lag = versions[:, columns], lag[:, columns]
    return dropped, {
        "min": float(lag.min()),
        "mean": float(lag.mean()),
        "max": float(lag.max()),
        "newest_version": float(versions.max()),
    }


class SgdStepLedger:
    """SGD (minibatch gradient) steps taken by this learner process (not checkpointed), and how
    many had been taken when each ``(policy version, revision)`` was published.

    Attributes:
        sgd_steps: SGD steps taken so far.
        published: ``(version, revision) -> SGD steps`` at its publishing, for the newest
            :data:`KEPT_VERSIONS` versions, in publishing order.
    """

    KEPT_VERSIONS = 256

    def __init__(self) -> None:
        self.sgd_steps = 0
        self.published: dict[tuple[int, int], int] = {}

    @property
    def last_published(self) -> int:
        """SGD steps when the newest weights (a version or a revision) were published; 0 before any."""
        return next(reversed(self.published.values()), 0)

    def note(self, version: int, revision: int, sgd_steps: int) -> None:
        """Revision ``revision`` of ``version`` was published after ``sgd_steps`` SGD steps."""
        self.published[(version, revision)] = sgd_steps
        # Keys arrive in increasing order (a dict keeps it): the oldest are at the front.
        while (oldest := next(iter(self.published)))[0] < version - (self.KEPT_VERSIONS - 1):
            del self.published[oldest]

    def lag(
        self,
        policy_versions: np.ndarray,
        policy_revisions: np.ndarray | None,
        *,
        current_version: int,
        sgd_steps_per_version: int,
    ) -> dict[str, float]:
        """Policy lag of rows in SGD steps: a row acted by revision ``r`` of version ``v`` lags
        ``sgd_steps - published[(v, r)]``; weights this process never published (before a resume)
        count ``(current_version - v) * sgd_steps_per_version``.

        Args:
            policy_versions: the rows' versions (any shape, int).
            policy_revisions: their revisions, the same shape; None: all 0.

        Returns:
            ``{"sgd_min", "sgd_mean", "sgd_max"}`` in SGD steps (0 for no rows).
        """
        if policy_versions.size == 0:
            return {"sgd_min": 0.0, "sgd_mean": 0.0, "sgd_max": 0.0}
        versions = np.ravel(policy_versions).astype(np.int64)
        revisions = (
            np.zeros_like(versions)
            if policy_revisions is None
            else np.ravel(policy_revisions).astype(np.int64)
        )
        # Each (version, revision) pair as one integer (revisions are >= 0): a 1-D unique, far cheaper
        # than np.unique(axis=0) on the pairs.
        span = int(revisions.max()) + 1
        keys, counts = np.unique(versions * span + revisions, return_counts=True)
        lags = np.array(
            [
                self.sgd_steps - self.published[(v, r)]
                if (v, r) in self.published
                else max(0, current_version - v) * sgd_steps_per_version
                for v, r in zip((keys // span).tolist(), (keys % span).tolist())
            ],
            dtype=np.float64,
        )
        return {
            "sgd_min": float(lags.min()),
            "sgd_mean": float((lags * counts).sum() / counts.sum()),
            "sgd_max": float(lags.max()),
        }

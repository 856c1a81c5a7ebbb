"""Reward scaling by the running standard deviation of the discounted return (learner side).

Continuous control (Pendulum, MuJoCo) needs rewards of a sane scale for the value function; SB3's
``VecNormalize`` and Gymnasium's ``NormalizeReward`` divide each reward by the running std of the
discounted return ``R_t = gamma * R_{t-1} * (1 - done_{t-1}) + r_t`` (Engstrom et al. 2020,
"Implementation Matters in Deep Policy Gradients", "reward scaling"). Here the learner does it on
each full rollout before GAE, so the statistics are the learner's alone (saved in checkpoints) and
actors send raw rewards. Values are then learned in scaled units; the logged episodic returns stay
raw. Observation normalisation lives in the model (:class:`oakemu_core.policy.models.RunningNormalizer`)
so that it travels to the actors with the weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["RewardScaler"]


class RewardScaler:
    """Running variance of discounted returns, per buffer column, and the scale it implies.

    Args:
        gamma: the discount of the returns whose std is tracked.
        eps: added to the variance before the square root.
    """

    def __init__(self, gamma: float, eps: float = 1e-8) -> None:
        self.gamma = float(gamma)
        self.eps = float(eps)
        self.mean = 0.0
        self.var = 1.0
        self.count = 1e-4
        self._carry: np.ndarray | None = (
            None  # (N,) discounted return at the end of the last rollout
        )

    def update(self, rewards: np.ndarray, dones: np.ndarray) -> float:
        """Fold a rollout's raw rewards into the statistics; return the scale ``1 / sqrt(var + eps)``.

        Args:
            rewards: ``(T, N)`` float32 raw training rewards. dones: ``(T, N)`` bool.
        """
        steps, columns = rewards.shape
        if self._carry is None or self._carry.shape != (columns,):
            self._carry = np.zeros(columns, np.float64)
        returns = np.empty((steps, columns), np.float64)
        carry = self._carry
        for t in range(steps):
            carry = self.gamma * carry + rewards[t]
            returns[t] = carry
            carry = np.where(dones[t], 0.0, carry)
        self._carry = carry
        self._merge(returns.reshape(-1))
        return self.scale

    def _merge(self, batch: np.ndarray) -> None:
        """Parallel mean/variance merge (Chan et al. 1979), as SB3's ``RunningMeanStd``."""
        batch_mean, batch_var, batch_count = float(batch.mean()), float(batch.var()), batch.size
        delta = batch_mean - self.mean
        total = self.count + batch_count
        m2 = (
            self.var * self.count
            + batch_var * batch_count
            + delta**2 * self.count * batch_count / total
        )
        self.mean += delta * batch_count / total
        self.var = m2 / total
        self.count = total

    @property
    def scale(self) -> float:
        """``1 / sqrt(var + eps)``: the factor applied to rewards."""
        return float(1.0 / np.sqrt(self.var + self.eps))

    def state_dict(self) -> dict[str, Any]:
        """Plain values for a checkpoint."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.mean, self.var, self.count = (
            float(state["mean"]),
            float(state["var"]),
            float(state["count"]),
        )

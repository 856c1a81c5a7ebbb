"""Per-step arrays an actor fills for all its envs (stub: being completed by the rollout-core work)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PPOActionBundle:
    """What the policy produced for a batch of observations.

    Attributes:
        actions: ``(batch, *action_shape)``, the action dtype (int64 for a categorical policy).
        log_probs: ``(batch,)`` float32, log pi(action | observation) of the acting policy.
        values: ``(batch,)`` float32, V(observation) of the acting policy.
    """

    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray

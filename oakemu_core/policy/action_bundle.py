"""The policy's output for a batch of observations (numpy only: importing it does not import torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["PPOActionBundle"]


@dataclass(frozen=True)
class PPOActionBundle:
    """What the policy produced for a batch of observations.

    Attributes:
        actions: ``(batch, *action_shape)``, the action dtype (int64 for a categorical policy).
        log_probs: ``(batch,)`` float32, log pi(action | observation) of the acting policy.
        values: ``(batch,)`` float32, V(observation) of the acting policy.
        distribution_fields: the distribution's stored parameters by field name (a Gaussian's
            ``action_mean`` / ``action_std`` ``(batch, d)`` float32); empty for other families.
        policy_state: a recurrent policy's state before these observations, ``(batch, state_size)``
            float32 (stored with the step: the learner's sequences start from it); None otherwise.
        next_state: a recurrent policy's state after them (the next step's ``policy_state`` unless the
            episode ended); None otherwise.
    """

    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    distribution_fields: dict[str, np.ndarray] = field(default_factory=dict)
    policy_state: np.ndarray | None = None
    next_state: np.ndarray | None = None

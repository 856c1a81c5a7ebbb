"""Acting over whole episodes: :class:`EpisodicActor` carries a recurrent policy's state from one call to
the next and zeroes it where an episode ends (evaluation, dataset recording, ``load_policy``'s
:class:`~oakemu_core.run.loading.Policy`). A feed-forward policy has no state; the same calls then act
as :meth:`~oakemu_core.policy.acting.ActorAPI.act` does.

The actors' :class:`~oakemu_core.actor.stepper.PolicyStepper` keeps its own states: it stores them with
the steps and chooses again from the same state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from oakemu_core.policy.action_bundle import PPOActionBundle

__all__ = ["EpisodicActor"]


class EpisodicActor:
    """Acts with ``model`` for a batch of ``B`` envs, call after call.

    A recurrent model (``model.recurrent``) starts from zeros (:meth:`reset`, and the first call),
    and each :meth:`act` moves :attr:`state` to the state after its observations; :meth:`reset` with
    the rows whose episode ended zeroes theirs, so their next observation starts a new episode.

    Args:
        model: an :class:`~oakemu_core.policy.models.ActorCritic` (anything with its ``act``,
            ``recurrent`` and ``initial_state``).

    Attributes:
        state: a recurrent model's state before the next call's observations, ``(B, state_size)``
            float32; None for a feed-forward model, and after :meth:`reset` with no rows (zeros of the
            next call's batch size).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.state: np.ndarray | None = None

    def act(
        self,
        observations: Any,
        *,
        action_mask: np.ndarray | None = None,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> PPOActionBundle:
        """The model's :meth:`~oakemu_core.policy.acting.ActorAPI.act` from :attr:`state` (arguments as
        there); :attr:`state` becomes the bundle's ``next_state``.

        Raises:
            ValueError: as ``model.act``, or a batch of another size than the state's (call
                :meth:`reset` first to change it).
        """
        if not self.model.recurrent:
            return self.model.act(
                observations, action_mask=action_mask, greedy=greedy, generator=generator
            )
        batch = _batch_size(observations)
        if self.state is None:
            self.state = self.model.initial_state(batch)
        elif self.state.shape[0] != batch:
            raise ValueError(
                f"observations: a batch of {batch}, the recurrent state holds {self.state.shape[0]} "
                f"envs; reset() before acting for another number of envs"
            )
        bundle = self.model.act(
            observations,
            action_mask=action_mask,
            greedy=greedy,
            generator=generator,
            state=self.state,
        )
        self.state = bundle.next_state
        return bundle

    def reset(self, rows: Any = None) -> None:
        """Start new episodes: ``rows`` None starts all (the next call's batch gets zeros, of any
        size); else the rows whose state is zeroed, as ``(B,)`` bool (a step's ``dones``) or row
        indices. No-op for a feed-forward model.

        Raises:
            IndexError: a row outside the batch, or a bool array of another length.
        """
        if rows is None or self.state is None:
            self.state = None
            return
        rows = np.asarray(rows)
        if rows.dtype == np.bool_ and rows.shape != (self.state.shape[0],):
            raise IndexError(
                f"rows: expected ({self.state.shape[0]},) bool or row indices, received shape {rows.shape}"
            )
        if rows.size:
            self.state = self.state.copy()
            self.state[rows] = 0.0


def _batch_size(observations: Any) -> int:
    """Rows of a batch of observations: an array, or a dict key -> array."""
    if isinstance(observations, dict):
        return len(next(iter(observations.values())))
    return len(observations)

"""Play whole episodes with a policy and report raw episodic returns (``oakemu evaluate``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from oakemu_core.envs import VectorEnv
from oakemu_core.models import ActorCritic

__all__ = ["EvaluationResult", "play_episodes"]


@dataclass(frozen=True)
class EvaluationResult:
    """Raw (unclipped) returns and lengths (agent steps) of the evaluated episodes, in the order
    they finished."""

    returns: list[float]
    lengths: list[int]

    @property
    def mean(self) -> float:
        return float(np.mean(self.returns))

    @property
    def std(self) -> float:
        """Population std (ddof 0)."""
        return float(np.std(self.returns))


def play_episodes(model: ActorCritic, env: VectorEnv, *, episodes: int, greedy: bool) -> EvaluationResult:
    """Play until ``episodes`` episodes have finished, acting with ``model`` (masks applied).

    Args:
        model: the policy (its observation layout and distribution fit ``env``).
        env: a vector env without reward clipping (:func:`oakemu_core.envs.make_eval_env`); reset here.
        episodes: episodes to finish, >= 1.
        greedy: act with the distribution's mode instead of sampling.

    Raises:
        ValueError: ``episodes`` < 1.
    """
    if episodes < 1:
        raise ValueError(f"episodes: expected >= 1, received {episodes}")
    returns: list[float] = []
    lengths: list[int] = []
    observations = env.reset()
    masks = env.action_masks()
    while len(returns) < episodes:
        step = env.step(model.act(observations, action_mask=masks, greedy=greedy).actions)
        returns.extend(step.episode_returns)
        lengths.extend(step.episode_lengths)
        observations, masks = step.observations, step.action_masks
    return EvaluationResult(returns[:episodes], lengths[:episodes])

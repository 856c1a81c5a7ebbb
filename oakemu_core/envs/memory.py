"""A memory task: ``CartPoleNoVel-v1``, CartPole-v1 with the velocities hidden.

The observation is CartPole-v1's with its velocity entries left out (index 1, cart velocity, and
index 3, pole angular velocity): ``[cart position, pole angle]``, shape ``(2,)``,
``float32``, bounded as CartPole's entries 0 and 2 (``[-4.8, 4.8]`` and ``[-0.419, 0.419]`` rad).
Actions, rewards, termination and the 500-step time limit (``max_episode_steps=500``, reward
threshold 475) are CartPole-v1's.

Why it needs memory: one frame says where the cart and the pole are, not where they are going, so a
feed-forward policy cannot tell a pole falling left from one swinging back right and balances it
poorly; a recurrent policy (or a stack of frames) can recover the velocities from successive
positions.

Source: rl-baselines3-zoo's benchmark task for sb3-contrib's ``RecurrentPPO``
(``rl_zoo3/import_envs.py`` registers ``CartPoleNoVel-v1`` as ``MaskVelocityWrapper(gym.make(
"CartPole-v1"))``; ``rl_zoo3/wrappers.py`` masks indices ``[1, 3]``; hyperparameters in
``hyperparams/ppo_lstm.yml``). The zoo multiplies the velocities by 0 and keeps shape ``(4,)``; this
module removes them. The two are the same task for a learner: an input that is always 0 carries no
information and adds nothing to a first linear layer's output (and ``VecNormalize`` keeps it at 0).

Importing this module registers the id with Gymnasium, so ``gymnasium.make(
"oakemu_core.envs.memory:CartPoleNoVel-v1")`` and ``oakemu train --env-id
oakemu_core.envs.memory:CartPoleNoVel-v1`` build it (as do SB3's ``make_vec_env`` and any Gymnasium
user after ``import oakemu_core.envs.memory``).
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

__all__ = [
    "CARTPOLE_NO_VEL_ID",
    "CARTPOLE_POSITION_INDICES",
    "PositionsOnly",
    "make_cartpole_no_vel",
]

CARTPOLE_NO_VEL_ID = "CartPoleNoVel-v1"
CARTPOLE_POSITION_INDICES = (0, 2)
"""CartPole-v1's observation entries kept: cart position (m) and pole angle (rad); 1 and 3 are the
velocities (rl-baselines3-zoo's ``MaskVelocityWrapper.velocity_indices["CartPole-v1"]``)."""


class PositionsOnly(gymnasium.ObservationWrapper):
    """Keeps the observation entries ``indices`` of a 1-D ``Box`` observation (dtype and bounds kept).

    Raises:
        ValueError: the observation space is not a 1-D ``Box`` or an index is out of range.
    """

    def __init__(self, env: gymnasium.Env, indices: tuple[int, ...]) -> None:
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, gymnasium.spaces.Box) or len(space.shape) != 1:
            raise ValueError(
                f"PositionsOnly: expected a 1-D Box observation space, received {space}"
            )
        if not indices or not all(0 <= i < space.shape[0] for i in indices):
            raise ValueError(
                f"PositionsOnly: expected indices in [0, {space.shape[0]}), received {indices}"
            )
        self._indices = np.asarray(indices, dtype=np.intp)
        self.observation_space = gymnasium.spaces.Box(
            low=space.low[self._indices], high=space.high[self._indices], dtype=space.dtype
        )

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[self._indices]


def make_cartpole_no_vel(render_mode: str | None = None, **kwargs: Any) -> gymnasium.Env:
    """CartPole-v1's dynamics with :data:`CARTPOLE_POSITION_INDICES` observed (the registered entry
    point; Gymnasium adds the 500-step ``TimeLimit``)."""
    return PositionsOnly(CartPoleEnv(render_mode=render_mode, **kwargs), CARTPOLE_POSITION_INDICES)


if CARTPOLE_NO_VEL_ID not in gymnasium.registry:
    gymnasium.register(
        id=CARTPOLE_NO_VEL_ID,
        entry_point=make_cartpole_no_vel,
        max_episode_steps=500,
        reward_threshold=475.0,
    )

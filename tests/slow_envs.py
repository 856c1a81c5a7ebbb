"""A deliberately slow CartPole for tester tests: importing this module registers ``SlowCartPole-v0``.

Use it as ``tests.slow_envs:SlowCartPole-v0`` (Gymnasium's ``module:EnvId`` form), also in a spawned
tester process. Every step sleeps :data:`STEP_SLEEP_S` seconds; otherwise it is ``CartPole-v1``.
"""

from __future__ import annotations

import time

import gymnasium
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

STEP_SLEEP_S = 0.01


class SlowCartPole(CartPoleEnv):
    """CartPole whose ``step`` takes at least :data:`STEP_SLEEP_S` seconds."""

    def step(self, action):  # type: ignore[override]
        time.sleep(STEP_SLEEP_S)
        return super().step(action)


if "SlowCartPole-v0" not in gymnasium.registry:
    gymnasium.register("SlowCartPole-v0", entry_point=SlowCartPole, max_episode_steps=500)

"""A CartPole whose ``step`` raises after :data:`CRASH_AFTER_STEPS` steps: importing this module registers
``CrashingCartPole-v0`` (use it as ``tests.crash_envs:CrashingCartPole-v0``).

It stands for a user's env with a bug: every actor that steps it fails the same way.
"""

from __future__ import annotations

import gymnasium
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

CRASH_AFTER_STEPS = 200


class EnvBugError(RuntimeError):
    """The error the crashing env raises (its name appears in the launcher's message)."""


class CrashingCartPole(CartPoleEnv):
    """CartPole whose ``step`` raises :class:`EnvBugError` after :data:`CRASH_AFTER_STEPS` steps of this instance."""

    def __init__(self, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.steps_taken = 0

    def step(self, action):  # type: ignore[override]
        self.steps_taken += 1
        if self.steps_taken > CRASH_AFTER_STEPS:
            raise EnvBugError(f"simulated env bug after {CRASH_AFTER_STEPS} steps")
        return super().step(action)


if "CrashingCartPole-v0" not in gymnasium.registry:
    gymnasium.register("CrashingCartPole-v0", entry_point=CrashingCartPole, max_episode_steps=500)

"""Small envs with the richer spaces, for unit tests and end-to-end training runs.

Importing this module registers its ids, so every command takes them in Gymnasium's ``module:EnvId``
form, from the repository root: ``oakemu train --env tests.spaces_envs:DictTarget-v0``.

Every env is a contextual bandit played for ``HORIZON`` = 8 steps per episode (a fresh random
target each step, the episode *terminates* after step 8, no time-limit truncation): the episodic
return is the sum of 8 per-step rewards in [0, 1], so the optimal return is 8.0. Each docstring
gives the expected return of a uniformly random policy and of the best policy that ignores part of
the observation, so end-to-end tests can calibrate their margins.

| id | observation | action | optimal | random |
| --- | --- | --- | --- | --- |
| ``MultiDiscreteTarget-v0`` | float32 (7,) | MultiDiscrete([3, 4]) | 8.0 | 1.5 |
| ``DictTarget-v0`` | Dict(image uint8 (1, 12, 12), vector float32 (2,)) | Discrete(4) | 8.0 | 2.0 |
| ``MaskedMultiDiscrete-v0`` | float32 (7,) + ``action_masks()`` | MultiDiscrete([3, 4]) | 8.0 | 3.0 (valid actions) |
| ``MultiBinaryTarget-v0`` | float32 (4,) | MultiBinary(4) | 8.0 | 4.0 |
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium
import numpy as np
from gymnasium import spaces

HORIZON = 8
NVEC = (3, 4)


class _TargetBandit(gymnasium.Env):
    """Shared loop: draw a target, observe it, score the action, stop after HORIZON steps."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.t = 0
        self._draw()
        return self._observation(), self._info()

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        reward = float(self._reward(action))
        self.t += 1
        self._draw()
        return self._observation(), reward, self.t >= HORIZON, False, self._info()

    def _info(self) -> dict:
        return {}

    def _draw(self) -> None:
        raise NotImplementedError

    def _observation(self) -> Any:
        raise NotImplementedError

    def _reward(self, action: Any) -> float:
        raise NotImplementedError


class MultiDiscreteTargetEnv(_TargetBandit):
    """Two sub-actions must match two observed targets: ``MultiDiscrete([3, 4])`` actions.

    Observation: float32 ``(7,)``, the one-hot of target ``t0`` in [0, 3) followed by the one-hot
    of ``t1`` in [0, 4). Reward per step: ``0.25 * [a0 == t0] + 0.25 * [a1 == t1] + 0.5 * [both]``.

    Returns per episode (8 steps): optimal 8.0; uniformly random 8 * (0.25/3 + 0.25/4 + 0.5/12)
    = 1.5; only sub-action 0 right (the other random) 8 * (0.25 + 0.25/4 + 0.5/4) = 3.5; only
    sub-action 1 right 8 * (0.25/3 + 0.25 + 0.5/3) = 4.0.
    """

    observation_space = spaces.Box(0.0, 1.0, (sum(NVEC),), np.float32)
    action_space = spaces.MultiDiscrete(NVEC)

    def _draw(self) -> None:
        self.target = np.array([self.np_random.integers(n) for n in NVEC], dtype=np.int64)

    def _observation(self) -> np.ndarray:
        out = np.zeros(sum(NVEC), dtype=np.float32)
        out[self.target[0]] = 1.0
        out[NVEC[0] + self.target[1]] = 1.0
        return out

    def _reward(self, action: Any) -> float:
        hits = np.asarray(action).reshape(2) == self.target
        return 0.25 * hits[0] + 0.25 * hits[1] + 0.5 * hits.all()


class DictTargetEnv(_TargetBandit):
    """Needs BOTH keys of a Dict observation: ``Discrete(4)`` action ``2 * side + sign``.

    Observation ``{"image": uint8 (1, 12, 12), "vector": float32 (2,)}`` (image channel-first):
    the image is black except a 3x3 white (255) square at a random place in its left half
    (``side`` 0, columns 0-5) or its right half (``side`` 1, columns 6-11); ``vector[0]`` is -1
    (``sign`` 0) or +1 (``sign`` 1) and ``vector[1]`` is uniform noise in [-1, 1]. Reward 1 when
    the action is ``2 * side + sign``, else 0.

    Returns per episode (8 steps): optimal 8.0; uniformly random 2.0; the best policy that sees
    only the image (or only the vector) 4.0, so a return well above 4 proves both keys are used.
    """

    observation_space = spaces.Dict(
        {
            "image": spaces.Box(0, 255, (1, 12, 12), np.uint8),
            "vector": spaces.Box(-1.0, 1.0, (2,), np.float32),
        }
    )
    action_space = spaces.Discrete(4)

    def _draw(self) -> None:
        self.side = int(self.np_random.integers(2))
        self.sign = int(self.np_random.integers(2))
        self.row = int(self.np_random.integers(0, 10))
        self.col = 6 * self.side + int(self.np_random.integers(0, 4))
        self.noise = float(self.np_random.uniform(-1.0, 1.0))

    def _observation(self) -> dict[str, np.ndarray]:
        image = np.zeros((1, 12, 12), dtype=np.uint8)
        image[0, self.row : self.row + 3, self.col : self.col + 3] = 255
        vector = np.array([2.0 * self.sign - 1.0, self.noise], dtype=np.float32)
        return {"image": image, "vector": vector}

    def _reward(self, action: Any) -> float:
        return float(int(action) == 2 * self.side + self.sign)


class MaskedMultiDiscreteEnv(MultiDiscreteTargetEnv):
    """:class:`MultiDiscreteTargetEnv` with sb3-contrib style masks: an ``action_masks()`` method.

    Per step and sub-action, the mask allows the target and ONE other random value (2 of 3, 2 of
    4); masks are concatenated per sub-action (width 7). Taking a masked-out value raises
    RuntimeError: masked actions must never reach the env. ``masked_actions_taken`` stays 0.

    Returns per episode (8 steps): optimal 8.0; uniformly random over the VALID values
    8 * (0.25/2 + 0.25/2 + 0.5/4) = 3.0 (uniform over all values, ignoring masks, would be 1.5).
    """

    def _draw(self) -> None:
        super()._draw()
        self.mask = np.zeros(sum(NVEC), dtype=np.int8)
        offset = 0
        for target, n in zip(self.target, NVEC, strict=True):
            other = (target + 1 + self.np_random.integers(n - 1)) % n
            self.mask[offset + target] = self.mask[offset + other] = 1
            offset += n

    def action_masks(self) -> np.ndarray:
        """``(7,)`` int8: [valid values of sub-action 0 (3), valid values of sub-action 1 (4)]."""
        return self.mask.copy()

    def _reward(self, action: Any) -> float:
        action = np.asarray(action).reshape(2)
        if not (self.mask[action[0]] and self.mask[NVEC[0] + action[1]]):
            raise RuntimeError(
                f"MaskedMultiDiscrete-v0: masked action {action.tolist()} taken (mask {self.mask.tolist()})"
            )
        return super()._reward(action)


class MultiBinaryTargetEnv(_TargetBandit):
    """``MultiBinary(4)`` actions must copy 4 observed random bits.

    Observation: float32 ``(4,)`` of 0/1 bits. Reward per step: the fraction of bits copied right.
    Returns per episode (8 steps): optimal 8.0; uniformly random 4.0.
    """

    observation_space = spaces.Box(0.0, 1.0, (4,), np.float32)
    action_space = spaces.MultiBinary(4)

    def _draw(self) -> None:
        self.bits = self.np_random.integers(0, 2, size=4)

    def _observation(self) -> np.ndarray:
        return self.bits.astype(np.float32)

    def _reward(self, action: Any) -> float:
        return float(np.mean(np.asarray(action).reshape(4) == self.bits))


ENV_IDS = {
    "MultiDiscreteTarget-v0": MultiDiscreteTargetEnv,
    "DictTarget-v0": DictTargetEnv,
    "MaskedMultiDiscrete-v0": MaskedMultiDiscreteEnv,
    "MultiBinaryTarget-v0": MultiBinaryTargetEnv,
}

for _env_id, _entry_point in ENV_IDS.items():
    if _env_id not in gymnasium.registry:
        gymnasium.register(id=_env_id, entry_point=_entry_point)

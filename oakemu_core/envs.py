"""Environment factory: one small vector-env interface over every emulator backend.

Actors, the evaluator and the benchmarks only see :class:`VectorEnv`, :class:`VectorStep` and
:class:`EnvSpec`; the backend behind them is picked from the env id:

* Atari ids (``ALE/...`` or ``...NoFrameskip...``): ale-py's threaded ``AtariVectorEnv`` with the
  usual DQN/PPO preprocessing built in (Machado et al. 2018, "Revisiting the ALE"; CleanRL
  ``ppo_atari.py``): no-op reset (up to 30), frame skip 4 with max-pooling over the last two
  frames, 84x84 grayscale, 4 stacked frames, sticky actions as the registered id says (0.25 for
  ``-v5``, 0.0 for ``NoFrameskip-v4``), minimal action set, FIRE on reset where the game has it.
  Observations ``(n, 4, 84, 84)`` uint8.
* Any other Gymnasium id: ``gymnasium.vector.SyncVectorEnv`` of ``gymnasium.make(env_id)``. Box
  observations keep their dtype, except float64 which the adapter casts to float32 (the dtype
  of the networks; halves the bytes on the wire).

Both backends autoreset in the *same step* an episode ends: ``observations`` returned by
:meth:`VectorEnv.step` are already the first observations of the new episodes, and the true last
observations are in ``final_observations``. PPO needs them to bootstrap truncated episodes
(Pardo et al. 2018, "Time Limits in Reinforcement Learning"; SB3 issue #633).

Rewards: ``training_rewards`` are clipped to [-1, 1] when reward clipping is on (default: on for
Atari ids), while ``episode_returns`` always report the raw game score.

A new backend (e.g. Game Boy through PyBoy) implements :class:`_Backend` and a branch in
:func:`make_vector_env` / :func:`env_spec`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from oakemu_core.config import is_atari_env

__all__ = [
    "EnvSpec",
    "UnsupportedEnvironmentError",
    "VectorEnv",
    "VectorStep",
    "env_spec",
    "make_eval_env",
    "make_vector_env",
]

ATARI_FRAME_SKIP = 4
ATARI_STACK = 4
ATARI_IMAGE_SIZE = 84
ATARI_NOOP_MAX = 30
ATARI_DEFAULT_MAX_FRAMES = 108_000  # 27,000 agent steps = 30 minutes of play at 60 Hz


class UnsupportedEnvironmentError(ValueError):
    """The env id is unknown or its spaces are not supported (message names id, expected, received)."""


@dataclass(frozen=True)
class EnvSpec:
    """What the model, the rollout buffer and the wire need to know about an environment.

    Attributes:
        env_id: the Gymnasium / ale-py id.
        observation_shape: shape of ONE observation, e.g. ``(4, 84, 84)`` for Atari, ``(4,)`` for CartPole.
        observation_dtype: dtype of observations as the vector env returns them (uint8 frames, float32 vectors).
        num_actions: size of the discrete action set (Atari: the game's minimal action set).
        action_shape: shape of ONE action; ``()`` for a discrete action.
        action_dtype: dtype of actions (int64).
        is_atari: True for ids served by ale-py's preprocessing.
    """

    env_id: str
    observation_shape: tuple[int, ...]
    observation_dtype: np.dtype
    num_actions: int
    action_shape: tuple[int, ...] = ()
    action_dtype: np.dtype = field(default_factory=lambda: np.dtype(np.int64))
    is_atari: bool = False


@dataclass
class VectorStep:
    """Result of one :meth:`VectorEnv.step` for all ``n`` envs.

    Attributes:
        observations: ``(n, *obs_shape)`` observation dtype; next observations, already reset on
            rows whose episode ended (same-step autoreset).
        training_rewards: ``(n,)`` float32; rewards for training, clipped to [-1, 1] when clipping is on.
        terminated: ``(n,)`` bool; the episode reached a terminal state (no bootstrap).
        truncated: ``(n,)`` bool; the episode was cut by a time limit (bootstrap from the final observation).
        final_observations: ``(n, *obs_shape)``; on rows where ``terminated | truncated`` the TRUE last
            observation of the finished episode. Other rows hold the same values as ``observations``
            (the array may then be the very same object: read it, do not write it).
        episode_returns: raw (unclipped) game score of each episode that ended this step.
        episode_lengths: length in agent steps of each episode that ended this step.
        episode_env_ids: env index (row) of each episode that ended this step, same order.
    """

    observations: np.ndarray
    training_rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_observations: np.ndarray
    episode_returns: list[float]
    episode_lengths: list[int]
    episode_env_ids: list[int]

    @property
    def dones(self) -> np.ndarray:
        """``(n,)`` bool, ``terminated | truncated``."""
        return self.terminated | self.truncated


class _Backend(Protocol):
    """What a backend provides; the adapter adds reward clipping and episode bookkeeping."""

    spec: EnvSpec
    num_envs: int

    def reset(self, seed: int | None) -> np.ndarray:
        """Reset all envs; returns ``(n, *obs_shape)`` observations."""

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Returns ``(observations, raw_rewards float64, terminated, truncated, final_observations)``."""

    def close(self) -> None:
        """Release the emulators."""


class VectorEnv:
    """Uniform vector env over the backends (see module docstring); build with :func:`make_vector_env`.

    Use: ``obs = env.reset()`` once, then ``step = env.step(actions)`` repeatedly; the env resets
    finished episodes itself. ``close()`` (or a ``with`` block) releases the emulators.
    """

    def __init__(self, backend: _Backend, *, seed: int | None, clip_rewards: bool) -> None:
        self._backend = backend
        self.spec: EnvSpec = backend.spec
        self.num_envs: int = backend.num_envs
        self.clip_rewards = clip_rewards
        self._seed = seed
        self._running_returns = np.zeros(self.num_envs, dtype=np.float64)
        self._running_lengths = np.zeros(self.num_envs, dtype=np.int64)
        self._needs_reset = True
        self._closed = False

    def reset(self) -> np.ndarray:
        """Reset every env (the first call uses the construction seed); returns ``(n, *obs_shape)``."""
        if self._closed:
            raise RuntimeError(f"VectorEnv({self.spec.env_id!r}) is closed")
        observations = self._backend.reset(self._seed)
        self._seed = None  # later resets continue the envs' own random streams
        self._running_returns[:] = 0.0
        self._running_lengths[:] = 0
        self._needs_reset = False
        return observations

    def step(self, actions: np.ndarray) -> VectorStep:
        """Step all envs with ``actions``: ``(n,)`` integers in ``[0, num_actions)``.

        Raises:
            ValueError: wrong shape, non-integer dtype or an action out of range.
            RuntimeError: called before :meth:`reset` or after :meth:`close`.
        """
        if self._needs_reset or self._closed:
            raise RuntimeError("VectorEnv.step called before reset() or after close()")
        actions = self._check_actions(actions)
        observations, raw_rewards, terminated, truncated, final_observations = self._backend.step(actions)

        self._running_returns += raw_rewards
        self._running_lengths += 1
        done_rows = np.flatnonzero(terminated | truncated)
        episode_returns = [float(self._running_returns[row]) for row in done_rows]
        episode_lengths = [int(self._running_lengths[row]) for row in done_rows]
        self._running_returns[done_rows] = 0.0
        self._running_lengths[done_rows] = 0

        training_rewards = raw_rewards.astype(np.float32)
        if self.clip_rewards:
            np.clip(training_rewards, -1.0, 1.0, out=training_rewards)
        return VectorStep(
            observations=observations,
            training_rewards=training_rewards,
            terminated=terminated,
            truncated=truncated,
            final_observations=final_observations,
            episode_returns=episode_returns,
            episode_lengths=episode_lengths,
            episode_env_ids=[int(row) for row in done_rows],
        )

    def close(self) -> None:
        """Release the emulators; idempotent."""
        if not self._closed:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> VectorEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_actions(self, actions: Any) -> np.ndarray:
        actions = np.asarray(actions)
        if actions.shape != (self.num_envs,):
            raise ValueError(f"actions: expected shape ({self.num_envs},), received {actions.shape}")
        if not np.issubdtype(actions.dtype, np.integer):
            raise ValueError(f"actions: expected an integer dtype (int64), received {actions.dtype}")
        if actions.size and (actions.min() < 0 or actions.max() >= self.spec.num_actions):
            raise ValueError(
                f"actions: expected values in [0, {self.spec.num_actions}), "
                f"received min {actions.min()} max {actions.max()}"
            )
        return actions.astype(np.int64, copy=False)


# ----------------------------------------------------------------------------------------------
# Atari (ale-py)


@dataclass(frozen=True)
class _AtariSettings:
    game: str
    repeat_action_probability: float
    full_action_space: bool
    max_num_frames_per_episode: int


def _atari_settings(env_id: str) -> _AtariSettings:
    """Read the ROM name and emulator settings from ale-py's Gymnasium registration of ``env_id``.

    ``ALE/Breakout-v5`` -> game ``breakout``; ``ALE/MontezumaRevenge-v5`` -> ``montezuma_revenge``.
    """
    import ale_py
    import gymnasium

    gymnasium.register_envs(ale_py)
    try:
        registered = gymnasium.spec(env_id)
    except gymnasium.error.Error as error:
        raise UnsupportedEnvironmentError(
            f"env_id: expected an Atari id registered by ale-py (e.g. 'ALE/Breakout-v5'), received {env_id!r} ({error})"
        ) from None
    kwargs = registered.kwargs
    obs_type = kwargs.get("obs_type", "rgb")
    if obs_type not in ("rgb", "grayscale") or "game" not in kwargs:
        raise UnsupportedEnvironmentError(
            f"env_id: expected an Atari id with image observations, received {env_id!r} (obs_type={obs_type!r})"
        )
    return _AtariSettings(
        game=str(kwargs["game"]),
        repeat_action_probability=float(kwargs.get("repeat_action_probability", 0.25)),
        full_action_space=bool(kwargs.get("full_action_space", False)),
        max_num_frames_per_episode=int(kwargs.get("max_num_frames_per_episode") or ATARI_DEFAULT_MAX_FRAMES),
    )


class _AtariBackend:
    """ale-py's threaded ``AtariVectorEnv`` in same-step autoreset mode, raw rewards."""

    def __init__(
        self, env_id: str, num_envs: int, *, max_episode_steps: int | None, num_threads: int | None
    ) -> None:
        from ale_py.vector_env import AtariVectorEnv

        settings = _atari_settings(env_id)
        max_frames = (
            max_episode_steps * ATARI_FRAME_SKIP  # ALE counts emulator frames, we count agent steps
            if max_episode_steps is not None
            else settings.max_num_frames_per_episode
        )
        self.num_envs = num_envs
        self._env = AtariVectorEnv(
            settings.game,
            num_envs,
            num_threads=num_threads if num_threads is not None else min(num_envs, os.cpu_count() or 1),
            autoreset_mode="SameStep",
            repeat_action_probability=settings.repeat_action_probability,
            full_action_space=settings.full_action_space,
            reward_clipping=False,  # clipped by the adapter, so episode returns stay raw
            frameskip=ATARI_FRAME_SKIP,
            maxpool=True,
            noop_max=ATARI_NOOP_MAX,
            stack_num=ATARI_STACK,
            img_height=ATARI_IMAGE_SIZE,
            img_width=ATARI_IMAGE_SIZE,
            grayscale=True,
            max_num_frames_per_episode=max_frames,
        )
        self.spec = EnvSpec(
            env_id=env_id,
            observation_shape=tuple(self._env.single_observation_space.shape),
            observation_dtype=np.dtype(self._env.single_observation_space.dtype),
            num_actions=int(self._env.single_action_space.n),
            is_atari=True,
        )
        self._in_order = np.arange(num_envs)

    def reset(self, seed: int | None) -> np.ndarray:
        observations, info = self._env.reset(seed=seed)
        return self._ordered(observations, info)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        observations, rewards, terminated, truncated, info = self._env.step(actions)
        order = None if np.array_equal(info["env_id"], self._in_order) else np.argsort(info["env_id"])
        if order is not None:  # ale-py returns rows in env order when batch_size == num_envs; be safe
            observations, rewards, terminated, truncated = (
                observations[order], rewards[order], terminated[order], truncated[order]
            )
        dones = terminated | truncated
        final_observations = observations
        if dones.any():
            # SameStep mode: info["final_obs"] is a full (n, ...) array, valid on the done rows.
            reported = info["final_obs"] if order is None else info["final_obs"][order]
            final_observations = observations.copy()
            final_observations[dones] = reported[dones]
        return observations, rewards.astype(np.float64), terminated, truncated, final_observations

    def _ordered(self, observations: np.ndarray, info: dict[str, Any]) -> np.ndarray:
        if np.array_equal(info["env_id"], self._in_order):
            return observations
        return observations[np.argsort(info["env_id"])]

    def close(self) -> None:
        self._env.close()


# ----------------------------------------------------------------------------------------------
# Any other Gymnasium id


class _GymnasiumBackend:
    """``gymnasium.vector.SyncVectorEnv`` with same-step autoreset; float64 observations cast to float32."""

    def __init__(self, env_id: str, num_envs: int, *, max_episode_steps: int | None) -> None:
        import gymnasium
        from gymnasium.vector import AutoresetMode, SyncVectorEnv

        def make_one() -> Any:
            return _make_gymnasium_env(env_id, max_episode_steps)

        self.num_envs = num_envs
        self._env = SyncVectorEnv([make_one for _ in range(num_envs)], autoreset_mode=AutoresetMode.SAME_STEP)
        self.spec = _gymnasium_spec(env_id, self._env.single_observation_space, self._env.single_action_space)
        action_space = self._env.single_action_space
        assert isinstance(action_space, gymnasium.spaces.Discrete)  # checked by _gymnasium_spec
        self._action_start = int(action_space.start)

    def reset(self, seed: int | None) -> np.ndarray:
        observations, _ = self._env.reset(seed=seed)  # env i gets seed + i
        return self._cast(observations)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        observations, rewards, terminated, truncated, info = self._env.step(actions + self._action_start)
        observations = self._cast(observations)
        final_observations = observations
        if "_final_obs" in info and info["_final_obs"].any():
            # SAME_STEP mode: info["final_obs"] is an object array, filled where info["_final_obs"].
            final_observations = observations.copy()
            for row in np.flatnonzero(info["_final_obs"]):
                final_observations[row] = info["final_obs"][row]
        return (
            observations,
            np.asarray(rewards, dtype=np.float64),
            np.asarray(terminated, dtype=bool),
            np.asarray(truncated, dtype=bool),
            final_observations,
        )

    def _cast(self, observations: np.ndarray) -> np.ndarray:
        return observations.astype(self.spec.observation_dtype, copy=False)

    def close(self) -> None:
        self._env.close()


def _make_gymnasium_env(env_id: str, max_episode_steps: int | None) -> Any:
    import gymnasium

    try:
        if max_episode_steps is None:
            return gymnasium.make(env_id)
        return gymnasium.make(env_id, max_episode_steps=max_episode_steps)
    except gymnasium.error.Error as error:
        raise UnsupportedEnvironmentError(
            f"env_id: expected a registered Gymnasium id (e.g. 'CartPole-v1'), received {env_id!r} ({error})"
        ) from None


def _gymnasium_spec(env_id: str, observation_space: Any, action_space: Any) -> EnvSpec:
    import gymnasium

    if not isinstance(action_space, gymnasium.spaces.Discrete):
        raise UnsupportedEnvironmentError(
            f"env_id: expected an env with a Discrete action space, received {env_id!r} with {action_space}"
        )
    if not isinstance(observation_space, gymnasium.spaces.Box):
        raise UnsupportedEnvironmentError(
            f"env_id: expected an env with a Box observation space, received {env_id!r} with {observation_space}"
        )
    dtype = np.dtype(observation_space.dtype)
    if dtype == np.float64:
        dtype = np.dtype(np.float32)  # see module docstring
    return EnvSpec(
        env_id=env_id,
        observation_shape=tuple(observation_space.shape),
        observation_dtype=dtype,
        num_actions=int(action_space.n),
        is_atari=False,
    )


# ----------------------------------------------------------------------------------------------
# Public factory


@functools.lru_cache(maxsize=32)
def env_spec(env_id: str) -> EnvSpec:
    """Spaces of ``env_id`` as the vector env will report them (builds one env, then closes it).

    Raises:
        UnsupportedEnvironmentError: unknown id, non-Discrete actions or non-Box observations.
    """
    if is_atari_env(env_id):
        backend = _AtariBackend(env_id, 1, max_episode_steps=None, num_threads=1)
        backend.close()
        return backend.spec
    env = _make_gymnasium_env(env_id, None)
    try:
        return _gymnasium_spec(env_id, env.observation_space, env.action_space)
    finally:
        env.close()


def make_vector_env(
    env_id: str,
    num_envs: int,
    *,
    seed: int | None,
    clip_rewards: bool | None = None,
    max_episode_steps: int | None = None,
    num_threads: int | None = None,
) -> VectorEnv:
    """Build ``num_envs`` copies of ``env_id`` behind one :class:`VectorEnv`.

    Args:
        env_id: Atari id (``ALE/Breakout-v5``, ``BreakoutNoFrameskip-v4``) or any Gymnasium id with
            Discrete actions and Box observations.
        num_envs: envs stepped together (>= 1).
        seed: seed of the first reset; env ``i`` is seeded with ``seed + i``. None: unseeded.
        clip_rewards: clip ``training_rewards`` to [-1, 1]; None means on for Atari ids, off otherwise.
        max_episode_steps: time limit in agent steps (truncation) replacing the id's own; None keeps it.
        num_threads: emulator threads (Atari only; default ``min(num_envs, cpu_count)``).

    Raises:
        ValueError: ``num_envs`` < 1 or ``max_episode_steps`` < 1.
        UnsupportedEnvironmentError: unknown id or unsupported spaces.
    """
    if num_envs < 1:
        raise ValueError(f"num_envs: expected >= 1, received {num_envs}")
    if max_episode_steps is not None and max_episode_steps < 1:
        raise ValueError(f"max_episode_steps: expected >= 1 or None, received {max_episode_steps}")
    atari = is_atari_env(env_id)
    backend: _Backend
    if atari:
        backend = _AtariBackend(env_id, num_envs, max_episode_steps=max_episode_steps, num_threads=num_threads)
    else:
        backend = _GymnasiumBackend(env_id, num_envs, max_episode_steps=max_episode_steps)
    return VectorEnv(backend, seed=seed, clip_rewards=atari if clip_rewards is None else clip_rewards)


def make_eval_env(env_id: str, *, seed: int | None, max_episode_steps: int | None = None) -> VectorEnv:
    """One env of ``env_id`` without reward clipping, for evaluation (same preprocessing as training)."""
    return make_vector_env(env_id, 1, seed=seed, clip_rewards=False, max_episode_steps=max_episode_steps, num_threads=1)

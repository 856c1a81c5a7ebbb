"""Atari ids through ale-py's threaded ``AtariVectorEnv``, with the usual DQN/PPO preprocessing
built in (Machado et al. 2018, "Revisiting the ALE"; CleanRL ``ppo_atari.py``).

No-op reset (up to 30), frame skip 4 with max-pooling over the last two frames, 84x84 grayscale,
4 stacked frames, sticky actions as the registered id says (0.25 for ``-v5``, 0.0 for
``NoFrameskip-v4``), minimal action set, FIRE on reset where the game has it; the no-ops, frame skip,
stack, sticky actions and life-loss episodes are :class:`~oakemu_core.envs.options.EnvOptions`. Observations
``(n, 4, 84, 84)`` uint8, ``Discrete`` actions, no action masks. Rewards are returned raw
(:class:`oakemu_core.envs.vector.VectorEnv` clips the training rewards).

Life-loss episodes (``atari_episodic_life``) are SB3's ``EpisodicLifeEnv`` with ``FireResetEnv``, as in
rl-baselines3-zoo and CleanRL ``ppo_atari.py``: a lost life ends the learner's episode (``terminated``) while
the game goes on, and the next step presses FIRE where the game's action set has it (Breakout serves the
ball). The episode statistics stay per game (:attr:`AtariBackend.games_ended`). ale-py's own
``episodic_life`` restarts the game on a lost life instead (docs/decisions/atari-life-loss.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from oakemu_core.envs.options import ATARI_FRAME_SKIP, ATARI_NOOP_MAX, ATARI_STACK, EnvOptions
from oakemu_core.envs.spec import EnvSpec, UnsupportedEnvironmentError

__all__ = [
    "ALE_SCREEN",
    "ATARI_FRAME_SKIP",
    "ATARI_IMAGE_SIZE",
    "ATARI_NOOP_MAX",
    "ATARI_STACK",
    "AtariBackend",
]

ATARI_IMAGE_SIZE = 84
ALE_SCREEN = (210, 160)
"""Height and width of the Atari 2600 screen as the ALE emulates it."""
ATARI_DEFAULT_MAX_FRAMES = 108_000  # 27,000 agent steps = 30 minutes of play at 60 Hz


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
        max_num_frames_per_episode=int(
            kwargs.get("max_num_frames_per_episode") or ATARI_DEFAULT_MAX_FRAMES
        ),
    )


class AtariBackend:
    """ale-py's threaded ``AtariVectorEnv`` in same-step autoreset mode, raw rewards.

    Implements :class:`oakemu_core.envs.vector.Backend` with ``send`` / ``recv`` (the emulators step
    in ale-py's threads). :attr:`spec` is read from the emulator's own spaces, so the spec of an
    Atari id is the spec of a one-env backend.

    With life-loss episodes (``options.atari_episodic_life``) ``terminated`` is True on a lost life too,
    the game is not restarted, and the step after it plays FIRE in place of the chosen action where the
    game's action set has FIRE: SB3's ``FireResetEnv`` plays it in steps the learner does not see, but
    ale-py's vector env steps all its envs at once, so here it is the first step of the new life.
    :meth:`forced_actions` names those rows before the step (the actor stores FIRE there, not the chosen
    action). :attr:`games_ended` marks the rows whose game ended (ale-py restarted them).

    With ``screen=True`` the observations are the colour screen instead, ``(n, 1, 210, 160, 3)``
    uint8 (one frame, max-pooled over the last two of the frame skip): the same game, seeded the
    same way, for videos (:class:`oakemu_core.envs.render.RecordingAtariBackend`).

    Raises:
        UnsupportedEnvironmentError: ``env_id`` is not an ale-py id with image observations.
    """

    games_ended: np.ndarray
    """``(n,)`` bool after each reset / step: the rows whose game ended (game over or time limit) and
    restarted, where the episode statistics count a game; ``terminated | truncated`` without life-loss episodes."""

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        *,
        max_episode_steps: int | None,
        num_threads: int | None,
        options: EnvOptions | None = None,
        screen: bool = False,
    ) -> None:
        from ale_py import Action
        from ale_py.vector_env import AtariVectorEnv

        settings = _atari_settings(env_id)
        options = options or EnvOptions()
        sticky = options.atari_sticky_actions
        max_frames = (
            max_episode_steps
            * options.atari_frame_skip  # ALE counts emulator frames, we count agent steps
            if max_episode_steps is not None
            else settings.max_num_frames_per_episode
        )
        self.num_envs = num_envs
        self._env = AtariVectorEnv(
            settings.game,
            num_envs,
            num_threads=num_threads
            if num_threads is not None
            else min(num_envs, os.cpu_count() or 1),
            autoreset_mode="SameStep",
            repeat_action_probability=settings.repeat_action_probability
            if sticky is None
            else float(sticky),
            full_action_space=settings.full_action_space,
            reward_clipping=False,  # VectorEnv clips the training rewards, so episode returns stay raw
            frameskip=options.atari_frame_skip,
            maxpool=True,
            noop_max=options.atari_noop_max,
            stack_num=1 if screen else options.atari_frame_stack,
            episodic_life=False,  # ale-py's episodic_life restarts the game on a lost life
            life_loss_info=options.atari_episodic_life,  # terminated on a lost life, the game goes on
            img_height=ALE_SCREEN[0] if screen else ATARI_IMAGE_SIZE,
            img_width=ALE_SCREEN[1] if screen else ATARI_IMAGE_SIZE,
            grayscale=not screen,
            max_num_frames_per_episode=max_frames,
        )
        self.spec = EnvSpec.discrete(
            env_id,
            tuple(self._env.single_observation_space.shape),
            self._env.single_observation_space.dtype,
            int(self._env.single_action_space.n),
            is_atari=True,
        )
        self._in_order = np.arange(num_envs)
        self._life_loss = options.atari_episodic_life
        action_set = list(self._env.ale.get_action_set())
        self._fire = (
            action_set.index(Action.FIRE) if self._life_loss and Action.FIRE in action_set else None
        )
        self._serve = np.zeros(num_envs, dtype=bool)  # rows that lost a life last step: FIRE next
        self._frames = np.zeros(
            (2, num_envs), dtype=np.int64
        )  # frame numbers: emulator's, the game's
        self.games_ended = np.zeros(num_envs, dtype=bool)

    def reset(self, seed: int | None) -> tuple[np.ndarray, None]:
        observations, info = self._env.reset(seed=seed)
        order = self._order(info)
        self._frames = self._frame_numbers(info, order)
        self._serve[:] = False
        self.games_ended = np.zeros(self.num_envs, dtype=bool)
        return (observations if order is None else observations[order]), None

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, None]:
        self.send(actions)
        return self.recv()

    def send(self, actions: np.ndarray) -> None:
        """Start stepping (ale-py's own threads step the emulators; returns at once)."""
        if self._serve.any():
            actions = actions.copy()
            actions[self._serve] = self._fire
        self._env.send(actions)

    def recv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, None]:
        """Wait for the step started by :meth:`send`."""
        observations, rewards, terminated, truncated, info = self._env.recv()
        order = self._order(info)
        if (
            order is not None
        ):  # ale-py returns rows in env order when batch_size == num_envs; be safe
            observations, rewards, terminated, truncated = (
                observations[order],
                rewards[order],
                terminated[order],
                truncated[order],
            )
        dones = terminated | truncated
        frames = self._frame_numbers(info, order)
        if self._life_loss:
            # A row ale-py restarted counted its game's frames from 0 again; a row going on counted both alike.
            restarted = (frames[0] - self._frames[0]) != (frames[1] - self._frames[1])
            self.games_ended = dones & restarted
        else:
            self.games_ended = dones
        self._frames = frames
        if self._fire is not None:
            self._serve = terminated & ~self.games_ended
        final_observations = observations
        if self.games_ended.any():
            # SameStep mode: info["final_obs"] is a full (n, ...) array, valid on the restarted rows.
            reported = info["final_obs"] if order is None else info["final_obs"][order]
            final_observations = observations.copy()
            final_observations[self.games_ended] = reported[self.games_ended]
        return (
            observations,
            rewards.astype(np.float64),
            terminated,
            truncated,
            final_observations,
            None,
        )

    def forced_actions(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The rows whose next step plays FIRE whatever action :meth:`send` is given (a life was lost on
        the last step, the game goes on): ``(rows (k,) int64, actions (k,) of the spec's action dtype)``,
        ``k >= 1``; None when no row is forced (always without life-loss episodes or without FIRE)."""
        if not self._serve.any():
            return None
        rows = np.flatnonzero(self._serve)
        return rows, np.full(rows.size, self._fire, dtype=self.spec.action_dtype)

    def _order(self, info: dict[str, Any]) -> np.ndarray | None:
        """The permutation putting ale-py's rows in env order; None when they already are."""
        return (
            None if np.array_equal(info["env_id"], self._in_order) else np.argsort(info["env_id"])
        )

    @staticmethod
    def _frame_numbers(info: dict[str, Any], order: np.ndarray | None) -> np.ndarray:
        """``(2, n)`` int64: each row's emulator frame number and its game's (``episode_frame_number``)."""
        frames = np.stack([info["frame_number"], info["episode_frame_number"]]).astype(np.int64)
        return frames if order is None else frames[:, order]

    def close(self) -> None:
        self._env.close()

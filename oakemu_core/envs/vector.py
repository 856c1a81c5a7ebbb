"""One small vector-env interface over every backend: :class:`VectorEnv`, its :class:`VectorStep`,
the :class:`Backend` protocol a backend implements, and :class:`EnvGroups`.

Every backend autoresets in the *same step* an episode ends: ``observations`` returned by
:meth:`VectorEnv.step` are already the first observations of the new episodes (and
``action_masks`` their masks), and the true last observations are in ``final_observations``. PPO
needs them to bootstrap truncated episodes (Pardo et al. 2018, "Time Limits in Reinforcement
Learning"; SB3 issue #633).

Rewards: ``training_rewards`` are clipped to [-1, 1] when reward clipping is on (the factory's
default: on for Atari ids), while ``episode_returns`` always report the raw game score.

Episodes for the learner and games: ``terminated`` / ``truncated`` end the learner's episodes, while the
episode statistics (``episode_returns``, ``episode_lengths``) count whole games. They differ only where a
backend ends episodes before the game does (Atari life-loss episodes, SB3's ``EpisodicLifeEnv``: a lost
life is ``terminated`` and the game goes on); such a backend says which rows' games ended in ``games_ended``.

Forced actions: a backend may play an action of its own on some rows whatever it is sent (Atari life-loss
episodes: FIRE on the step after a lost life, where SB3's ``FireResetEnv`` takes hidden steps);
:meth:`VectorEnv.forced_actions` names them before the step, so that the actor stores the action taken
(non-trainable, as a routed step: :mod:`oakemu_core.actor.routing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from oakemu_core.envs.spec import EnvSpec, Observations

__all__ = ["Backend", "EnvGroups", "VectorEnv", "VectorStep"]


@dataclass
class VectorStep:
    """Result of one :meth:`VectorEnv.step` for all ``n`` envs.

    Attributes:
        observations: next observations, already reset on rows whose episode ended (same-step
            autoreset): ``(n, *shape)`` array for a plain space, ``{key: (n, *shape)}`` for a dict
            space (shapes and dtypes as in ``EnvSpec.observation_layout``).
        training_rewards: ``(n,)`` float32; rewards for training, clipped to [-1, 1] when clipping is on.
        terminated: ``(n,)`` bool; the episode reached a terminal state (no bootstrap): the game is over, or
            with Atari life-loss episodes a life was lost (the game goes on).
        truncated: ``(n,)`` bool; the episode was cut by a time limit (bootstrap from the final observation).
        final_observations: same structure as ``observations``; on rows where ``terminated |
            truncated`` the TRUE last observation of the finished episode. Other rows hold the same
            values as ``observations`` (arrays may then be the very same objects: read, do not write).
        episode_returns: raw (unclipped) game score of each game that ended this step (with life-loss
            episodes a game spans several of the learner's episodes; it ends on a done row).
        episode_lengths: length in agent steps of each game that ended this step.
        episode_env_ids: env index (row) of each game that ended this step, same order.
        action_masks: ``(n, action_mask_width)`` bool, the masks of ``observations`` (on rows that
            ended: the new episode's first mask); None when the env has no masks.
    """

    observations: Observations
    training_rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_observations: Observations
    episode_returns: list[float]
    episode_lengths: list[int]
    episode_env_ids: list[int]
    action_masks: np.ndarray | None = None

    @property
    def dones(self) -> np.ndarray:
        """``(n,)`` bool, ``terminated | truncated``."""
        return self.terminated | self.truncated


class Backend(Protocol):
    """What a backend provides; :class:`VectorEnv` adds checks, reward clipping and episode bookkeeping.

    A backend whose envs step in threads of their own may also provide ``send(actions)`` and
    ``recv()`` (the two halves of :meth:`step`); :class:`VectorEnv` then steps asynchronously.

    A backend whose episodes can end before the game does (Atari life-loss episodes) also has
    ``games_ended``: after each reset and step, ``(n,)`` bool, the rows whose game ended (and restarted),
    a subset of ``terminated | truncated``. :class:`VectorEnv` counts the episode statistics per game
    then; without it every done row ends a game.

    A backend that plays actions of its own on some rows also has ``forced_actions()``: before each step,
    ``(rows (k,) int64, actions (k, *action_shape) of spec.action_dtype)`` of the rows whose next action it
    replaces (allowed by their masks), or None when none is; see :meth:`VectorEnv.forced_actions`.
    """

    spec: EnvSpec
    num_envs: int

    def reset(self, seed: int | None) -> tuple[Observations, np.ndarray | None]:
        """Reset all envs; returns ``(observations, action masks (n, width) bool or None)``."""

    def step(
        self, actions: np.ndarray
    ) -> tuple[Observations, np.ndarray, np.ndarray, np.ndarray, Observations, np.ndarray | None]:
        """Step with checked, normalised actions (dtype ``spec.action_dtype``).

        Returns ``(observations, raw_rewards float64, terminated, truncated, final_observations,
        action_masks)``.
        """

    def close(self) -> None:
        """Release the emulators."""


class VectorEnv:
    """Uniform vector env over the backends (see module docstring); build with
    :func:`oakemu_core.envs.make_vector_env`.

    Use: ``obs = env.reset()`` once, then ``step = env.step(actions)`` repeatedly; the env resets
    finished episodes itself. ``close()`` (or a ``with`` block) releases the emulators.
    """

    def __init__(self, backend: Backend, *, seed: int | None, clip_rewards: bool) -> None:
        self._backend = backend
        self.spec: EnvSpec = backend.spec
        self.num_envs: int = backend.num_envs
        self.clip_rewards = clip_rewards
        self._seed = seed
        self._running_returns = np.zeros(self.num_envs, dtype=np.float64)
        self._running_lengths = np.zeros(self.num_envs, dtype=np.int64)
        self._masks: np.ndarray | None = None
        self._needs_reset = True
        self._closed = False
        self._in_flight: np.ndarray | None = None  # actions sent by step_async, not yet waited for
        self._sent = False  # the backend is stepping them in its own threads (send/recv)
        self.asynchronous = callable(getattr(backend, "send", None)) and callable(
            getattr(backend, "recv", None)
        )
        """True when :meth:`step_async` returns while the envs step (ale-py's threads); otherwise
        the step runs in :meth:`step_wait`."""

    def reset(self) -> Observations:
        """Reset every env (the first call uses the construction seed).

        Returns ``(n, *shape)`` for a plain space, ``{key: (n, *shape)}`` for a dict space.

        Raises:
            InvalidActionMaskError: an env's first mask is malformed or allows nothing.
        """
        if self._closed:
            raise RuntimeError(f"VectorEnv({self.spec.env_id!r}) is closed")
        observations, masks = self._backend.reset(self._seed)
        self._seed = None  # later resets continue the envs' own random streams
        self._running_returns[:] = 0.0
        self._running_lengths[:] = 0
        self._masks = masks
        self._needs_reset = False
        return observations

    def action_masks(self) -> np.ndarray | None:
        """``(n, action_mask_width)`` bool masks of the observations last returned by reset()/step().

        None when the env has no masks (``spec.action_mask_width == 0``) or before the first reset.
        """
        return self._masks

    def forced_actions(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The rows whose next step the env plays with an action of its own, whatever :meth:`step` is given.

        Returns:
            ``(rows, actions)``: ``rows`` ``(k,)`` int64 env rows, ``k >= 1``, ascending; ``actions``
            ``(k, *spec.action_shape)`` of ``spec.action_dtype``, the actions those rows will take (Atari
            life-loss episodes: FIRE after a lost life). None when no row is forced (most envs, always).

        Raises:
            RuntimeError: a step is in flight (between :meth:`step_async` and :meth:`step_wait`).
        """
        if self._in_flight is not None:
            raise RuntimeError("VectorEnv.forced_actions: a step is in flight (call step_wait)")
        forced = getattr(self._backend, "forced_actions", None)
        return None if forced is None or self._needs_reset else forced()

    def step(self, actions: Any) -> VectorStep:
        """Step all envs with ``actions`` (one row per env, in the spec's normalised action space).

        * Discrete: ``(n,)`` integers in ``[0, n_actions)``.
        * MultiDiscrete: ``(n, k)`` integers, column ``j`` in ``[0, nvec[j])``.
        * MultiBinary: ``(n, k)`` integers or bools in {0, 1}.
        * Box: ``(n, d)`` real numbers, all finite; clipped to the bounds for the env only.

        Raises:
            ValueError: wrong shape, dtype, an out-of-range or non-finite action, or an action
                that the current action mask forbids (no env is stepped then).
            InvalidActionMaskError: an env returned a malformed mask or one that allows nothing.
            RuntimeError: called before :meth:`reset` or after :meth:`close`.
        """
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Start a step with ``actions`` (checked as in :meth:`step`); :meth:`step_wait` returns it.

        With an asynchronous backend (:attr:`asynchronous`: ale-py's vector env) the envs step in
        their own threads meanwhile, so the caller can compute something else (the actor infers the
        actions of another env group, see :class:`EnvGroups`).

        Raises:
            RuntimeError: a step is already in flight, or before :meth:`reset` / after :meth:`close`.
            ValueError: as :meth:`step` (nothing is sent then).
        """
        if self._needs_reset or self._closed:
            raise RuntimeError("VectorEnv.step called before reset() or after close()")
        if self._in_flight is not None:
            raise RuntimeError("VectorEnv.step_async: a step is already in flight (call step_wait)")
        actions = self._check_actions(actions)
        self._sent = self.asynchronous
        if self._sent:
            self._backend.send(actions)  # type: ignore[attr-defined]
        self._in_flight = actions

    def step_wait(self) -> VectorStep:
        """The result of the step started by :meth:`step_async` (see :meth:`step`)."""
        actions = self._in_flight
        if actions is None:
            raise RuntimeError("VectorEnv.step_wait: no step in flight (call step_async)")
        self._in_flight = None
        if self._sent:
            observations, raw_rewards, terminated, truncated, final_observations, masks = (
                self._backend.recv()
            )  # type: ignore[attr-defined]
        else:
            observations, raw_rewards, terminated, truncated, final_observations, masks = (
                self._backend.step(actions)
            )
        self._masks = masks

        self._running_returns += raw_rewards
        self._running_lengths += 1
        games_ended = getattr(self._backend, "games_ended", None)
        ended_rows = np.flatnonzero(terminated | truncated if games_ended is None else games_ended)
        episode_returns = [float(self._running_returns[row]) for row in ended_rows]
        episode_lengths = [int(self._running_lengths[row]) for row in ended_rows]
        self._running_returns[ended_rows] = 0.0
        self._running_lengths[ended_rows] = 0

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
            episode_env_ids=[int(row) for row in ended_rows],
            action_masks=masks,
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

    # -- action checks ----------------------------------------------------------------------

    def _check_actions(self, actions: Any) -> np.ndarray:
        spec, n = self.spec, self.num_envs
        actions = np.asarray(actions)
        expected_shape = (n, *spec.action_shape)
        if actions.shape != expected_shape:
            raise ValueError(f"actions: expected shape {expected_shape}, received {actions.shape}")
        kind = spec.action_kind
        if kind == "box":
            if actions.dtype.kind not in "fiu":  # a real or integer dtype
                raise ValueError(
                    f"actions: expected a real (float32) dtype, received {actions.dtype}"
                )
            finite = np.isfinite(actions)
            if not finite.all():
                row = int(np.flatnonzero(~finite.all(axis=1))[0])
                raise ValueError(
                    f"actions: expected finite values for {spec.env_id!r}, received {actions[row].tolist()} "
                    f"at env {row} (non-finite actions never reach an env)"
                )
            return actions.astype(np.float32, copy=False)
        if kind == "multi_binary" and actions.dtype == np.bool_:
            actions = actions.astype(np.int8)
        if actions.dtype.kind not in "iu":  # an integer dtype
            raise ValueError(
                f"actions: expected an integer dtype ({spec.action_dtype}), received {actions.dtype}"
            )
        if kind == "discrete":
            high: Any = spec.num_actions
            description = f"[0, {spec.num_actions})"
        elif kind == "multi_discrete":
            high = np.broadcast_to(spec.action_space.nvec.astype(np.int64), expected_shape)
            description = f"[0, nvec) with nvec {spec.action_space.nvec.tolist()}"
        else:
            high, description = 2, "{0, 1}"
        bad = (actions < 0) | (actions >= high)
        if bad.any():
            row = int(np.flatnonzero(bad.reshape(n, -1).any(axis=1))[0])
            raise ValueError(
                f"actions: expected values in {description}, received {actions[row].tolist()} at env {row} "
                f"(min {actions.min()} max {actions.max()})"
            )
        actions = actions.astype(spec.action_dtype, copy=False)
        if self._masks is not None:
            self._check_masked(actions)
        return actions

    def _check_masked(self, actions: np.ndarray) -> None:
        """Raise ValueError when an action is forbidden by the current mask (masks are never overridden)."""
        masks = self._masks
        assert masks is not None
        rows = np.arange(self.num_envs)
        if actions.ndim == 1:
            allowed = masks[rows, actions]
        else:
            offsets = np.concatenate([[0], np.cumsum(self.spec.action_mask_segments)[:-1]]).astype(
                np.int64
            )
            allowed = masks[rows[:, None], offsets[None, :] + actions.astype(np.int64)].all(axis=1)
        if not allowed.all():
            row = int(np.flatnonzero(~allowed)[0])
            raise ValueError(
                f"actions: env {row} of {self.spec.env_id!r} received action {actions[row].tolist()}, which its "
                f"action mask forbids (mask {masks[row].astype(np.int8).tolist()}); masked actions are never taken"
            )


class EnvGroups:
    """``groups`` vector envs of one id that together hold an actor's ``num_envs`` envs.

    The actor steps them overlapped (:class:`oakemu_core.actor.stepper.PolicyStepper`): while one group
    steps in its emulator threads, the policy chooses the next actions of another (Sample
    Factory's double-buffered sampling). Env ``i`` of the whole is env ``i - offsets[g]`` of group
    ``g``, seeded ``seed + i`` as in one vector env of ``num_envs``.
    """

    def __init__(self, groups: list[VectorEnv]) -> None:
        if not groups or len({g.spec for g in groups}) != 1:
            raise ValueError("EnvGroups: expected one or more vector envs of one spec")
        self.groups = groups
        self.spec: EnvSpec = groups[0].spec
        self.num_envs = sum(g.num_envs for g in groups)
        self.offsets = np.cumsum([0] + [g.num_envs for g in groups])

    def close(self) -> None:
        for group in self.groups:
            group.close()

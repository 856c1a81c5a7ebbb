"""Environment factory: one small vector-env interface over every emulator backend and space.

Actors, the evaluator and the benchmarks only see :class:`VectorEnv`, :class:`VectorStep` and
:class:`EnvSpec`; the backend behind them is picked from the env id:

* Atari ids (``ALE/...`` or ``...NoFrameskip...``): ale-py's threaded ``AtariVectorEnv`` with the
  usual DQN/PPO preprocessing built in (Machado et al. 2018, "Revisiting the ALE"; CleanRL
  ``ppo_atari.py``): no-op reset (up to 30), frame skip 4 with max-pooling over the last two
  frames, 84x84 grayscale, 4 stacked frames, sticky actions as the registered id says (0.25 for
  ``-v5``, 0.0 for ``NoFrameskip-v4``), minimal action set, FIRE on reset where the game has it.
  Observations ``(n, 4, 84, 84)`` uint8, ``Discrete`` actions, no action masks.
* Emulator ids (``gameboy:...``, ``retro:...``): ``oakemu_core.envs.emulators.make_emulator_env`` builds
  one ``gymnasium.Env`` per copy, then the Gymnasium path below applies.
* Any other Gymnasium id, including Gymnasium's ``module:EnvId`` form for custom envs
  (``my_pkg.envs:MyEnv-v0``: the module is imported first, it registers its ids): a
  ``gymnasium.vector.SyncVectorEnv`` of ``gymnasium.make(env_id)``.

Spaces (checked by :func:`env_spec` before any process starts; anything else raises
:class:`UnsupportedEnvironmentError` naming the env id and the space):

* Observations are a plain space (one key, the empty string ``""``) or a ``spaces.Dict`` (nested
  dicts flattened by key path joined with ``"."``, e.g. ``"agent.position"``; keys sorted). Each
  leaf keeps its own shape and dtype, with these conversions: ``Box`` float64 -> float32 (the
  networks' dtype; halves the bytes on the wire), other ``Box`` dtypes kept (uint8 frames stay
  uint8); ``Discrete(n)`` -> one-hot float32 ``(n,)``; ``MultiDiscrete(nvec)`` -> the one-hot
  vectors of its entries concatenated, float32 ``(sum(nvec),)``; ``MultiBinary`` -> float32 0/1
  of the same shape (float32 rather than int8 so that every non-image key reaches the model as
  float32). ``Tuple``, ``Text``, ``Graph``, ``Sequence``, ``OneOf`` are refused.
* Actions: ``Discrete`` and ``MultiDiscrete`` (1-D ``nvec``) normalised to start 0 (the adapter adds
  the env's ``start`` back when stepping), ``MultiBinary`` (1-D), ``Box`` (1-D, float; the spec's
  space is float32; actions are clipped to the bounds at the env boundary only).
* Action masks (Gymnasium's ``info["action_mask"]``, e.g. Taxi, or sb3-contrib's ``action_masks()``
  method on the env) for Discrete, MultiDiscrete and MultiBinary actions; see :class:`EnvSpec`.

Both backends autoreset in the *same step* an episode ends: ``observations`` returned by
:meth:`VectorEnv.step` are already the first observations of the new episodes (and
``action_masks`` their masks), and the true last observations are in ``final_observations``. PPO
needs them to bootstrap truncated episodes (Pardo et al. 2018, "Time Limits in Reinforcement
Learning"; SB3 issue #633).

Rewards: ``training_rewards`` are clipped to [-1, 1] when reward clipping is on (default: on for
Atari ids), while ``episode_returns`` always report the raw game score.

A new backend implements :class:`_Backend` and a branch in :func:`make_vector_env` /
:func:`env_spec`.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from oakemu_core.config import is_atari_env

__all__ = [
    "EMULATOR_ID_PREFIXES",
    "EnvSpec",
    "InvalidActionMaskError",
    "Observations",
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

EMULATOR_ID_PREFIXES = ("gameboy:", "retro:")
PLAIN_KEY = ""  # the observation_layout key of a plain (non-dict) observation space

#: A batch of observations: ``(n, *shape)`` for a plain space, ``{key: (n, *shape)}`` for a dict space.
Observations = np.ndarray | dict[str, np.ndarray]


class UnsupportedEnvironmentError(ValueError):
    """The env id is unknown, cannot be imported or built, or its spaces are not supported.

    The message names the env id, what is expected and what was received (e.g. the space).
    """


class InvalidActionMaskError(ValueError):
    """An env produced an action mask of the wrong width or dtype, or one that allows no action.

    The message names the env id, the env index in its vector env and the received mask.
    """


# ----------------------------------------------------------------------------------------------
# Spec


@dataclass(frozen=True)
class EnvSpec:
    """What the model, the rollout buffer and the wire need to know about an environment.

    Attributes:
        env_id: the id as given (``ALE/Breakout-v5``, ``CartPole-v1``, ``my_pkg.envs:MyEnv-v0``,
            ``gameboy:...``).
        observation_layout: ``{key: (shape of ONE observation, dtype)}``. A plain observation
            space has the single key ``""``; a Dict space one entry per leaf, keys sorted, nested
            keys joined with ``"."``. Examples: Atari ``{"": ((4, 84, 84), uint8)}``, CartPole
            ``{"": ((4,), float32)}``, Taxi ``{"": ((500,), float32)}`` (one-hot).
        action_space: the normalised action space of ONE env: ``Discrete(n)`` (start 0),
            ``MultiDiscrete(nvec)`` (1-D, start 0, int64), ``MultiBinary(k)`` or
            ``Box(low, high, (d,), float32)``. Compared by value.
        action_mask_width: 0 when the env gives no action masks; else ``n`` (Discrete),
            ``sum(nvec)`` (MultiDiscrete: the sub-actions' masks concatenated in order) or ``2 * k``
            (MultiBinary: for bit ``i``, mask entries ``2i`` = "may be 0" and ``2i + 1`` = "may be
            1"; the same layout as ``MultiDiscrete([2] * k)``). See :attr:`action_mask_segments`.
        is_atari: True for ids served by ale-py's preprocessing.
    """

    env_id: str
    observation_layout: dict[str, tuple[tuple[int, ...], np.dtype]]
    action_space: Any  # gymnasium.spaces.Space (typed Any: gymnasium is imported lazily)
    action_mask_width: int = 0
    is_atari: bool = False

    def __post_init__(self) -> None:
        layout = {
            str(key): (tuple(int(d) for d in shape), np.dtype(dtype))
            for key, (shape, dtype) in sorted(self.observation_layout.items())
        }
        if not layout:
            raise ValueError(f"EnvSpec({self.env_id!r}): observation_layout is empty")
        if PLAIN_KEY in layout and len(layout) > 1:
            raise ValueError(f"EnvSpec({self.env_id!r}): the plain key '' cannot be mixed with dict keys")
        object.__setattr__(self, "observation_layout", layout)
        object.__setattr__(self, "action_mask_width", int(self.action_mask_width))

    def __hash__(self) -> int:  # observation_layout is a dict and spaces are unhashable
        return hash((self.env_id, tuple(self.observation_layout.items()), repr(self.action_space),
                     self.action_mask_width, self.is_atari))

    @classmethod
    def discrete(
        cls,
        env_id: str,
        observation_shape: tuple[int, ...],
        observation_dtype: Any,
        num_actions: int,
        *,
        is_atari: bool = False,
    ) -> EnvSpec:
        """Shorthand for the plain case: one observation key ``""`` and ``Discrete(num_actions)``."""
        import gymnasium

        return cls(
            env_id=env_id,
            observation_layout={PLAIN_KEY: (tuple(observation_shape), np.dtype(observation_dtype))},
            action_space=gymnasium.spaces.Discrete(int(num_actions)),
            is_atari=is_atari,
        )

    # -- observations ---------------------------------------------------------------------

    @property
    def is_dict_observation(self) -> bool:
        """True when observations are ``dict[str, np.ndarray]`` (a Dict space), False for one array."""
        return PLAIN_KEY not in self.observation_layout

    @property
    def observation_keys(self) -> tuple[str, ...]:
        """The observation keys, sorted (``("",)`` for a plain space)."""
        return tuple(self.observation_layout)

    @property
    def observation_shape(self) -> tuple[int, ...]:
        """Shape of ONE plain observation. Raises ValueError for dict observations."""
        return self._plain_entry()[0]

    @property
    def observation_dtype(self) -> np.dtype:
        """Dtype of plain observations. Raises ValueError for dict observations."""
        return self._plain_entry()[1]

    def _plain_entry(self) -> tuple[tuple[int, ...], np.dtype]:
        if self.is_dict_observation:
            raise ValueError(
                f"{self.env_id!r} has dict observations (keys {list(self.observation_layout)}): "
                "use EnvSpec.observation_layout instead of observation_shape / observation_dtype"
            )
        return self.observation_layout[PLAIN_KEY]

    # -- actions --------------------------------------------------------------------------

    @property
    def action_kind(self) -> str:
        """``"discrete"``, ``"multi_discrete"``, ``"multi_binary"`` or ``"box"``."""
        import gymnasium

        spaces = gymnasium.spaces
        for kind, space_type in (
            ("discrete", spaces.Discrete),
            ("multi_discrete", spaces.MultiDiscrete),
            ("multi_binary", spaces.MultiBinary),
            ("box", spaces.Box),
        ):
            if isinstance(self.action_space, space_type):
                return kind
        raise ValueError(f"{self.env_id!r}: unsupported action space {self.action_space}")

    @property
    def num_actions(self) -> int:
        """``n`` of a Discrete action space. Raises ValueError for other action spaces."""
        if self.action_kind != "discrete":
            raise ValueError(
                f"{self.env_id!r}: num_actions is defined for Discrete action spaces only, "
                f"received {self.action_space}"
            )
        return int(self.action_space.n)

    @property
    def action_shape(self) -> tuple[int, ...]:
        """Shape of ONE action: ``()`` Discrete, ``(k,)`` MultiDiscrete / MultiBinary, ``(d,)`` Box."""
        return tuple(int(d) for d in self.action_space.shape)

    @property
    def action_dtype(self) -> np.dtype:
        """int64 (Discrete, MultiDiscrete), int8 (MultiBinary) or float32 (Box)."""
        return np.dtype({"discrete": np.int64, "multi_discrete": np.int64, "multi_binary": np.int8,
                         "box": np.float32}[self.action_kind])

    @property
    def action_mask_segments(self) -> tuple[int, ...]:
        """Widths of the consecutive mask segments, one per sub-action (sum = the full mask width).

        ``(n,)`` Discrete, ``tuple(nvec)`` MultiDiscrete, ``(2,) * k`` MultiBinary, ``()`` Box.
        """
        kind = self.action_kind
        if kind == "discrete":
            return (int(self.action_space.n),)
        if kind == "multi_discrete":
            return tuple(int(v) for v in self.action_space.nvec)
        if kind == "multi_binary":
            return (2,) * int(self.action_space.n)
        return ()

    @property
    def has_action_masks(self) -> bool:
        return self.action_mask_width > 0

    # -- plain-data form (msgpack / JSON / checkpoints) ------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain data (str, int, float, bool, lists): for msgpack, JSON or checkpoints.

        Box bounds may contain ``inf`` floats (msgpack carries them; strict JSON does not).
        """
        kind = self.action_kind
        space = self.action_space
        action: dict[str, Any] = {"kind": kind}
        if kind == "discrete":
            action["n"] = int(space.n)
        elif kind == "multi_discrete":
            action["nvec"] = [int(v) for v in space.nvec]
        elif kind == "multi_binary":
            action["n"] = int(space.n)
        else:
            action["low"] = [float(v) for v in space.low]
            action["high"] = [float(v) for v in space.high]
        return {
            "env_id": self.env_id,
            "observation_layout": {
                key: {"shape": list(shape), "dtype": dtype.str} for key, (shape, dtype) in self.observation_layout.items()
            },
            "action_space": action,
            "action_mask_width": self.action_mask_width,
            "is_atari": self.is_atari,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EnvSpec:
        """Inverse of :meth:`to_dict`. Raises ValueError / KeyError / TypeError on malformed data."""
        import gymnasium

        spaces = gymnasium.spaces
        action = data["action_space"]
        kind = action["kind"]
        space: Any
        if kind == "discrete":
            space = spaces.Discrete(int(action["n"]))
        elif kind == "multi_discrete":
            space = spaces.MultiDiscrete(np.asarray(action["nvec"], dtype=np.int64))
        elif kind == "multi_binary":
            space = spaces.MultiBinary(int(action["n"]))
        elif kind == "box":
            low = np.asarray(action["low"], dtype=np.float32)
            space = spaces.Box(low, np.asarray(action["high"], dtype=np.float32), low.shape, np.float32)
        else:
            raise ValueError(f"action_space.kind: expected discrete, multi_discrete, multi_binary or box, received {kind!r}")
        layout = {
            str(key): (tuple(int(d) for d in entry["shape"]), np.dtype(entry["dtype"]))
            for key, entry in data["observation_layout"].items()
        }
        return cls(
            env_id=str(data["env_id"]),
            observation_layout=layout,
            action_space=space,
            action_mask_width=int(data["action_mask_width"]),
            is_atari=bool(data["is_atari"]),
        )


# ----------------------------------------------------------------------------------------------
# Vector env


@dataclass
class VectorStep:
    """Result of one :meth:`VectorEnv.step` for all ``n`` envs.

    Attributes:
        observations: next observations, already reset on rows whose episode ended (same-step
            autoreset): ``(n, *shape)`` array for a plain space, ``{key: (n, *shape)}`` for a dict
            space (shapes and dtypes as in ``EnvSpec.observation_layout``).
        training_rewards: ``(n,)`` float32; rewards for training, clipped to [-1, 1] when clipping is on.
        terminated: ``(n,)`` bool; the episode reached a terminal state (no bootstrap).
        truncated: ``(n,)`` bool; the episode was cut by a time limit (bootstrap from the final observation).
        final_observations: same structure as ``observations``; on rows where ``terminated |
            truncated`` the TRUE last observation of the finished episode. Other rows hold the same
            values as ``observations`` (arrays may then be the very same objects: read, do not write).
        episode_returns: raw (unclipped) game score of each episode that ended this step.
        episode_lengths: length in agent steps of each episode that ended this step.
        episode_env_ids: env index (row) of each episode that ended this step, same order.
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


class _Backend(Protocol):
    """What a backend provides; the adapter adds checks, reward clipping and episode bookkeeping."""

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
        self._masks: np.ndarray | None = None
        self._needs_reset = True
        self._closed = False
        self._in_flight: np.ndarray | None = None  # actions sent by step_async, not yet waited for
        self._sent = False  # the backend is stepping them in its own threads (send/recv)
        self.asynchronous = callable(getattr(backend, "send", None)) and callable(getattr(backend, "recv", None))
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
        actions of another env group: issue 11, overlapped actors).

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
            observations, raw_rewards, terminated, truncated, final_observations, masks = self._backend.recv()  # type: ignore[attr-defined]
        else:
            observations, raw_rewards, terminated, truncated, final_observations, masks = self._backend.step(actions)
        self._masks = masks

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
            if not (np.issubdtype(actions.dtype, np.floating) or np.issubdtype(actions.dtype, np.integer)):
                raise ValueError(f"actions: expected a real (float32) dtype, received {actions.dtype}")
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
        if not np.issubdtype(actions.dtype, np.integer):
            raise ValueError(f"actions: expected an integer dtype ({spec.action_dtype}), received {actions.dtype}")
        if kind == "discrete":
            high = np.full(expected_shape, spec.num_actions)
            description = f"[0, {spec.num_actions})"
        elif kind == "multi_discrete":
            high = np.broadcast_to(spec.action_space.nvec.astype(np.int64), expected_shape)
            description = f"[0, nvec) with nvec {spec.action_space.nvec.tolist()}"
        else:
            high = np.full(expected_shape, 2)
            description = "{0, 1}"
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
            offsets = np.concatenate([[0], np.cumsum(self.spec.action_mask_segments)[:-1]]).astype(np.int64)
            allowed = masks[rows[:, None], offsets[None, :] + actions.astype(np.int64)].all(axis=1)
        if not allowed.all():
            row = int(np.flatnonzero(~allowed)[0])
            raise ValueError(
                f"actions: env {row} of {self.spec.env_id!r} received action {actions[row].tolist()}, which its "
                f"action mask forbids (mask {masks[row].astype(np.int8).tolist()}); masked actions are never taken"
            )

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
        self.spec = EnvSpec.discrete(
            env_id,
            tuple(self._env.single_observation_space.shape),
            self._env.single_observation_space.dtype,
            int(self._env.single_action_space.n),
            is_atari=True,
        )
        self._in_order = np.arange(num_envs)

    def reset(self, seed: int | None) -> tuple[np.ndarray, None]:
        observations, info = self._env.reset(seed=seed)
        return self._ordered(observations, info), None

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, None]:
        self.send(actions)
        return self.recv()

    def send(self, actions: np.ndarray) -> None:
        """Start stepping (ale-py's own threads step the emulators; returns at once)."""
        self._env.send(actions)

    def recv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, None]:
        """Wait for the step started by :meth:`send`."""
        observations, rewards, terminated, truncated, info = self._env.recv()
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
        return observations, rewards.astype(np.float64), terminated, truncated, final_observations, None

    def _ordered(self, observations: np.ndarray, info: dict[str, Any]) -> np.ndarray:
        if np.array_equal(info["env_id"], self._in_order):
            return observations
        return observations[np.argsort(info["env_id"])]

    def close(self) -> None:
        self._env.close()


# ----------------------------------------------------------------------------------------------
# Any other Gymnasium id: spaces


@dataclass(frozen=True)
class _ObservationLeaf:
    """One observation key: where it sits in the env's observation, and how it is converted."""

    key: str  # flattened key, "" for a plain space
    path: tuple[Any, ...]  # keys into the (nested) dict observation; () for a plain space
    kind: str  # "box" | "one_hot" | "multi_one_hot" | "binary"
    space: Any
    shape: tuple[int, ...]
    dtype: np.dtype


_SUPPORTED_OBSERVATIONS = "Box, Discrete, MultiDiscrete, MultiBinary, or a Dict of these"
_SUPPORTED_ACTIONS = "Discrete, MultiDiscrete (1-D nvec), MultiBinary (1-D) or Box (1-D, float)"


def _observation_leaves(env_id: str, space: Any) -> list[_ObservationLeaf]:
    """The observation keys of ``space``, sorted; raises UnsupportedEnvironmentError naming the space."""
    import gymnasium

    spaces = gymnasium.spaces
    leaves: list[_ObservationLeaf] = []

    def visit(path: tuple[Any, ...], sub: Any) -> None:
        key = ".".join(str(part) for part in path)
        where = f" at key {key!r}" if path else ""
        if isinstance(sub, spaces.Dict):
            if not sub.spaces:
                raise UnsupportedEnvironmentError(
                    f"env_id: {env_id!r} has an empty Dict observation space{where} ({space})"
                )
            for name, child in sub.spaces.items():
                if str(name) == "" or "." in str(name):
                    raise UnsupportedEnvironmentError(
                        f"env_id: {env_id!r} has a Dict observation key {name!r}{where}: expected non-empty keys "
                        f"without '.' (nested keys are joined with '.'), received {space}"
                    )
                visit((*path, name), child)
            return
        if isinstance(sub, spaces.Box):
            dtype = np.dtype(sub.dtype)
            if dtype == np.float64:
                dtype = np.dtype(np.float32)  # see module docstring
            leaves.append(_ObservationLeaf(key, path, "box", sub, tuple(sub.shape), dtype))
        elif isinstance(sub, spaces.Discrete):
            leaves.append(_ObservationLeaf(key, path, "one_hot", sub, (int(sub.n),), np.dtype(np.float32)))
        elif isinstance(sub, spaces.MultiDiscrete):
            width = int(np.sum(sub.nvec))
            leaves.append(_ObservationLeaf(key, path, "multi_one_hot", sub, (width,), np.dtype(np.float32)))
        elif isinstance(sub, spaces.MultiBinary):
            leaves.append(_ObservationLeaf(key, path, "binary", sub, tuple(sub.shape), np.dtype(np.float32)))
        else:
            raise UnsupportedEnvironmentError(
                f"env_id: expected an observation space of {_SUPPORTED_OBSERVATIONS}, received {env_id!r} "
                f"with {type(sub).__name__} observations{where}: {space}"
            )

    visit((), space)
    return sorted(leaves, key=lambda leaf: leaf.key)


def _converted_space(leaf: _ObservationLeaf) -> Any:
    """The Box space of one converted observation key (what SyncVectorEnv batches)."""
    import gymnasium

    if leaf.kind == "box":
        space = leaf.space
        if np.dtype(space.dtype) == leaf.dtype:
            return space
        with np.errstate(over="ignore"):  # float64 bounds beyond float32 become +-inf
            low, high = space.low.astype(leaf.dtype), space.high.astype(leaf.dtype)
        return gymnasium.spaces.Box(low, high, leaf.shape, leaf.dtype)
    return gymnasium.spaces.Box(0.0, 1.0, leaf.shape, np.float32)


def _converter(leaf: _ObservationLeaf) -> Callable[[Any], np.ndarray]:
    """Function from the env's raw value of this key to the converted array (shape, dtype of the leaf)."""
    if leaf.kind == "box":
        dtype = leaf.dtype
        return lambda value: np.asarray(value, dtype=dtype)
    if leaf.kind == "one_hot":
        n, start = int(leaf.space.n), int(leaf.space.start)

        def one_hot(value: Any) -> np.ndarray:
            out = np.zeros(n, dtype=np.float32)
            out[int(value) - start] = 1.0
            return out

        return one_hot
    if leaf.kind == "multi_one_hot":
        nvec = np.asarray(leaf.space.nvec, dtype=np.int64).ravel()
        start = np.broadcast_to(np.asarray(leaf.space.start, dtype=np.int64), leaf.space.nvec.shape).ravel()
        offsets = np.concatenate([[0], np.cumsum(nvec)[:-1]])
        width = int(nvec.sum())

        def multi_one_hot(value: Any) -> np.ndarray:
            out = np.zeros(width, dtype=np.float32)
            out[offsets + np.asarray(value, dtype=np.int64).ravel() - start] = 1.0
            return out

        return multi_one_hot
    return lambda value: np.asarray(value, dtype=np.float32)


def _normalised_action_space(env_id: str, space: Any) -> Any:
    """The spec's action space for the env's ``space`` (start 0, float32 Box); refuses the rest."""
    import gymnasium

    spaces = gymnasium.spaces
    if isinstance(space, spaces.Discrete):
        return spaces.Discrete(int(space.n))
    if isinstance(space, spaces.MultiDiscrete) and space.nvec.ndim == 1:
        return spaces.MultiDiscrete(space.nvec.astype(np.int64))
    if isinstance(space, spaces.MultiBinary) and len(space.shape) == 1:
        return spaces.MultiBinary(int(space.shape[0]))
    if isinstance(space, spaces.Box) and len(space.shape) == 1 and np.issubdtype(space.dtype, np.floating):
        with np.errstate(over="ignore"):
            low, high = space.low.astype(np.float32), space.high.astype(np.float32)
        return spaces.Box(low, high, space.shape, np.float32)
    raise UnsupportedEnvironmentError(
        f"env_id: expected an action space of {_SUPPORTED_ACTIONS}, received {env_id!r} with "
        f"{type(space).__name__} actions: {space}"
    )


def _mask_segments(action_space: Any) -> tuple[int, ...]:
    """Mask segment widths of a normalised action space (see ``EnvSpec.action_mask_segments``)."""
    return EnvSpec("", {PLAIN_KEY: ((), np.dtype(np.float32))}, action_space).action_mask_segments


def _checked_mask(raw: Any, *, env_id: str, index: int, segments: tuple[int, ...]) -> np.ndarray:
    """``raw`` as a ``(sum(segments),)`` bool mask; raises InvalidActionMaskError unless every segment allows one."""
    width = sum(segments)
    mask = np.asarray(raw)
    problem = ""
    if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.integer):
        problem = f"expected a bool or integer 0/1 array, received dtype {mask.dtype}"
    elif mask.shape != (width,):
        problem = f"expected shape ({width},), received shape {mask.shape}"
    elif mask.dtype != np.bool_ and not np.isin(mask, (0, 1)).all():
        problem = "expected only 0 and 1 values"
    else:
        mask = mask.astype(bool, copy=False)
        offsets = np.cumsum((0, *segments))
        empty = [j for j in range(len(segments)) if not mask[offsets[j] : offsets[j + 1]].any()]
        if empty:
            which = "" if len(segments) == 1 else f" in sub-action(s) {empty}"
            problem = f"expected at least one valid action per sub-action, received none{which}"
    if problem:
        raise InvalidActionMaskError(
            f"action mask of env {index} of {env_id!r}: {problem} (mask segments {list(segments)}); "
            f"received {np.asarray(raw).tolist()!r}"
        )
    return mask


def _read_mask(env: Any, info: Any, *, env_id: str, index: int, segments: tuple[int, ...]) -> np.ndarray:
    """The mask of the env's current observation: ``info["action_mask"]``, else ``env.action_masks()``."""
    raw = info.get("action_mask") if isinstance(info, dict) else None
    if raw is None and env.has_wrapper_attr("action_masks"):
        raw = env.get_wrapper_attr("action_masks")()
    if raw is None:
        raise InvalidActionMaskError(
            f"action mask of env {index} of {env_id!r}: expected info['action_mask'] or an action_masks() "
            f"method (the env gave masks before), received neither"
        )
    return _checked_mask(raw, env_id=env_id, index=index, segments=segments)


def _gymnasium_spec(env_id: str, env: Any) -> EnvSpec:
    """Spec of one (unwrapped-by-us) Gymnasium env; resets it once to detect action masks."""
    import gymnasium

    leaves = _observation_leaves(env_id, env.observation_space)
    action_space = _normalised_action_space(env_id, env.action_space)
    mask_width = 0
    if not isinstance(action_space, gymnasium.spaces.Box):  # masks: discrete-like actions only
        _, info = env.reset(seed=0)
        has_info_mask = isinstance(info, dict) and info.get("action_mask") is not None
        if has_info_mask or env.has_wrapper_attr("action_masks"):
            segments = _mask_segments(action_space)
            _read_mask(env, info, env_id=env_id, index=0, segments=segments)
            mask_width = sum(segments)
    return EnvSpec(
        env_id=env_id,
        observation_layout={leaf.key: (leaf.shape, leaf.dtype) for leaf in leaves},
        action_space=action_space,
        action_mask_width=mask_width,
        is_atari=False,
    )


# ----------------------------------------------------------------------------------------------
# Any other Gymnasium id: backend


def _adapter_class() -> type:
    """The per-env wrapper class (defined lazily: gymnasium is imported lazily)."""
    import gymnasium

    class SpaceAdapter(gymnasium.Wrapper):
        """Converts observations to the spec's layout; puts the checked bool mask in ``info["action_mask"]``.

        Sits on each env inside SyncVectorEnv, so in SAME_STEP autoreset the vector info of a row
        that ended carries the reset's info, i.e. the new episode's first mask (the finished
        episode's last step info, with its mask, is under ``info["final_info"]``).
        """

        def __init__(self, env: Any, spec: EnvSpec, index: int) -> None:
            super().__init__(env)
            leaves = _observation_leaves(spec.env_id, env.observation_space)
            layout = {leaf.key: (leaf.shape, leaf.dtype) for leaf in leaves}
            if layout != spec.observation_layout:
                raise UnsupportedEnvironmentError(
                    f"env_id: env {index} of {spec.env_id!r} has observation layout {layout}, expected the spec's "
                    f"{spec.observation_layout} (every copy of an env must have the same spaces)"
                )
            self._spec = spec
            self._index = index
            self._plain = not spec.is_dict_observation
            self._converters = [(leaf.key, leaf.path, _converter(leaf)) for leaf in leaves]
            if self._plain:
                self.observation_space = _converted_space(leaves[0])
            else:
                self.observation_space = gymnasium.spaces.Dict({leaf.key: _converted_space(leaf) for leaf in leaves})
            self._segments = spec.action_mask_segments if spec.has_action_masks else ()

        def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
            observation, info = self.env.reset(seed=seed, options=options)
            return self._convert(observation), self._with_mask(info)

        def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
            observation, reward, terminated, truncated, info = self.env.step(action)
            return self._convert(observation), reward, terminated, truncated, self._with_mask(info)

        def _convert(self, observation: Any) -> Any:
            if self._plain:
                return self._converters[0][2](observation)
            out = {}
            for key, path, convert in self._converters:
                value = observation
                for part in path:
                    value = value[part]
                out[key] = convert(value)
            return out

        def _with_mask(self, info: dict[str, Any]) -> dict[str, Any]:
            if not self._segments:
                return info
            mask = _read_mask(self.env, info, env_id=self._spec.env_id, index=self._index, segments=self._segments)
            return {**info, "action_mask": mask}

    return SpaceAdapter


class _GymnasiumBackend:
    """``gymnasium.vector.SyncVectorEnv`` of adapted envs with same-step autoreset."""

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        *,
        max_episode_steps: int | None,
        settings_file: str | None,
        seed: int | None,
    ) -> None:
        import gymnasium
        from gymnasium.vector import AutoresetMode, SyncVectorEnv

        self.spec = env_spec(env_id, settings_file=settings_file)
        adapter = _adapter_class()

        def maker(index: int) -> Callable[[], Any]:
            def make_one() -> Any:
                env_seed = None if seed is None else seed + index
                env = _make_gymnasium_env(env_id, max_episode_steps, settings_file=settings_file, seed=env_seed)
                return adapter(env, self.spec, index)

            return make_one

        self.num_envs = num_envs
        self._env = SyncVectorEnv([maker(i) for i in range(num_envs)], autoreset_mode=AutoresetMode.SAME_STEP)
        raw_space = self._env.single_action_space
        self._raw_action_dtype = np.dtype(raw_space.dtype) if raw_space.dtype is not None else np.dtype(np.int64)
        self._action_offset: Any = 0
        self._action_low = self._action_high = None
        if isinstance(raw_space, (gymnasium.spaces.Discrete, gymnasium.spaces.MultiDiscrete)):
            self._action_offset = np.asarray(raw_space.start, dtype=np.int64)
        elif isinstance(raw_space, gymnasium.spaces.Box):
            self._action_low, self._action_high = raw_space.low, raw_space.high

    def reset(self, seed: int | None) -> tuple[Observations, np.ndarray | None]:
        observations, info = self._env.reset(seed=seed)  # env i gets seed + i
        return observations, self._masks(info)

    def step(
        self, actions: np.ndarray
    ) -> tuple[Observations, np.ndarray, np.ndarray, np.ndarray, Observations, np.ndarray | None]:
        observations, rewards, terminated, truncated, info = self._env.step(self._env_actions(actions))
        final_observations = observations
        if "_final_obs" in info and info["_final_obs"].any():
            # SAME_STEP mode: info["final_obs"] is an object array, filled where info["_final_obs"].
            rows = np.flatnonzero(info["_final_obs"])
            if isinstance(observations, dict):
                final_observations = {key: value.copy() for key, value in observations.items()}
                for row in rows:
                    for key, value in info["final_obs"][row].items():
                        final_observations[key][row] = value
            else:
                final_observations = observations.copy()
                for row in rows:
                    final_observations[row] = info["final_obs"][row]
        return (
            observations,
            np.asarray(rewards, dtype=np.float64),
            np.asarray(terminated, dtype=bool),
            np.asarray(truncated, dtype=bool),
            final_observations,
            self._masks(info),
        )

    def _env_actions(self, actions: np.ndarray) -> np.ndarray:
        """Checked spec actions -> the env's own actions (start added back, Box clipped to the bounds)."""
        if self._action_low is not None:
            return np.clip(actions, self._action_low, self._action_high).astype(self._raw_action_dtype)
        return (actions + self._action_offset).astype(self._raw_action_dtype, copy=False)

    def _masks(self, info: dict[str, Any]) -> np.ndarray | None:
        if not self.spec.has_action_masks:
            return None
        return np.asarray(info["action_mask"], dtype=bool)  # (n, width), checked per env by the adapter

    def close(self) -> None:
        self._env.close()


def _import_env_module(env_id: str) -> None:
    """Import the module of a ``module:EnvId`` id (it registers EnvId), as gymnasium.make would.

    Like ``python -m``, the working directory is searched too (appended to ``sys.path``), so
    ``tests.spaces_envs:...`` or ``my_envs:...`` resolve from the directory a command runs in.
    """
    module = env_id.split(":", 1)[0]
    try:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            cwd = os.getcwd()
            top = module.split(".")[0]
            if error.name not in (top, module) or cwd in sys.path or "" in sys.path:
                raise
            sys.path.append(cwd)
            importlib.import_module(module)
    except Exception as error:  # any failure of a user's module: one clear message
        raise UnsupportedEnvironmentError(
            f"env_id: expected 'module:EnvId' with an importable module that registers EnvId, received "
            f"{env_id!r}: importing {module!r} failed with {type(error).__name__}: {error}"
        ) from error


def _make_emulator_env(env_id: str, max_episode_steps: int | None, settings_file: str | None, seed: int | None) -> Any:
    try:
        emulators = importlib.import_module("oakemu_core.envs.emulators")
    except ImportError as error:
        raise UnsupportedEnvironmentError(
            f"env_id: {env_id!r} needs emulator support, which is not installed ({type(error).__name__}: {error})"
        ) from None
    make_emulator_env = getattr(emulators, "make_emulator_env", None)
    if make_emulator_env is None:
        raise UnsupportedEnvironmentError(
            f"env_id: {env_id!r} needs emulator support, which is not installed "
            "(oakemu_core.envs.emulators has no make_emulator_env)"
        )
    env = make_emulator_env(env_id, max_episode_steps=max_episode_steps, settings_file=settings_file, seed=seed)
    if env is None:
        raise UnsupportedEnvironmentError(
            f"env_id: expected a known emulator id ({', '.join(p + '...' for p in EMULATOR_ID_PREFIXES)}), "
            f"received {env_id!r}"
        )
    return env


def _make_gymnasium_env(
    env_id: str, max_episode_steps: int | None, *, settings_file: str | None = None, seed: int | None = None
) -> Any:
    """One raw env: emulator ids through ``oakemu_core.envs.emulators``, everything else through ``gymnasium.make``.

    ``settings_file`` and ``seed`` are passed to emulator backends only (Gymnasium envs are seeded
    by their first reset).
    """
    if env_id.startswith(EMULATOR_ID_PREFIXES):
        return _make_emulator_env(env_id, max_episode_steps, settings_file, seed)
    import gymnasium

    if ":" in env_id:
        _import_env_module(env_id)
    kwargs = {} if max_episode_steps is None else {"max_episode_steps": max_episode_steps}
    try:
        return gymnasium.make(env_id, **kwargs)
    except (gymnasium.error.Error, ImportError) as error:
        raise UnsupportedEnvironmentError(
            f"env_id: expected a registered Gymnasium id (e.g. 'CartPole-v1', or 'module:EnvId' for a custom env), "
            f"received {env_id!r} ({type(error).__name__}: {error})"
        ) from None


# ----------------------------------------------------------------------------------------------
# Public factory


@functools.lru_cache(maxsize=32)
def env_spec(env_id: str, *, settings_file: str | None = None) -> EnvSpec:
    """Spaces of ``env_id`` as the vector env will report them (builds one env, resets it once, closes it).

    Cached per ``(env_id, settings_file)``; cheap to call early (the CLI does, before any process starts).

    Raises:
        UnsupportedEnvironmentError: unknown id, a module that cannot be imported, unsupported spaces
            (the message names the space), or emulator support not installed.
        InvalidActionMaskError: the env's first action mask is malformed or allows nothing.
    """
    if is_atari_env(env_id):
        backend = _AtariBackend(env_id, 1, max_episode_steps=None, num_threads=1)
        backend.close()
        return backend.spec
    env = _make_gymnasium_env(env_id, None, settings_file=settings_file)
    try:
        return _gymnasium_spec(env_id, env)
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
    settings_file: str | None = None,
) -> VectorEnv:
    """Build ``num_envs`` copies of ``env_id`` behind one :class:`VectorEnv`.

    Args:
        env_id: Atari id (``ALE/Breakout-v5``, ``BreakoutNoFrameskip-v4``), emulator id
            (``gameboy:...``, ``retro:...``), any Gymnasium id, or ``module:EnvId`` for a custom env.
        num_envs: envs stepped together (>= 1).
        seed: seed of the first reset; env ``i`` is seeded with ``seed + i``. None: unseeded.
        clip_rewards: clip ``training_rewards`` to [-1, 1]; None means on for Atari ids, off otherwise.
        max_episode_steps: time limit in agent steps (truncation) replacing the id's own; None keeps it.
        num_threads: emulator threads (Atari only; default ``min(num_envs, cpu_count)``).
        settings_file: emulator settings file, passed to ``make_emulator_env`` (emulator ids only).

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
        backend = _GymnasiumBackend(
            env_id, num_envs, max_episode_steps=max_episode_steps, settings_file=settings_file, seed=seed
        )
    return VectorEnv(backend, seed=seed, clip_rewards=atari if clip_rewards is None else clip_rewards)


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


def make_env_groups(env_id: str, num_envs: int, groups: int, *, seed: int | None, **kwargs: Any) -> EnvGroups:
    """``num_envs`` envs in ``groups`` vector envs (sizes differ by at most one); keyword arguments
    as :func:`make_vector_env`.

    Raises:
        ValueError: ``groups`` < 1 or more groups than envs.
    """
    if groups < 1 or groups > num_envs:
        raise ValueError(f"env_groups: expected 1 <= groups <= num_envs {num_envs}, received {groups}")
    sizes = [num_envs // groups + (1 if g < num_envs % groups else 0) for g in range(groups)]
    made, first = [], 0
    for size in sizes:
        made.append(make_vector_env(env_id, size, seed=None if seed is None else seed + first, **kwargs))
        first += size
    return EnvGroups(made)


def make_eval_env(
    env_id: str, *, seed: int | None, max_episode_steps: int | None = None, settings_file: str | None = None
) -> VectorEnv:
    """One env of ``env_id`` without reward clipping, for evaluation (same preprocessing as training)."""
    return make_vector_env(
        env_id,
        1,
        seed=seed,
        clip_rewards=False,
        max_episode_steps=max_episode_steps,
        num_threads=1,
        settings_file=settings_file,
    )


def check_env(env_id: str, *, settings_file: str | None = None, envs_per_process: int | None = None) -> EnvSpec:
    """Everything that can be checked about an env before any process starts; returns its spec.

    Emulator ids (``gameboy:`` / ``retro:``) are validated by their backend first (ROM, settings
    file, reward spec, emulators per process), then the spec is built (spaces supported?).

    Raises:
        UnsupportedEnvironmentError: unknown id or unsupported spaces.
        oakemu_core.envs.emulators.EmulatorConfigError: a bad emulator setting (a ``ValueError``).
    """
    if env_id.startswith(EMULATOR_ID_PREFIXES):
        from oakemu_core.envs.emulators import validate_emulator_env

        validate_emulator_env(env_id, settings_file, envs_per_process=envs_per_process)
    return env_spec(env_id, settings_file=settings_file)

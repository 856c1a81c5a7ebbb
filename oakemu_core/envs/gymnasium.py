"""Gymnasium envs (any non-Atari id, emulator ids included): space conversion, action masks and
the ``gymnasium.vector.SyncVectorEnv`` backend.

Spaces (checked by :func:`gymnasium_spec` before any process starts; anything else raises
:class:`~oakemu_core.envs.spec.UnsupportedEnvironmentError` naming the env id and the space):

* Observations are a plain space (one key, the empty string ``""``) or a ``spaces.Dict`` (nested
  dicts flattened by key path joined with ``"."``, e.g. ``"agent.position"``; keys sorted). Each
  leaf keeps its own shape and dtype, with these conversions: ``Box`` float64 -> float32 (the
  networks' dtype; halves the bytes on the wire), other ``Box`` dtypes kept (uint8 frames stay
  uint8); ``Discrete(n)`` -> one-hot float32 ``(n,)``; ``MultiDiscrete(nvec)`` -> the one-hot
  vectors of its entries concatenated, float32 ``(sum(nvec),)``; ``MultiBinary`` -> float32 0/1
  of the same shape (float32 rather than int8 so that every non-image key reaches the model as
  float32). ``Tuple``, ``Text``, ``Graph``, ``Sequence``, ``OneOf`` are refused.
* Actions: ``Discrete`` and ``MultiDiscrete`` (1-D ``nvec``) normalised to start 0 (the backend
  adds the env's ``start`` back when stepping), ``MultiBinary`` (1-D), ``Box`` (1-D, float; the
  spec's space is float32; actions are clipped to the bounds at the env boundary only).
* Action masks (Gymnasium's ``info["action_mask"]``, e.g. Taxi, or sb3-contrib's ``action_masks()``
  method on the env) for Discrete, MultiDiscrete and MultiBinary actions; see
  :class:`~oakemu_core.envs.spec.EnvSpec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from oakemu_core.envs.spec import (
    PLAIN_KEY,
    EnvSpec,
    InvalidActionMaskError,
    Observations,
    UnsupportedEnvironmentError,
)

__all__ = ["GymnasiumBackend", "gymnasium_spec"]


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
                dtype = np.dtype(np.float32)  # the networks' dtype (module docstring)
            leaves.append(_ObservationLeaf(key, path, "box", sub, tuple(sub.shape), dtype))
        elif isinstance(sub, spaces.Discrete):
            leaves.append(
                _ObservationLeaf(key, path, "one_hot", sub, (int(sub.n),), np.dtype(np.float32))
            )
        elif isinstance(sub, spaces.MultiDiscrete):
            width = int(np.sum(sub.nvec))
            leaves.append(
                _ObservationLeaf(key, path, "multi_one_hot", sub, (width,), np.dtype(np.float32))
            )
        elif isinstance(sub, spaces.MultiBinary):
            leaves.append(
                _ObservationLeaf(key, path, "binary", sub, tuple(sub.shape), np.dtype(np.float32))
            )
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
        start = np.broadcast_to(
            np.asarray(leaf.space.start, dtype=np.int64), leaf.space.nvec.shape
        ).ravel()
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
    if (
        isinstance(space, spaces.Box)
        and len(space.shape) == 1
        and np.issubdtype(space.dtype, np.floating)
    ):
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


def _read_mask(
    env: Any, info: Any, *, env_id: str, index: int, segments: tuple[int, ...]
) -> np.ndarray:
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


def gymnasium_spec(env_id: str, env: Any) -> EnvSpec:
    """Spec of one raw Gymnasium env (not yet adapted); resets it once (seed 0) to detect action masks.

    Raises:
        UnsupportedEnvironmentError: an unsupported observation or action space (named in the message).
        InvalidActionMaskError: the env's first action mask is malformed or allows nothing.
    """
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
                self.observation_space = gymnasium.spaces.Dict(
                    {leaf.key: _converted_space(leaf) for leaf in leaves}
                )
            self._segments = spec.action_mask_segments if spec.has_action_masks else ()

        def reset(
            self, *, seed: int | None = None, options: dict[str, Any] | None = None
        ) -> tuple[Any, dict]:
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
            mask = _read_mask(
                self.env, info, env_id=self._spec.env_id, index=self._index, segments=self._segments
            )
            return {**info, "action_mask": mask}

    return SpaceAdapter


class GymnasiumBackend:
    """``gymnasium.vector.SyncVectorEnv`` of adapted envs with same-step autoreset.

    Args:
        spec: the env's spec (:func:`gymnasium_spec` of one copy); every copy must match it.
        make_env: ``make_env(index)`` builds the raw ``gymnasium.Env`` of copy ``index``.
        num_envs: copies stepped together (>= 1).

    Raises:
        UnsupportedEnvironmentError: a copy's observation layout differs from ``spec``.
    """

    def __init__(self, spec: EnvSpec, make_env: Callable[[int], Any], num_envs: int) -> None:
        import gymnasium
        from gymnasium.vector import AutoresetMode, SyncVectorEnv

        self.spec = spec
        adapter = _adapter_class()

        def maker(index: int) -> Callable[[], Any]:
            return lambda: adapter(make_env(index), spec, index)

        self.num_envs = num_envs
        self._env = SyncVectorEnv(
            [maker(i) for i in range(num_envs)], autoreset_mode=AutoresetMode.SAME_STEP
        )
        raw_space = self._env.single_action_space
        self._raw_action_dtype = (
            np.dtype(raw_space.dtype) if raw_space.dtype is not None else np.dtype(np.int64)
        )
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
        observations, rewards, terminated, truncated, info = self._env.step(
            self._env_actions(actions)
        )
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
            return np.clip(actions, self._action_low, self._action_high).astype(
                self._raw_action_dtype
            )
        return (actions + self._action_offset).astype(self._raw_action_dtype, copy=False)

    def _masks(self, info: dict[str, Any]) -> np.ndarray | None:
        if not self.spec.has_action_masks:
            return None
        return np.asarray(
            info["action_mask"], dtype=bool
        )  # (n, width), checked per env by the adapter

    def close(self) -> None:
        self._env.close()

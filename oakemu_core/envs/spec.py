"""What an environment looks like to the rest of the system: :class:`EnvSpec`, the env errors and
the env-id rules that pick a backend.

An env id is one of:

* an Atari id served by ale-py (:func:`is_atari_env`: ``ALE/...`` or ``...NoFrameskip...``);
* an emulator id (``gameboy:...``, ``retro:...``; :data:`EMULATOR_ID_PREFIXES`);
* any other Gymnasium id, including Gymnasium's ``module:EnvId`` form for custom envs
  (``my_pkg.envs:MyEnv-v0``: the module is imported first, it registers its ids).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from oakemu_core.errors import UserError

__all__ = [
    "EMULATOR_ID_PREFIXES",
    "PLAIN_KEY",
    "EnvSpec",
    "InvalidActionMaskError",
    "Observations",
    "UnsupportedEnvironmentError",
    "is_atari_env",
    "is_emulator_env",
]

EMULATOR_ID_PREFIXES = ("gameboy:", "retro:")
PLAIN_KEY = ""  # the observation_layout key of a plain (non-dict) observation space

#: A batch of observations: ``(n, *shape)`` for a plain space, ``{key: (n, *shape)}`` for a dict space.
Observations = np.ndarray | dict[str, np.ndarray]


def is_atari_env(env_id: str) -> bool:
    """Return True for Atari ids served by ale-py: ``ALE/...`` or ``...NoFrameskip...`` ids."""
    return env_id.startswith("ALE/") or "NoFrameskip" in env_id


def is_emulator_env(env_id: str) -> bool:
    """Return True for ids served by :mod:`oakemu_core.envs.emulators` (``gameboy:...``, ``retro:...``)."""
    return env_id.startswith(EMULATOR_ID_PREFIXES)


class UnsupportedEnvironmentError(UserError, ValueError):
    """The env id is unknown, cannot be imported or built, or its spaces are not supported.

    The message names the env id, what is expected and what was received (e.g. the space).
    """


class InvalidActionMaskError(UserError, ValueError):
    """An env produced an action mask of the wrong width or dtype, or one that allows no action.

    The message names the env id, the env index in its vector env and the received mask.
    """


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
            raise ValueError(
                f"EnvSpec({self.env_id!r}): the plain key '' cannot be mixed with dict keys"
            )
        object.__setattr__(self, "observation_layout", layout)
        object.__setattr__(self, "action_mask_width", int(self.action_mask_width))

    def __hash__(self) -> int:  # observation_layout is a dict and spaces are unhashable
        return hash(
            (
                self.env_id,
                tuple(self.observation_layout.items()),
                repr(self.action_space),
                self.action_mask_width,
                self.is_atari,
            )
        )

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

    @functools.cached_property  # read on every step (the action check)
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

    @functools.cached_property  # read on every step (the action check)
    def action_shape(self) -> tuple[int, ...]:
        """Shape of ONE action: ``()`` Discrete, ``(k,)`` MultiDiscrete / MultiBinary, ``(d,)`` Box."""
        return tuple(int(d) for d in self.action_space.shape)

    @functools.cached_property  # read on every step (the action check)
    def action_dtype(self) -> np.dtype:
        """int64 (Discrete, MultiDiscrete), int8 (MultiBinary) or float32 (Box)."""
        return np.dtype(
            {
                "discrete": np.int64,
                "multi_discrete": np.int64,
                "multi_binary": np.int8,
                "box": np.float32,
            }[self.action_kind]
        )

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
                key: {"shape": list(shape), "dtype": dtype.str}
                for key, (shape, dtype) in self.observation_layout.items()
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
            space = spaces.Box(
                low, np.asarray(action["high"], dtype=np.float32), low.shape, np.float32
            )
        else:
            raise ValueError(
                f"action_space.kind: expected discrete, multi_discrete, multi_binary or box, received {kind!r}"
            )
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

"""How an env is made beyond its id: :class:`EnvOptions` (Gymnasium ``make`` keyword arguments, the Atari
preprocessing users toggle).

One value travels from the settings (``env_kwargs``, ``atari_*``) to every place that makes the env: the
learner's spec, the actors (in the join's ``env_config``, as scalars), the tester, ``oakemu evaluate``
(from a checkpoint's settings). The defaults are CleanRL ``ppo_atari.py``'s preprocessing (life-loss episodes
included) with the registered id's sticky actions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from pydantic import BaseModel, Field

from oakemu_core.errors import ConfigError

__all__ = ["ATARI_FRAME_SKIP", "ATARI_NOOP_MAX", "ATARI_STACK", "EnvOptions", "EnvSettings"]

ATARI_FRAME_SKIP = 4
"""Emulator frames per agent step (the last two max-pooled)."""
ATARI_STACK = 4
"""Frames stacked into one observation."""
ATARI_NOOP_MAX = 30
"""Most no-op actions at an episode's start."""


@dataclass(frozen=True)
class EnvOptions:
    """Everything but the id that decides how an env is made (hashable: a cache key).

    Attributes:
        env_kwargs: keyword arguments of ``gymnasium.make`` (non-Atari ids), as canonical JSON text (an
            object, keys sorted); :attr:`make_kwargs` is the dict.
        atari_frame_skip: emulator frames per agent step, the last two max-pooled (Atari ids).
        atari_frame_stack: frames stacked into one observation (Atari ids).
        atari_noop_max: most no-op actions at an episode's start (Atari ids).
        atari_sticky_actions: probability of repeating the previous action (Atari ids); None: the
            registered id's own (0.25 for ``-v5``, 0 for ``NoFrameskip-v4``).
        atari_episodic_life: a lost life ends the learner's episode while the game goes on (Atari ids;
            SB3's ``EpisodicLifeEnv`` and ``FireResetEnv`` as in rl-baselines3-zoo and CleanRL
            ``ppo_atari.py``): ``terminated`` is True on a lost life (no bootstrap across it), the game is
            not restarted, the next step plays FIRE where the game has it, and the logged episodic
            return and length are the whole game's. Not ale-py's ``episodic_life``, which restarts the game.
    """

    env_kwargs: str = "{}"
    atari_frame_skip: int = ATARI_FRAME_SKIP
    atari_frame_stack: int = ATARI_STACK
    atari_noop_max: int = ATARI_NOOP_MAX
    atari_sticky_actions: float | None = None
    atari_episodic_life: bool = True

    @property
    def make_kwargs(self) -> dict[str, Any]:
        """:attr:`env_kwargs` as a dict."""
        return dict(json.loads(self.env_kwargs))

    @classmethod
    def from_settings(cls, settings: Any) -> EnvOptions:
        """The options of a settings object (an ``OakEmuConfig``) or mapping (a join's ``env_config``, a
        checkpoint's ``config``); a setting it lacks takes its default, ``env_kwargs`` may be a dict or
        JSON text.

        Raises:
            ConfigError: ``env_kwargs`` is not a JSON object (a ValueError too).
        """

        def read(name: str, default: Any) -> Any:
            value = (
                settings.get(name, default)
                if isinstance(settings, Mapping)
                else getattr(settings, name, default)
            )
            return default if value is None and name != "atari_sticky_actions" else value

        kwargs = read("env_kwargs", {})
        if isinstance(kwargs, str):
            try:
                kwargs = json.loads(kwargs)
            except json.JSONDecodeError as error:
                raise ConfigError(
                    f"env_kwargs: expected a JSON object of keyword arguments, received {kwargs!r} "
                    f"({error.msg})"
                ) from None
        if not isinstance(kwargs, Mapping):
            raise ConfigError(
                f"env_kwargs: expected a JSON object of keyword arguments, received {kwargs!r}"
            )
        values = {f.name: read(f.name, f.default) for f in fields(cls) if f.name != "env_kwargs"}
        return cls(env_kwargs=json.dumps(dict(kwargs), sort_keys=True), **values)

    def to_dict(self) -> dict[str, Any]:
        """The options as scalars (``env_kwargs`` as JSON text): what a join's ``env_config`` carries."""
        return asdict(self)


class EnvSettings(BaseModel):
    """The settings :class:`EnvOptions` is made of (:class:`oakemu_core.config.OakEmuConfig` inherits them)."""

    env_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of gymnasium.make for non-Atari ids: a JSON object on the command line "
        'and in OAKEMU_ENV_KWARGS, a table in TOML, e.g. {"continuous": true}.',
    )
    atari_frame_skip: int = Field(
        ATARI_FRAME_SKIP,
        ge=1,
        description="Atari: emulator frames per agent step (the last two max-pooled).",
    )
    atari_frame_stack: int = Field(
        ATARI_STACK, ge=1, description="Atari: frames stacked into one observation."
    )
    atari_noop_max: int = Field(
        ATARI_NOOP_MAX, ge=0, description="Atari: most no-op actions at an episode's start."
    )
    atari_sticky_actions: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Atari: probability of repeating the previous action (None: the id's own, "
        "0.25 for -v5 ids).",
    )
    atari_episodic_life: bool = Field(
        True,
        description="Atari: a lost life ends the learner's episode while the game goes on, FIRE is pressed "
        "after it where the game has FIRE (SB3's EpisodicLifeEnv, CleanRL); the logged return is the whole game's.",
    )

    @property
    def env_options(self) -> EnvOptions:
        """How the env is made beyond its id: ``env_kwargs`` and the ``atari_*`` settings."""
        return EnvOptions.from_settings(self)

"""The search space of a hyperparameter study: which settings a trial samples, and from what.

A space is a TOML file of ``[space.<setting>]`` tables, one per :class:`~oakemu_core.config.OakEmuConfig`
setting (the names of ``config.toml`` and ``--config`` files)::

    [space.learning_rate]      # a float, log-uniform between low and high
    low = 1e-5
    high = 2e-3
    log = true

    [space.ppo_epochs]         # an int: a setting declared int samples ints; type = "int" says so anyway
    low = 1
    high = 20
    step = 1                   # optional grid step (not with log)

    [space.clip_coef]          # one of the choices (numbers, strings or booleans)
    choices = [0.1, 0.2, 0.3]

The shipped defaults are rl-baselines3-zoo's PPO ranges (``rl_zoo3/hyperparams_opt.py``,
``sample_ppo_params``) in OakEmu-RL's names: ``spaces/ppo.toml``, and for picture observations (Atari,
emulator games) ``spaces/ppo-images.toml`` (:func:`default_space`). A space is checked when it is read
(:func:`load_space`) and against the run's other settings (:meth:`SearchSpace.check`); every mistake is one
line (:class:`~oakemu_core.errors.ConfigError`). Sampling goes through an Optuna trial's ``suggest_*``
methods (:meth:`SearchSpace.suggest`); this module does not import Optuna.
"""

from __future__ import annotations

import difflib
import math
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from oakemu_core.config import OakEmuConfig
from oakemu_core.envs.spec import is_atari_env, is_emulator_env
from oakemu_core.errors import ConfigError

__all__ = [
    "DEFAULT_SPACE",
    "IMAGES_SPACE",
    "Parameter",
    "SearchSpace",
    "default_space",
    "default_space_path",
    "load_space",
    "parse_space",
    "tunable_settings",
]

DEFAULT_SPACE = "ppo.toml"
"""The default space's file in ``oakemu_core/tuning/spaces/``: rl-zoo's PPO ranges, MLP policies."""
IMAGES_SPACE = "ppo-images.toml"
"""The default space for picture observations (CNN policies): no MLP sizes, shorter rollouts."""

UNTUNABLE = frozenset({"config_file", "run_name", "runs_dir", "actor_id"})
"""Settings that name a run or its files rather than how it trains."""

_ENTRY_KEYS = frozenset({"low", "high", "log", "step", "choices", "type"})
Scalar = bool | int | float | str


def tunable_settings() -> list[str]:
    """The settings a space may name: every :class:`OakEmuConfig` field but :data:`UNTUNABLE`."""
    return [name for name in OakEmuConfig.model_fields if name not in UNTUNABLE]


@dataclass(frozen=True)
class Parameter:
    """One setting of a space: ``choices``, or a range ``[low, high]`` of ``kind`` int or float.

    Attributes:
        name: the setting (a field of :class:`OakEmuConfig`).
        kind: ``"categorical"`` (``choices``), ``"int"`` or ``"float"`` (``low`` .. ``high``, both included).
        low, high: the range's bounds (None for choices).
        log: sample the range log-uniformly (``low > 0``).
        step: the range's grid step (None: continuous floats, every int).
        choices: the values to choose from (None for a range).
    """

    name: str
    kind: Literal["categorical", "int", "float"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Scalar, ...] | None = None

    def suggest(self, trial: Any) -> Scalar:
        """The trial's value of this setting (``trial``: an ``optuna.Trial``)."""
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices or ()))
        if self.kind == "int":
            return trial.suggest_int(
                self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log
            )
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def extremes(self) -> tuple[Scalar, ...]:
        """The values that stand for the whole range when checked against the other settings: every
        choice, or the two bounds."""
        if self.choices is not None:
            return self.choices
        cast = int if self.kind == "int" else float
        return (cast(self.low), cast(self.high))

    def describe(self) -> str:
        """``name [a, b, c]`` or ``name 1e-05..0.002 log``."""
        if self.choices is not None:
            return f"{self.name} [{', '.join(str(choice) for choice in self.choices)}]"
        return f"{self.name} {self.low:g}..{self.high:g}" + (" log" if self.log else "")


@dataclass(frozen=True)
class SearchSpace:
    """The settings a trial samples (:class:`Parameter` each), and where they were read."""

    parameters: tuple[Parameter, ...]
    source: str

    @property
    def names(self) -> list[str]:
        return [parameter.name for parameter in self.parameters]

    def suggest(self, trial: Any) -> dict[str, Scalar]:
        """Setting name -> the ``trial``'s value (an ``optuna.Trial``; sampled by its sampler)."""
        return {parameter.name: parameter.suggest(trial) for parameter in self.parameters}

    def check(self, build: Callable[..., Any]) -> None:
        """Check every choice and both bounds of each range against the other settings: ``build(**{name:
        value})`` must accept each (``build``: e.g. ``make_config`` with the study's other settings).

        Raises:
            ConfigError: ``<source>: [space.<name>] <value>: <why>`` for the first value refused.
        """
        for parameter in self.parameters:
            for value in parameter.extremes():
                try:
                    build(**{parameter.name: value})
                except ConfigError as error:
                    reason = str(error).removeprefix("invalid configuration: ")
                    raise ConfigError(
                        f"{self.source}: [space.{parameter.name}] {value!r}: {reason}"
                    ) from None


def default_space_path(env_id: str) -> Path:
    """The shipped space file for ``env_id``: :data:`IMAGES_SPACE` for Atari and emulator ids (picture
    observations), :data:`DEFAULT_SPACE` otherwise."""
    name = IMAGES_SPACE if is_atari_env(env_id) or is_emulator_env(env_id) else DEFAULT_SPACE
    return Path(str(resources.files(__package__).joinpath("spaces", name)))


def default_space(env_id: str) -> SearchSpace:
    """The shipped space for ``env_id`` (:func:`default_space_path`)."""
    return load_space(default_space_path(env_id))


def load_space(path: str | Path) -> SearchSpace:
    """The space of the TOML file ``path``.

    Raises:
        ConfigError: the file is missing or not TOML, or a table of it is not a valid entry
            (:func:`parse_space`).
    """
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"space: cannot read {str(path)!r}: {error.strerror or error}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"space: {str(path)!r} is not valid TOML: {error}") from None
    return parse_space(document, str(path))


def parse_space(document: Mapping[str, Any], source: str) -> SearchSpace:
    """The space of a parsed TOML ``document`` (``{"space": {setting: entry}}``); ``source`` names it
    in errors.

    Raises:
        ConfigError: no ``[space.*]`` table, another top-level key, a setting that does not exist or
            cannot be tuned (with the closest name), an entry with unknown keys, without choices or
            bounds, with ``low >= high``, ``log`` with ``low <= 0``, ``log`` with ``step``, ints for a
            float setting's ``type = "int"`` missing, or duplicate choices.
    """
    extra = sorted(set(document) - {"space"})
    tables = document.get("space")
    if extra or not isinstance(tables, Mapping) or not tables:
        received = f"the key(s) {', '.join(extra)}" if extra else "no [space.<setting>] table"
        raise ConfigError(
            f"{source}: expected [space.<setting>] tables (e.g. [space.learning_rate] with low, high, "
            f"log or choices), received {received}"
        )
    settings = tunable_settings()
    parameters = []
    for name, entry in tables.items():
        if name not in settings:
            close = difflib.get_close_matches(name, settings, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            why = "cannot be tuned" if name in UNTUNABLE else "is no setting"
            raise ConfigError(f"{source}: [space.{name}]: {name!r} {why}{hint}")
        if not isinstance(entry, Mapping):
            raise ConfigError(
                f"{source}: [space.{name}]: expected a table (low, high, log or choices), "
                f"received {entry!r}"
            )
        parameters.append(_parameter(name, entry, f"{source}: [space.{name}]"))
    return SearchSpace(tuple(parameters), source)


def _parameter(name: str, entry: Mapping[str, Any], where: str) -> Parameter:
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)} (expected low, high, log, step, choices, type)"
        )
    if "choices" in entry:
        return _categorical(name, entry, where)
    if "low" not in entry or "high" not in entry:
        raise ConfigError(f"{where}: expected choices = [...] or both low and high")
    kind = entry.get("type", _field_kind(name))
    if kind not in ("int", "float"):
        raise ConfigError(f"{where}: type: expected 'int' or 'float', received {kind!r}")
    low, high, step, log = entry["low"], entry["high"], entry.get("step"), entry.get("log", False)
    numbers = {"low": low, "high": high} | ({"step": step} if step is not None else {})
    for key, value in numbers.items():
        valid = isinstance(value, int) if kind == "int" else isinstance(value, (int, float))
        if isinstance(value, bool) or not valid or not math.isfinite(value):
            expected = "an integer" if kind == "int" else "a finite number"
            raise ConfigError(f"{where}: {key}: expected {expected}, received {value!r}")
    if not isinstance(log, bool):
        raise ConfigError(f"{where}: log: expected true or false, received {log!r}")
    if not low < high:
        raise ConfigError(f"{where}: expected low < high, received low={low!r}, high={high!r}")
    if log and low <= 0:
        raise ConfigError(f"{where}: log = true needs low > 0, received low={low!r}")
    if log and step is not None:
        raise ConfigError(f"{where}: expected step or log = true, received both")
    if step is not None and step <= 0:
        raise ConfigError(f"{where}: step: expected a number > 0, received {step!r}")
    return Parameter(name, kind, low=low, high=high, log=log, step=step)


def _categorical(name: str, entry: Mapping[str, Any], where: str) -> Parameter:
    extra = sorted(set(entry) - {"choices", "type"})
    if extra:
        raise ConfigError(
            f"{where}: expected choices or low/high, received both ({', '.join(extra)})"
        )
    choices = entry["choices"]
    if not isinstance(choices, list) or not choices:
        raise ConfigError(f"{where}: choices: expected a non-empty list, received {choices!r}")
    for choice in choices:
        if not isinstance(choice, (bool, int, float, str)):
            raise ConfigError(
                f"{where}: choices: expected numbers, strings or booleans, received {choice!r}"
            )
    if len({(type(choice), choice) for choice in choices}) < len(choices):
        raise ConfigError(f"{where}: choices: expected distinct values, received {choices!r}")
    return Parameter(name, "categorical", choices=tuple(choices))


def _field_kind(name: str) -> str:
    """``"int"`` for a setting declared int (``ppo_epochs``, ``int | None``), else ``"float"``."""
    annotation = OakEmuConfig.model_fields[name].annotation
    members = typing.get_args(annotation) or (annotation,)
    return "int" if int in members and float not in members else "float"

"""The one configuration model of OakEmu-RL (pydantic-settings).

Every service (learner, actor, monitor, the embedded ``oakemu train``) reads an
:class:`OakEmuConfig`. Values come from four places, highest precedence first:

1. command-line flags (kebab case, e.g. ``--env-id``/``--env``, ``--total-env-steps``),
2. ``OAKEMU_*`` environment variables (e.g. ``OAKEMU_LEARNER_HOST``),
3. a TOML file (flat keys, same names as the fields) given by ``--config PATH`` or
   ``OAKEMU_CONFIG_FILE``,
4. the defaults below (the usual Atari PPO hyperparameters, CleanRL ``ppo_atari.py``).

The whole model is validated when it is built; a user error raises :class:`ConfigError`
whose message names the field, the expected and the received value.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from oakemu_core.actor.fitting import available_cpus, fit_actors
from oakemu_core.algo.settings import PPOSettings, finite_number
from oakemu_core.envs.emulators import RETRO_PREFIX
from oakemu_core.envs.options import EnvSettings
from oakemu_core.envs.spec import is_atari_env
from oakemu_core.errors import ConfigError
from oakemu_core.options import add_setting_arguments, given_settings, unknown_variables
from oakemu_core.policy.network import NetworkSettings
from oakemu_core.run.config_file import settings_from_toml
from oakemu_core.run.evaluation_settings import EvaluationSettings
from oakemu_core.run.settings import RollbackSettings, RunSettings
from oakemu_core.transport.batching import AUTO_MESSAGE_MIN_ROWS, auto_steps_per_message
from oakemu_core.transport.settings import SecuritySettings, TransportSettings, check_ports_differ

__all__ = [
    "CONFIG_FILE_ENV_VAR",
    "ConfigError",
    "OakEmuConfig",
    "add_config_arguments",
    "config_from_namespace",
    "format_validation_error",
    "load_config",
    "make_config",
    "resolved_device",
    "to_toml",
    "unknown_environment_variables",
]

ENV_PREFIX = "OAKEMU_"
CONFIG_FILE_ENV_VAR = "OAKEMU_CONFIG_FILE"
"""Environment variable naming the TOML file (used when no ``--config`` flag is given)."""

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _ConfigFileSource(PydanticBaseSettingsSource):
    """TOML file source whose path is decided per construction.

    The path is the ``config_file`` init keyword (set by :func:`load_config` from ``--config``)
    or else the ``OAKEMU_CONFIG_FILE`` environment variable. A named file that does not exist
    is an error (a silently ignored typo in a path would train with the wrong settings).
    """

    def __init__(self, settings_cls: type[BaseSettings], init_kwargs: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        path = init_kwargs.get("config_file") or os.environ.get(CONFIG_FILE_ENV_VAR) or None
        self.path = Path(path) if path is not None else None
        self._data: dict[str, Any] = {}
        if self.path is not None:
            if not self.path.is_file():
                raise ConfigError(
                    f"config_file: expected an existing TOML file, received {str(self.path)!r} "
                    f"(from --config or {CONFIG_FILE_ENV_VAR})"
                )
            try:
                self._data = settings_from_toml(
                    self.path.read_text(encoding="utf-8"), settings_cls.model_fields
                )
            except (ValueError, OSError) as error:  # tomllib.TOMLDecodeError is a ValueError
                raise ConfigError(
                    f"config_file: {str(self.path)!r} is not valid TOML: {error}"
                ) from error

    def get_field_value(
        self, field: Any, field_name: str
    ) -> tuple[Any, str, bool]:  # pragma: no cover
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


_BASE_SETTINGS: ContextVar[Mapping[str, Any]] = ContextVar(
    "oakemu_base_settings", default=MappingProxyType({})
)
"""Settings below the TOML file and above the defaults while a configuration is built (:func:`config_from_namespace`'s
``base``: a preset, the resumed run's own ``config.toml``)."""


class _BaseSettingsSource(PydanticBaseSettingsSource):
    """The lowest source above the defaults: :data:`_BASE_SETTINGS` as set for this construction."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        self._data = dict(_BASE_SETTINGS.get())

    def get_field_value(
        self, field: Any, field_name: str
    ) -> tuple[Any, str, bool]:  # pragma: no cover
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


class OakEmuConfig(  # fields in reverse order of the bases, then this class's (config.toml's order)
    SecuritySettings,
    TransportSettings,
    RollbackSettings,
    RunSettings,
    PPOSettings,
    NetworkSettings,
    EnvSettings,
    EvaluationSettings,
    BaseSettings,
):
    """All settings of a training run, an actor, a learner or a monitor (flat, one line each).

    The settings of one concern are declared once, beside the code that reads them, and inherited
    here: the PPO hyperparameters and the seed (:class:`~oakemu_core.algo.settings.PPOSettings`), the
    environment's (:class:`~oakemu_core.envs.options.EnvSettings`), the periodic evaluation's
    (:class:`~oakemu_core.run.evaluation_settings.EvaluationSettings`), the run folder's, logging's
    and tracking's (:class:`~oakemu_core.run.settings.RunSettings`), the rollback's
    (:class:`~oakemu_core.run.settings.RollbackSettings`), the transport's
    (:class:`~oakemu_core.transport.settings.TransportSettings`) and the learner's limits on its peers
    (:class:`~oakemu_core.transport.settings.SecuritySettings`). This class declares the rest: the
    actors, the rollout and learning rate, the run's mode and devices, and routing.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,  # `OAKEMU_X: ${X:-}` in docker compose means "unset"
        env_parse_none_str="null",
        extra="forbid",
        validate_default=True,
    )

    # --- configuration file (recorded so a run folder says where its settings came from) ---
    config_file: Path | None = Field(
        None,
        description="TOML file read below flags and OAKEMU_* variables (--config or OAKEMU_CONFIG_FILE).",
    )

    # --- environment ---
    env_id: str = Field(
        "ALE/Breakout-v5",
        min_length=1,
        description="Environment id: ale-py (ALE/...), any Gymnasium id, module:EnvId for a custom env, gameboy:ROM "
        "or retro:Game-Id.",
    )
    num_actors: int | None = Field(
        None,
        ge=1,
        description="Actor processes `oakemu train` starts (None: num_envs "
        "split over one actor per CPU the learner leaves, at least 4 envs each).",
    )
    actor_restarts: int = Field(
        5,
        ge=0,
        description="Times `oakemu train` restarts an actor that exits with an error (0: never).",
    )
    envs_per_actor: int = Field(
        8,
        ge=1,
        description="Environments each actor steps in one vector env (neither it "
        "nor num_actors given: num_envs / the fitted actor count).",
    )
    env_groups: int = Field(
        1,
        ge=1,
        description="Env groups per actor: while one group's emulators step, the actor infers the other "
        "groups' actions (threaded Atari envs). Needs env_groups <= envs_per_actor, no policy routing and "
        "a feed-forward policy.",
    )
    emulator_threads: int | None = Field(
        None,
        ge=1,
        description="ale-py emulator threads per actor (Atari ids), split among its env groups. None: "
        "the CPUs this process may use divided by num_actors, at least 1.",
    )
    num_envs: int | None = Field(
        None,
        ge=1,
        description="Rollout columns the learner plans for (default num_actors * envs_per_actor): the "
        "rollout size, so minibatch rows = rollout_length * num_envs / num_minibatches. Async: the buffer's columns.",
    )
    max_episode_steps: int | None = Field(
        None,
        ge=1,
        description="Time limit in agent steps overriding the env's own (None keeps it).",
    )
    clip_rewards: bool | None = Field(
        None, description="Clip training rewards to [-1, 1] (None: auto, on for Atari ids)."
    )
    normalize_observations: bool = Field(
        False,
        description="Normalise float observations by the learner's running mean/std (as SB3 VecNormalize).",
    )
    emulator_settings: str | None = Field(
        None,
        description="TOML file of an emulator backend (gameboy:/retro: ids): ROM, states, rewards, ...",
    )

    # --- rollout and learning rate (the PPO hyperparameters are PPOSettings' fields) ---
    rollout_length: int = Field(128, ge=1, description="Steps per env per rollout (T).")
    total_env_steps: int = Field(
        10_000_000,
        ge=1,
        description="Stop after the PPO update that brings the env steps trained on (all envs) to "
        "this many; rows discarded or too stale to train never count.",
    )
    learning_rate: float = Field(
        2.5e-4, gt=0.0, description="Adam learning rate (start value when annealed)."
    )
    anneal_lr: bool = Field(
        True, description="Anneal the learning rate linearly to 0 over total_env_steps."
    )
    publish_every_epoch: bool = Field(
        True,
        description="Async mode: also publish the weights after each epoch of an update (revisions of the version "
        "in training), so actors act with weights at most one epoch old. Ignored in sync mode.",
    )
    publish_min_sgd_steps: int = Field(
        32,
        ge=1,
        description="Async mode with publish_every_epoch: publish an epoch's weights only when at least this many "
        "SGD steps were taken since the weights were last published (1: after every epoch).",
    )
    mode: Literal["async", "sync"] = Field(
        "sync",
        description="sync: on-policy as SB3, actors wait for the weights trained on their rows (elastic; a fixed "
        "set of actors reproduces a seed). async: actors keep stepping while the learner trains (rows up to "
        "max_policy_lag versions old).",
    )
    max_actors: int | None = Field(
        None,
        ge=1,
        description="Sync mode: the most actors one rollout takes (the buffer is allocated for max_actors * "
        "envs_per_actor columns; a join beyond them is refused). None: max(4, 2 * num_actors).",
    )
    steps_per_message: int | Literal["auto"] = Field(
        "auto",
        description="Vector steps an actor sends per step message: a divisor of rollout_length, or auto (chosen "
        "from the message's bytes and the rollout length, oakemu_core.transport.batching).",
    )
    device: str = Field(
        "auto", description="Learner torch device: auto (cuda if available), cpu, cuda, cuda:N."
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per actor process.")
    learner_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads of the learner process (default: "
        "1 for a model without convolutions, torch's, one per core, for a CNN).",
    )
    actor_inference: Literal["auto", "torch", "numpy", "onnxruntime", "bfloat16", "central"] = (
        Field(
            "auto",
            description="What runs the actors' forward passes: auto (numpy for MLP models of vector observations, "
            "else torch); torch; numpy (MLP models only); onnxruntime (extra 'onnx', not for dict observations); "
            "bfloat16 (uint8 image observations only; the learner re-evaluates every rollout); or central (oakemu "
            "train only: one inference server process runs every actor's forward passes in batches, on "
            "inference_device). Neither onnxruntime nor bfloat16 serves a recurrent policy.",
        )
    )
    inference_device: str = Field(
        "auto",
        description="actor_inference central: the inference server's torch device: auto (cuda if available), "
        "cpu, cuda, cuda:N.",
    )

    actor_id: str | None = Field(
        None, min_length=1, description="Actor name (default: hostname-pid)."
    )

    # --- behaviour cloning (demonstrations in the Minari format, see `oakemu record`) ---
    bc_dataset: str | None = Field(
        None, description="Local Minari dataset folder of demonstrations (None: no BC)."
    )

    # --- policy routing (oakemu_core/actor/routing.py): routed steps are stored for GAE, never trained on ---
    route_random_first_steps: int = Field(
        0,
        ge=0,
        description="Random actions for the first N steps of every game (all its Atari lives; "
        "non-trainable rows).",
    )
    route_random_probability: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Probability that a step is random-controlled (non-trainable row).",
    )
    route_scripted_policy: str | None = Field(
        None,
        description="module:callable (observations, action_mask) -> actions of a scripted policy.",
    )
    route_scripted_probability: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Probability that a non-random step is scripted (needs route_scripted_policy).",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Sources, highest precedence first; pydantic-settings puts the CLI source in front."""
        init_kwargs = getattr(init_settings, "init_kwargs", {})
        return (
            init_settings,
            env_settings,
            _ConfigFileSource(settings_cls, init_kwargs),
            _BaseSettingsSource(settings_cls),
        )

    # --- validation ---
    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE_PATTERN.match(value):
            raise ValueError(f"expected auto, cpu, mps, cuda or cuda:N, received {value!r}")
        return value

    @field_validator("inference_device")
    @classmethod
    def _check_inference_device(cls, value: str) -> str:
        if value == "mps" or not _DEVICE_PATTERN.match(value):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N, received {value!r}")
        return value

    @field_validator("learning_rate", "actor_timeout_s")
    @classmethod
    def _check_finite(cls, value: float) -> float:
        return finite_number(value)

    @model_validator(mode="after")
    def _check_consistency(self) -> OakEmuConfig:
        self._fit_actors()
        buffer_columns = self.buffer_num_envs
        if buffer_columns < self.envs_per_actor:
            raise ValueError(
                f"num_envs: the learner's {buffer_columns} buffer columns must hold at least one actor's "
                f"envs_per_actor={self.envs_per_actor} envs; received num_envs={self.num_envs}"
            )
        if self.steps_per_message != "auto" and (
            self.steps_per_message < 1 or self.rollout_length % self.steps_per_message
        ):
            raise ValueError(
                f"steps_per_message: expected 'auto' or a divisor of rollout_length={self.rollout_length} (a step "
                f"message never crosses a segment boundary), received {self.steps_per_message}"
            )
        batch_rows = self.rollout_length * buffer_columns
        if self.num_minibatches > batch_rows:
            raise ValueError(
                f"num_minibatches: expected at most rollout_length * buffer columns = "
                f"{self.rollout_length} * {buffer_columns} = {batch_rows} (at least 1 row per minibatch), "
                f"received {self.num_minibatches}"
            )
        if (self.route_scripted_policy is None) != (self.route_scripted_probability == 0.0):
            raise ValueError(
                "route_scripted_policy / route_scripted_probability: expected both set (a 'module:callable' and a "
                f"probability > 0) or neither, received {self.route_scripted_policy!r} and "
                f"{self.route_scripted_probability!r}"
            )
        if self.recurrent != "none" and self.env_groups > 1:
            raise ValueError(
                f"env_groups: a recurrent policy (recurrent={self.recurrent}) steps each actor's envs "
                f"in one group; expected 1, received {self.env_groups}"
            )
        if self.recurrent != "none" and self.actor_inference in ("onnxruntime", "bfloat16"):
            raise ValueError(
                f"actor_inference: {self.actor_inference!r} serves feed-forward policies only; a "
                f"recurrent policy (recurrent={self.recurrent}) acts in numpy or torch: use auto, numpy "
                f"or torch"
            )
        if self.recurrent != "none" and self.bc_dataset is not None:
            raise ValueError(
                f"bc_dataset: behaviour cloning serves feed-forward policies only (demonstrations hold "
                f"no recurrent state); received recurrent={self.recurrent}"
            )
        check_ports_differ(self)
        return self

    def _fit_actors(self) -> None:
        """Fill what was not given of ``num_actors`` / ``envs_per_actor``.

        The counts come from :func:`~oakemu_core.actor.fitting.fit_actors`.
        """
        self.num_actors, self.envs_per_actor = fit_actors(
            self.num_actors,
            self.envs_per_actor,
            self.num_envs,
            envs_per_actor_given="envs_per_actor" in self.model_fields_set,
            cpus=available_cpus(),
            one_env_per_actor=self.env_id.startswith(RETRO_PREFIX),
        )

    # --- derived values ---
    def resolved_steps_per_message(
        self, env_step_bytes: int, num_envs: int, *, step_ring: bool = False
    ) -> int:
        """Steps per message K for an actor of ``num_envs`` envs, each of whose steps puts
        ``env_step_bytes`` bytes on the wire (:func:`oakemu_core.transport.frame_stacks.wire_bytes_per_env`):
        the configured int, or :func:`oakemu_core.transport.batching.auto_steps_per_message` for ``"auto"``,
        without its bound on a message's bytes for an actor offered a step ring (``step_ring``: the
        arrays do not travel in the message), and with its allowance of up to
        :data:`~oakemu_core.transport.batching.AUTO_MESSAGE_MIN_ROWS` rows at rollouts under 64 steps (CartPole, 8
        envs, rollout 32: K = 4, not 1)."""
        if self.steps_per_message != "auto":
            return int(self.steps_per_message)
        ring_bounds = {"target_bytes": None, "min_rows": AUTO_MESSAGE_MIN_ROWS} if step_ring else {}
        return auto_steps_per_message(
            env_step_bytes, self.rollout_length, num_envs=num_envs, **ring_bounds
        )

    @property
    def buffer_num_envs(self) -> int:
        """Learner rollout buffer columns N: ``num_envs`` or ``num_actors * envs_per_actor``."""
        return self.num_envs if self.num_envs is not None else self.num_actors * self.envs_per_actor

    @property
    def resolved_max_actors(self) -> int:
        """``max_actors``, or ``max(4, 2 * num_actors)``."""
        return self.max_actors if self.max_actors is not None else max(4, 2 * self.num_actors)

    @property
    def allocated_num_envs(self) -> int:
        """Columns of each rollout buffer the learner allocates: :attr:`buffer_num_envs`, and in sync
        mode room for ``resolved_max_actors`` actors (a rollout holds the columns of the actors
        present when it starts)."""
        if self.mode != "sync":
            return self.buffer_num_envs
        return max(self.buffer_num_envs, self.resolved_max_actors * self.envs_per_actor)

    @property
    def batch_size(self) -> int:
        """Rows per rollout, ``rollout_length * buffer_num_envs``."""
        return self.rollout_length * self.buffer_num_envs

    def resolved_emulator_threads(self, cpus: int | None = None) -> int:
        """Emulator threads of one actor's env group: ``emulator_threads`` (None: ``cpus // num_actors``,
        at least 1) divided among its ``env_groups``, at least 1 each.

        Args:
            cpus: CPUs this process may run on; None reads them (:func:`available_cpus`).
        """
        threads = self.emulator_threads or max(1, (cpus or available_cpus()) // self.num_actors)
        return max(1, threads // min(self.env_groups, self.envs_per_actor))

    @property
    def resolved_clip_rewards(self) -> bool:
        """``clip_rewards`` with None resolved: True for Atari ids, else False."""
        return is_atari_env(self.env_id) if self.clip_rewards is None else self.clip_rewards

    @property
    def resolved_eval_greedy(self) -> bool:
        """``eval_greedy`` with "auto" resolved: sampled actions for Atari ids, greedy otherwise."""
        return (
            not is_atari_env(self.env_id) if self.eval_greedy == "auto" else bool(self.eval_greedy)
        )

    @property
    def resolved_clip_value_range(self) -> float | None:
        """``clip_value_range`` with "auto" resolved: ``clip_coef`` for Atari ids (CleanRL's
        ``ppo_atari.py``, rewards clipped to [-1, 1]), else None (no value clipping)."""
        if self.clip_value_range == "auto":
            return self.clip_coef if is_atari_env(self.env_id) else None
        return self.clip_value_range


def unknown_environment_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning per ``OAKEMU_*`` variable that names no setting (:func:`oakemu_core.options.unknown_variables`)."""
    return unknown_variables(OakEmuConfig.model_fields, os.environ if environ is None else environ)


def resolved_device(config: OakEmuConfig, setting: str = "device") -> str:
    """Torch device string of the learner (``setting`` ``"device"``) or of the inference server
    (``"inference_device"``): ``auto`` becomes ``cuda`` when available, else ``cpu``.

    Raises:
        ConfigError: the setting asks for CUDA (or MPS) but torch reports it unavailable.
    """
    import torch  # lazy: config parsing must stay fast

    device = getattr(config, setting)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{setting}: expected an available device, received {device!r} (no CUDA device found)"
            )
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"{setting}: expected cuda:0..cuda:{torch.cuda.device_count() - 1}, received {device!r}"
            )
    if device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            f"{setting}: expected an available device, received 'mps' (MPS not available)"
        )
    return device


def to_toml(config: OakEmuConfig) -> str:
    """The resolved configuration as a flat TOML document readable by ``--config``.

    Fields whose value is None are written as comments, ``# name = (unset)`` (TOML has no null), which
    :func:`~oakemu_core.run.config_file.settings_from_toml` reads back as None, so reading the file back gives the same
    configuration. ``config_file`` is not written.
    """
    # tomli_w is not installed here; the fields are flat scalars, so a small writer suffices.
    lines = ["# OakEmu-RL resolved configuration"]
    for name, field in OakEmuConfig.model_fields.items():
        if name == "config_file":
            continue
        value = getattr(config, name)
        if field.description:
            lines.append(f"# {field.description}")
        if value is None:
            lines.append(f"# {name} = (unset)")
        else:
            lines.append(f"{name} = {_toml_scalar(value)}")
    return "\n".join(lines) + "\n"


def _toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, Mapping):  # an inline table; keys quoted
        return (
            "{"
            + ", ".join(
                f"{_toml_scalar(str(key))} = {_toml_scalar(item)}" for key, item in value.items()
            )
            + "}"
        )
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_scalar(item) for item in value) + "]"
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        escaped = "".join(ch if ch >= " " else f"\\u{ord(ch):04x}" for ch in escaped)
        return f'"{escaped}"'
    raise TypeError(f"cannot write {type(value).__name__} as a TOML scalar")


class _RaisingArgumentParser(argparse.ArgumentParser):
    """ArgumentParser that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}")


def add_config_arguments(parser: argparse.ArgumentParser, command: str | None = None) -> None:
    """Add ``--config FILE`` and the options of the settings ``command`` offers (``train``, ``learner``,
    ``actor``; None: every setting), grouped by role (:mod:`oakemu_core.options`). Parse with the parser,
    then build the config with :func:`config_from_namespace`."""
    add_setting_arguments(parser, OakEmuConfig.model_fields, command)


def config_from_namespace(
    namespace: argparse.Namespace,
    *,
    toml_path: str | os.PathLike[str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> OakEmuConfig:
    """Build and validate the config from parsed options, ``OAKEMU_*`` variables, TOML, ``base`` and defaults.

    The TOML file is ``namespace.config`` (``--config``) when given, else ``toml_path``, else
    ``$OAKEMU_CONFIG_FILE``. ``base`` holds settings below it (a preset, a resumed run's own settings).

    Raises:
        ConfigError: a value is invalid or the TOML file is missing or malformed.
    """
    settings = given_settings(namespace, OakEmuConfig.model_fields)
    config_path = getattr(namespace, "config", None) or toml_path
    if config_path is not None:
        settings["config_file"] = Path(config_path)
    return make_config(base, **settings)


def make_config(base: Mapping[str, Any] | None = None, **settings: Any) -> OakEmuConfig:
    """The validated configuration from ``settings`` (field name -> value), ``OAKEMU_*`` variables, the
    TOML file (``settings["config_file"]`` or ``$OAKEMU_CONFIG_FILE``), ``base`` (a preset's settings) and
    the defaults, in that precedence; the Python API's counterpart of the command line.

    Raises:
        ConfigError: an unknown setting, a value of the wrong type or out of range (one line).
    """
    token = _BASE_SETTINGS.set(dict(base or {}))
    try:
        return OakEmuConfig(**settings)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None
    finally:
        _BASE_SETTINGS.reset(token)


def load_config(
    args: Sequence[str] | None = None,
    *,
    toml_path: str | os.PathLike[str] | None = None,
    prog: str = "oakemu",
) -> OakEmuConfig:
    """Parse command-line ``args`` (None: no flags) and build the validated configuration.

    Precedence: flags > ``OAKEMU_*`` environment variables > TOML file > defaults. The TOML file
    is ``--config PATH`` from ``args``, else ``toml_path``, else ``$OAKEMU_CONFIG_FILE``.

    Raises:
        ConfigError: unknown flag, a value of the wrong type or out of range, a missing or
            malformed TOML file. The message names the field, expected and received values.
    """
    parser = _RaisingArgumentParser(prog=prog, allow_abbrev=False)
    add_config_arguments(parser)
    namespace = parser.parse_args(list(args or []))
    return config_from_namespace(namespace, toml_path=toml_path)


def format_validation_error(error: ValidationError) -> str:
    """One line: ``invalid configuration: field: message, received value; field: ...``."""
    lines: list[str] = []
    for item in error.errors(include_url=False):
        location = ".".join(str(part) for part in item["loc"]) or "config"
        received = item.get("input")
        message = item["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        if item["type"] == "extra_forbidden":
            close = difflib.get_close_matches(location, OakEmuConfig.model_fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"{location}: unknown setting (received {received!r}){hint}")
        elif not item["loc"]:
            lines.append(message)
        elif "received" in message:
            lines.append(f"{location}: {message}")
        else:
            lines.append(f"{location}: {message}, received {received!r}")
    return "invalid configuration: " + "; ".join(lines)

"""The settings as command-line options: grouped by role, offered only by the commands that use them.

Every field of :class:`~oakemu_core.config.OakEmuConfig` is one option, ``--field-name`` (``--env`` too
for ``env_id``), in one of :data:`GROUPS` (environment, run, actors, PPO, asynchronous mode, transport,
checkpoints, evaluation, rollback, behaviour cloning, routing, logging, security). A group lists, per
field, the commands whose process reads it: ``oakemu actor`` has no ``--learning-rate`` and ``oakemu
train`` no ``--learner-host``; a setting a command does not offer is still read from ``OAKEMU_*``
variables and TOML files (one file can serve every service).

Values are parsed here only as far as their type (numbers, ``auto``, ``None`` / ``null`` for "unset",
``--flag`` / ``--no-flag`` for booleans); ranges and cross-field rules are the model's validation. Only
the options given on the command line reach the model (:func:`given_settings`), as its highest-precedence
source. This module does not import the configuration model (it is handed its fields), so the model's
module can use it.
"""

from __future__ import annotations

import argparse
import difflib
import json
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "COMMANDS",
    "GROUPS",
    "Group",
    "add_setting_arguments",
    "given_settings",
    "option_name",
    "unknown_option_hint",
    "unknown_variables",
]

TRAIN, LEARNER, ACTOR = "train", "learner", "actor"
COMMANDS = (TRAIN, LEARNER, ACTOR)
"""The commands that take settings as options."""

_TL = (TRAIN, LEARNER)
_TLA = (TRAIN, LEARNER, ACTOR)
_TA = (TRAIN, ACTOR)


@dataclass(frozen=True)
class Group:
    """A titled group of options; ``fields`` maps each setting to the commands that offer it."""

    title: str
    description: str
    fields: Mapping[str, tuple[str, ...]]


GROUPS: tuple[Group, ...] = (
    Group(
        "environment",
        "What is played, and how its episodes are cut and scored.",
        {
            "env_id": _TL,
            "seed": _TL,
            "max_episode_steps": _TL,
            "clip_rewards": _TL,
            "normalize_observations": _TL,
            "emulator_settings": _TL,
            "env_kwargs": _TL,
            "atari_frame_skip": _TL,
            "atari_frame_stack": _TL,
            "atari_noop_max": _TL,
            "atari_sticky_actions": _TL,
            "atari_episodic_life": _TL,
        },
    ),
    Group(
        "run",
        "The budget, the run folder and the learner's device and threads.",
        {
            "total_env_steps": _TL,
            "runs_dir": _TL,
            "run_name": _TL,
            "device": _TL,
            "learner_precision": _TL,
            "compile_update": _TL,
            "learner_threads": _TL,
        },
    ),
    Group(
        "actors",
        "Actor processes and the envs each steps.",
        {
            "num_actors": _TL,
            "actor_restarts": (TRAIN,),
            "envs_per_actor": _TLA,
            "num_envs": _TL,
            "max_actors": _TL,
            "env_groups": _TA,
            "emulator_threads": _TA,
            "torch_threads": _TA,
            "actor_inference": _TA,
            "inference_device": (TRAIN,),
            "actor_id": (ACTOR,),
        },
    ),
    Group(
        "PPO",
        "The PPO update (CleanRL's names and defaults).",
        {
            "rollout_length": _TL,
            "ppo_epochs": _TL,
            "num_minibatches": _TL,
            "learning_rate": _TL,
            "anneal_lr": _TL,
            "clip_coef": _TL,
            "clip_value_range": _TL,
            "ent_coef": _TL,
            "vf_coef": _TL,
            "gamma": _TL,
            "gae_lambda": _TL,
            "max_grad_norm": _TL,
            "target_kl": _TL,
            "normalize_advantages": _TL,
            "normalize_rewards": _TL,
        },
    ),
    Group(
        "policy network",
        "The actor-critic's layers: MLP sizes, picture encoder, recurrent core, your own encoder.",
        {
            "net_arch": _TL,
            "activation": _TL,
            "shared_torso": _TL,
            "cnn": _TL,
            "impala_channels": _TL,
            "recurrent": _TL,
            "recurrent_hidden": _TL,
            "shared_core": _TL,
            "ortho_init": _TL,
            "sequence_length": _TL,
            "policy_module": _TL,
        },
    ),
    Group(
        "asynchronous mode",
        "Training while actors act, on rows of older policy versions.",
        {
            "mode": _TL,
            "max_policy_lag": _TL,
            "off_policy_correction": _TL,
            "importance_weight_cap": _TL,
            "publish_every_epoch": _TL,
            "publish_min_sgd_steps": _TL,
            "steps_per_message": _TL,
        },
    ),
    Group(
        "transport",
        "Addresses, ports and message limits between the learner and its actors.",
        {
            "step_transport": _TLA,
            "bind_host": _TL,
            "learner_host": (ACTOR,),
            "data_port": _TLA,
            "control_port": _TLA,
            "weights_port": _TLA,
            "telemetry_port": _TL,
            "metrics_port": _TL,
            "metrics_host": _TL,
            "actor_timeout_s": _TLA,
            "max_message_bytes": _TLA,
        },
    ),
    Group(
        "checkpoints",
        "When checkpoints are written and how many are kept.",
        {
            "checkpoint_every_updates": _TL,
            "checkpoint_every_seconds": _TL,
            "keep_checkpoints": _TL,
            "max_checkpoint_failures": _TL,
        },
    ),
    Group(
        "evaluation",
        "Periodic evaluation of the newest weights, in a process of its own.",
        {
            "eval_every_updates": _TL,
            "eval_max_share": _TL,
            "eval_episodes": _TL,
            "eval_greedy": _TL,
            "eval_video": _TL,
            "eval_video_every": _TL,
        },
    ),
    Group(
        "rollback",
        "Going back to the last good checkpoint when a run collapses (on by default; each "
        "rollback multiplies the learning rate by rollback_lr_factor).",
        {
            "rollback": _TL,
            "rollback_max_approx_kl": _TL,
            "rollback_eval_fraction": _TL,
            "rollback_eval_patience": _TL,
            "rollback_lr_factor": _TL,
            "max_rollbacks": _TL,
        },
    ),
    Group(
        "behaviour cloning",
        "Pre-training on, or a loss term from, recorded demonstrations (oakemu record).",
        {
            "bc_dataset": _TL,
            "bc_pretrain_updates": _TL,
            "bc_batch_size": _TL,
            "bc_coef": _TL,
            "bc_coef_decay": _TL,
        },
    ),
    Group(
        "routing",
        "Steps acted by a random or scripted policy: stored for GAE, never trained on.",
        {
            "route_random_first_steps": _TL,
            "route_random_probability": _TL,
            "route_scripted_policy": _TL,
            "route_scripted_probability": _TL,
        },
    ),
    Group("logging", "Log records of every process.", {"log_level": _TLA, "log_format": _TLA}),
    Group(
        "tracking",
        "Experiment trackers the learner also reports to (MLflow, Weights & Biases).",
        {"track": _TL, "track_uri": _TL, "track_project": _TL},
    ),
    Group(
        "security",
        "ZeroMQ CURVE encryption and authentication, and the learner's limits on its peers "
        "(deploy/README.md).",
        {
            "curve": (LEARNER, ACTOR),
            "curve_secret_key": (LEARNER, ACTOR),
            "curve_server_key": (ACTOR,),
            "curve_authorized_keys": (LEARNER,),
            "max_envs_per_actor": (LEARNER,),
            "max_connected_actors": (LEARNER,),
            "reward_low": (LEARNER,),
            "reward_high": (LEARNER,),
            "step_ring_max_mib": (LEARNER,),
            "step_ring_max_mib_per_actor": (LEARNER,),
        },
    ),
)

METAVARS = {
    "env_id": "ENV",
    "seed": "SEED",
    "env_kwargs": "JSON",
    "atari_frame_skip": "FRAMES",
    "atari_frame_stack": "FRAMES",
    "atari_noop_max": "STEPS",
    "atari_sticky_actions": "P|null",
    "max_episode_steps": "STEPS",
    "emulator_settings": "FILE",
    "total_env_steps": "STEPS",
    "runs_dir": "DIR",
    "run_name": "NAME",
    "device": "DEVICE",
    "actor_id": "NAME",
    "rollout_length": "STEPS",
    "learning_rate": "LR",
    "clip_coef": "EPSILON",
    "clip_value_range": "RANGE|auto|null",
    "ent_coef": "COEF",
    "vf_coef": "COEF",
    "gamma": "GAMMA",
    "gae_lambda": "LAMBDA",
    "max_grad_norm": "NORM",
    "target_kl": "KL|null",
    "max_policy_lag": "VERSIONS",
    "importance_weight_cap": "CAP",
    "publish_min_sgd_steps": "STEPS",
    "steps_per_message": "STEPS|auto",
    "bind_host": "HOST",
    "learner_host": "HOST",
    "metrics_port": "PORT|null",
    "actor_timeout_s": "SECONDS",
    "max_message_bytes": "BYTES",
    "checkpoint_every_seconds": "SECONDS",
    "rollback_max_approx_kl": "KL|null",
    "rollback_eval_fraction": "FRACTION|null",
    "rollback_lr_factor": "FACTOR",
    "bc_dataset": "DIR",
    "bc_batch_size": "ROWS",
    "bc_coef": "COEF",
    "bc_coef_decay": "FACTOR",
    "route_random_first_steps": "STEPS",
    "route_random_probability": "P",
    "route_scripted_policy": "MODULE:CALLABLE",
    "route_scripted_probability": "P",
    "eval_greedy": "auto|true|false",
    "curve_secret_key": "FILE",
    "curve_server_key": "FILE",
    "curve_authorized_keys": "DIR",
    "metrics_host": "HOST",
    "track_uri": "URI",
    "track_project": "NAME",
    "reward_low": "REWARD|null",
    "reward_high": "REWARD|null",
    "step_ring_max_mib": "MIB",
    "step_ring_max_mib_per_actor": "MIB",
    "max_actors": "N|null",
    "eval_max_share": "SHARE",
}
"""What a value is, where its type alone would not say it (ports are PORT, counts N, other numbers X)."""

HELP_DEFAULTS = {
    "envs_per_actor": "fitted; 8 with num_actors given",
    "num_envs": "16 when no count is given",
}
"""The default a setting's help shows where its field default alone would mislead (fitted values)."""

_NONE_WORDS = ("none", "null")
_TRUE_WORDS, _FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def option_name(field: str) -> str:
    """``--field-name`` for a setting."""
    return "--" + field.replace("_", "-")


def _members(annotation: Any) -> tuple[Any, ...]:
    """The members of a union annotation (``int | None`` -> ``(int, NoneType)``), or the annotation alone."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _literals(members: Iterable[Any]) -> list[Any]:
    return [
        value
        for member in members
        if typing.get_origin(member) is Literal
        for value in typing.get_args(member)
    ]


def _converter(field: str, members: tuple[Any, ...]) -> Callable[[str], Any]:
    """A function parsing one option value of a field whose annotation has ``members``."""
    literals = _literals(members)
    kinds = [member for member in members if member in (int, float, str, Path, bool)]
    optional = type(None) in members
    if any(typing.get_origin(member) is dict or member is dict for member in members):
        return _json_object

    def convert(text: str) -> Any:
        word = text.strip().lower()
        if optional and word in _NONE_WORDS:
            return None
        for value in literals:
            if word == str(value).lower():
                return value
        for kind in kinds:
            if kind is bool and word in _TRUE_WORDS + _FALSE_WORDS:
                return word in _TRUE_WORDS
            if kind in (int, float):
                try:
                    return kind(text)
                except ValueError:
                    continue
            if kind in (str, Path):
                return kind(text)
        raise argparse.ArgumentTypeError(f"expected {_expected(members)}, received {text!r}")

    convert.__name__ = field  # argparse names the option's type in some messages
    return convert


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object (keyword arguments) from an option's value."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"continuous\": true}}', received "
            f"{text!r} ({error})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, received {text!r}")
    return value


def _expected(members: tuple[Any, ...]) -> str:
    words = [repr(value) for value in _literals(members)]
    words += {int: ["an integer"], float: ["a number"], bool: ["true or false"]}.get(
        next((m for m in members if m in (int, float, bool)), None), []
    )
    if type(None) in members:
        words.append("None/null")
    return " or ".join(words) or "a value"


def _metavar(field: str, members: tuple[Any, ...]) -> str:
    if field in METAVARS:
        return METAVARS[field]
    literals = _literals(members)
    if literals:
        return "{" + ",".join(str(value) for value in literals) + "}"
    if field.endswith("_port"):
        return "PORT"
    return (
        "N"
        if int in members
        else "X"
        if float in members
        else "PATH"
        if Path in members
        else "VALUE"
    )


def _help(description: str | None, default: Any) -> str:
    text = (description or "").rstrip()
    if default is None or default is Ellipsis:
        return text
    shown = str(default).lower() if isinstance(default, bool) else default
    return f"{text} (default: {shown})"


def add_setting_arguments(
    parser: argparse.ArgumentParser, fields: Mapping[str, Any], command: str | None
) -> None:
    """Add ``--config FILE`` and one option per setting that ``command`` offers (every setting for None),
    in the argument groups of :data:`GROUPS`. Options that are not given stay out of the namespace.

    Args:
        parser: the command's parser.
        fields: the model's fields (name -> pydantic ``FieldInfo``: ``annotation``, ``default``, ``description``).
        command: one of :data:`COMMANDS`, or None for all settings.
    """
    files = parser.add_argument_group("configuration files")
    files.add_argument(
        "--config",
        dest="config",
        type=Path,
        default=None,
        metavar="FILE",
        help="TOML file of settings (field = value), below options and OAKEMU_* variables "
        "(default: $OAKEMU_CONFIG_FILE).",
    )
    for group in GROUPS:
        names = [
            name
            for name, commands in group.fields.items()
            if command is None or command in commands
        ]
        if not names:
            continue
        arguments = parser.add_argument_group(f"{group.title} settings", group.description)
        for name in names:
            _add_setting(arguments, name, fields[name])


def _tri_state(text: str) -> bool | None:
    """The value of ``--flag VALUE`` for a ``bool | None`` setting: auto / null / none -> None, else a boolean."""
    word = text.strip().lower()
    if word in ("auto", *_NONE_WORDS):
        return None
    if word in _TRUE_WORDS + _FALSE_WORDS:
        return word in _TRUE_WORDS
    raise argparse.ArgumentTypeError(f"expected auto, null, true or false, received {text!r}")


def _add_setting(arguments: Any, name: str, info: Any) -> None:
    members = _members(info.annotation)
    flags = [option_name(name)] + (["--env"] if name == "env_id" else [])
    help_text = _help(
        info.description,
        info.get_default(call_default_factory=True)
        if name not in HELP_DEFAULTS
        else HELP_DEFAULTS[name],
    )
    if set(members) == {bool, type(None)}:  # --flag [auto|true|false], --no-flag
        arguments.add_argument(
            *flags,
            dest=name,
            nargs="?",
            const=True,
            type=_tri_state,
            default=argparse.SUPPRESS,
            metavar="auto|false",
            help=f"{help_text} --no-{flags[0][2:]}: false.",
        )
        arguments.add_argument(
            f"--no-{flags[0][2:]}",
            dest=name,
            action="store_const",
            const=False,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
        return
    if set(members) == {bool}:
        arguments.add_argument(
            *flags,
            dest=name,
            action=argparse.BooleanOptionalAction,
            default=argparse.SUPPRESS,
            help=help_text,
        )
        return
    arguments.add_argument(
        *flags,
        dest=name,
        type=_converter(name, members),
        default=argparse.SUPPRESS,
        metavar=_metavar(name, members),
        help=help_text,
    )


def given_settings(namespace: argparse.Namespace, fields: Iterable[str]) -> dict[str, Any]:
    """The settings given as options in ``namespace`` (parsed by a parser of :func:`add_setting_arguments`)."""
    names = set(fields)
    return {key: value for key, value in vars(namespace).items() if key in names}


def unknown_option_hint(option: str, offered: Iterable[str], command: str | None) -> str:
    """A hint for an option a command does not know: the closest of the ``offered`` option strings, or the
    commands that offer it when it is a setting of another command; '' when there is neither."""
    name = option.split("=", 1)[0]
    field = name.lstrip("-").replace("-", "_")
    elsewhere = [
        other
        for group in GROUPS
        for setting, commands in group.fields.items()
        if setting == field
        for other in commands
        if other != command
    ]
    if elsewhere and command is not None:
        return f"{name} is a setting of oakemu {' and oakemu '.join(elsewhere)}, not of oakemu {command}"
    close = difflib.get_close_matches(
        name, [o for o in offered if o.startswith("--")], n=1, cutoff=0.6
    )
    return f"did you mean {close[0]}?" if close else ""


ENV_PREFIX = "OAKEMU_"
DEPLOYMENT_VARIABLES = frozenset(
    {
        "OAKEMU_CONFIG_FILE",
        "OAKEMU_PARENT_PID",
        "OAKEMU_INFERENCE_ADDRESS",
        "OAKEMU_VENV",
        "OAKEMU_TORCH",
        "OAKEMU_TORCH_INDEX",
        "OAKEMU_EXTRAS",
        "OAKEMU_IMAGE",
        "OAKEMU_IMAGE_CACHE",
        "OAKEMU_CUDA_IMAGE",
        "OAKEMU_TEST_IMAGE",
        "OAKEMU_SHM_SIZE",
        "OAKEMU_ACTORS",
        "OAKEMU_LEARNER_CONSTRAINT",
        "OAKEMU_CURVE_ACTOR_SECRET_KEY",
        "OAKEMU_CURVE_MONITOR_SECRET_KEY",
        "OAKEMU_KEYS_DIR",
        "OAKEMU_GRAFANA_IMAGE",
        "OAKEMU_PROMETHEUS_IMAGE",
        "OAKEMU_GRAFANA_ADMIN_PASSWORD",
    }
)
"""``OAKEMU_*`` variables that are not settings: the TOML file, the launcher's own, and those of ``run.sh``,
the compose files and the image build (``OAKEMU_PUBLISH_*`` too)."""


def unknown_variables(fields: Iterable[str], environ: Mapping[str, str]) -> list[str]:
    """A warning per ``OAKEMU_*`` variable of ``environ`` that names none of the settings ``fields`` (a typo is
    otherwise ignored silently), naming the closest setting's variable when one is close
    (:func:`difflib.get_close_matches`)."""
    known = {ENV_PREFIX + name.upper() for name in fields if name != "config_file"}
    suffixes = sorted(variable[len(ENV_PREFIX) :] for variable in known)
    warnings = []
    for name in sorted(environ):
        upper = name.upper()
        if (
            not upper.startswith(ENV_PREFIX)
            or upper in known | DEPLOYMENT_VARIABLES
            or upper.startswith(ENV_PREFIX + "PUBLISH_")
        ):
            continue
        close = difflib.get_close_matches(upper[len(ENV_PREFIX) :], suffixes, n=1, cutoff=0.6)
        hint = (
            f"did you mean {ENV_PREFIX}{close[0]}?"
            if close
            else "`oakemu train --help` lists the settings"
        )
        warnings.append(f"{name} is not a setting and is ignored ({hint})")
    return warnings

"""``oakemu`` command line: one entry point, one subcommand per service.

    oakemu train [--preset NAME] [--resume RUN] [--config FILE] [SETTING ...]
    oakemu tune [--preset NAME] [--trials N] [--space FILE] [--storage URL --study NAME] [SETTING ...]
    oakemu learner [--config FILE] [SETTING ...]
    oakemu actor [--config FILE] [SETTING ...]
    oakemu monitor [RUN | --connect tcp://HOST:PORT] [--json] [--once] [--timeout S]
    oakemu evaluate CHECKPOINT [--episodes N] [--greedy | --sampled] [--seed S] [--video DIR] [--json]
    oakemu export CHECKPOINT DIR [--episodes N] [--sampled] [--seed S] [--no-video] [--push-to-hub OWNER/NAME]
    oakemu keygen NAME [--dir DIR] [--force]
    oakemu record --env ENV --episodes N --output PATH [--checkpoint CKPT | --policy random|module:callable] [--seed S]

The settings are options of the commands whose process reads them, grouped by role
(:mod:`oakemu_core.options`; ``oakemu train --help`` lists them); ``OAKEMU_*`` environment variables
and a TOML file fill in what the options leave out. Each subcommand imports its service lazily and
returns the service's exit status. A mistake the user can fix (:class:`~oakemu_core.errors.UserError`)
prints one line and exits with its status (2 for bad input); an unknown command or option names the closest one.

Also runnable as ``python -m oakemu_services.cli ...``.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from oakemu_services.arg_types import positive_float, positive_int
from oakemu_services.runtime import startup_done
from oakemu_services.tune_cli import add_tune_parser, tune_arguments

from oakemu_core.config import (
    add_config_arguments,
    config_from_namespace,
    load_config,
    unknown_environment_variables,
)
from oakemu_core.errors import ConfigError, UserError
from oakemu_core.options import unknown_option_hint
from oakemu_core.presets import load_preset, preset_names
from oakemu_core.run.run_folder import find_run_folder, resumed_settings

__all__ = ["build_parser", "main"]

PROG = "oakemu"
EXIT_USAGE = 2
"""Exit status for a usage or configuration error (argparse's convention)."""

DEFAULT_MONITOR_TIMEOUT_S = 5.0


class _Parser(argparse.ArgumentParser):
    """A parser whose errors are one line (no usage dump) pointing at ``--help``; exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(
            EXIT_USAGE, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n"
        )


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``oakemu`` parser and its subcommand parsers by name."""
    parser = _Parser(
        prog=PROG,
        description="OakEmu-RL: actor/learner PPO on emulator games over ZeroMQ.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_Parser
    )  # none: main lists them
    for add in (
        _add_train,
        add_tune_parser,
        _add_learner,
        _add_actor,
        _add_monitor,
        _add_evaluate,
        _add_export,
        _add_record,
        _add_keygen,
    ):
        add(commands)
    return parser, dict(commands.choices)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("oakemu-rl")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def _add_train(commands: Any) -> None:
    train = commands.add_parser(
        "train",
        help="train on this machine: a learner and num_actors actor processes",
        description="Start a learner and num_actors actors on this machine and train until total_env_steps env "
        "steps were trained; the run folder records the settings, logs, metrics and checkpoints.",
        usage="%(prog)s [--preset NAME] [--resume RUN] [--config FILE] [SETTING ...]",
        allow_abbrev=False,
    )
    start = train.add_argument_group("starting point")
    start.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help=f"start from a preset's settings ({', '.join(preset_names())}); options, OAKEMU_* "
        "variables and --config override them",
    )
    start.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN",
        help="continue a run from its last checkpoint, with its own settings: its folder, or its name "
        "in the runs folder (--runs-dir, default runs)",
    )
    add_config_arguments(train, "train")


def _add_learner(commands: Any) -> None:
    _add_service(
        commands,
        "learner",
        "run only the learner (actors connect to it by address)",
        "Bind the learner's sockets on bind_host and train with the actors that join; a run folder that "
        "has a checkpoint is resumed.",
    )


def _add_actor(commands: Any) -> None:
    _add_service(
        commands,
        "actor",
        "run one actor that joins the learner at learner_host",
        "Step envs_per_actor environments and stream the steps to the learner at learner_host; the "
        "environment and its settings come from the learner.",
    )


def _add_service(commands: Any, name: str, summary: str, description: str) -> None:
    """A subcommand that takes the settings its process reads, and nothing else."""
    service = commands.add_parser(
        name,
        help=summary,
        description=description,
        usage="%(prog)s [--config FILE] [SETTING ...]",
        allow_abbrev=False,
    )
    add_config_arguments(service, name)


def _add_monitor(commands: Any) -> None:
    monitor = commands.add_parser(
        "monitor",
        help="attach to a running learner's telemetry and show a live view",
        description="Read-only live view of a running learner (its telemetry socket). A run on this machine that is "
        "not running (it finished or stopped) is shown as its folder last recorded it.",
        allow_abbrev=False,
    )
    monitor.add_argument(
        "run",
        nargs="?",
        default=None,
        metavar="RUN",
        help="a run on this machine: its folder, or its name in $OAKEMU_RUNS_DIR (default runs)",
    )
    monitor.add_argument(
        "--connect",
        default=None,
        metavar="tcp://HOST:PORT",
        help="the learner's telemetry address (default: tcp://$OAKEMU_LEARNER_HOST:"
        "$OAKEMU_TELEMETRY_PORT, i.e. tcp://127.0.0.1:5558)",
    )
    monitor.add_argument(
        "--json", action="store_true", help="print one JSON object per update instead of the view"
    )
    monitor.add_argument("--once", action="store_true", help="print one snapshot and exit")
    monitor.add_argument(
        "--timeout",
        type=positive_float,
        default=DEFAULT_MONITOR_TIMEOUT_S,
        metavar="S",
        help="give up with an error when no snapshot arrives within S seconds "
        f"(default {DEFAULT_MONITOR_TIMEOUT_S})",
    )


def _add_evaluate(commands: Any) -> None:
    evaluate = commands.add_parser(
        "evaluate",
        help="play episodes with a checkpoint and print mean and std of the episodic return",
        description="Play episodes with the policy in CHECKPOINT; print the mean and std of the raw episodic return.",
        allow_abbrev=False,
    )
    evaluate.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT",
        help="checkpoint file, run folder, or a folder written by oakemu export",
    )
    evaluate.add_argument(
        "--episodes", type=positive_int, default=10, metavar="N", help="episodes (default 10)"
    )
    policy = evaluate.add_mutually_exclusive_group()
    policy.add_argument(
        "--greedy",
        dest="greedy",
        action="store_true",
        default=True,
        help="take the most likely action (default)",
    )
    policy.add_argument(
        "--sampled", dest="greedy", action="store_false", help="sample actions from the policy"
    )
    evaluate.add_argument(
        "--seed", type=int, default=1, metavar="SEED", help="environment seed (default 1)"
    )
    evaluate.add_argument(
        "--video",
        type=Path,
        default=None,
        metavar="DIR",
        help="record every episode as DIR/episode_<n>.mp4 (the game's full-colour screen; needs "
        "pip install 'oakemu-rl[video]')",
    )
    evaluate.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _add_export(commands: Any) -> None:
    export = commands.add_parser(
        "export",
        help="write a trained policy as a pickle-free folder (safetensors, JSON, model card, video)",
        description="Evaluate the policy in CHECKPOINT and write it to DIR as safetensors weights, its config and "
        "spaces as JSON and a Hugging Face-style model card with the result and a video. Needs pip install "
        "'oakemu-rl[export,video]'.",
        allow_abbrev=False,
    )
    export.add_argument(
        "checkpoint", type=Path, metavar="CHECKPOINT", help="checkpoint file (or run folder)"
    )
    export.add_argument(
        "directory", type=Path, metavar="DIR", help="folder to write (absent or empty)"
    )
    export.add_argument(
        "--episodes",
        type=positive_int,
        default=10,
        metavar="N",
        help="evaluation episodes for the model card (default 10)",
    )
    export.add_argument(
        "--sampled",
        dest="greedy",
        action="store_false",
        default=True,
        help="evaluate with sampled actions instead of the most likely ones",
    )
    export.add_argument(
        "--seed",
        type=int,
        default=1,
        metavar="SEED",
        help="environment seed of the evaluation (default 1)",
    )
    export.add_argument(
        "--no-video",
        dest="video",
        action="store_false",
        default=True,
        help="leave the evaluation video (replay.mp4) out",
    )
    export.add_argument(
        "--push-to-hub",
        default=None,
        metavar="OWNER/NAME",
        help="also upload the folder to this Hugging Face Hub model repository (token: HF_TOKEN)",
    )


def _add_record(commands: Any) -> None:
    record = commands.add_parser(
        "record",
        help="play episodes (a checkpoint's policy, random or scripted play) and write a Minari dataset",
        description="Play N episodes and write them as a Minari dataset of demonstrations for behaviour cloning "
        "(--bc-dataset DIR). Needs the optional minari package: pip install 'oakemu-rl[bc]'.",
        allow_abbrev=False,
    )
    record.add_argument(
        "--env",
        "--env-id",
        dest="env_id",
        default=None,
        metavar="ENV",
        help="env id (default with --checkpoint: the checkpoint's env)",
    )
    record.add_argument(
        "--episodes", type=positive_int, required=True, metavar="N", help="episodes to record"
    )
    record.add_argument(
        "--output", type=Path, required=True, metavar="DIR", help="dataset folder to create"
    )
    acting = record.add_mutually_exclusive_group()
    acting.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        metavar="CKPT",
        help="act with this checkpoint's policy (file or run folder)",
    )
    acting.add_argument(
        "--policy",
        default=None,
        metavar="random|module:callable",
        help="random play (default) or a scripted policy (observations, action_mask) -> actions",
    )
    record.add_argument(
        "--seed", type=int, default=1, metavar="SEED", help="environment seed (default 1)"
    )
    record.add_argument(
        "--num-envs",
        type=positive_int,
        default=1,
        metavar="K",
        help="envs played together (default 1)",
    )
    record.add_argument(
        "--max-episode-steps",
        type=positive_int,
        default=None,
        metavar="M",
        help="time limit in agent steps (default: the env's own, or the checkpoint run's)",
    )
    record.add_argument(
        "--sampled",
        dest="greedy",
        action="store_false",
        default=True,
        help="with --checkpoint: sample actions instead of taking the most likely one",
    )
    record.add_argument(
        "--overwrite", action="store_true", help="replace an existing dataset folder"
    )
    record.add_argument(
        "--env-kwargs",
        default=None,
        metavar="JSON",
        help="gymnasium.make keyword arguments, e.g. '{\"continuous\": true}' (a checkpoint uses its run's)",
    )


def _add_keygen(commands: Any) -> None:
    keygen = commands.add_parser(
        "keygen",
        help="write a CURVE key pair (NAME.key public, NAME.key_secret secret) for the authenticated "
        "transport",
        description="Write DIR/NAME.key (public: give it to the learner's authorised keys, or to clients when NAME "
        "is the learner) and DIR/NAME.key_secret (secret, mode 0600: stays with its owner). See deploy/README.md.",
        allow_abbrev=False,
    )
    keygen.add_argument("name", metavar="NAME", help="key name, e.g. learner, actor, monitor")
    keygen.add_argument(
        "--dir",
        type=Path,
        default=Path("keys"),
        metavar="DIR",
        help="folder for the key files (default ./keys)",
    )
    keygen.add_argument(
        "--force", action="store_true", help="overwrite existing key files of that name"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``oakemu`` command; returns the process exit status (2 for usage/config errors)."""
    parser, subcommand_parsers = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    command_word = next((arg for arg in args if not arg.startswith("-")), None)
    if command_word is not None and command_word not in _COMMANDS:
        print(f"{PROG}: error: {unknown_command_hint(command_word)}", file=sys.stderr)
        return EXIT_USAGE
    if command_word in _COMMANDS:  # before parsing: `--help` and usage errors warn too
        for warning in unknown_environment_variables():
            print(f"{PROG} {command_word}: warning: {warning}", file=sys.stderr)
    try:
        namespace, unknown = parser.parse_known_args(args)
        if namespace.command is None:  # `oakemu` alone, or only options: name the commands
            if unknown:
                parser.error(f"unrecognized arguments: {' '.join(unknown)}")
            print(
                f"{PROG}: error: expected a command: {', '.join(subcommand_parsers)} ({PROG} --help describes them, "
                f"{PROG} COMMAND --help one)",
                file=sys.stderr,
            )
            return EXIT_USAGE
        if unknown:  # report with the subcommand's name, and the closest option it offers
            command_parser = subcommand_parsers[namespace.command]
            hint = unknown_option_hint(
                unknown[0], command_parser._option_string_actions, namespace.command
            )
            command_parser.error(
                f"unrecognized arguments: {' '.join(unknown)}" + (f"; {hint}" if hint else "")
            )
    except (
        SystemExit
    ) as exit_request:  # --help, --version (0) or a usage error (2, message already printed)
        return _exit_code(exit_request)
    command: str = namespace.command
    if command not in _CALL_STARTUP_DONE_THEMSELVES:
        startup_done()
    try:
        return _COMMANDS[command](namespace)
    except UserError as error:  # every mistake a user can fix: one line, no traceback
        print(f"{PROG} {command}: error: {_one_line(error)}", file=sys.stderr)
        return error.exit_status
    except ServiceUnavailable as error:
        print(f"{PROG} {command}: error: {error}", file=sys.stderr)
        return 1
    except (
        KeyboardInterrupt
    ):  # a second Ctrl-C, or one before the services installed their handlers
        return 130
    except OSError as error:  # the machine, not the input: a permission, a full disk
        print(f"{PROG} {command}: error: {_one_line(error)}", file=sys.stderr)
        return 1


def unknown_command_hint(word: str) -> str:
    """The error for a word that names no subcommand, with the closest one (:func:`difflib.get_close_matches`)."""
    close = difflib.get_close_matches(word, list(_COMMANDS), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"{PROG} --help lists the commands"
    return f"unknown command {word!r} ({hint})"


def _train(namespace: argparse.Namespace) -> int:
    # A preset, then a resumed run's own config.toml, under --config, OAKEMU_* and options.
    preset = load_preset(namespace.preset) if namespace.preset is not None else None
    base = dict(preset.settings) if preset is not None else {}
    if namespace.resume is not None:
        namespace.resume = _resume_folder(namespace, base)
        base.update(resumed_settings(namespace.resume))
    config = config_from_namespace(namespace, base=base)
    return int(_service("train").main(config, namespace.resume, preset=preset))


def _tune(namespace: argparse.Namespace) -> int:
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError("oakemu tune needs Optuna: pip install 'oakemu-rl[tune]'")
    return int(_service("tune").main(*tune_arguments(namespace)))


def _resume_folder(namespace: argparse.Namespace, base: dict[str, Any]) -> Path:
    """The run folder ``--resume RUN`` names (:func:`find_run_folder`, as ``oakemu monitor RUN`` finds it):
    RUN or ``RUN`` in the runs folder (``--runs-dir``, ``OAKEMU_RUNS_DIR``, ``--config``'s or the preset's,
    default ``runs``), whichever holds a ``config.toml``; RUN again when neither does
    (:func:`resumed_settings` refuses it)."""
    run: Path = namespace.resume
    found = find_run_folder(run) or find_run_folder(
        run, config_from_namespace(namespace, base=base).runs_dir
    )
    return run if found is None else found


def _monitor(namespace: argparse.Namespace) -> int:
    from oakemu_core.transport.auth import client_security

    config = load_config(
        None, prog=f"{PROG} monitor"
    )  # OAKEMU_* settings: learner address, CURVE keys
    monitor = _service("monitor")
    if namespace.run is not None and namespace.connect is not None:
        raise ConfigError("monitor: expected RUN or --connect, received both")
    run_dir = (
        monitor.run_folder(namespace.run, config.runs_dir) if namespace.run is not None else None
    )
    connect = (
        monitor.run_telemetry_address(run_dir)
        if run_dir is not None
        else namespace.connect or config.learner_address(config.telemetry_port)
    )
    return int(
        monitor.main(
            connect,
            json_output=namespace.json,
            once=namespace.once,
            timeout_s=namespace.timeout,
            security=client_security(config),
            run_dir=run_dir,
        )
    )


def _keygen(namespace: argparse.Namespace) -> int:
    from oakemu_core.transport.auth import generate_keypair, load_public_key

    public, secret = generate_keypair(namespace.dir, namespace.name, overwrite=namespace.force)
    print(f"public key {public}: {load_public_key(public).decode()}")
    print(f"secret key {secret} (keep it private)")
    return 0


def _record(namespace: argparse.Namespace) -> int:
    return int(
        _service("record").main(
            env_id=namespace.env_id,
            episodes=namespace.episodes,
            output=namespace.output,
            checkpoint=namespace.checkpoint,
            policy=namespace.policy,
            seed=namespace.seed,
            num_envs=namespace.num_envs,
            greedy=namespace.greedy,
            max_episode_steps=namespace.max_episode_steps,
            overwrite=namespace.overwrite,
            env_kwargs=namespace.env_kwargs,
        )
    )


def _evaluate(namespace: argparse.Namespace) -> int:
    return int(
        _service("evaluate").main(
            namespace.checkpoint,
            episodes=namespace.episodes,
            greedy=namespace.greedy,
            seed=namespace.seed,
            video_dir=namespace.video,
            json_output=namespace.json,
        )
    )


def _export(namespace: argparse.Namespace) -> int:
    return int(
        _service("export").main(
            namespace.checkpoint,
            namespace.directory,
            episodes=namespace.episodes,
            greedy=namespace.greedy,
            seed=namespace.seed,
            video=namespace.video,
            push_to_hub_repo=namespace.push_to_hub,
        )
    )


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": _train,
    "tune": _tune,
    "learner": lambda namespace: int(_service("learner").main(config_from_namespace(namespace))),
    "actor": lambda namespace: int(_service("actor").main(config_from_namespace(namespace))),
    "monitor": _monitor,
    "keygen": _keygen,
    "record": _record,
    "evaluate": _evaluate,
    "export": _export,
}
"""What each subcommand runs: it builds the service's arguments and returns its exit status."""


def _one_line(error: BaseException) -> str:
    """The error's message on one line (newlines joined with "; ")."""
    return (
        "; ".join(part.strip() for part in str(error).splitlines() if part.strip())
        or type(error).__name__
    )


class ServiceUnavailable(RuntimeError):
    """The module implementing a subcommand cannot be imported."""


_CALL_STARTUP_DONE_THEMSELVES = frozenset({"learner", "actor"})
"""Commands whose service turns the garbage collector back on when it is ready (the rest before they start)."""


def _service(name: str) -> Any:
    """Import ``oakemu_services.<name>`` lazily (only the chosen subcommand's dependencies load)."""
    module_name = f"oakemu_services.{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise  # a dependency of the service is missing: keep the real traceback
        raise ServiceUnavailable(f"{module_name} is not installed in this build") from None


def _exit_code(exit_request: SystemExit) -> int:
    code = exit_request.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def run() -> None:
    """Console entry point (``oakemu``, ``python -m oakemu_services.cli``): :func:`main`, then exit with its
    status. Before the interpreter shuts down, every object is frozen out of the garbage
    collector's reach (``gc.freeze``): a process that imported torch otherwise spends about 1 s of
    CPU collecting its modules at exit, and ``oakemu train`` stops three or more such processes at
    once. Exit handlers (``atexit``, ``logging.shutdown``) and thread joins still run, but an object
    caught in a reference cycle is no longer finalised at exit: close files and sockets
    explicitly (every service does) instead of relying on ``__del__``. The collector is off
    during a service's start (:func:`oakemu_services.runtime.startup_done`)."""
    import gc
    import os

    gc.disable()
    os.register_at_fork(
        after_in_child=gc.enable
    )  # a process forked during a start (an env's workers) collects
    status = main()
    gc.freeze()
    sys.exit(status)


if __name__ == "__main__":
    run()

"""The ``oakemu tune`` command line: its options (the study's, then every training setting of ``oakemu
train``, given to each trial) and how they become :func:`oakemu_services.tune.tune`'s arguments.

Kept apart from :mod:`oakemu_services.tune` so that building the ``oakemu`` parser does not import Optuna.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from oakemu_services.arg_types import positive_float, positive_int

from oakemu_core.config import OakEmuConfig, add_config_arguments
from oakemu_core.options import given_settings
from oakemu_core.presets import preset_names

__all__ = ["add_tune_parser", "tune_arguments"]

STUDY_OPTIONS = (
    "trials",
    "timeout_s",
    "storage",
    "study",
    "space",
    "objective",
    "pruner",
    "jobs",
    "study_dir",
    "heartbeat_s",
    "preset",
)
"""The namespace's names that are :func:`~oakemu_services.tune.tune` arguments, not training settings."""


def _jobs(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


def add_tune_parser(commands: Any) -> None:
    """Register ``oakemu tune`` on the ``oakemu`` parser's subcommands."""
    tune = commands.add_parser(
        "tune",
        help="a hyperparameter study (Optuna): trials of training runs with sampled settings",
        description="Run an Optuna study: each trial trains a run (a run folder of its own) with settings "
        "sampled from a search space, scored by its evaluation, and stops early when it falls behind; at the "
        "end the study folder holds the table of trials, the best settings (best.toml, for oakemu train "
        "--config) and plots. Needs pip install 'oakemu-rl[tune]'.",
        usage="%(prog)s [--preset NAME] [--trials N] [--space FILE] [--storage URL --study NAME] [--jobs N|auto] "
        "[SETTING ...]",
        allow_abbrev=False,
    )
    study = tune.add_argument_group("study")
    study.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help=f"the preset every trial starts from ({', '.join(preset_names())}); its budget is each trial's",
    )
    study.add_argument(
        "--trials",
        type=positive_int,
        default=20,
        metavar="N",
        help="the study's trial count: trials ended (complete, pruned or failed) over every worker, "
        "earlier calls on the study included (default 20)",
    )
    study.add_argument(
        "--timeout",
        dest="timeout_s",
        type=positive_float,
        default=None,
        metavar="S",
        help="start no trial after S seconds (a running trial ends first)",
    )
    study.add_argument(
        "--space",
        type=Path,
        default=None,
        metavar="FILE",
        help="search space TOML ([space.learning_rate] low, high, log / choices; default: rl-baselines3-zoo's "
        "PPO ranges, oakemu_core/tuning/spaces/)",
    )
    study.add_argument(
        "--objective",
        choices=("eval", "train"),
        default="eval",
        help="what a trial scores, maximised: eval, the final evaluation's mean return (default); train, "
        "the mean training return of the last 100 episodes",
    )
    study.add_argument(
        "--pruner",
        choices=("median", "halving", "none"),
        default="median",
        help="stop trials that fall behind at their evaluations: median (default; after 5 trials and a "
        "third of the budget), halving (successive halving) or none",
    )
    _add_storage_options(tune.add_argument_group("storage and workers"))
    add_config_arguments(tune, "train")


def _add_storage_options(group: Any) -> None:
    """Where the study lives, and who runs its trials."""
    group.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help="SQLAlchemy URL of a database shared by workers on several machines "
        "(postgresql+psycopg://user:password@host/db, with pip install 'psycopg[binary]'; "
        "default: sqlite, study.db in the study folder)",
    )
    group.add_argument(
        "--study",
        default=None,
        metavar="NAME",
        help="the study's name in the storage (default: the preset's, else the env id); the same "
        "--storage and --study on several machines share the trials",
    )
    group.add_argument(
        "--jobs",
        type=_jobs,
        default=1,
        metavar="N|auto",
        help="trials run at once on this machine, one worker process each (auto: one per 2 CPUs; default 1)",
    )
    group.add_argument(
        "--study-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the study folder: outputs, and the trials' run folders in runs/ (default studies/<study>)",
    )
    group.add_argument(
        "--heartbeat",
        dest="heartbeat_s",
        type=positive_int,
        default=10,
        metavar="S",
        help="seconds between a running trial's heartbeats; a trial silent for 3 (its worker was killed) "
        "is failed by another worker (default 10)",
    )


def tune_arguments(namespace: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(options, settings)`` of a parsed ``oakemu tune``: :func:`~oakemu_services.tune.tune`'s study
    arguments, and the training settings given (``--config FILE`` as ``config_file``)."""
    options = {name: getattr(namespace, name) for name in STUDY_OPTIONS}
    settings = given_settings(namespace, OakEmuConfig.model_fields)
    if getattr(namespace, "config", None) is not None:
        settings["config_file"] = Path(namespace.config)
    return options, settings

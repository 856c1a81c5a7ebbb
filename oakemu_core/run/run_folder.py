"""A run folder across restarts: safe resume checks and cutting logs back to the checkpoint.

A run folder (``runs/<name>/``) holds ``config.toml``, ``checkpoints/``, ``metrics.jsonl`` and
``episodes.jsonl``. A learner started on a folder that already has a checkpoint resumes from it;
before anything in the folder is written:

1. :func:`check_resume_compatible` compares the checkpoint with what this learner was asked for
   (env id, observation/action spaces through the step schema, model parameter names and shapes)
   and raises :class:`ResumeMismatchError` (one message naming both sides and how to start a new
   run) when they disagree;
2. :func:`~oakemu_core.run.run_logs.truncate_run_logs` cuts ``metrics.jsonl`` and
   ``episodes.jsonl`` back to the records whose ``global_step`` is at most the checkpoint's, so
   the resumed run does not write the same range of steps twice (``global_step`` never goes back
   in either file, whatever the number of crashes).

:func:`config_changes` lists which settings of a run's ``config.toml`` a resume would change and
refuses the ones that cannot change (:data:`IMMUTABLE_FIELDS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from oakemu_core.errors import RunFolderError, UserError
from oakemu_core.run.atomic_files import disk_full_error, write_text_atomic
from oakemu_core.run.run_lock import LOCK_FILE_NAME, RunFolderBusyError, RunFolderLock, live_holder
from oakemu_core.run.run_logs import (
    LOG_FILE_NAMES,
    read_json_lines,
    resume_step,
    truncate_after,
    truncate_run_logs,
)
from oakemu_core.transport.settings import PORT_FIELDS

__all__ = [
    "IMMUTABLE_FIELDS",
    "LOG_FILE_NAMES",
    "PORT_FIELDS",
    "ResumeCheck",
    "ResumeMismatchError",
    "check_config_complete",
    "check_resume_compatible",
    "check_resume_folder",
    "resumed_settings",
    "config_changes",
    "describe_spaces",
    "find_run_folder",
    "format_changes",
    "make_new_run_folder",
    "make_run_folder",
    "read_json_lines",
    "resume_step",
    "spent_budget",
    "truncate_after",
    "truncate_run_logs",
    "write_text_atomic",
]


IMMUTABLE_FIELDS = ("env_id", "normalize_observations")
"""Settings a resumed run cannot change: they decide the environment's spaces or the model's shape."""

IGNORED_FIELDS = frozenset({"config_file", "runs_dir", "run_name", *PORT_FIELDS})
"""Settings not compared on resume (where the run lives and listens, not how it trains)."""

log = logging.getLogger("oakemu.run_folder")

NEW_RUN_HINT = (
    "to start a new run instead, give it another name (--run-name NAME or OAKEMU_RUN_NAME=NAME)"
)


class ResumeMismatchError(UserError, ValueError):
    """A run folder's checkpoint (or config) does not fit the learner asked to resume it.

    The message is one line: what the folder holds, what was requested, that nothing was changed,
    and how to start a new run. ``oakemu`` maps it to exit status 2.
    """


# ------------------------------------------------------------------------------- resume checks
def describe_spaces(schema: Mapping[str, Any] | None) -> str:
    """Short text of the spaces in a ``StepSchema.to_dict()``: observation fields and the action distribution,
    e.g. ``observations float32 (4,); actions categorical(num_actions=2)``."""
    if not isinstance(schema, Mapping):
        return "unknown spaces"
    parts = []
    for field in schema.get("fields", []):
        if not isinstance(field, Mapping):
            continue
        name = str(field.get("name", "?"))
        if name == "observations" or name.startswith("observations"):
            parts.append(
                f"{name} {_dtype_name(field.get('dtype'))} {tuple(field.get('shape', ()))}"
            )
    distribution = schema.get("distribution")
    if isinstance(distribution, Mapping):
        details = ", ".join(
            f"{k}={v}"
            for k, v in distribution.items()
            if k != "kind" and v not in (None, 0, [], ())
        )
        parts.append(f"actions {distribution.get('kind', '?')}({details})")
    return "; ".join(parts) or "unknown spaces"


def _dtype_name(dtype: Any) -> str:
    try:
        import numpy as np

        return str(np.dtype(dtype))
    except TypeError:
        return str(dtype)


def _spaces_key(schema: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must match between two schemas: the name, shape and dtype of every field actors send,
    and the distribution. (Value bounds, roles and the fields the learner keeps for itself, such as
    ``policy_revisions``, are left out: they may change between versions without changing a space.
    A recurrent policy's ``policy_state`` is left out too: its size is the network's, which
    :func:`check_resume_compatible` compares and names apart.)"""
    fields = tuple(
        (str(f.get("name")), tuple(f.get("shape", ())), _dtype_name(f.get("dtype")))
        for f in schema.get("fields", [])
        if isinstance(f, Mapping) and f.get("sent", True) and f.get("name") != "policy_state"
    )
    distribution = schema.get("distribution")
    return fields, json.dumps(distribution, sort_keys=True, default=str)


def check_resume_compatible(
    checkpoint_state: Mapping[str, Any],
    *,
    env_id: str,
    schema: Any,
    model: Any = None,
    checkpoint_path: Path | str | None = None,
    network: Any = None,
) -> None:
    """Refuse to resume from a checkpoint made for another env, other spaces or another model.

    Compares ``checkpoint_state["env"]`` (``{"env_id", "schema": StepSchema.to_dict()}``; older
    checkpoints without it are checked on the model alone) with ``env_id`` / ``schema``, and the
    parameter names and shapes of ``checkpoint_state["model"]`` with ``model.state_dict()``. Reads only:
    nothing is written or loaded into ``model``.

    Args:
        checkpoint_state: the dict from :func:`oakemu_core.run.checkpoint.load_checkpoint`.
        env_id: the env id this learner was asked for.
        schema: this learner's :class:`~oakemu_core.step_schema.StepSchema` (or its ``to_dict()``).
        model: this learner's freshly built model (a ``torch.nn.Module``); None skips the model check.
        checkpoint_path: the checkpoint file, named in the message.
        network: this learner's :class:`~oakemu_core.policy.network.NetworkSpec`, compared with the one of
            the checkpoint's settings (absent fields: the defaults); None skips it.

    Raises:
        ResumeMismatchError: env id, spaces or model differ; the one-line message names both sides,
            says nothing was changed and how to start a new run.
    """
    where = (
        f"checkpoint {checkpoint_path}" if checkpoint_path is not None else "the run's checkpoint"
    )
    requested_schema = schema.to_dict() if hasattr(schema, "to_dict") else schema
    env = checkpoint_state.get("env")
    problems: list[str] = []
    saved_env_id = env.get("env_id") if isinstance(env, Mapping) else None
    saved_schema = env.get("schema") if isinstance(env, Mapping) else None
    if saved_env_id is not None and saved_env_id != env_id:
        problems.append(f"env {saved_env_id!r} vs requested {env_id!r}")
    if (
        isinstance(saved_schema, Mapping)
        and isinstance(requested_schema, Mapping)
        and (_spaces_key(saved_schema) != _spaces_key(requested_schema))
    ):
        problems.append(
            f"spaces [{describe_spaces(saved_schema)}] vs requested [{describe_spaces(requested_schema)}]"
        )
    if network is not None and not problems:
        from oakemu_core.policy.network import NetworkSpec

        saved_network = NetworkSpec.from_config(checkpoint_state.get("config") or {})
        if saved_network != network:
            problems.append(
                f"network [{saved_network.describe()}] vs requested [{network.describe()}]"
            )
    if (
        model is not None and not problems
    ):  # another env nearly always means another model: say the cause once
        model_problem = _model_mismatch(checkpoint_state.get("model"), model)
        if model_problem:
            problems.append(model_problem)
    if problems:
        raise ResumeMismatchError(
            f"cannot resume: {where} was made for another environment or model ({'; '.join(problems)}); "
            f"nothing in the run folder was changed. Resume with the run's own settings, or {NEW_RUN_HINT}"
        )


def _model_mismatch(saved: Any, model: Any) -> str:
    """'' when ``saved`` (a state dict) has exactly ``model``'s parameter names and shapes, else what differs."""
    if not isinstance(saved, Mapping):
        return "model: the checkpoint holds no model state"
    current = model.state_dict()
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    shapes = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(current[k].shape)}"
        for k in current
        if k in saved
        and hasattr(saved[k], "shape")
        and tuple(saved[k].shape) != tuple(current[k].shape)
    ]
    parts = []
    if shapes:
        parts.append(
            "parameter shapes differ: "
            + ", ".join(shapes[:3])
            + (" ..." if len(shapes) > 3 else "")
        )
    if missing:
        parts.append(
            "missing in the checkpoint: "
            + ", ".join(missing[:3])
            + (" ..." if len(missing) > 3 else "")
        )
    if unexpected:
        parts.append(
            "not in this model: "
            + ", ".join(unexpected[:3])
            + (" ..." if len(unexpected) > 3 else "")
        )
    return ("model (checkpoint vs requested): " + "; ".join(parts)) if parts else ""


def config_changes(
    old: Mapping[str, Any], new: Mapping[str, Any], *, immutable: tuple[str, ...] = IMMUTABLE_FIELDS
) -> dict[str, tuple[Any, Any]]:
    """Settings that differ between a run's saved configuration and the one requested for its resume.

    Args:
        old: the run's settings (``config.toml`` read with ``tomllib``; unset fields are absent).
        new: the requested settings (``OakEmuConfig.model_dump(mode="json")``).
        immutable: settings that cannot change (default :data:`IMMUTABLE_FIELDS`).

    Returns:
        ``{field: (old, new)}`` for every differing field except :data:`IGNORED_FIELDS` (absent = None).

    Raises:
        ResumeMismatchError: an ``immutable`` field differs (the message lists them as ``field: old -> new``).
    """
    changes: dict[str, tuple[Any, Any]] = {}
    for name in sorted(set(old) | set(new)):
        if name in IGNORED_FIELDS:
            continue
        before, after = _plain(old.get(name)), _plain(new.get(name))
        if before != after:
            changes[name] = (before, after)
    refused = {k: v for k, v in changes.items() if k in immutable}
    if refused:
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in refused.items())
        raise ResumeMismatchError(
            f"cannot resume: the run was made with other settings that cannot change ({listed}); nothing in the "
            f"run folder was changed. Resume with the run's own settings, or {NEW_RUN_HINT}"
        )
    return changes


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return value  # 1.0 == 1 compares equal already
    return value


def format_changes(changes: Mapping[str, tuple[Any, Any]]) -> str:
    """``field: old -> new, ...`` (for the resume warning)."""
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())


# ------------------------------------------------------------------------------ whole folder
@dataclasses.dataclass(frozen=True)
class ResumeCheck:
    """What :func:`check_resume_folder` found in a run folder.

    Attributes:
        changes: ``{setting: (old, new)}`` of the settings a resume changes ({} for a new run).
        checkpoint: the checkpoint the run resumes from; None when the folder has none (a new run).
        update: that checkpoint's PPO update (0 without one).
        trained_env_steps: the env steps it trained on, the count the budget is spent by (0 without one).
    """

    changes: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    checkpoint: Path | None = None
    update: int = 0
    trained_env_steps: int = 0

    def describe(self, run_dir: Path) -> str:
        """``resuming RUN_DIR from checkpoint_<n>.pt (update N, S env steps trained)``, or, without a
        checkpoint, that training starts from the beginning."""
        if self.checkpoint is None:
            return (
                f"resuming {run_dir}: it has no checkpoint yet, training starts from the beginning"
            )
        return (
            f"resuming {run_dir} from {self.checkpoint.name} (update {self.update}, "
            f"{self.trained_env_steps:,} env steps trained)"
        )


def check_resume_folder(
    run_dir: Path,
    config: Any,
    *,
    check_model: bool = True,
    check_budget: bool = False,
    notes: list[str] | None = None,
) -> ResumeCheck:
    """Everything a process checks before it writes into a run folder it may resume; call it holding
    the folder (:class:`~oakemu_core.run.run_lock.RunFolderLock`).

    When ``run_dir`` has a checkpoint: checks that its ``config.toml`` names every setting
    (:func:`check_config_complete`) and compares it with ``config`` (:func:`config_changes`), then
    compares the checkpoint the run resumes from (the newest readable one,
    :func:`~oakemu_core.run.checkpoint.newest_readable_checkpoint`) with the env, spaces and model
    ``config`` asks for (:func:`check_resume_compatible`; the model is built on the CPU when
    ``check_model``). Only once every check passed are newer checkpoints that do not load set aside
    (:func:`~oakemu_core.run.checkpoint.set_aside_unreadable`): the run resumes from the older one. A
    folder without a checkpoint is a new run: nothing is compared.

    Args:
        run_dir: the run folder.
        config: the requested :class:`~oakemu_core.config.OakEmuConfig`.
        check_model: also build the model and compare parameter names and shapes.
        check_budget: also refuse a run whose checkpoint already trained ``config.total_env_steps``.
        notes: receives one line per unreadable checkpoint set aside; None logs them as warnings.

    Returns:
        :class:`ResumeCheck`: the settings that will change (for a warning) and the checkpoint the run
        resumes from; no changes and no checkpoint for a new run.

    Raises:
        ResumeMismatchError: a setting that cannot change differs, or the checkpoint was made for
            another env, other spaces or another model.
        oakemu_core.run.checkpoint.CheckpointError: no checkpoint of the folder loads.
        RunFolderError: ``config.toml`` lacks settings; with ``check_budget``, the run has nothing left
            to train. Nothing in the folder was changed in these cases.
    """
    # A new run has no checkpoint file yet: answer without importing torch (checkpoint.py does),
    # which would hold up ``oakemu train`` before it starts any child process.
    if not any((Path(run_dir) / "checkpoints").glob("*.pt")):
        return ResumeCheck()
    from oakemu_core.run.checkpoint import newest_readable_checkpoint, set_aside_unreadable

    changes = _settings_changes(Path(run_dir), config)
    found = newest_readable_checkpoint(Path(run_dir))
    if found is None:
        return ResumeCheck(changes)
    checkpoint, state, unreadable = found
    _check_checkpoint_fits(state, checkpoint, config, check_model=check_model)
    if check_budget:
        _check_budget_left(state, config.total_env_steps, run_dir)
    for note in set_aside_unreadable(checkpoint, unreadable):
        if notes is not None:
            notes.append(note)
        else:
            log.warning("%s", note)
    from oakemu_core.run.checkpoint import checkpoint_trained_steps

    ppo = state.get("ppo")
    update = ppo.get("iterations") if isinstance(ppo, Mapping) else None
    return ResumeCheck(
        changes,
        checkpoint,
        int(update) if isinstance(update, int) else 0,
        checkpoint_trained_steps(state),
    )


def _settings_changes(run_dir: Path, config: Any) -> dict[str, tuple[Any, Any]]:
    """The settings of ``run_dir/config.toml`` that ``config`` changes (:func:`config_changes`),
    after :func:`check_config_complete`; {} when the file is missing or unreadable (the learner
    rewrites it; the checkpoint still decides)."""
    import tomllib

    from oakemu_core.run.config_file import settings_from_toml

    config_toml = run_dir / "config.toml"
    if not config_toml.is_file():
        return {}
    try:
        old = settings_from_toml(config_toml.read_text(encoding="utf-8"), type(config).model_fields)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}
    check_config_complete(
        run_dir, [name for name in type(config).model_fields if name != "config_file"]
    )
    return config_changes(old, config.model_dump(mode="json"))


def _check_checkpoint_fits(
    state: Mapping[str, Any], checkpoint: Path, config: Any, *, check_model: bool
) -> None:
    """:func:`check_resume_compatible` of the checkpoint ``state`` with the env, spaces and (with
    ``check_model``, built on the CPU) model that ``config`` asks for."""
    from oakemu_core.envs.factory import env_spec
    from oakemu_core.policy.schemas import schema_for_env

    spec = env_spec(
        config.env_id, settings_file=config.emulator_settings, options=config.env_options
    )
    schema = schema_for_env(spec, config.network)
    model = None
    if check_model and schema.distribution is not None:
        from oakemu_core.policy.models import build_model

        model = build_model(
            spec.observation_layout,
            schema.distribution,
            normalize_observations=config.normalize_observations,
            network=config.network,
        )
    check_resume_compatible(
        state,
        env_id=config.env_id,
        schema=schema,
        model=model,
        checkpoint_path=checkpoint,
        network=config.network,
    )


def _check_budget_left(state: Mapping[str, Any], total_env_steps: int, run_dir: Path) -> None:
    """Raise :class:`RunFolderError` when the checkpoint ``state`` already trained ``total_env_steps``."""
    from oakemu_core.run.checkpoint import checkpoint_trained_steps

    trained = checkpoint_trained_steps(state)
    if trained >= total_env_steps:
        update = (
            state.get("ppo", {}).get("iterations", "?")
            if isinstance(state.get("ppo"), Mapping)
            else "?"
        )
        raise RunFolderError(
            f"{run_dir}: the run already reached its budget ({trained} env steps trained by update "
            f"{update}, total_env_steps={total_env_steps}); to train it longer, raise --total-env-steps"
        )


def spent_budget(run_dir: Path) -> tuple[int, int] | None:
    """``(trained, total_env_steps)`` when the run in ``run_dir`` trained its whole budget: the env steps
    its newest readable checkpoint trained on and the ``total_env_steps`` of its ``config.toml``; None
    when it has budget left or either cannot be read. Reads only (loads the checkpoint: imports torch)."""
    import tomllib

    from oakemu_core.errors import CheckpointError
    from oakemu_core.run.checkpoint import checkpoint_trained_steps, newest_readable_checkpoint

    try:
        total = tomllib.loads((Path(run_dir) / "config.toml").read_text(encoding="utf-8")).get(
            "total_env_steps"
        )
        found = newest_readable_checkpoint(Path(run_dir))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, CheckpointError):
        return None
    if found is None or not isinstance(total, int):
        return None
    trained = checkpoint_trained_steps(found[1])
    return (trained, total) if trained >= total else None


ADDED_SETTINGS = frozenset(
    "net_arch activation shared_torso cnn impala_channels recurrent recurrent_hidden shared_core "
    "ortho_init policy_module sequence_length compile_update inference_device".split()
)
"""Settings added after run folders existed: a ``config.toml`` written before them lacks them, and their
defaults are how those runs behaved (a feed-forward network of the default layers, orthogonally
initialised). A new setting is listed here when its default keeps the earlier behaviour."""


def check_config_complete(run_dir: Path, field_names: Collection[str]) -> None:
    """Refuse a run folder whose ``config.toml`` does not name every setting: a file cut short (a
    copy, a crash outside ``oakemu``) is still valid TOML, and the settings it lost would silently take
    their defaults. ``config.toml`` names each setting as ``name = value`` or, unset, ``# name = (unset)``.
    A missing or unparsable file passes (the callers deal with those); :data:`ADDED_SETTINGS` may be
    missing (a run made before they existed).

    Args:
        run_dir: the run folder.
        field_names: every setting a complete file names (``OakEmuConfig.model_fields`` without ``config_file``).

    Raises:
        RunFolderError: one line naming the file and the settings it lacks.
    """
    import tomllib

    from oakemu_core.run.config_file import UNSET_LINE

    path = Path(run_dir) / "config.toml"
    try:
        text = path.read_text(encoding="utf-8")
        settings = tomllib.loads(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return
    named = set(settings) | set(UNSET_LINE.findall(text))
    missing = [name for name in field_names if name not in named and name not in ADDED_SETTINGS]
    if missing:
        listed = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise RunFolderError(
            f"{path} is incomplete: it lacks {len(missing)} of {len(field_names)} settings "
            f"({listed}); it was cut short, so the run's settings are unknown. Nothing was "
            f"changed; restore the file, or {NEW_RUN_HINT}"
        )


def find_run_folder(
    run: str | os.PathLike[str], runs_dir: str | os.PathLike[str] | None = None
) -> Path | None:
    """The run folder a user's ``RUN`` names (``oakemu train --resume RUN``, ``oakemu monitor RUN``):
    ``RUN`` itself when it holds a ``config.toml``, else ``runs_dir/RUN`` when that does (a run's name in
    the runs folder; not looked for when ``runs_dir`` is None); None when neither does. Reads only."""
    candidates = [Path(run)] if runs_dir is None else [Path(run), Path(runs_dir) / run]
    return next((folder for folder in candidates if (folder / "config.toml").is_file()), None)


def resumed_settings(run_dir: Path) -> dict[str, Any]:
    """The settings of a run folder given to ``--resume``: its ``config.toml`` without the ports
    (:data:`PORT_FIELDS`: a resumed ``oakemu train`` picks free ones again).

    Raises:
        RunFolderError: no such folder, a folder without ``config.toml``, or one that is not valid TOML
            (the message names ``--resume`` and the path). A folder without a checkpoint yet starts
            from the beginning.
    """
    import tomllib

    from oakemu_core.run.config_file import settings_from_toml

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is a file" if run_dir.exists() else "does not exist"
        raise RunFolderError(
            f"--resume {run_dir}: expected a run folder (runs/<name>/) or the name of one in the "
            f"runs folder, received a path that {what}"
        )
    config_toml = run_dir / "config.toml"
    if not config_toml.is_file():
        raise RunFolderError(
            f"--resume {run_dir}: expected a run folder written by oakemu train, received a "
            "folder without config.toml"
        )
    try:
        settings = settings_from_toml(config_toml.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise RunFolderError(f"--resume {run_dir}: cannot read config.toml ({error})") from None
    return {name: value for name, value in settings.items() if name not in PORT_FIELDS}


def make_run_folder(run_dir: Path) -> Path:
    """Create ``run_dir`` and its ``logs/`` folder (parents too; existing ones are kept); returns ``run_dir``.

    Raises:
        DiskFullError: no space (or quota) left; the message names the folder and the bytes free.
        RunFolderError: the place is read-only, not a folder or not writable (one line naming it).
    """
    run_dir = Path(run_dir)
    _make_folder(run_dir / "logs", run_dir.parent, parents=True)
    return run_dir


NEW_NAME_TRIES = 1000
"""How many numbered names (``name-2`` ... ``name-1000``) :func:`make_new_run_folder` tries."""


def make_new_run_folder(
    runs_dir: Path, name: str, *, numbered: bool, hint: str | Callable[[Path, bool], str] = ""
) -> RunFolderLock:
    """Make a new run folder ``runs_dir/name`` and hold it (:class:`RunFolderLock`): a new run never
    writes into a folder that exists.

    Each candidate is made with ``mkdir`` without ``exist_ok``, so two processes never take the same
    one. With ``numbered``, the first free of ``name``, ``name-2``, ``name-3``, ... is taken (two runs
    named in the same second); without it, ``name`` is taken only when it does not exist or is an empty
    folder. ``runs_dir`` (and its parents) is made when missing.

    Args:
        runs_dir: the folder holding run folders.
        name: the run's name.
        numbered: take a numbered name when ``name`` exists, instead of refusing.
        hint: (not numbered) what to do instead, appended to the refusal of an existing folder; or a
            function of the folder and whether a live run holds it that returns that text.

    Returns:
        The lock; its ``run_dir`` is the folder made.

    Raises:
        RunFolderBusyError: (not numbered) a live run holds ``name`` (the message names its pid).
        RunFolderError: (not numbered) ``name`` holds another run; or ``runs_dir`` is read-only, not a
            folder or not writable (one line naming it).
        DiskFullError: no space (or quota) left.
    """
    runs_dir = Path(runs_dir)
    _make_folder(runs_dir, runs_dir, parents=True)
    candidates = (
        [name, *(f"{name}-{n}" for n in range(2, NEW_NAME_TRIES + 1))] if numbered else [name]
    )
    for candidate in candidates:
        run_dir = runs_dir / candidate
        if _make_folder(run_dir, runs_dir):
            try:
                return RunFolderLock.acquire(run_dir)
            except BaseException:
                with contextlib.suppress(
                    OSError
                ):  # made here; not removed when it holds something now
                    run_dir.rmdir()
                raise
        if not numbered:
            return _take_empty_folder(run_dir, hint)
    raise RunFolderError(
        f"--runs-dir {runs_dir}: {name} and {name}-2 ... {name}-{NEW_NAME_TRIES} are all taken; "
        "choose another --run-name"
    )


def _make_folder(folder: Path, runs_dir: Path, *, parents: bool = False) -> bool:
    """``mkdir folder``: True when made, False when something of that name exists (with ``parents``,
    an existing folder is fine: True).

    Raises:
        RunFolderError: ``runs_dir`` is read-only, not a folder or not writable.
        DiskFullError: no space left.
    """
    try:
        folder.mkdir(parents=parents, exist_ok=parents)
    except FileExistsError:
        if parents:  # exist_ok: it exists and is no folder
            raise RunFolderError(
                f"--runs-dir {runs_dir}: expected a folder for run folders, received a file"
                f"{'' if folder == runs_dir else f' at {folder}'}"
            ) from None
        return False
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full_error(error, folder, 4096) from None
        raise RunFolderError(
            f"--runs-dir {runs_dir}: cannot make {folder} ({error.strerror or error}); "
            "choose a folder this user can write with --runs-dir"
        ) from None
    return True


def _take_empty_folder(run_dir: Path, hint: str | Callable[[Path, bool], str]) -> RunFolderLock:
    """Hold the existing ``run_dir`` for a new run when it is an empty folder; refuse it otherwise."""

    def then(live: bool) -> str:
        text = hint(run_dir, live) if callable(hint) else hint
        return f"; {text}" if text else ""

    if not run_dir.is_dir():
        raise RunFolderError(
            f"{run_dir} exists and is not a folder; nothing was changed{then(False)}"
        )
    holder = live_holder(run_dir)
    if holder is not None:
        raise RunFolderBusyError(
            f"{run_dir} is in use by a live run ({holder}); nothing was changed{then(True)}"
        )
    if not _holds_files(run_dir):
        lock = RunFolderLock.acquire(run_dir, hint=then(True)[2:])
        if not _holds_files(run_dir):
            return lock
        lock.release()
    raise RunFolderError(
        f"{run_dir} exists and holds an earlier run; nothing was changed{then(False)}"
    )


def _holds_files(run_dir: Path) -> bool:
    return any(entry.name != LOCK_FILE_NAME for entry in run_dir.iterdir())

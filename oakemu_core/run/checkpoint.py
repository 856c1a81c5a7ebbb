"""Atomic checkpoint files and RNG state capture.

A checkpoint is one ``torch.save`` file holding a dict of plain values: dicts, lists, tuples,
str, int, float, bool, None and torch tensors (``model.state_dict()``, ``optimizer.state_dict()``,
schedule and counter dicts, :func:`capture_rng_state`). It is read back with
``torch.load(weights_only=True)``, which refuses arbitrary pickled objects, so
:func:`save_checkpoint` rejects anything else up front rather than at resume time.

Layout in a run folder: :mod:`oakemu_core.run.checkpoint_paths` (``checkpoint_<n>.pt`` files and a
``latest.pt`` link to the newest, found there without torch).

Writes are atomic: the file is written to a temporary name in the same directory, flushed and
fsync'ed, renamed over the final name with :func:`os.replace` (atomic on POSIX), and the directory
is fsync'ed so the rename survives a power cut. A crash at any point leaves either the old file or
the new one, never a torn file.
"""

from __future__ import annotations

import io
import logging
import os
import random
import re
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oakemu_core.errors import CheckpointError
from oakemu_core.run.checkpoint_paths import (
    CHECKPOINT_DIR_NAME,
    LATEST_NAME,
    checkpoint_path,
    is_numbered_checkpoint,
    latest_checkpoint,
    latest_target,
    numbered_checkpoints,
)

__all__ = [
    "CHECKPOINT_DIR_NAME",
    "LATEST_NAME",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointWriteFailed",
    "CheckpointWriter",
    "capture_rng_state",
    "checkpoint_path",
    "checkpoint_trained_steps",
    "latest_checkpoint",
    "load_checkpoint",
    "load_run_checkpoint",
    "newest_readable_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "save_run_checkpoint",
    "set_aside_unreadable",
]

_PLAIN_SCALARS = (str, int, float, bool, type(None))


log = logging.getLogger("oakemu.checkpoint")


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the given path (no such file, or a run folder without checkpoints)."""


class CheckpointWriteFailed(RuntimeError):
    """:class:`CheckpointWriter` gave up: ``max_consecutive_failures`` checkpoint writes in a row failed.

    The message names the file, the error, the bytes needed and free, and the last checkpoint that
    is still loadable. Training should stop (the run can be resumed from that checkpoint).
    """


def _check_plain(value: Any, where: str) -> None:
    """Raise TypeError naming the first entry that ``torch.load(weights_only=True)`` would refuse."""
    # Exact types: numpy scalars subclass float/int but a weights_only load refuses them.
    if type(value) in _PLAIN_SCALARS or isinstance(value, torch.Tensor):
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(
                    f"checkpoint state: key {key!r} at {where} must be str or int, "
                    f"got {type(key).__name__}"
                )
            _check_plain(item, f"{where}[{key!r}]")
        return
    if type(value) in (list, tuple, torch.Size):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"checkpoint state: {where} has type {type(value).__name__}; expected dict, list, tuple, str, int, "
        f"float, bool, None or torch.Tensor (convert numpy arrays with torch.from_numpy, dataclasses with "
        f"dataclasses.asdict)"
    )


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (temp file in the same directory, fsync, rename).

    Args:
        path: destination file; its parent directory is created if needed.
        state: dict of plain values and tensors (see the module docstring).

    Raises:
        TypeError: ``state`` holds a value that a ``weights_only`` load would refuse (the message
            names its key path). Nothing is written in that case.
        OSError: the write failed; the previous file at ``path``, if any, is untouched and the
            temporary file is removed.
    """
    path = Path(path)
    if not isinstance(state, dict):
        raise TypeError(f"checkpoint state: expected a dict, got {type(state).__name__}")
    _check_plain(state, "state")
    # Serialised in memory first: torch's zip writer reports a failed file write (a full disk) as a
    # RuntimeError ("unexpected pos"); a plain write of the bytes raises the OSError itself.
    serialised = io.BytesIO()
    torch.save(state, serialised)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(serialised.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(path.parent)


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Args:
        path: the checkpoint file (``latest.pt`` symlinks are followed).
        map_location: device for the loaded tensors (``torch.load``'s ``map_location``).

    Returns:
        The saved dict.

    Raises:
        CheckpointNotFoundError: no file at ``path`` (a FileNotFoundError too).
        CheckpointError: the file is truncated, corrupt, holds disallowed objects, or is not a dict;
            the message is one line naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"checkpoint: no file at {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError, ...
        raise CheckpointError(
            f"checkpoint: {path} is not a readable checkpoint (expected a file written by "
            f"oakemu train; torch: {_torch_reason(exc)})"
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint: {path} holds a {type(state).__name__}, expected a dict")
    return state


def _torch_reason(error: Exception) -> str:
    """The gist of a ``torch.load`` error on one line (its pickler detail, not its advice to unpickle
    untrusted files), at most 160 characters."""
    text = str(error)
    detail = re.search(
        r"WeightsUnpickler error:\s*(.+?)\s*(?:Check the documentation|$)", text, re.S
    )
    reason = " ".join(
        (
            detail.group(1) if detail else text.strip().splitlines()[0] if text.strip() else ""
        ).split()
    )
    reason = f"{type(error).__name__}: {reason}" if reason else type(error).__name__
    return reason if len(reason) <= 160 else reason[:157] + "..."


def load_run_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """``(file, state)`` of a checkpoint of ``oakemu train``: a file, or a run folder's latest
    (:func:`resolve_checkpoint`), loaded on the CPU (:func:`load_checkpoint`).

    Raises:
        CheckpointError: no checkpoint there, an unreadable file, or one without the ``env``, ``config``
            and ``model`` entries every checkpoint of a run holds.
    """
    file = resolve_checkpoint(path)
    state = load_checkpoint(file)
    missing = [key for key in ("env", "config", "model") if not isinstance(state.get(key), dict)]
    if missing:
        raise CheckpointError(
            f"checkpoint: {file} is not a checkpoint of oakemu train (no {', '.join(missing)})"
        )
    return file, state


def checkpoint_trained_steps(state: Mapping[str, Any]) -> int:
    """Env steps trained on when a checkpoint was written (the run's budget count): its
    ``ppo.trained_env_steps``, or for checkpoints without it the env steps received (``global_step``)."""
    trained = (
        state.get("ppo", {}).get("trained_env_steps")
        if isinstance(state.get("ppo"), Mapping)
        else None
    )
    return int(trained if trained is not None else state.get("global_step", 0))


def save_run_checkpoint(
    run_dir: Path, update: int, state: dict[str, Any], *, keep_last: int | None = None
) -> Path:
    """Save ``state`` as the checkpoint of ``update`` in a run folder and point ``latest.pt`` at it.

    The ``latest.pt`` symlink is replaced atomically after the numbered file is durable. With
    ``keep_last`` set, older numbered checkpoints beyond the newest ``keep_last`` are deleted.

    Returns:
        The path of the numbered checkpoint file.

    Raises:
        ValueError: negative ``update`` or ``keep_last`` < 1. TypeError/OSError as :func:`save_checkpoint`.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last: expected >= 1 or None, got {keep_last}")
    path = checkpoint_path(run_dir, update)
    save_checkpoint(path, state)
    directory = path.parent
    tmp_link = directory / f".{LATEST_NAME}.{os.getpid()}.tmp"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    try:
        os.symlink(path.name, tmp_link)
        os.replace(tmp_link, directory / LATEST_NAME)
    except OSError:  # e.g. no space for the link: latest.pt still points at the previous checkpoint
        tmp_link.unlink(missing_ok=True)
        raise
    _fsync_directory(directory)
    if keep_last is not None:
        for old in numbered_checkpoints(directory)[:-keep_last]:
            old[1].unlink(missing_ok=True)
    return path


UNREADABLE_SUFFIX = ".unreadable"
"""Appended to the name of a checkpoint file that a resume found unreadable and set aside."""


def newest_readable_checkpoint(
    run_dir: Path,
    map_location: str | torch.device = "cpu",
) -> tuple[Path, dict[str, Any], list[tuple[Path, str]]] | None:
    """The checkpoint a run folder resumes from: the newest one that loads, newest first ``latest.pt``
    (its target), then ``checkpoint_<n>.pt`` by falling ``n``. Reads only.

    Returns:
        ``(file, state, unreadable)``: the file, its loaded state and ``(file, reason)`` for each newer
        candidate that did not load (truncated, damaged); None when the folder has no checkpoint.

    Raises:
        CheckpointError: there are checkpoints and none loads; one line naming each file and why.
    """
    directory = Path(run_dir) / CHECKPOINT_DIR_NAME
    latest = latest_target(directory)
    candidates: list[Path] = [] if latest is None else [latest]
    # latest.pt's target is one of the numbered files: each file is tried (and set aside) once.
    seen = {path.resolve() for path in candidates}
    candidates += [
        path for _, path in reversed(numbered_checkpoints(directory)) if path.resolve() not in seen
    ]
    unreadable: list[tuple[Path, str]] = []
    for path in candidates:
        try:
            return path, load_checkpoint(path, map_location=map_location), unreadable
        except CheckpointError as error:
            cause = error.__cause__
            unreadable.append(
                (path, _torch_reason(cause) if isinstance(cause, Exception) else str(error))
            )
    if unreadable:
        listed = "; ".join(f"{path.name}: {reason}" for path, reason in unreadable)
        raise CheckpointError(
            f"cannot resume {run_dir}: no checkpoint in {directory} is readable (truncated or "
            f"damaged; torch: {listed}); nothing in the run folder was changed"
        )
    return None


def set_aside_unreadable(resumed: Path, unreadable: list[tuple[Path, str]]) -> list[str]:
    """Rename each unreadable checkpoint to ``<name>.unreadable`` (kept for inspection; a resumed run
    writes its numbers again) and point ``latest.pt`` at ``resumed``, the file the run resumes from.

    Args:
        resumed: the checkpoint the run resumes from (:func:`newest_readable_checkpoint`).
        unreadable: ``(file, reason)`` of the newer files that did not load.

    Returns:
        One line per file set aside: which, why, what the run resumes from instead.

    Raises:
        OSError: a rename or the new ``latest.pt`` link failed.
    """
    notes = []
    for path, reason in unreadable:
        kept = path.with_name(path.name + UNREADABLE_SUFFIX)
        os.replace(path, kept)
        notes.append(
            f"checkpoint {path} is not readable (truncated or damaged; torch: {reason}); resuming from "
            f"{resumed.name} instead (the file is kept as {kept.name})"
        )
    if unreadable and is_numbered_checkpoint(resumed.name):
        directory = resumed.parent
        tmp_link = directory / f".{LATEST_NAME}.{os.getpid()}.tmp"
        tmp_link.unlink(missing_ok=True)
        os.symlink(resumed.name, tmp_link)
        os.replace(tmp_link, directory / LATEST_NAME)
        _fsync_directory(directory)
    return notes


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint file from a path that is either the file or a run folder (its latest checkpoint).

    Raises:
        CheckpointNotFoundError: a folder without checkpoints, or no such file.
    """
    path = Path(path)
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointNotFoundError(
                f"{path}: expected a checkpoint file or a run folder with checkpoints/, "
                "received a folder without checkpoints"
            )
        path = found
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such checkpoint file")
    return path


def capture_rng_state() -> dict[str, Any]:
    """State of Python's ``random``, numpy's global RNG and torch's CPU (and CUDA, if present) RNGs,
    as plain values and tensors that :func:`save_checkpoint` accepts."""
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the RNGs from :func:`capture_rng_state`'s dict. The CUDA RNGs are restored only
    when the state has them and this machine has the same number of CUDA devices.

    Raises:
        ValueError: a required entry (``python``, ``numpy``, ``torch``) is missing.
    """
    missing = [key for key in ("python", "numpy", "torch") if key not in state]
    if missing:
        raise ValueError(f"rng state: missing entries {missing}, got {sorted(state)}")
    python_state = state["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    numpy_state = state["numpy"]
    key = numpy_state["key"]
    key = key.cpu().numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {"key": key.astype(np.uint32), "pos": int(numpy_state["pos"])},
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        }
    )
    torch.set_rng_state(state["torch"].cpu())
    if "torch_cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["torch_cuda"])
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])


class CheckpointWriter:
    """Writes a run's checkpoints and survives failed writes (a full disk must not stop training).

    :meth:`save` writes ``run_dir/checkpoints/checkpoint_<update>.pt`` atomically and points
    ``latest.pt`` at it (:func:`save_run_checkpoint`). When the write fails with an ``OSError``
    (``ENOSPC``, ``EIO``, ``EDQUOT``, ...):

    - the previous checkpoint stays as it was and loadable (the temporary file is removed, the
      ``latest.pt`` link still points at the previous file);
    - one ERROR line is logged naming the file, the error, the bytes needed (the size of the state)
      and the bytes free on that file system (``shutil.disk_usage``), and the last good checkpoint;
    - :attr:`failures` (total) and :attr:`consecutive_failures` go up, :meth:`save` returns None and
      the caller goes on training; the next :meth:`save` (the next checkpoint time) is the retry;
    - after ``max_consecutive_failures`` failures in a row, :meth:`save` raises
      :class:`CheckpointWriteFailed` with that message (training should stop).

    A successful save resets :attr:`consecutive_failures` to 0. The run's final checkpoint is the save
    called with ``final=True``; when it fails, one ERROR line ``final checkpoint <file> not written: ...``
    (the same details) is logged, :meth:`save` returns None and raises nothing (no retry follows), and
    :attr:`final_saved` stays None. Not thread-safe: call it from one thread.

    Args:
        run_dir: the run folder.
        keep_last: numbered checkpoints kept (older ones deleted after a successful save); None keeps all.
        max_consecutive_failures: failed saves in a row that make :meth:`save` raise (>= 1).
        logger: where failures are logged (default ``oakemu.checkpoint``).

    Raises:
        ValueError: ``keep_last`` < 1 or ``max_consecutive_failures`` < 1.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        keep_last: int | None = 3,
        max_consecutive_failures: int = 5,
        logger: logging.Logger | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last: expected >= 1 or None, got {keep_last}")
        if int(max_consecutive_failures) < 1:
            raise ValueError(
                f"max_consecutive_failures: expected >= 1, got {max_consecutive_failures}"
            )
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        self.max_consecutive_failures = int(max_consecutive_failures)
        self.logger = logger if logger is not None else log
        self.failures = 0
        """Failed saves since this writer was made (telemetry ``checkpoint_failures``)."""
        self.consecutive_failures = 0
        """Failed saves since the last successful one."""
        self.last_saved: Path | None = latest_checkpoint(self.run_dir)
        """The newest checkpoint known to be complete (written by this writer, or found at start)."""
        self.last_error: str | None = None
        """The message of the last failure (None after a success)."""
        self.final_saved: Path | None = None
        """The final checkpoint once written (a successful ``save(..., final=True)``); None until then."""

    def save(self, update: int, state: dict[str, Any], *, final: bool = False) -> Path | None:
        """Write the checkpoint of ``update`` (see the class docstring).

        Args:
            update: PPO update number (the file's number, >= 0).
            state: the checkpoint dict (plain values and tensors, see :func:`save_checkpoint`).
            final: this is the run's final checkpoint (sets :attr:`final_saved` when written).

        Returns:
            The numbered checkpoint path, or None when the write failed (logged and counted).

        Raises:
            CheckpointWriteFailed: this was the ``max_consecutive_failures``-th failure in a row (never for
                the final checkpoint, ``final=True``).
            TypeError: ``state`` holds a value a checkpoint cannot hold (a bug, nothing is written).
            ValueError: negative ``update``.
        """
        path = checkpoint_path(self.run_dir, update)
        try:
            save_run_checkpoint(self.run_dir, update, state, keep_last=self.keep_last)
        except OSError as error:
            self.failures += 1
            self.consecutive_failures += 1
            self.last_error = self._describe_failure(path, state, error)
            if final:
                self.logger.error("final %s", self.last_error)
                return None
            if self.consecutive_failures >= self.max_consecutive_failures:
                raise CheckpointWriteFailed(
                    f"{self.consecutive_failures} checkpoint writes in a row failed (max_checkpoint_failures = "
                    f"{self.max_consecutive_failures}), stopping; last: {self.last_error}"
                ) from error
            self.logger.error(
                "%s; training goes on, retried at the next checkpoint (%d of %d failures in a row "
                "allowed)",
                self.last_error,
                self.consecutive_failures,
                self.max_consecutive_failures,
            )
            return None
        self.consecutive_failures = 0
        self.last_error = None
        self.last_saved = path
        if final:
            self.final_saved = path
        return path

    def _describe_failure(self, path: Path, state: dict[str, Any], error: OSError) -> str:
        needed = _state_bytes(state)
        try:
            free = f"{shutil.disk_usage(path.parent if path.parent.is_dir() else self.run_dir).free} bytes free"
        except OSError:
            free = "free space unknown"
        previous = (
            f"{self.last_saved} is kept and loadable"
            if self.last_saved is not None
            else "no earlier checkpoint"
        )
        reason = error.strerror or str(error)
        return (
            f"checkpoint {path} not written: [Errno {error.errno}] {reason} ({needed} bytes needed, {free} "
            f"on {path.parent}); {previous}"
        )


def _state_bytes(state: dict[str, Any]) -> str:
    """Serialised size of ``state`` in bytes, as text (measured in memory only after a failure)."""
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
    except Exception as error:  # noqa: BLE001 - a size estimate must not hide the original error
        return f"unknown ({type(error).__name__})"
    return str(buffer.getbuffer().nbytes)

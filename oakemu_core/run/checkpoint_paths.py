"""Where a run folder's checkpoints are and which one a resume starts from, by their paths only.

Layout in a run folder::

    run_dir/checkpoints/checkpoint_00000010.pt   # one file per saved update (8-digit number)
    run_dir/checkpoints/latest.pt                # relative symlink to the newest one
    run_dir/checkpoints/best.pt                  # the best evaluation's weights (not a resume point)

Reads names and links only, never a file's contents, and imports no torch: the launcher and
``oakemu monitor`` use it to tell whether a run can be resumed. The files themselves are written and
read by :mod:`oakemu_core.run.checkpoint`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "CHECKPOINT_DIR_NAME",
    "LATEST_NAME",
    "checkpoint_path",
    "is_numbered_checkpoint",
    "latest_checkpoint",
    "latest_target",
    "numbered_checkpoints",
]

CHECKPOINT_DIR_NAME = "checkpoints"
LATEST_NAME = "latest.pt"
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d{8,})\.pt$")


def checkpoint_path(run_dir: Path, update: int) -> Path:
    """``run_dir/checkpoints/checkpoint_<update:08d>.pt``; raises ValueError for a negative update."""
    if int(update) < 0:
        raise ValueError(f"update: expected >= 0, got {update}")
    return Path(run_dir) / CHECKPOINT_DIR_NAME / f"checkpoint_{int(update):08d}.pt"


def is_numbered_checkpoint(name: str) -> bool:
    """Whether a file name is a numbered checkpoint's, ``checkpoint_<n>.pt`` (8 digits or more)."""
    return _CHECKPOINT_RE.match(name) is not None


def numbered_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(update, path)`` of every ``checkpoint_<n>.pt`` file in ``directory``, oldest first (empty when
    ``directory`` does not exist)."""
    found = []
    if directory.is_dir():
        for entry in directory.iterdir():
            match = _CHECKPOINT_RE.match(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_target(directory: Path) -> Path | None:
    """The file ``directory/latest.pt`` stands for, None when it is missing or dangling: a plain file is
    itself; a link to a name in ``directory`` (as the checkpoint writer makes it) is ``directory/<name>``,
    in the form ``directory`` was given in (relative stays relative); any other link is its resolved path."""
    latest = directory / LATEST_NAME
    if not latest.is_file():  # follows the symlink; False for a dangling one
        return None
    if not latest.is_symlink():
        return latest
    target = Path(os.readlink(latest))
    named = directory / target
    plain_name = (
        not target.is_absolute() and len(target.parts) == 1 and target.name not in (".", "..")
    )
    if plain_name and not named.is_symlink():
        return named
    return latest.resolve()


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of a run folder, the one a resume starts from; None if it has none.

    Follows ``run_dir/checkpoints/latest.pt`` when it points at an existing file (a plain-file
    ``latest.pt`` is returned as is); otherwise falls back to the highest-numbered
    ``checkpoint_<n>.pt``. ``best.pt`` never counts (a resume does not start from it).
    """
    directory = Path(run_dir) / CHECKPOINT_DIR_NAME
    target = latest_target(directory)
    if target is not None:
        return target
    numbered = numbered_checkpoints(directory)
    return numbered[-1][1] if numbered else None

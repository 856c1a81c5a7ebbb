"""Errors shared across layers: here, below every sub-package, so that any of them can raise one.

Every mistake a user can fix (a setting, a path, a port, a checkpoint, an env id) raises a subclass of
:class:`UserError`. The ``oakemu`` command catches that one class: it prints the message (one line)
and exits with :attr:`UserError.exit_status`, never with a traceback.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError", "DiskFullError", "RunFolderError", "UserError"]


class UserError(Exception):
    """A mistake the user can fix; the message says what was expected and what was received.

    Attributes:
        exit_status: the ``oakemu`` command's exit status for it (2: bad input, argparse's convention).
    """

    exit_status = 2


class ConfigError(UserError, ValueError):
    """A configuration value given by the user is invalid (message names field, expected, received)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used: no such file, or a file that is not a readable checkpoint
    (truncated, corrupt, or another kind of file)."""


class RunFolderError(UserError, ValueError):
    """A run folder cannot be used as asked: not a run folder, or a resumed run with nothing left to do."""


class DiskFullError(UserError, OSError):
    """A file could not be written for lack of space; the message names the path, the bytes needed and
    the bytes free. Exit status 1: the input was right, the machine needs room."""

    exit_status = 1

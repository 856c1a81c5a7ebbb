"""Errors shared across layers: here, below every sub-package, so that any of them can raise one."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value given by the user is invalid (message names field, expected, received)."""

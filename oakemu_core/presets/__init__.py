"""Presets: named sets of settings for well-known environments, shipped as TOML files in this package.

Each ``<name>.toml`` holds a ``[preset]`` table (``description``, ``expect``: the return and time to
expect) and a ``[settings]`` table of :class:`~oakemu_core.config.OakEmuConfig` fields. A preset is a
layer of the configuration: flags, ``OAKEMU_*`` variables and a TOML file override it, and it overrides
the defaults (``oakemu train --preset NAME``, ``oakemu_core.train(preset=NAME)``). A setting set to None
is written as ``config.toml`` writes it, the comment ``# name = (unset)`` (TOML has no null).
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from oakemu_core.errors import ConfigError
from oakemu_core.run.config_file import UNSET_LINE

__all__ = ["Preset", "load_preset", "preset_names"]


@dataclass(frozen=True)
class Preset:
    """One preset file: its name, what it is, what to expect, and its settings (field name -> value)."""

    name: str
    description: str
    expect: str
    settings: dict[str, Any] = field(default_factory=dict)


def preset_names() -> list[str]:
    """The names of the presets shipped with the package, sorted."""
    return sorted(
        entry.name[: -len(".toml")]
        for entry in resources.files(__name__).iterdir()
        if entry.name.endswith(".toml")
    )


def load_preset(name: str) -> Preset:
    """The preset ``name`` (its settings are validated where they are used, with the configuration).

    Raises:
        ConfigError: no preset of that name (the message lists them and names the closest), or a file
            without its ``[preset]`` / ``[settings]`` tables.
    """
    names = preset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"preset: expected one of {', '.join(names)}, received {name!r}{hint}")
    text = resources.files(__name__).joinpath(f"{name}.toml").read_text(encoding="utf-8")
    document = tomllib.loads(text)
    info, settings = document.get("preset"), document.get("settings")
    if (
        not isinstance(info, dict)
        or not isinstance(settings, dict)
        or set(document) != {"preset", "settings"}
    ):
        raise ConfigError(
            f"preset {name!r}: expected the tables [preset] and [settings], received {sorted(document)}"
        )
    unset = {key: None for key in UNSET_LINE.findall(text) if key not in settings}
    return Preset(
        name,
        str(info.get("description", "")),
        str(info.get("expect", "")),
        {**settings, **unset},
    )

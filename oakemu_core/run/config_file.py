"""The configuration file's format where TOML falls short: a setting whose value is None.

TOML has no null, so :func:`oakemu_core.config.to_toml` writes such a setting as the comment
``# name = (unset)`` (:data:`UNSET_LINE`); :func:`settings_from_toml` reads it back as None. A run's
``config.toml`` is such a file, and ``oakemu train`` hands its configuration to the learner and actors
as one (``OAKEMU_CONFIG_FILE``): without the comment, a None whose setting defaults to something else
(``--clip-value-range null`` against ``auto``) would come back as that default.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Collection
from typing import Any

__all__ = ["UNSET_LINE", "settings_from_toml"]

UNSET_LINE = re.compile(r"^#\s*([A-Za-z_]\w*) = \(unset\)\s*$", re.MULTILINE)
"""The line naming a setting whose value is None: ``# name = (unset)``."""


def settings_from_toml(text: str, fields: Collection[str] | None = None) -> dict[str, Any]:
    """The settings a configuration TOML document gives: its keys, plus None for each setting that an
    :data:`UNSET_LINE` names and no key sets; with ``fields`` (setting names), only for those.

    Raises:
        tomllib.TOMLDecodeError: ``text`` is not valid TOML.
    """
    settings = tomllib.loads(text)
    for name in UNSET_LINE.findall(text):
        if fields is None or name in fields:
            settings.setdefault(name, None)
    return settings

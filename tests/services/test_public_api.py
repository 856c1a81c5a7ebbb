"""The package's front door: every exported name loads, and ``import oakemu_core`` stays torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

import oakemu_core


@pytest.mark.parametrize("name", oakemu_core.__all__)
def test_every_exported_name_loads_and_is_defined_where_the_table_says(name: str) -> None:
    value = getattr(oakemu_core, name)
    module = oakemu_core._LAZY.get(name)
    if module is not None:
        assert getattr(sys.modules[module], name) is value


def test_an_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(oakemu_core, "no_such_name")


def test_importing_the_package_does_not_import_torch() -> None:
    code = "import sys, oakemu_core; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"

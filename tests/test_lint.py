"""The sources pass the formatter and the linter configured in ``pyproject.toml`` (``[tool.ruff]``).

A failure names the files: ``ruff format .`` rewrites them; ``ruff check --fix .`` fixes what it can.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff")

pytestmark = pytest.mark.skipif(RUFF is None, reason="ruff is not installed (the dev extra has it)")


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(RUFF), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def test_sources_are_formatted() -> None:
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_sources_pass_the_linter() -> None:
    result = _ruff("check", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr
